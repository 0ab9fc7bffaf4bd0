"""Build remote-code Hub artifacts from official snapshots, driven by the manifests and the family adapters.

An artifact is a folder Transformers loads with `trust_remote_code=True`: config.json with an
`auto_map` for every advertised AutoClass, the runtime modules (exactly the closure of single-dot
relative imports of the family's entry modules, copied byte for byte), tokenizer files, safetensors
weights, kernels.lock, a model card and `provenance.json` (inputs, transform, builder version and the
hash of every output file). Builds are deterministic: the same inputs give byte-identical folders.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .. import __version__
from ..families import FamilyAdapter, adapter_for, entry_modules
from ..manifest import REPO_ROOT, Family, find_checkpoint, load_all
from .snapshot import BuildError, check_snapshot_tree

# The runtime: the top-level modules of the package, which artifacts ship byte for byte.
RUNTIME_DIR = Path(__file__).resolve().parents[1]
# Packages a runtime module may import (besides the standard library and single-dot siblings):
# what Transformers' remote-code loader can rely on, plus kernels, which flash.py imports lazily.
RUNTIME_PACKAGES = frozenset({"torch", "transformers", "safetensors", "kernels"})
SHARD_BYTES = 2 * 1024**3
PROVENANCE = "provenance.json"
DIST_DIR = REPO_ROOT / "dist" / "hub"


# --------------------------------------------------------------------------- runtime bundle


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling modules imported with `from .x import`, top-level packages imported absolutely)."""
    relative, absolute = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            absolute |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                absolute.add((node.module or "").split(".")[0])
            elif node.level == 1 and node.module and "." not in node.module:
                relative.add(node.module)
            else:
                dots = "." * node.level
                raise BuildError(
                    f"{path.name}: 'from {dots}{node.module or ''} import ...' is not a single-dot import of a "
                    "sibling module; remote-code artifacts are one flat folder"
                )
    return relative, absolute


def runtime_closure(entries: Iterable[str], directory: Path = RUNTIME_DIR) -> list[str]:
    """Module names reachable from `entries` through single-dot imports; refuses foreign imports."""
    allowed = RUNTIME_PACKAGES | set(sys.stdlib_module_names) | {"__future__"}
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = directory / f"{name}.py"
        if not path.is_file():
            raise BuildError(f"runtime module {name!r} does not exist in {directory}")
        seen.add(name)
        relative, absolute = _imports(path)
        foreign = sorted(absolute - allowed)
        if foreign:
            raise BuildError(
                f"{path.name} imports {', '.join(foreign)}; a runtime module may import only the standard "
                f"library, {', '.join(sorted(RUNTIME_PACKAGES))} and sibling runtime modules"
            )
        todo.extend(relative - seen)
    return sorted(seen)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


# --------------------------------------------------------------------------- writing


def _write_weights(state: Mapping[str, torch.Tensor], out: Path) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        tensor = state[key].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def _write_config(config, family: Family, adapter: FamilyAdapter, out: Path) -> None:
    pretrained = family.auto_classes.get(adapter.pretrained_auto_class)
    if pretrained is None:
        raise BuildError(
            f"{family.path.name}: the family's pretrained class {adapter.pretrained_auto_class} is not in its "
            f"auto_classes ({', '.join(family.auto_classes)})"
        )
    config.auto_map = dict(family.auto_classes)
    config.architectures = [pretrained.split(".")[1]]
    data = config.to_dict()
    for key in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        data.pop(key, None)
    data.pop("attn_implementation", None)  # left to the caller
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _output_hashes(out: Path) -> dict[str, str]:
    return {
        path.relative_to(out).as_posix(): sha256_file(path)
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name != PROVENANCE
    }


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not (out / PROVENANCE).is_file() and not force:
        if not out.is_dir() or any(out.iterdir()):
            raise BuildError(f"{out} exists and is not a previous fastplms build; pass --force to replace it")


def build(
    model_id: str,
    snapshot: str | Path,
    out: str | Path | None = None,
    *,
    allow_unpinned: bool = False,
    force: bool = False,
) -> Path:
    """Build the artifact of checkpoint `model_id` (id or published name) from an official snapshot."""
    from .model_card import render_model_card

    family, checkpoint = find_checkpoint(model_id)
    try:
        adapter = adapter_for(family)
    except ValueError as error:
        raise BuildError(str(error)) from None
    snapshot = Path(snapshot)
    out = Path(out) if out is not None else DIST_DIR / checkpoint.published
    _prepare_out(out, force)
    check_snapshot_tree(snapshot)
    source, inputs, state = adapter.read_snapshot(snapshot, family, checkpoint)
    input_hashes = {name: sha256_file(path) for name, path in sorted(inputs.items())}
    mismatched = {
        name: (pinned, input_hashes.get(name))
        for name, pinned in source.files.items()
        if input_hashes.get(name) != pinned
    }
    if mismatched and not allow_unpinned:
        detail = "; ".join(f"{n}: pinned {p}, found {f}" for n, (p, f) in mismatched.items())
        raise BuildError(
            f"snapshot files differ from the official {checkpoint.id} hashes pinned in the manifest ({detail}). "
            "Pass --allow-unpinned to build from these weights anyway (they will be marked unofficial)."
        )
    pinned = not mismatched and bool(source.files)
    from_snapshot = {}
    if checkpoint.from_snapshot:
        if adapter.snapshot_config is None:
            raise BuildError(
                f"{checkpoint.id}: the manifest leaves {checkpoint.from_snapshot} to the snapshot, "
                f"but the {family.name} adapter cannot read them"
            )
        from_snapshot = adapter.snapshot_config(snapshot, checkpoint)
    config = adapter.make_config(family, checkpoint, **from_snapshot)

    # Stage beside `out`: os.replace cannot move a folder across filesystems (e.g. out of a tmpfs /tmp).
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{checkpoint.published}-", dir=out.parent))
    try:
        for module in runtime_closure(entry_modules(family, adapter)):
            shutil.copyfile(RUNTIME_DIR / f"{module}.py", staging / f"{module}.py")
        _write_config(config, family, adapter, staging)
        weight_files = _write_weights(state, staging)
        if adapter.tokenizer is not None:
            spec = adapter.tokenizer
            tokenizer = importlib.import_module(f"fastplms.{spec.module}")
            vocab = snapshot if spec.vocab_from_snapshot else spec.vocab
            tokenizer.tokenizer_files(staging, vocab, spec.model_max_length)
        shutil.copyfile(REPO_ROOT / "kernels.lock", staging / "kernels.lock")
        provenance = {
            "checkpoint": checkpoint.id,
            "published": checkpoint.published,
            "family": family.id,
            "source": {
                "kind": source.kind,
                "repo": source.repo,
                "revision": source.revision,
                "file": source.file,
                "url": source.url,
                "license": source.license or checkpoint.license,
            },
            "official_weights": pinned,
            "unpinned_files": sorted(mismatched),
            "inputs": input_hashes,
            "transform": family.transform,
            "builder": f"fastplms {__version__}",
            "weights": weight_files,
        }
        (staging / "README.md").write_text(render_model_card(family, checkpoint, provenance, adapter.usage))
        provenance["files"] = _output_hashes(staging)
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        # mkdtemp and safetensors create private files; an artifact is meant to be shared.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def build_all(snapshots: str | Path, out_root: str | Path | None = None, **kwargs) -> list[Path]:
    """Build every manifest checkpoint whose snapshot folder (named by id or published name) exists."""
    root = Path(snapshots)
    built = []
    for family in load_all(resolve=False).values():
        for checkpoint in family.checkpoints:
            for name in (checkpoint.id, checkpoint.published):
                if (root / name).is_dir():
                    out = None if out_root is None else Path(out_root) / checkpoint.published
                    built.append(build(checkpoint.id, root / name, out, **kwargs))
                    break
    return built
