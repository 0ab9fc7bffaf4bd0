"""Build remote-code Hub artifacts from official snapshots, driven by the manifests (not runtime).

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .manifest import REPO_ROOT, Checkpoint, Family, Source, find_checkpoint

RUNTIME_DIR = Path(__file__).resolve().parent
# Packages a runtime module may import (besides the standard library and single-dot siblings):
# what Transformers' remote-code loader can rely on, plus kernels, which flash.py imports lazily.
RUNTIME_PACKAGES = frozenset({"torch", "transformers", "safetensors", "kernels"})
SHARD_BYTES = 2 * 1024**3
PROVENANCE = "provenance.json"
DIST_DIR = REPO_ROOT / "dist" / "hub"


class BuildError(ValueError):
    pass


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


# --------------------------------------------------------------------------- family adapters


@dataclass(frozen=True)
class FamilyBuild:
    """What the builder needs to know about a family beyond its manifest."""

    read_snapshot: Callable[[Path, Family, Checkpoint], tuple[Source, dict[str, Path], dict[str, torch.Tensor]]]
    make_config: Callable[[Family, Checkpoint], object]
    vocab: tuple[str, ...]
    tokenizer_module: str
    model_max_length: int


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _check_snapshot_tree(snapshot: Path) -> None:
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


def _require(snapshot: Path, names: Iterable[str], what: str) -> dict[str, Path]:
    found = {name: snapshot / name for name in names}
    missing = [name for name, path in found.items() if not path.is_file()]
    if missing:
        raise BuildError(f"snapshot {snapshot} ({what}) is missing: {', '.join(missing)}")
    return found


def _read_hub_weights(snapshot: Path, formats: Iterable[str]) -> tuple[dict[str, Path], dict[str, torch.Tensor]]:
    """Weights of a Hub snapshot: a sharded index or a single file, in the first of `formats` present."""
    from .conversion import load_weights

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
            files = _require(snapshot, [index_name, *shards], "sharded weights")
            for shard in shards:
                state.update(load_weights(files[shard]))
            return files, state
        if (snapshot / single).is_file():
            return {single: snapshot / single}, load_weights(snapshot / single)
    wanted = " or ".join(names[fmt][0] for fmt in formats)
    raise BuildError(f"snapshot {snapshot} has no {wanted} (single or sharded)")


def _esm2_read_snapshot(snapshot: Path, family: Family, checkpoint: Checkpoint):
    from .conversion import load_weights
    from .convert_esm2 import from_fair_esm, from_transformers

    fair = checkpoint.source("fair-esm")
    if (snapshot / fair.file).is_file():
        stem = Path(fair.file).stem
        files = _require(snapshot, [fair.file, f"{stem}-contact-regression.pt"], "fair-esm layout")
        state = load_weights(files[fair.file])
        contact = load_weights(files[f"{stem}-contact-regression.pt"])
        return fair, files, from_fair_esm(state, checkpoint.num_heads, contact)
    source = checkpoint.source("transformers")
    if not (snapshot / "config.json").is_file():
        raise BuildError(
            f"snapshot {snapshot} is neither a Transformers snapshot of {source.repo} (config.json) nor a "
            f"fair-esm checkpoint ({fair.file})"
        )
    config = json.loads((snapshot / "config.json").read_text())
    expected = {
        "num_hidden_layers": checkpoint.num_layers,
        "hidden_size": checkpoint.hidden_size,
        "num_attention_heads": checkpoint.num_heads,
        "vocab_size": 33,
    }
    wrong = [f"{k} is {config.get(k)!r}, expected {v}" for k, v in expected.items() if config.get(k) != v]
    if wrong:
        raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
    files, state = _read_hub_weights(snapshot, ("safetensors", "bin"))
    return source, {"config.json": snapshot / "config.json", **files}, from_transformers(state, checkpoint.num_heads)


def _esm2_config(family: Family, checkpoint: Checkpoint):
    from .configuration_esm2 import ESM2Config

    return ESM2Config(
        hidden_size=checkpoint.hidden_size,
        num_hidden_layers=checkpoint.num_layers,
        num_attention_heads=checkpoint.num_heads,
        allowed_backends=list(family.backends),
        allowed_dtypes=list(family.dtypes),
        bf16_policy=family.bf16,
        family=family.name,
    )


# Names Hub configs use for ESMC's dimensions: the Transformers port has used both spellings.
_ESMC_CONFIG_DIMS = {
    "num_layers": ("n_layers", "num_hidden_layers"),
    "hidden_size": ("d_model", "hidden_size"),
    "num_heads": ("n_heads", "num_attention_heads"),
}


def _esmc_read_snapshot(snapshot: Path, family: Family, checkpoint: Checkpoint):
    """EvolutionaryScale `esm` layout (the .pth at the source's `file`) or a Biohub safetensors snapshot."""
    from .conversion import load_weights
    from .convert_esmc import dims, from_biohub, from_esm

    esm = next((s for s in checkpoint.sources if s.kind == "esm"), None)
    if esm is not None and (snapshot / esm.file).is_file():
        files = {esm.file: snapshot / esm.file}
        source, state = esm, from_esm(load_weights(files[esm.file]))
    else:
        biohub = next((s for s in checkpoint.sources if s.kind == "biohub"), None)
        if biohub is None or not (snapshot / "config.json").is_file():
            expected = [f"an esm snapshot of {esm.repo} ({esm.file})"] if esm is not None else []
            if biohub is not None:
                expected.append(f"a Biohub snapshot of {biohub.repo} (config.json + safetensors)")
            raise BuildError(f"snapshot {snapshot} is not {' nor '.join(expected) or 'a known ESMC layout'}")
        config = json.loads((snapshot / "config.json").read_text())
        wrong = []
        for attr, names in _ESMC_CONFIG_DIMS.items():
            found = [(name, config[name]) for name in names if name in config]
            want = getattr(checkpoint, attr)
            wrong += [f"{name} is {value!r}, expected {want}" for name, value in found if value != want]
        if config.get("vocab_size", 64) != 64:
            wrong.append(f"vocab_size is {config['vocab_size']!r}, expected 64")
        if wrong:
            raise BuildError(f"snapshot config.json does not match {checkpoint.id}: {'; '.join(wrong)}")
        files, raw = _read_hub_weights(snapshot, ("safetensors",))
        files = {"config.json": snapshot / "config.json", **files}
        source, state = biohub, from_biohub(raw)
    layers, hidden = dims(state)
    if (layers, hidden) != (checkpoint.num_layers, checkpoint.hidden_size):
        raise BuildError(
            f"snapshot weights have {layers} layers, hidden size {hidden}; {checkpoint.id} has "
            f"{checkpoint.num_layers} layers, hidden size {checkpoint.hidden_size}"
        )
    return source, files, state


def _esmc_config(family: Family, checkpoint: Checkpoint):
    from .configuration_esmc import ESMCConfig

    return ESMCConfig(
        hidden_size=checkpoint.hidden_size,
        num_hidden_layers=checkpoint.num_layers,
        num_attention_heads=checkpoint.num_heads,
        allowed_backends=list(family.backends),
        allowed_dtypes=list(family.dtypes),
        bf16_policy=family.bf16,
        family=family.name,
    )


def _family_builds() -> dict[str, FamilyBuild]:
    from .tokenization_esm import ESM2_VOCAB, ESMC_VOCAB

    return {
        "esm2": FamilyBuild(_esm2_read_snapshot, _esm2_config, ESM2_VOCAB, "tokenization_esm", 1026),
        # ESMC has no position limit (rotary only); 2048 tokens is the nominal length its Biohub configs
        # and hosted APIs use, and what the tokenizer truncates to when asked.
        "esmc": FamilyBuild(_esmc_read_snapshot, _esmc_config, ESMC_VOCAB, "tokenization_esm", 2048),
    }


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


def _write_config(config, family: Family, out: Path) -> None:
    config.auto_map = dict(family.auto_classes)
    config.architectures = [family.auto_classes["AutoModelForMaskedLM"].split(".")[1]]
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
    spec = _family_builds().get(family.id)
    if spec is None:
        raise BuildError(f"family {family.id!r} has no builder")
    snapshot = Path(snapshot)
    out = Path(out) if out is not None else DIST_DIR / checkpoint.published
    _prepare_out(out, force)
    _check_snapshot_tree(snapshot)
    source, inputs, state = spec.read_snapshot(snapshot, family, checkpoint)
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
    config = spec.make_config(family, checkpoint)
    entries = {target.split(".")[0] for target in family.auto_classes.values()} | {spec.tokenizer_module}

    # Stage beside `out`: os.replace cannot move a folder across filesystems (e.g. out of a tmpfs /tmp).
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{checkpoint.published}-", dir=out.parent))
    try:
        for module in runtime_closure(entries):
            shutil.copyfile(RUNTIME_DIR / f"{module}.py", staging / f"{module}.py")
        _write_config(config, family, staging)
        weight_files = _write_weights(state, staging)
        tokenizer = importlib.import_module(f"{__package__}.{spec.tokenizer_module}")
        tokenizer.tokenizer_files(staging, spec.vocab, spec.model_max_length)
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
        (staging / "README.md").write_text(render_model_card(family, checkpoint, provenance))
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
    from .manifest import load_all

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
