"""Profluent-E1 state transform: the official `E1ForMaskedLM` layout (Profluent-Bio Hub snapshots) -> ours.

Transform id `e1-v1`. The official state dict (Profluent-AI/E1 `src/E1/modeling.py`; the rotary caches are
non-persistent buffers, so they are in neither the state dict nor the snapshots):

- `model.embed_tokens`, `model.embed_seq_id`, `model.norm` (final RMSNorm);
- per layer `model.layers.N.norm_attn_norm.{input_layernorm,post_attention_layernorm}` (RMSNorms) and
  `.self_attn.{q,k,v,o}_proj` (bias-free), `model.layers.N.ffn.mlp.{w1,w2,w3}` (gate, down, up; bias-free);
- `mlm_head.{0,2,3}` (Sequential(Linear, GELU, LayerNorm, Linear)).

Ours renames only (`e1.` prefix, flat layer names, `lm_head.{dense,norm,decoder}`); no tensor is reshaped or
reordered. Floating tensors are stored as float32 (the models keep float32 parameters; BF16 runs under autocast).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .common import ConversionError, rename_strict, rule_renamer

TRANSFORM_ID = "e1-v1"

_LAYER = r"model\.layers\.(\d+)\."
_RULES = [
    (r"model\.embed_tokens\.weight", r"e1.embed_tokens.weight"),
    (r"model\.embed_seq_id\.weight", r"e1.embed_seq_id.weight"),
    (_LAYER + r"norm_attn_norm\.self_attn\.([qkvo])_proj\.weight", r"e1.layers.\1.\2_proj.weight"),
    (_LAYER + r"norm_attn_norm\.input_layernorm\.weight", r"e1.layers.\1.attn_norm.weight"),
    (_LAYER + r"norm_attn_norm\.post_attention_layernorm\.weight", r"e1.layers.\1.mlp_norm.weight"),
    (_LAYER + r"ffn\.mlp\.(w[123])\.weight", r"e1.layers.\1.\2.weight"),
    (r"model\.norm\.weight", r"e1.final_norm.weight"),
    (r"mlm_head\.0\.(weight|bias)", r"lm_head.dense.\1"),
    (r"mlm_head\.2\.(weight|bias)", r"lm_head.norm.\1"),
    (r"mlm_head\.3\.(weight|bias)", r"lm_head.decoder.\1"),
]


def canonical_spec(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int = 34,
    max_num_sequences: int = 512,
) -> dict[str, tuple[int, ...]]:
    """Our E1ForMaskedLM state-dict layout: key -> shape."""
    d, f = hidden_size, intermediate_size
    if d % num_heads or num_heads % num_kv_heads:
        raise ConversionError(f"{num_heads} heads must divide hidden size {d} and be a multiple of {num_kv_heads}")
    kv = num_kv_heads * (d // num_heads)
    spec: dict[str, tuple[int, ...]] = {
        "e1.embed_tokens.weight": (vocab_size, d),
        "e1.embed_seq_id.weight": (max_num_sequences, d),
    }
    for i in range(num_layers):
        p = f"e1.layers.{i}."
        spec |= {
            p + "attn_norm.weight": (d,),
            p + "q_proj.weight": (d, d),
            p + "k_proj.weight": (kv, d),
            p + "v_proj.weight": (kv, d),
            p + "o_proj.weight": (d, d),
            p + "mlp_norm.weight": (d,),
            p + "w1.weight": (f, d),
            p + "w3.weight": (f, d),
            p + "w2.weight": (d, f),
        }
    spec |= {
        "e1.final_norm.weight": (d,),
        "lm_head.dense.weight": (d, d),
        "lm_head.dense.bias": (d,),
        "lm_head.norm.weight": (d,),
        "lm_head.norm.bias": (d,),
        "lm_head.decoder.weight": (vocab_size, d),
        "lm_head.decoder.bias": (vocab_size,),
    }
    return spec


def _shape(state: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    if key not in state:
        raise ConversionError(f"Profluent E1 state dict: missing keys: {key}")
    return tuple(state[key].shape)


def official_dims(state: Mapping[str, torch.Tensor], num_heads: int) -> dict[str, int]:
    """The dims an official E1 state dict was built at (heads are not visible in shapes: `num_heads` given)."""
    layers = {int(m.group(1)) for key in state if (m := re.match(_LAYER, key))}
    vocab, hidden = _shape(state, "model.embed_tokens.weight")
    kv_rows = _shape(state, "model.layers.0.norm_attn_norm.self_attn.k_proj.weight")[0]
    if hidden % num_heads:
        raise ConversionError(f"Profluent E1 state dict: hidden size {hidden} is not a multiple of {num_heads} heads")
    head_dim = hidden // num_heads
    if kv_rows % head_dim:
        raise ConversionError(
            f"Profluent E1 state dict: k_proj rows {kv_rows} are not a multiple of head dim {head_dim}"
        )
    return {
        "num_layers": max(layers) + 1 if layers else 0,
        "hidden_size": hidden,
        "num_heads": num_heads,
        "num_kv_heads": kv_rows // head_dim,
        "intermediate_size": _shape(state, "model.layers.0.ffn.mlp.w1.weight")[0],
        "vocab_size": vocab,
        "max_num_sequences": _shape(state, "model.embed_seq_id.weight")[0],
    }


def from_official(state: Mapping[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """Official Profluent `E1ForMaskedLM` state dict (a Hub snapshot's model.safetensors) -> ours.

    Unknown, missing or colliding keys and shapes that do not fit one E1 are `ConversionError`s.
    """
    dims = official_dims(state, num_heads)
    spec = canonical_spec(**dims)
    out = rename_strict(state, rule_renamer(_RULES), spec, source="Profluent E1")
    wrong = [f"{k} {tuple(v.shape)} (expected {spec[k]})" for k, v in sorted(out.items()) if tuple(v.shape) != spec[k]]
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; ... ({len(wrong)} in all)" if len(wrong) > 8 else "")
        raise ConversionError(f"Profluent E1 state dict: shapes do not fit an E1 of dims {dims}: {shown}")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in out.items()}
