"""DPLM and DPLM2 state transforms: airkingbd `EsmForDPLM` / `EsmForDPLM2` snapshots (ByProt) -> ours.

Transform ids `dplm-v1` and `dplm2-v1`. The official state holds Transformers' Esm keys plus
`esm.embeddings.position_embeddings.weight` (Transformers 4.39 builds an absolute position table even for
rotary models; unused, dropped). DPLM's decoder is tied to the word embeddings, so a checkpoint saves it
once and it is materialised here (one that is present must equal the embeddings, as tying makes it);
DPLM2's decoder is untied and must be present. The rest is ESM2's transform.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import ConversionError
from .esm2 import from_transformers

TRANSFORM_ID = "dplm-v1"
POSITION_TABLE = "esm.embeddings.position_embeddings.weight"
EMBEDDINGS = "esm.embeddings.word_embeddings.weight"
DECODER = "lm_head.decoder.weight"


def tie_decoder(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The state with its tied decoder materialised from the word embeddings (checked if present)."""
    out = dict(state)
    if EMBEDDINGS not in out:
        raise ConversionError(f"{source} state dict has no {EMBEDDINGS}")
    decoder = out.get(DECODER)
    if decoder is not None and not torch.equal(decoder, out[EMBEDDINGS]):
        raise ConversionError(
            f"{source} state dict: {DECODER} differs from {EMBEDDINGS}; the official model ties them, so it "
            "would use the embeddings and ignore this decoder"
        )
    out[DECODER] = out[EMBEDDINGS].clone()
    return out


def from_byprot(state: Mapping[str, torch.Tensor], num_heads: int, *, tied: bool = True) -> dict[str, torch.Tensor]:
    """airkingbd/dplm_* (`EsmForDPLM`, `tied`) or airkingbd/dplm2_* (`EsmForDPLM2`, untied) layout -> ours."""
    family = "DPLM" if tied else "DPLM2"
    if POSITION_TABLE not in state:
        raise ConversionError(
            f"{family} state dict has no {POSITION_TABLE}: every ByProt checkpoint carries it; "
            f"this is not an official {family} snapshot"
        )
    rest = {k: v for k, v in state.items() if k != POSITION_TABLE}
    if not tied and DECODER not in rest:
        raise ConversionError(f"DPLM2 state dict has no {DECODER}: its decoder is untied, so it must be stored")
    return from_transformers(tie_decoder(rest, family) if tied else rest, num_heads)
