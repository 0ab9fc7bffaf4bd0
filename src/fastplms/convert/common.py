"""Strict, pure state transforms from official checkpoint layouts to ours: the shared machinery.

A transform is a function `official state dict -> canonical state dict`. It must account for every
key: a key it does not know, a canonical key that two official keys map to, or a canonical key no
official key provides are all `ConversionError`s listing the keys. Weights are read with safetensors
or `torch.load(weights_only=True)`, never with unrestricted pickle.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

DROP = object()  # a rename result meaning "known key, intentionally not carried over"


class ConversionError(ValueError):
    pass


def _listing(keys: Iterable[str], limit: int = 12) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file, or of a .bin/.pt file loaded with weights_only=True."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    # fair-esm checkpoints carry their args as an argparse.Namespace; allow exactly that type.
    with torch.serialization.safe_globals([argparse.Namespace]):
        data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, Mapping) and "model" in data and isinstance(data["model"], Mapping):
        data = data["model"]
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ConversionError(f"{path}: not a state dict of tensors")
    return dict(data)


def rename_strict(
    state: Mapping[str, torch.Tensor],
    rename: Callable[[str], object],
    expected: Iterable[str],
    *,
    source: str,
) -> dict[str, torch.Tensor]:
    """Apply `rename` (key -> new key | DROP | None for unknown) and check the result is complete."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    unknown, collisions = [], []
    for key, value in state.items():
        new = rename(key)
        if new is DROP:
            continue
        if new is None:
            unknown.append(key)
            continue
        if new in out:
            collisions.append(f"{origin[new]} and {key} -> {new}")
            continue
        out[new], origin[new] = value, key
    problems = []
    if unknown:
        problems.append(f"unknown keys: {_listing(unknown)}")
    if collisions:
        problems.append(f"colliding keys: {'; '.join(collisions)}")
    missing = set(expected) - set(out)
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    extra = set(out) - set(expected)
    if extra:
        problems.append(f"keys with no place in the model: {_listing(extra)}")
    if problems:
        raise ConversionError(f"{source} state dict: " + "; ".join(problems))
    return out


def rule_renamer(rules: Iterable[tuple[str, object]]) -> Callable[[str], object]:
    """Renamer from (regex, replacement-or-DROP) rules; the first full match wins."""
    compiled = [(re.compile(pattern), target) for pattern, target in rules]

    def rename(key: str) -> object:
        for pattern, target in compiled:
            match = pattern.fullmatch(key)
            if match:
                return target if target is DROP else match.expand(target)
        return None

    return rename
