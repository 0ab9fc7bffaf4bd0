"""ANKH state transform: an ElnaggarLab Hub snapshot (Transformers' `T5ForConditionalGeneration`) -> ours.

Transform id `ankh-v1`. T5 keeps one embedding table, `shared.weight`; `encoder.embed_tokens.weight` and
`decoder.embed_tokens.weight`, where a file stores them, are the same tensor and must equal it. The relative
bias lives in block 0 of each stack (`relative_attention_bias`) and is shared by every block, so it moves to
the stack. The LM head is untied (ANKH's `tie_word_embeddings` is false) and kept as written.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import DROP, ConversionError, rename_strict, rule_renamer

TRANSFORM_ID = "ankh-v1"

_ENC = r"encoder\.block\.(\d+)\.layer\."
_DEC = r"decoder\.block\.(\d+)\.layer\."
_RULES = [
    (r"shared\.weight", r"encoder.embed_tokens.weight"),
    (r"(encoder|decoder)\.embed_tokens\.weight", DROP),  # T5's shared table, checked equal below
    (r"encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight", r"encoder.relative_bias.weight"),
    (r"decoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight", r"decoder.relative_bias.weight"),
    (_ENC + r"0\.layer_norm\.weight", r"encoder.layers.\1.attn_norm.weight"),
    (_ENC + r"0\.SelfAttention\.([qkvo])\.weight", r"encoder.layers.\1.attention.\2.weight"),
    (_ENC + r"1\.layer_norm\.weight", r"encoder.layers.\1.mlp_norm.weight"),
    (_ENC + r"1\.DenseReluDense\.(wi_0|wi_1|wo)\.weight", r"encoder.layers.\1.mlp.\2.weight"),
    (r"encoder\.final_layer_norm\.weight", r"encoder.final_norm.weight"),
    (_DEC + r"0\.layer_norm\.weight", r"decoder.layers.\1.self_norm.weight"),
    (_DEC + r"0\.SelfAttention\.([qkvo])\.weight", r"decoder.layers.\1.self_attention.\2.weight"),
    (_DEC + r"1\.layer_norm\.weight", r"decoder.layers.\1.cross_norm.weight"),
    (_DEC + r"1\.EncDecAttention\.([qkvo])\.weight", r"decoder.layers.\1.cross_attention.\2.weight"),
    (_DEC + r"2\.layer_norm\.weight", r"decoder.layers.\1.mlp_norm.weight"),
    (_DEC + r"2\.DenseReluDense\.(wi_0|wi_1|wo)\.weight", r"decoder.layers.\1.mlp.\2.weight"),
    (r"decoder\.final_layer_norm\.weight", r"decoder.final_norm.weight"),
    (r"lm_head\.weight", r"lm_head.weight"),
]


def canonical_keys(num_layers: int, num_decoder_layers: int) -> set[str]:
    """Every key of our `ANKHForConditionalGeneration` state dict."""
    keys = {"encoder.embed_tokens.weight", "encoder.relative_bias.weight", "encoder.final_norm.weight"}
    keys |= {"decoder.relative_bias.weight", "decoder.final_norm.weight", "lm_head.weight"}
    for i in range(num_layers):
        p = f"encoder.layers.{i}."
        keys |= {f"{p}attn_norm.weight", f"{p}mlp_norm.weight"}
        keys |= {f"{p}attention.{x}.weight" for x in "qkvo"} | {f"{p}mlp.{w}.weight" for w in ("wi_0", "wi_1", "wo")}
    for i in range(num_decoder_layers):
        p = f"decoder.layers.{i}."
        keys |= {f"{p}{n}.weight" for n in ("self_norm", "cross_norm", "mlp_norm")}
        keys |= {f"{p}{a}.{x}.weight" for a in ("self_attention", "cross_attention") for x in "qkvo"}
        keys |= {f"{p}mlp.{w}.weight" for w in ("wi_0", "wi_1", "wo")}
    return keys


def _depth(state: Mapping[str, torch.Tensor], stack: str) -> int:
    found = {int(k.split(".")[2]) for k in state if k.startswith(f"{stack}.block.")}
    return max(found) + 1 if found else 0


def from_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`T5ForConditionalGeneration` state (ElnaggarLab/ankh*) -> ours; strict about every key."""
    if "shared.weight" not in state:
        raise ConversionError("ANKH state dict has no shared.weight: not a Transformers T5 checkpoint")
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if key in state and not torch.equal(state[key], state["shared.weight"]):
            raise ConversionError(f"ANKH state dict: {key} differs from shared.weight; T5 shares one table")
    expected = canonical_keys(_depth(state, "encoder"), _depth(state, "decoder"))
    out = rename_strict(state, rule_renamer(_RULES), expected, source="ANKH (Transformers T5)")
    return {k: v.contiguous() for k, v in sorted(out.items())}
