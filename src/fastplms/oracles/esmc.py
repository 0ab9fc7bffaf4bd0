"""Seeded ESMC checkpoints in the official EvolutionaryScale layout, and the golden panel.

What lives here, for parity tests of our ESMC implementation against the official ``esm.models.esmc.ESMC``
(the released models' dims are in ``manifests/esmc.toml``):

- ``esmc_official_spec``: key -> shape of ``ESMC(...).state_dict()`` (the layout of
  ``data/weights/esmc_300m_2024_12_v0.pth``; the official loader reads it with a strict ``load_state_dict``).
- ``esmc_official_state_dict``: seeded float32 tensors for that spec (``esmc_rule`` picks the scales).
- ``esmc_panel``: the fixed input panel the goldens in ``tests/goldens/esmc_*.safetensors`` were computed on,
  tokenised with the official ESMC sequence vocabulary (``esmc_tokenize``).

The goldens themselves are produced by ``tools/goldens/esmc.py`` in a separate venv (``.venv-esmc``) that
has the official ``esm`` package; see ``tools/goldens/README.md``. Nothing from that package is imported or
copied here: the layout facts below (key names, shapes, vocabulary ids) were read off a constructed model and
are re-checked against it by ``tests/test_esmc_reference.py`` whenever the oracle venv exists.

This module must import in both venvs, so it depends only on numpy, torch and ``seeded_weights.py`` (which
it loads by file path when it is itself loaded by path, outside the ``fastplms`` package). It never imports
transformers.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

if __package__:
    from .seeded_weights import seeded_tensor
else:  # loaded by file path (the oracle venv has no fastplms installed): load the sibling by path too
    _SW_NAME = "_fastplms_seeded_weights_by_path"
    _sw = sys.modules.get(_SW_NAME)
    if _sw is None:
        _spec = importlib.util.spec_from_file_location(_SW_NAME, Path(__file__).with_name("seeded_weights.py"))
        assert _spec is not None and _spec.loader is not None
        _sw = importlib.util.module_from_spec(_spec)
        sys.modules[_SW_NAME] = _sw
        _spec.loader.exec_module(_sw)
    seeded_tensor = _sw.seeded_tensor

__all__ = [
    "biohub_key",
    "biohub_state",
    "ESMC_VOCAB",
    "ESMC_VOCAB_SIZE",
    "CLS_ID",
    "PAD_ID",
    "EOS_ID",
    "UNK_ID",
    "CHAIN_BREAK_ID",
    "MASK_ID",
    "EsmcPanel",
    "esmc_ffn_hidden",
    "esmc_official_spec",
    "esmc_official_state_dict",
    "esmc_panel",
    "esmc_rule",
    "esmc_tokenize",
]

# The ESMC sequence vocabulary in id order (33 tokens). The embedding table and the LM head have 64 rows;
# ids 33..63 are never produced by the tokenizer.
ESMC_VOCAB: tuple[str, ...] = (
    ("<cls>", "<pad>", "<eos>", "<unk>") + tuple("LAGVSERTIDPKQNFYMHWCXBUZO") + (".", "-", "|", "<mask>")
)
ESMC_VOCAB_SIZE = 64  # rows of embed.weight and of the sequence head's output layer
CLS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHAIN_BREAK_ID = 31  # "|"
MASK_ID = 32  # "<mask>"

_TOKEN_TO_ID = {tok: i for i, tok in enumerate(ESMC_VOCAB)}
# Multi-character tokens first, then any single character (unknown characters become <unk>).
_TOKEN_RE = re.compile(r"<cls>|<pad>|<eos>|<unk>|<mask>|.", re.DOTALL)


def esmc_ffn_hidden(d_model: int, expansion_ratio: float = 8 / 3) -> int:
    """SwiGLU hidden size of an ESMC block: ``expansion_ratio * d_model`` rounded *up* to a multiple of 256.

    960 -> 2560, 1152 -> 3072, 2560 -> 6912 (computed in float like the official code, then floored).
    """
    return int(((expansion_ratio * d_model) + 255) // 256 * 256)


def _check_dims(n_layers: int, d_model: int, n_heads: int) -> None:
    if n_layers < 1 or d_model < 1 or n_heads < 1 or d_model % n_heads:
        raise ValueError(f"invalid ESMC dims: n_layers={n_layers} d_model={d_model} n_heads={n_heads}")
    if (d_model // n_heads) % 2:
        raise ValueError(f"rotary needs an even head dim, got {d_model // n_heads}")


def esmc_official_spec(n_layers: int, d_model: int, n_heads: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the official ``ESMC(d_model, n_heads, n_layers, ...).state_dict()``, in its order.

    Rotary ``inv_freq`` buffers are non-persistent in the official model, so they are not in the state dict
    (nor in the released ``.pth`` files). All projections are bias-free except the sequence head.
    """
    _check_dims(n_layers, d_model, n_heads)
    d, h = d_model, esmc_ffn_hidden(d_model)
    spec: dict[str, tuple[int, ...]] = {"embed.weight": (ESMC_VOCAB_SIZE, d)}
    for i in range(n_layers):
        p = f"transformer.blocks.{i}."
        spec[p + "attn.layernorm_qkv.0.weight"] = (d,)  # pre-attention LayerNorm (with bias)
        spec[p + "attn.layernorm_qkv.0.bias"] = (d,)
        spec[p + "attn.layernorm_qkv.1.weight"] = (3 * d, d)  # fused q|k|v, no bias
        spec[p + "attn.out_proj.weight"] = (d, d)
        spec[p + "attn.q_ln.weight"] = (d,)  # LayerNorm over all of d_model, no bias
        spec[p + "attn.k_ln.weight"] = (d,)
        spec[p + "ffn.0.weight"] = (d,)  # pre-FFN LayerNorm (with bias)
        spec[p + "ffn.0.bias"] = (d,)
        spec[p + "ffn.1.weight"] = (2 * h, d)  # fused [gate | up], no bias
        spec[p + "ffn.3.weight"] = (d, h)  # down, no bias
    spec["transformer.norm.weight"] = (d,)  # final LayerNorm, no bias
    spec["sequence_head.0.weight"] = (d, d)
    spec["sequence_head.0.bias"] = (d,)
    spec["sequence_head.2.weight"] = (d,)  # LayerNorm (with bias)
    spec["sequence_head.2.bias"] = (d,)
    spec["sequence_head.3.weight"] = (ESMC_VOCAB_SIZE, d)
    spec["sequence_head.3.bias"] = (ESMC_VOCAB_SIZE,)
    return spec


_NORM_WEIGHT_RE = re.compile(
    r"(attn\.layernorm_qkv\.0|attn\.q_ln|attn\.k_ln|ffn\.0|transformer\.norm|sequence_head\.2)\.weight$"
)


def esmc_rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) for ESMC tensors, chosen so that a masking, rotary or scaling bug changes the outputs.

    - ``embed.weight``: ``normal`` std 1 (the official model does not scale or normalise embeddings).
    - LayerNorm scales (``layernorm_qkv.0``, ``q_ln``, ``k_ln``, ``ffn.0``, ``transformer.norm``,
      ``sequence_head.2``): ``ones_jitter`` std 0.1.
    - biases (LayerNorm and sequence-head Linear biases): ``zeros_jitter`` std 0.02.
    - other matrices: ``normal`` std ``1/sqrt(fan_in)`` so activations and logits stay O(1) and the
      attention is far from uniform (q/k LayerNorm keeps per-head logits at std ~1 whatever the scale).
    """
    if key == "embed.weight":
        return "normal", 1.0
    if _NORM_WEIGHT_RE.search(key):
        return "ones_jitter", 0.1
    if key.endswith("bias"):
        return "zeros_jitter", 0.02
    if len(shape) == 2:
        return "normal", 1.0 / math.sqrt(shape[1])
    raise ValueError(f"no ESMC rule for {key!r} with shape {shape}")


def esmc_official_state_dict(n_layers: int, d_model: int, n_heads: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for ``esmc_official_spec`` (per-key streams of ``seeded_weights.seeded_tensor``).

    Loads into the official ``ESMC`` with ``load_state_dict(strict=True)``; the same numbers feed ours.
    """
    out: dict[str, torch.Tensor] = {}
    for key, shape in esmc_official_spec(n_layers, d_model, n_heads).items():
        kind, std = esmc_rule(key, shape)
        out[key] = torch.from_numpy(seeded_tensor(key, shape, seed=seed, kind=kind, std=std))
    return out


def esmc_tokenize(sequence: str, *, add_special_tokens: bool = True) -> list[int]:
    """Ids the official ``EsmSequenceTokenizer().encode(sequence)`` returns (``<cls> ... <eos>``).

    One token per character, except the literal special tokens ``<mask>``, ``<cls>``, ``<eos>``, ``<pad>``,
    ``<unk>``; ``|`` is the chain break (id 31). Unknown characters map to ``<unk>`` (3). Note: the official
    ``esm.utils.encoding.tokenize_sequence`` additionally rewrites ``_`` to ``<mask>`` before encoding; the
    tokenizer's own ``encode`` (and this function) do not. The panel contains no ``_``.
    """
    ids = [_TOKEN_TO_ID.get(tok, UNK_ID) for tok in _TOKEN_RE.findall(sequence)]
    return [CLS_ID, *ids, EOS_ID] if add_special_tokens else ids


class EsmcPanel(NamedTuple):
    """The golden input panel. Unpacks as ``sequences, input_ids, attention_mask, sequence_id``."""

    sequences: list[str]  # residues as strings; "<mask>" literal for masked positions, "|" chain breaks
    input_ids: torch.Tensor  # (B, S) int64: <cls> + tokens + <eos>, right-padded with <pad>=1
    attention_mask: torch.Tensor  # (B, S) int64: 1 for real tokens (incl. <cls>/<eos>/"|"), 0 for padding
    sequence_id: torch.Tensor  # (B, S) int64: chain index (0, 1, ...) per real token, -1 for padding


# Ubiquitin's first 70 residues with two masks and an X; every row has at least one <mask>, rows 1 and 2
# carry W and C (absent from ubiquitin). Lengths in residues: 1, 9, 33 (16 + "|" + 16), 70.
_PANEL_SEQUENCES: tuple[str, ...] = (
    "M",
    "MK<mask>LVAGHW",
    "MSEQNDRFIL<mask>KTYPA|GCWVLAHEKR<mask>DQISF",
    "MQIFVKTLTGKTITLEVEPS<mask>TIENVKAKIQDKEGIPPDQQRLIFAGKQ<mask>EDGRTLSDYNIQXESTLHLV",
)


def esmc_panel() -> EsmcPanel:
    """The fixed ESMC golden panel: 4 rows, 3 / 11 / 35 / 72 tokens, padded to S = 72.

    ``sequence_id`` is the explicit-mask variant used by the goldens' ``seqid_*`` tensors: every real token
    gets the index of its chain, counting ``|`` tokens *strictly before* it (so ``<cls>`` and the ``|`` belong
    to the chain they close/open as: ``<cls>``+chain A+``|`` -> 0, chain B+``<eos>`` -> 1), and padding gets
    -1. The official model attends i -> j iff ``sequence_id[i] == sequence_id[j]`` (pads therefore attend to
    pads, in both variants). Rotary positions are *not* reset per chain (they are 0..S-1 per row).
    """
    rows = [esmc_tokenize(s) for s in _PANEL_SEQUENCES]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.int64)
    sequence_id = torch.full((len(rows), width), -1, dtype=torch.int64)
    for b, ids in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        chain = np.concatenate([[0], np.cumsum(np.asarray(ids[:-1]) == CHAIN_BREAK_ID)])
        sequence_id[b, : len(ids)] = torch.from_numpy(chain.astype(np.int64))
    attention_mask = (input_ids != PAD_ID).to(torch.int64)
    return EsmcPanel(list(_PANEL_SEQUENCES), input_ids, attention_mask, sequence_id)


# The Biohub re-release: the same tensors under Transformer-Engine module names below `esmc.`, the head as
# `lm_head.{0,2,3}`, plus weightless `_extra_state` entries per fused module.
_BIOHUB_SUFFIX = {
    "attn.layernorm_qkv.0.weight": "attn.layernorm_qkv.layer_norm_weight",
    "attn.layernorm_qkv.0.bias": "attn.layernorm_qkv.layer_norm_bias",
    "attn.layernorm_qkv.1.weight": "attn.layernorm_qkv.weight",
    "ffn.0.weight": "ffn.layer_norm_weight",
    "ffn.0.bias": "ffn.layer_norm_bias",
    "ffn.1.weight": "ffn.fc1_weight",
    "ffn.3.weight": "ffn.fc2_weight",
}


def biohub_key(key: str) -> str:
    """Official `esm` key -> the Biohub re-release's name for the same tensor."""
    if key.startswith("sequence_head."):
        return "lm_head." + key.removeprefix("sequence_head.")
    if key.startswith("transformer.blocks."):
        block, layer, rest = key.split(".", 3)[1:]
        return f"esmc.transformer.{block}.{layer}.{_BIOHUB_SUFFIX.get(rest, rest)}"
    return "esmc." + key


def biohub_state(official: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An official `esm` state dict in the Biohub layout, `_extra_state` entries included (on the tensors'
    device, so a meta-device spec stays on the meta device)."""
    out = {biohub_key(key): value for key, value in official.items()}
    device = next(iter(official.values())).device
    layers = {key.split(".")[3] for key in out if key.startswith("esmc.transformer.blocks.")}
    for i in layers:
        for module in ("attn.layernorm_qkv", "ffn"):
            out[f"esmc.transformer.blocks.{i}.{module}._extra_state"] = torch.zeros(0, dtype=torch.uint8, device=device)
    return out
