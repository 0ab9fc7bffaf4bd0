"""Profluent-E1 configuration (runtime module: ships inside every E1 artifact). Built with Profluent-E1.

Field names are the official `E1Config`'s (Profluent-AI/E1 `src/E1/config.py`), so an official config.json
reads directly; the defaults are the E1-150M checkpoint's (the official class defaults describe no released
checkpoint: 16384-wide FFN, global theta 1e5, 131072 global positions).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from .attention import ATTENTION_BACKENDS


class E1Config(PretrainedConfig):
    """Dimensions of an E1 checkpoint plus the backends and dtypes its manifest declares.

    Layer i is global (block-causal across the sequences of a row, global positions, `rope_theta_global`)
    iff (i + 1) % `global_attention_every_n_layers` == 0; 0 makes every layer local (within its sequence,
    within-sequence positions, `rope_theta_within_seq`). q, k and v are clamped to +-`clip_qkv` (None: no
    clamp). Only the released checkpoints' FFN is implemented: gated (`gated_mlp`) with SiLU.
    `allowed_backends`, `allowed_dtypes` and `bf16_policy` are baked in from the manifest when an artifact is
    built; models refuse anything outside them.
    """

    model_type = "fastplms_e1"

    def __init__(
        self,
        vocab_size: int = 34,
        hidden_size: int = 768,
        intermediate_size: int = 2304,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 12,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        gated_mlp: bool = True,
        rms_norm_eps: float = 1e-5,
        global_attention_every_n_layers: int = 3,
        max_num_sequences: int = 512,
        max_num_positions_within_seq: int = 8192,
        max_num_positions_global: int = 65536,
        rope_theta_within_seq: float = 10000.0,
        rope_theta_global: float = 500000.0,
        clip_qkv: float | None = 8.0,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        mask_token_id: int = 5,
        initializer_range: float = 0.02,
        classifier_dropout: float = 0.0,
        allowed_backends: tuple[str, ...] | list[str] = ("eager", "sdpa", "flex_attention"),
        allowed_dtypes: tuple[str, ...] | list[str] = ("float32", "bfloat16"),
        bf16_policy: str = "autocast",
        family: str = "Profluent-E1",
        **kwargs,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
        num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size {hidden_size} must be num_attention_heads {num_attention_heads} times an even head dim."
            )
        if num_key_value_heads < 1 or num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads {num_key_value_heads} must divide num_attention_heads {num_attention_heads}."
            )
        if not gated_mlp or hidden_act != "silu":
            raise ValueError(
                f"only the released E1 FFN is implemented: gated_mlp=True with hidden_act='silu' "
                f"(got gated_mlp={gated_mlp!r}, hidden_act={hidden_act!r})."
            )
        if clip_qkv is not None and clip_qkv <= 0:
            raise ValueError(f"clip_qkv must be positive or None, got {clip_qkv!r}.")
        if global_attention_every_n_layers < 0:
            raise ValueError(f"global_attention_every_n_layers must be >= 0, got {global_attention_every_n_layers}.")
        unknown = set(allowed_backends) - set(ATTENTION_BACKENDS)
        if unknown:
            raise ValueError(f"unknown attention backends {sorted(unknown)}; valid: {', '.join(ATTENTION_BACKENDS)}.")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.rms_norm_eps = rms_norm_eps
        self.global_attention_every_n_layers = global_attention_every_n_layers
        self.max_num_sequences = max_num_sequences
        self.max_num_positions_within_seq = max_num_positions_within_seq
        self.max_num_positions_global = max_num_positions_global
        self.rope_theta_within_seq = rope_theta_within_seq
        self.rope_theta_global = rope_theta_global
        self.clip_qkv = clip_qkv
        self.mask_token_id = mask_token_id
        self.initializer_range = initializer_range
        self.classifier_dropout = classifier_dropout
        self.allowed_backends = list(allowed_backends)
        self.allowed_dtypes = list(allowed_dtypes)
        self.bf16_policy = bf16_policy
        self.family = family

    @property
    def layer_norm_eps(self) -> float:
        """The MLM head's LayerNorm eps: the official head uses `rms_norm_eps` there too."""
        return self.rms_norm_eps

    def is_global_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a global (block-causal) layer."""
        n = self.global_attention_every_n_layers
        return n > 0 and (index + 1) % n == 0
