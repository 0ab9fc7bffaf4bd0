"""ESM2 state transforms: `facebook/esm2_*` (Transformers) and fair-esm `.pt` layouts -> ours.

Transform id `esm2-v1`. Both official layouts are first renamed to one intermediate layout with
separate q/k/v projections, checked for completeness, then q/k/v are fused into `qkv` (one matmul).
Rotary `inv_freq` buffers are derived from the config, so they are checked against the formula and
dropped; a checkpoint whose `inv_freq` differs would not be ESM2 and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import DROP, ConversionError, rename_strict, rule_renamer

TRANSFORM_ID = "esm2-v1"

_LAYER_PARTS = ("q", "k", "v", "out_proj", "attn_norm", "mlp_norm", "fc1", "fc2")

_HF_RULES = [
    (r"esm\.embeddings\.word_embeddings\.weight", r"esm.embed_tokens.weight"),
    (r"esm\.embeddings\.position_ids", DROP),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"esm.layers.\1.q.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"esm.layers.\1.k.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"esm.layers.\1.v.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.self\.rotary_embeddings\.inv_freq", DROP),
    (r"esm\.rotary_embeddings\.inv_freq", DROP),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"esm.layers.\1.out_proj.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.LayerNorm\.(weight|gamma)", r"esm.layers.\1.attn_norm.weight"),
    (r"esm\.encoder\.layer\.(\d+)\.attention\.LayerNorm\.(bias|beta)", r"esm.layers.\1.attn_norm.bias"),
    (r"esm\.encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"esm.layers.\1.fc1.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"esm.layers.\1.fc2.\2"),
    (r"esm\.encoder\.layer\.(\d+)\.LayerNorm\.(weight|gamma)", r"esm.layers.\1.mlp_norm.weight"),
    (r"esm\.encoder\.layer\.(\d+)\.LayerNorm\.(bias|beta)", r"esm.layers.\1.mlp_norm.bias"),
    (r"esm\.encoder\.emb_layer_norm_after\.(weight|gamma)", r"esm.final_norm.weight"),
    (r"esm\.encoder\.emb_layer_norm_after\.(bias|beta)", r"esm.final_norm.bias"),
    (r"esm\.contact_head\.regression\.(weight|bias)", r"esm.contact_head.\1"),
    (r"lm_head\.dense\.(weight|bias)", r"lm_head.dense.\1"),
    (r"lm_head\.layer_norm\.(weight|gamma)", r"lm_head.norm.weight"),
    (r"lm_head\.layer_norm\.(bias|beta)", r"lm_head.norm.bias"),
    (r"lm_head\.decoder\.weight", r"lm_head.decoder.weight"),
    (r"lm_head\.bias", r"lm_head.bias"),
]

# fair-esm files store fairseq names ("encoder.sentence_encoder." body, "encoder." LM head); the
# module's own state_dict() has neither prefix. Both are accepted.
_FAIR_RULES = [
    (r"(?:encoder\.sentence_encoder\.)?embed_tokens\.weight", r"esm.embed_tokens.weight"),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"esm.layers.\1.q.\2"),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"esm.layers.\1.k.\2"),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"esm.layers.\1.v.\2"),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn\.rot_emb\.inv_freq", DROP),
    (
        r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)",
        r"esm.layers.\1.out_proj.\2",
    ),
    (
        r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.self_attn_layer_norm\.(weight|bias)",
        r"esm.layers.\1.attn_norm.\2",
    ),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.fc1\.(weight|bias)", r"esm.layers.\1.fc1.\2"),
    (r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.fc2\.(weight|bias)", r"esm.layers.\1.fc2.\2"),
    (
        r"(?:encoder\.sentence_encoder\.)?layers\.(\d+)\.final_layer_norm\.(weight|bias)",
        r"esm.layers.\1.mlp_norm.\2",
    ),
    (r"(?:encoder\.sentence_encoder\.)?emb_layer_norm_after\.(weight|bias)", r"esm.final_norm.\1"),
    (r"contact_head\.regression\.(weight|bias)", r"esm.contact_head.\1"),
    (r"(?:encoder\.)?lm_head\.dense\.(weight|bias)", r"lm_head.dense.\1"),
    (r"(?:encoder\.)?lm_head\.layer_norm\.(weight|bias)", r"lm_head.norm.\1"),
    (r"(?:encoder\.)?lm_head\.weight", r"lm_head.decoder.weight"),
    (r"(?:encoder\.)?lm_head\.bias", r"lm_head.bias"),
]


def _intermediate_keys(num_layers: int) -> set[str]:
    keys = {"esm.embed_tokens.weight", "esm.final_norm.weight", "esm.final_norm.bias"}
    keys |= {"esm.contact_head.weight", "esm.contact_head.bias"}
    keys |= {f"lm_head.{p}" for p in ("dense.weight", "dense.bias", "norm.weight", "norm.bias")}
    keys |= {"lm_head.decoder.weight", "lm_head.bias"}
    for i in range(num_layers):
        keys |= {f"esm.layers.{i}.{part}.{kind}" for part in _LAYER_PARTS for kind in ("weight", "bias")}
    return keys


def _num_layers(state: Mapping[str, torch.Tensor], pattern: str) -> int:
    import re

    found = {int(m.group(1)) for k in state if (m := re.search(pattern, k))}
    return max(found) + 1 if found else 0


def _check_inv_freq(state: Mapping[str, torch.Tensor], head_dim: int, source: str) -> None:
    expected = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    for key, value in state.items():
        if key.endswith("inv_freq") and (
            value.shape != expected.shape or not torch.allclose(value.float(), expected, rtol=1e-5, atol=0)
        ):
            raise ConversionError(f"{source} state dict: {key} is not the ESM2 rotary inv_freq for head_dim {head_dim}")


def _fuse(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    for i in range(num_layers):
        for kind in ("weight", "bias"):
            parts = [state.pop(f"esm.layers.{i}.{p}.{kind}") for p in ("q", "k", "v")]
            state[f"esm.layers.{i}.qkv.{kind}"] = torch.cat(parts, dim=0)
    return state


def _finish(state: dict[str, torch.Tensor], num_heads: int, source: str) -> dict[str, torch.Tensor]:
    num_layers = _num_layers(state, r"^esm\.layers\.(\d+)\.")
    hidden = state["esm.embed_tokens.weight"].shape[1]
    out = _fuse(state, num_layers)
    contact = out["esm.contact_head.weight"]
    if contact.shape != (1, num_layers * num_heads):
        raise ConversionError(
            f"{source} state dict: contact regression has shape {tuple(contact.shape)}; expected "
            f"(1, {num_layers * num_heads}) for {num_layers} layers x {num_heads} heads (hidden {hidden})"
        )
    return {k: v.contiguous() for k, v in sorted(out.items())}


def from_transformers(state: Mapping[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """`facebook/esm2_*` EsmForMaskedLM layout (LayerNorm weight/bias or gamma/beta) -> ours."""
    num_layers = _num_layers(state, r"^esm\.encoder\.layer\.(\d+)\.")
    # Renamed (and so checked for completeness) first: a missing embedding is a listed ConversionError.
    renamed = rename_strict(state, rule_renamer(_HF_RULES), _intermediate_keys(num_layers), source="Transformers ESM2")
    hidden = renamed["esm.embed_tokens.weight"].shape[1]
    _check_inv_freq(state, hidden // num_heads, "Transformers ESM2")
    return _finish(renamed, num_heads, "Transformers ESM2")


def from_fair_esm(
    state: Mapping[str, torch.Tensor], num_heads: int, contact: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """fair-esm ESM2 `.pt` layout (plus its `-contact-regression.pt` tensors) -> ours."""
    merged = {**state, **(contact or {})}
    num_layers = _num_layers(merged, r"layers\.(\d+)\.")
    renamed = rename_strict(merged, rule_renamer(_FAIR_RULES), _intermediate_keys(num_layers), source="fair-esm ESM2")
    hidden = renamed["esm.embed_tokens.weight"].shape[1]
    _check_inv_freq(merged, hidden // num_heads, "fair-esm ESM2")
    return _finish(renamed, num_heads, "fair-esm ESM2")
