"""Seeded T5 v1.1 checkpoints in Transformers' layout (ElnaggarLab/ankh*), and Transformers' T5 as the ANKH oracle.

The layout is `T5ForConditionalGeneration.state_dict()`: `shared.weight`, `encoder.block.{i}.layer.{0,1}.*`,
`decoder.block.{i}.layer.{0,1,2}.*`, the relative bias in block 0 of each stack, final norms and an untied
`lm_head.weight`. Real checkpoint files also hold `encoder.embed_tokens.weight` and `decoder.embed_tokens.weight`,
the same tensor as `shared.weight` (`with_embed_copies=True` writes them).

The oracle is built as the reference prescribes for Transformers 5: a fresh `T5ForConditionalGeneration` ties
`lm_head` to `shared` even when the config says `tie_word_embeddings=False`, so `lm_head.weight` is replaced by
a parameter of its own before the untied state is loaded (the "tie trap").
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import torch

from .seeded_weights import seeded_state_dict


class T5Dims(NamedTuple):
    num_layers: int
    num_decoder_layers: int
    hidden: int
    heads: int
    d_kv: int
    d_ff: int
    vocab: int
    activation: str  # "gated-gelu" or "gated-silu"
    buckets: int = 64
    max_distance: int = 128


def t5_spec(dims: T5Dims) -> dict[str, tuple[int, ...]]:
    """Transformers' `T5ForConditionalGeneration` key -> shape, in its `state_dict()` order."""
    d, inner = dims.hidden, dims.heads * dims.d_kv
    spec: dict[str, tuple[int, ...]] = {"shared.weight": (dims.vocab, d)}

    def attention(prefix: str, bias: bool) -> None:
        for name in "qkv":
            spec[f"{prefix}.{name}.weight"] = (inner, d)
        spec[f"{prefix}.o.weight"] = (d, inner)
        if bias:
            spec[f"{prefix}.relative_attention_bias.weight"] = (dims.buckets, dims.heads)

    def mlp(prefix: str) -> None:
        spec[f"{prefix}.DenseReluDense.wi_0.weight"] = (dims.d_ff, d)
        spec[f"{prefix}.DenseReluDense.wi_1.weight"] = (dims.d_ff, d)
        spec[f"{prefix}.DenseReluDense.wo.weight"] = (d, dims.d_ff)
        spec[f"{prefix}.layer_norm.weight"] = (d,)

    for i in range(dims.num_layers):
        attention(f"encoder.block.{i}.layer.0.SelfAttention", i == 0)
        spec[f"encoder.block.{i}.layer.0.layer_norm.weight"] = (d,)
        mlp(f"encoder.block.{i}.layer.1")
    spec["encoder.final_layer_norm.weight"] = (d,)
    for i in range(dims.num_decoder_layers):
        attention(f"decoder.block.{i}.layer.0.SelfAttention", i == 0)
        spec[f"decoder.block.{i}.layer.0.layer_norm.weight"] = (d,)
        attention(f"decoder.block.{i}.layer.1.EncDecAttention", False)
        spec[f"decoder.block.{i}.layer.1.layer_norm.weight"] = (d,)
        mlp(f"decoder.block.{i}.layer.2")
    spec["decoder.final_layer_norm.weight"] = (d,)
    spec["lm_head.weight"] = (dims.vocab, d)
    return spec


def t5_rule(dims: T5Dims):
    """(kind, std) per key, as T5's own initialisation scales them: q by 1/sqrt(d_model * d_kv) (T5 folds the
    1/sqrt(d_kv) it never applies to the scores into q), every other matrix by 1/sqrt(fan_in), norm scales
    near 1, the relative bias at 0.5 (large enough that positions matter, small enough not to dominate).
    Without the q factor a 48-layer stack is chaotic: float rounding alone moves its outputs by 10%."""

    def rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if "layer_norm" in key:
            return "ones_jitter", 0.1
        if "relative_attention_bias" in key:
            return "normal", 0.5
        if key.endswith(".q.weight"):
            return "normal", 1.0 / math.sqrt(dims.hidden * dims.d_kv)
        return "normal", 1.0 / math.sqrt(shape[1])

    return rule


def t5_state_dict(dims: T5Dims, *, seed: int = 0, with_embed_copies: bool = False) -> dict[str, torch.Tensor]:
    """Seeded float32 weights under Transformers' T5 keys."""
    arrays = seeded_state_dict(t5_spec(dims), seed=seed, rules=t5_rule(dims))
    state = {k: torch.from_numpy(v) for k, v in arrays.items()}
    if with_embed_copies:
        state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
        state["decoder.embed_tokens.weight"] = state["shared.weight"].clone()
    return state


def t5_config(dims: T5Dims, **overrides):
    """The `T5Config` of an ANKH checkpoint at these dims (pad 0, eos 1, decoder start 0, untied, no dropout)."""
    from transformers import T5Config

    values = {
        "vocab_size": dims.vocab,
        "d_model": dims.hidden,
        "d_kv": dims.d_kv,
        "d_ff": dims.d_ff,
        "num_layers": dims.num_layers,
        "num_decoder_layers": dims.num_decoder_layers,
        "num_heads": dims.heads,
        "relative_attention_num_buckets": dims.buckets,
        "relative_attention_max_distance": dims.max_distance,
        "feed_forward_proj": dims.activation,
        "layer_norm_epsilon": 1e-6,
        "dropout_rate": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "is_encoder_decoder": True,
        "architectures": ["T5ForConditionalGeneration"],
    }
    values.update(overrides)
    return T5Config(**values)


def t5_config_json(dims: T5Dims) -> dict:
    """config.json as the official ElnaggarLab snapshots carry it (saved by Transformers 4.x, which kept
    `tie_word_embeddings: false`; Transformers 5's T5Config would write true, the tie trap)."""
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "d_ff": dims.d_ff,
        "d_kv": dims.d_kv,
        "d_model": dims.hidden,
        "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new" if dims.activation == "gated-gelu" else "silu",
        "dropout_rate": 0.0,
        "eos_token_id": 1,
        "feed_forward_proj": dims.activation,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "is_gated_act": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "num_decoder_layers": dims.num_decoder_layers,
        "num_heads": dims.heads,
        "num_layers": dims.num_layers,
        "pad_token_id": 0,
        "relative_attention_max_distance": dims.max_distance,
        "relative_attention_num_buckets": dims.buckets,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.25.1",
        "use_cache": True,
        "vocab_size": dims.vocab,
    }


def t5_oracle(dims: T5Dims, state: dict[str, torch.Tensor]):
    """Transformers' `T5ForConditionalGeneration` (eager, float32, eval) holding `state`, untied by hand."""
    from torch import nn
    from transformers import T5ForConditionalGeneration
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = T5ForConditionalGeneration(t5_config(dims))
    # The tie trap: a fresh model shares lm_head with shared; give the head its own parameter first.
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    if set(missing) - allowed or unexpected:
        raise ValueError(f"T5 state does not fit: missing {sorted(set(missing) - allowed)}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr():
        raise ValueError("lm_head is tied to shared; ANKH's head is untied")
    return model.eval()


def write_ankh_snapshot(folder, dims: T5Dims, *, generation: str = "v1", seed: int = 0):
    """A folder laid out like an ElnaggarLab/ankh* Hub snapshot at these dims: config.json (T5), model.safetensors
    (Transformers' keys, embedding copies included), and the generation's tokenizer files (`oracles.ankh`)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from .ankh import write_ankh_tokenizer_snapshot

    directory = Path(folder)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t5_state_dict(dims, seed=seed, with_embed_copies=True), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(t5_config_json(dims), indent=2, sort_keys=True) + "\n")
    write_ankh_tokenizer_snapshot(directory, generation)
    return directory
