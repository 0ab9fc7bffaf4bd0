"""ESM2 configuration (runtime module: ships inside every ESM2 artifact)."""

from __future__ import annotations

from transformers import PretrainedConfig

from .attention import ATTENTION_BACKENDS


class ESM2Config(PretrainedConfig):
    """Dimensions of an ESM2 checkpoint plus the backends and dtypes its manifest declares.

    `allowed_backends`, `allowed_dtypes` and `bf16_policy` are baked in from the manifest when an
    artifact is built; models refuse anything outside them.
    """

    model_type = "fastplms_esm2"

    def __init__(
        self,
        vocab_size: int = 33,
        hidden_size: int = 320,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 20,
        intermediate_size: int | None = None,
        layer_norm_eps: float = 1e-5,
        max_position_embeddings: int = 1026,
        rope_theta: float = 10000.0,
        token_dropout: bool = True,
        mask_token_id: int = 32,
        pad_token_id: int = 1,
        cls_token_id: int = 0,
        eos_token_id: int = 2,
        classifier_dropout: float = 0.0,
        allowed_backends: tuple[str, ...] | list[str] = ATTENTION_BACKENDS,  # built from a manifest: its list
        allowed_dtypes: tuple[str, ...] | list[str] = ("float32", "bfloat16"),
        bf16_policy: str = "autocast",
        family: str = "ESM2",
        **kwargs,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.layer_norm_eps = layer_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.token_dropout = token_dropout
        self.mask_token_id = mask_token_id
        self.cls_token_id = cls_token_id
        self.classifier_dropout = classifier_dropout
        self.allowed_backends = list(allowed_backends)
        self.allowed_dtypes = list(allowed_dtypes)
        self.bf16_policy = bf16_policy
        self.family = family
