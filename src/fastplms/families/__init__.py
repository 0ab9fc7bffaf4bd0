"""Family adapters, selected by a manifest's `architecture`: `families/<architecture>.py` defines `ADAPTER`.

The builder, the verifier and the parity driver are generic; what they need to know per family comes
from here (see `adapter.FamilyAdapter`).
"""

from __future__ import annotations

import importlib

from ..manifest import Family
from .adapter import FamilyAdapter, Parity, Tokenizer, entry_modules, tokenized_inputs

__all__ = ["FamilyAdapter", "Parity", "Tokenizer", "adapter_for", "entry_modules", "tokenized_inputs"]


def adapter_for(family: Family) -> FamilyAdapter:
    """The adapter of `family`'s architecture; a ValueError names the architecture when there is none."""
    try:
        module = importlib.import_module(f"{__name__}.{family.architecture}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{family.architecture}":
            raise
        raise ValueError(
            f"{family.path.name}: architecture {family.architecture!r} has no adapter "
            f"(src/fastplms/families/{family.architecture}.py)"
        ) from None
    return module.ADAPTER
