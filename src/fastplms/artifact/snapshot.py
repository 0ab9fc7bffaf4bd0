"""Reading official snapshots: the checks and weight readers every family's snapshot reader shares."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from ..convert.common import load_weights


class BuildError(ValueError):
    pass


def check_snapshot_tree(snapshot: Path) -> None:
    """A snapshot must be a folder of real files: a symlink out of it would be read as if it were its own."""
    if not snapshot.is_dir():
        raise BuildError(f"snapshot {snapshot} is not a directory")
    root = snapshot.resolve()
    for path in sorted(snapshot.rglob("*")):
        if path.is_symlink():
            target = path.resolve()
            if root not in target.parents and target != root:
                raise BuildError(
                    f"snapshot {snapshot}: {path.relative_to(snapshot)} is a symlink escaping the snapshot "
                    f"(to {target}); download with --local-dir so files are real"
                )


def require(snapshot: Path, names: Iterable[str], what: str) -> dict[str, Path]:
    """name -> path of files that must all exist, checked before any of them is read."""
    found = {name: snapshot / name for name in names}
    missing = [name for name, path in found.items() if not path.is_file()]
    if missing:
        raise BuildError(f"snapshot {snapshot} ({what}) is missing: {', '.join(missing)}")
    return found


def read_hub_weights(snapshot: Path, formats: Iterable[str]) -> tuple[dict[str, Path], dict[str, torch.Tensor]]:
    """Weights of a Hub snapshot: a sharded index or a single file, in the first of `formats` present."""
    names = {
        "safetensors": ("model.safetensors", "model.safetensors.index.json"),
        "bin": ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    }
    formats = tuple(formats)
    state: dict[str, torch.Tensor] = {}
    for fmt in formats:
        single, index_name = names[fmt]
        if (snapshot / index_name).is_file():
            index = json.loads((snapshot / index_name).read_text())
            shards = sorted(set(index["weight_map"].values()))
            files = require(snapshot, [index_name, *shards], "sharded weights")
            for shard in shards:
                state.update(load_weights(files[shard]))
            return files, state
        if (snapshot / single).is_file():
            return {single: snapshot / single}, load_weights(snapshot / single)
    wanted = " or ".join(names[fmt][0] for fmt in formats)
    raise BuildError(f"snapshot {snapshot} has no {wanted} (single or sharded)")
