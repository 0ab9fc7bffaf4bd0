"""ESMC (ESM Cambrian, published here as ESM++) configuration (runtime module: ships inside every ESMC artifact)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .attention import ATTENTION_BACKENDS


def swiglu_hidden_size(hidden_size: int, expansion_ratio: float = 8 / 3) -> int:
    """Width of the SwiGLU MLP: expansion_ratio * hidden rounded UP to a multiple of 256 (official rule)."""
    return int(((expansion_ratio * hidden_size) + 255) // 256 * 256)


class ESMCConfig(PretrainedConfig):
    """Dimensions of an ESMC checkpoint plus the backends and dtypes its manifest declares.

    ESMC has no learned positions (rotary only), so `max_position_embeddings` is a nominal length: it
    sizes the tokenizer's `model_max_length` and the embedding pipeline's per-sequence limit, while the
    model itself accepts longer inputs. `allowed_backends`, `allowed_dtypes` and `bf16_policy` are baked
    in from the manifest when an artifact is built; models refuse anything outside them.
    """

    model_type = "fastplms_esmc"

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 960,
        num_hidden_layers: int = 30,
        num_attention_heads: int = 15,
        intermediate_size: int | None = None,
        layer_norm_eps: float = 1e-5,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        mask_token_id: int = 32,
        pad_token_id: int = 1,
        cls_token_id: int = 0,
        eos_token_id: int = 2,
        chain_break_token_id: int = 31,
        classifier_dropout: float = 0.0,
        allowed_backends: tuple[str, ...] | list[str] = ATTENTION_BACKENDS,  # built from a manifest: its list
        allowed_dtypes: tuple[str, ...] | list[str] = ("float32", "bfloat16"),
        bf16_policy: str = "autocast",
        family: str = "ESM++",
        **kwargs,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, **kwargs)
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}."
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size or swiglu_hidden_size(hidden_size)
        self.layer_norm_eps = layer_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.mask_token_id = mask_token_id
        self.cls_token_id = cls_token_id
        self.chain_break_token_id = chain_break_token_id
        self.classifier_dropout = classifier_dropout
        self.allowed_backends = list(allowed_backends)
        self.allowed_dtypes = list(allowed_dtypes)
        self.bf16_policy = bf16_policy
        self.family = family
