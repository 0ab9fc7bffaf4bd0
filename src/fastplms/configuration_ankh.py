"""ANKH configuration (runtime module: ships inside every ANKH artifact).

ANKH is T5 v1.1: `hidden_size` is T5's d_model, `num_hidden_layers` the encoder depth, `d_kv` the width of
one head (so the attention inner width is heads * d_kv, which need not equal d_model), `intermediate_size`
the gated FFN width; `feed_forward_proj` is "gated-gelu" (ANKH v1: GELU, tanh formula) or "gated-silu"
(ANKH2, ANKH3). Relative position buckets: 64 over a maximum distance of 128 (every ANKH checkpoint).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from .attention import ATTENTION_BACKENDS

ACTIVATIONS = ("gated-gelu", "gated-silu")


class ANKHConfig(PretrainedConfig):
    model_type = "fastplms_ankh"

    def __init__(
        self,
        vocab_size: int = 144,
        hidden_size: int = 768,
        num_hidden_layers: int = 48,
        num_decoder_layers: int = 24,
        num_attention_heads: int = 12,
        d_kv: int = 64,
        intermediate_size: int = 3072,
        feed_forward_proj: str = "gated-gelu",
        relative_attention_num_buckets: int = 64,
        relative_attention_max_distance: int = 128,
        layer_norm_eps: float = 1e-6,
        pad_token_id: int = 0,
        eos_token_id: int = 1,
        decoder_start_token_id: int = 0,
        classifier_dropout: float = 0.0,
        max_position_embeddings: int | None = None,
        allowed_backends: tuple[str, ...] | list[str] = ATTENTION_BACKENDS,  # built from a manifest: its list
        allowed_dtypes: tuple[str, ...] | list[str] = ("float32", "bfloat16"),
        bf16_policy: str = "autocast",
        family: str = "ANKH",
        **kwargs,
    ) -> None:
        if feed_forward_proj not in ACTIVATIONS:
            raise ValueError(f"feed_forward_proj must be one of {ACTIVATIONS}; received {feed_forward_proj!r}")
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("is_encoder_decoder", True)
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            decoder_start_token_id=decoder_start_token_id,
            **kwargs,
        )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_decoder_layers = num_decoder_layers
        self.num_attention_heads = num_attention_heads
        self.d_kv = d_kv
        self.intermediate_size = intermediate_size
        self.feed_forward_proj = feed_forward_proj
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.layer_norm_eps = layer_norm_eps
        self.classifier_dropout = classifier_dropout
        # Relative positions have no limit; None: any length (the tokenizer's model_max_length applies).
        self.max_position_embeddings = max_position_embeddings
        self.allowed_backends = list(allowed_backends)
        self.allowed_dtypes = list(allowed_dtypes)
        self.bf16_policy = bf16_policy
        self.family = family
