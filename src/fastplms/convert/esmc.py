"""ESMC state transforms: EvolutionaryScale `esm` and Biohub Transformer-Engine layouts -> ours.

Transform id `esmc-v1`. Two official layouts hold the same tensors under different names:

- `esm` (EvolutionaryScale's package, `data/weights/esmc_*_2024_12_v0.pth`): the `ESMC` module's own
  `state_dict()`: `embed`, `transformer.blocks.N.attn.layernorm_qkv.{0,1}` (Sequential(LayerNorm,
  Linear)), `attn.{q_ln,k_ln,out_proj}`, `ffn.{0,1,3}` (Sequential(LayerNorm, Linear, SwiGLU, Linear)),
  `transformer.norm`, `sequence_head.{0,2,3}` (Sequential(Linear, GELU, LayerNorm, Linear)).
- `biohub` (`biohub/ESMC-*` safetensors): the same body under `esmc.`, with Transformer-Engine's fused
  module names (`attn.layernorm_qkv.{layer_norm_weight,layer_norm_bias,weight}`,
  `ffn.{layer_norm_weight,layer_norm_bias,fc1_weight,fc2_weight}`, plus `_extra_state` entries that hold
  no weights) and the head as `lm_head.{0,2,3}`.

Both keep the fused QKV and the fused SwiGLU input projection exactly as stored: chunks (q, k, v) and
(gate, value) in that order, which is how the official forward splits them. No tensor is reordered.
Floating tensors are stored as float32 (the models keep float32 parameters; BF16 runs under autocast).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..configuration_esmc import swiglu_hidden_size
from .common import DROP, ConversionError, rename_strict, rule_renamer

TRANSFORM_ID = "esmc-v1"
VOCAB_ROWS = 64

_ESM_RULES = [
    (r"embed\.weight", r"esmc.embed_tokens.weight"),
    (r"transformer\.blocks\.(\d+)\.attn\.layernorm_qkv\.0\.(weight|bias)", r"esmc.layers.\1.attn_norm.\2"),
    (r"transformer\.blocks\.(\d+)\.attn\.layernorm_qkv\.1\.weight", r"esmc.layers.\1.qkv.weight"),
    (r"transformer\.blocks\.(\d+)\.attn\.q_ln\.weight", r"esmc.layers.\1.q_norm.weight"),
    (r"transformer\.blocks\.(\d+)\.attn\.k_ln\.weight", r"esmc.layers.\1.k_norm.weight"),
    (r"transformer\.blocks\.(\d+)\.attn\.out_proj\.weight", r"esmc.layers.\1.out_proj.weight"),
    (r"transformer\.blocks\.(\d+)\.ffn\.0\.(weight|bias)", r"esmc.layers.\1.mlp_norm.\2"),
    (r"transformer\.blocks\.(\d+)\.ffn\.1\.weight", r"esmc.layers.\1.fc1.weight"),
    (r"transformer\.blocks\.(\d+)\.ffn\.3\.weight", r"esmc.layers.\1.fc2.weight"),
    (r"transformer\.norm\.weight", r"esmc.final_norm.weight"),
    (r"sequence_head\.0\.(weight|bias)", r"lm_head.dense.\1"),
    (r"sequence_head\.2\.(weight|bias)", r"lm_head.norm.\1"),
    (r"sequence_head\.3\.(weight|bias)", r"lm_head.decoder.\1"),
]

_BIOHUB_BLOCK = r"esmc\.transformer\.blocks\.(\d+)\."
_BIOHUB_RULES = [
    (r"esmc\.embed\.weight", r"esmc.embed_tokens.weight"),
    (_BIOHUB_BLOCK + r"attn\.layernorm_qkv\.layer_norm_weight", r"esmc.layers.\1.attn_norm.weight"),
    (_BIOHUB_BLOCK + r"attn\.layernorm_qkv\.layer_norm_bias", r"esmc.layers.\1.attn_norm.bias"),
    (_BIOHUB_BLOCK + r"attn\.layernorm_qkv\.weight", r"esmc.layers.\1.qkv.weight"),
    (_BIOHUB_BLOCK + r"attn\.q_ln\.weight", r"esmc.layers.\1.q_norm.weight"),
    (_BIOHUB_BLOCK + r"attn\.k_ln\.weight", r"esmc.layers.\1.k_norm.weight"),
    (_BIOHUB_BLOCK + r"attn\.out_proj\.weight", r"esmc.layers.\1.out_proj.weight"),
    (_BIOHUB_BLOCK + r"ffn\.layer_norm_weight", r"esmc.layers.\1.mlp_norm.weight"),
    (_BIOHUB_BLOCK + r"ffn\.layer_norm_bias", r"esmc.layers.\1.mlp_norm.bias"),
    (_BIOHUB_BLOCK + r"ffn\.fc1_weight", r"esmc.layers.\1.fc1.weight"),
    (_BIOHUB_BLOCK + r"ffn\.fc2_weight", r"esmc.layers.\1.fc2.weight"),
    # Transformer-Engine module metadata (FP8 recipe state), not weights.
    (_BIOHUB_BLOCK + r"(?:attn\.layernorm_qkv|attn\.out_proj|ffn)\._extra_state", DROP),
    (r"esmc\.transformer\.norm\.weight", r"esmc.final_norm.weight"),
    (r"lm_head\.0\.(weight|bias)", r"lm_head.dense.\1"),
    (r"lm_head\.2\.(weight|bias)", r"lm_head.norm.\1"),
    (r"lm_head\.3\.(weight|bias)", r"lm_head.decoder.\1"),
]

_LAYER_SHAPES = {
    "attn_norm.weight": lambda d, h: (d,),
    "attn_norm.bias": lambda d, h: (d,),
    "qkv.weight": lambda d, h: (3 * d, d),
    "q_norm.weight": lambda d, h: (d,),
    "k_norm.weight": lambda d, h: (d,),
    "out_proj.weight": lambda d, h: (d, d),
    "mlp_norm.weight": lambda d, h: (d,),
    "mlp_norm.bias": lambda d, h: (d,),
    "fc1.weight": lambda d, h: (2 * h, d),
    "fc2.weight": lambda d, h: (d, h),
}


def canonical_spec(num_layers: int, hidden_size: int, vocab_rows: int = VOCAB_ROWS) -> dict[str, tuple[int, ...]]:
    """Our ESMCForMaskedLM state-dict layout: key -> shape (heads do not change any shape)."""
    d, h = hidden_size, swiglu_hidden_size(hidden_size)
    spec: dict[str, tuple[int, ...]] = {
        "esmc.embed_tokens.weight": (vocab_rows, d),
        "esmc.final_norm.weight": (d,),
        "lm_head.dense.weight": (d, d),
        "lm_head.dense.bias": (d,),
        "lm_head.norm.weight": (d,),
        "lm_head.norm.bias": (d,),
        "lm_head.decoder.weight": (vocab_rows, d),
        "lm_head.decoder.bias": (vocab_rows,),
    }
    for i in range(num_layers):
        spec |= {f"esmc.layers.{i}.{name}": shape(d, h) for name, shape in _LAYER_SHAPES.items()}
    return spec


def _num_layers(state: Mapping[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for key in state if (m := re.match(pattern, key))}
    return max(found) + 1 if found else 0


def _convert(
    state: Mapping[str, torch.Tensor], rules: list, layer_pattern: str, embed_key: str, source: str
) -> dict[str, torch.Tensor]:
    num_layers = _num_layers(state, layer_pattern)
    if embed_key not in state:
        raise ConversionError(f"{source} state dict: missing keys: {embed_key}")
    hidden = state[embed_key].shape[-1]
    spec = canonical_spec(num_layers, hidden)
    out = rename_strict(state, rule_renamer(rules), spec, source=source)
    wrong = [f"{k} {tuple(v.shape)} (expected {spec[k]})" for k, v in sorted(out.items()) if tuple(v.shape) != spec[k]]
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; ... ({len(wrong)} in all)" if len(wrong) > 8 else "")
        raise ConversionError(
            f"{source} state dict: shapes do not fit an ESMC of {num_layers} layers, hidden size {hidden}: {shown}"
        )
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in sorted(out.items())}


def from_esm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EvolutionaryScale `esm` ESMC state dict (`esmc_*_2024_12_v0.pth`) -> ours."""
    return _convert(state, _ESM_RULES, r"transformer\.blocks\.(\d+)\.", "embed.weight", "EvolutionaryScale esm ESMC")


def from_biohub(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Biohub `biohub/ESMC-*` safetensors (Transformer-Engine names) -> ours."""
    return _convert(state, _BIOHUB_RULES, _BIOHUB_BLOCK, "esmc.embed.weight", "Biohub ESMC")


def dims(state: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(num_layers, hidden_size) of a canonical ESMC state dict."""
    return _num_layers(state, r"esmc\.layers\.(\d+)\."), state["esmc.embed_tokens.weight"].shape[1]
