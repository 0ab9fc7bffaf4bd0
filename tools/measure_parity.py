"""Measure parity against the official implementations and write `reports/parity/<family>.json`.

    python -m tools.measure_parity esm2 [--checkpoints esm2_8m,esm2_35m,esm2_150m]
        [--large-forward esm2_650m] [--out reports/parity/esm2.json]
    python -m tools.measure_parity esmc [--checkpoints esmc_300m,esmc_600m] [--out reports/parity/esmc.json]

ESM2, per listed checkpoint (default: every one whose forward fits this machine): FP32 on every CPU backend
against both oracles, and BF16 autocast on SDPA against the FP32 Transformers oracle. `--large-forward`
adds one short FP32 SDPA run against Transformers for a bigger checkpoint. Every manifest checkpoint
without a full forward run gets the conversion shape check at real dims.

ESMC, per listed checkpoint (default: every one with committed oracle goldens): FP32 and BF16 autocast on
every CPU backend, with the default padding mask and with explicit `sequence_id`, against the official
`esm` FP32 goldens. Every manifest checkpoint gets the conversion shape check (both official layouts).

All numbers come from `fastplms.parity`; `python -m tools.gen_docs` turns the report into docs/support.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from fastplms.manifest import MANIFEST_DIR, REPO_ROOT, load_manifest
from fastplms.parity import (
    ESM2_BACKENDS,
    ESM2_ORACLES,
    ESMC_BACKENDS,
    ESMC_GOLDENS,
    check_esm2_conversion_shapes,
    check_esmc_conversion_shapes,
    esm2_parameter_count,
    esmc_golden_models,
    forward_feasible,
    measure_esm2,
    measure_esmc,
)

DEFAULT_OUT = "reports/parity/{family}.json"
# Installed packages whose versions each family's report records.
_PACKAGES = {"esm2": ("torch", "transformers", "fair-esm", "numpy"), "esmc": ("torch", "transformers", "numpy")}
SHORT_PANEL = (1, 12, 37, 120)
# Metrics whose interesting digits sit just below 1 keep more of them.
_NEAR_ONE = {"residue_cosine_p1", "pooled_cosine", "top1_agreement", "top1_agreement_all"}


def _machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gb = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gb, "os": platform.system()}


def _versions(family: str) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    if family == "esmc":  # the oracle ran in its own venv; its version is the goldens'
        recipe = json.loads((ESMC_GOLDENS / "esmc_manifest.json").read_text(encoding="utf-8"))
        versions["esm (goldens)"] = recipe["versions"]["esm"]
    for package in _PACKAGES[family]:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _round(value: object, key: str = "") -> object:
    if isinstance(value, dict):
        return {k: _round(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v, key) for v in value]
    if isinstance(value, float):
        return float(f"{value:.{8 if key in _NEAR_ONE else 4}g}")
    return value


def _write(path: Path, report: dict[str, object], *, final: bool = False) -> None:
    """Save progress beside the report (`<name>.partial.tmp`); only the finished run replaces it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.tmp")
    partial.write_text(json.dumps(_round(report), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if final:
        partial.replace(path)


def _log(message: str) -> None:
    print(f"[measure_parity {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def measure_family_esm2(args: argparse.Namespace, report: dict[str, object], out: Path) -> None:
    family = load_manifest(MANIFEST_DIR / "esm2.toml", resolve=False)
    known = [c.id for c in family.checkpoints]
    chosen = _csv(args.checkpoints) if args.checkpoints else [c.id for c in family.checkpoints if forward_feasible(c)]
    large = _csv(args.large_forward)
    for checkpoint in chosen + large:
        if checkpoint not in known:
            raise SystemExit(f"unknown ESM2 checkpoint {checkpoint!r}; known: {', '.join(known)}")
    backends = [b for b in ESM2_BACKENDS if b in family.backends]
    records: list[dict[str, object]] = report["records"]  # type: ignore[assignment]
    notes: list[str] = report["notes"]  # type: ignore[assignment]

    for checkpoint in chosen:
        _log(f"{checkpoint}: FP32, backends {backends}, oracles {list(ESM2_ORACLES)}")
        records += measure_esm2(checkpoint, backends=backends, dtype="float32", seed=args.seed)
        _write(out, report)
        _log(f"{checkpoint}: BF16 autocast, sdpa, transformers")
        records += measure_esm2(
            checkpoint, backends=("sdpa",), dtype="bfloat16", oracles=("transformers",), seed=args.seed
        )
        _write(out, report)

    for checkpoint in family.checkpoints:
        if checkpoint.id in chosen:
            continue
        _log(f"{checkpoint.id}: conversion shape check")
        records.append(check_esm2_conversion_shapes(checkpoint.id))
        _write(out, report)

    for checkpoint in large:
        _log(f"{checkpoint}: short FP32 forward, sdpa, transformers, lengths {list(SHORT_PANEL)}")
        records += measure_esm2(
            checkpoint, backends=("sdpa",), oracles=("transformers",), lengths=SHORT_PANEL, seed=args.seed
        )
        notes.append(
            f"{checkpoint}: one short real-dim forward only (FP32, sdpa, Transformers oracle, "
            f"residue lengths {list(SHORT_PANEL)}), plus the conversion shape check."
        )
        _write(out, report)

    for checkpoint in family.checkpoints:
        if checkpoint.id not in chosen and checkpoint.id not in large:
            gb = esm2_parameter_count(checkpoint) * 4 / 1e9
            notes.append(
                f"{checkpoint.id}: forward not run ({gb:.1f} GB of FP32 weights per copy; the oracle, its "
                "weights and ours do not fit this machine's memory and time); conversion shape check only."
            )
    notes.append(
        "Contacts are built from attention maps, so every implementation computes them with eager "
        "attention; contact numbers are therefore the same for every backend of one oracle and dtype."
    )
    notes.append(
        "Logits and hidden-state metrics cover all non-padding tokens (<cls> and <eos> included); "
        "contacts cover pairs of real residues. BF16 rows: ours under CPU BF16 autocast with FP32 "
        "parameters vs the FP32 oracle."
    )
    notes.append(
        "top1_agreement counts only positions where the oracle puts p >= 0.5 on its top token "
        "(confident_positions says how many); seeded weights give few or none, so top1_agreement_all "
        "(argmax agreement over every valid position) is reported beside it."
    )
    _write(out, report, final=True)


def measure_family_esmc(args: argparse.Namespace, report: dict[str, object], out: Path) -> None:
    family = load_manifest(MANIFEST_DIR / "esmc.toml", resolve=False)
    known = [c.id for c in family.checkpoints]
    golden = esmc_golden_models()
    chosen = _csv(args.checkpoints) if args.checkpoints else [c for c in known if c in golden]
    for checkpoint in chosen:
        if checkpoint not in known:
            raise SystemExit(f"unknown ESMC checkpoint {checkpoint!r}; known: {', '.join(known)}")
        if checkpoint not in golden:
            raise SystemExit(f"no oracle goldens for {checkpoint!r}; have: {', '.join(golden)}")
    if args.large_forward:
        raise SystemExit("--large-forward is for esm2 only")
    backends = [b for b in ESMC_BACKENDS if b in family.backends]
    dtypes = [d for d in ("float32", "bfloat16") if d in family.dtypes]
    records: list[dict[str, object]] = report["records"]  # type: ignore[assignment]
    notes: list[str] = report["notes"]  # type: ignore[assignment]

    for checkpoint in chosen:
        _log(f"{checkpoint}: {dtypes}, backends {backends}, default mask and sequence_id, vs the esm goldens")
        records += measure_esmc(checkpoint, backends=backends, dtype=dtypes)
        _write(out, report)
    parameters: dict[str, int] = {}
    for checkpoint in known:
        _log(f"{checkpoint}: conversion shape check (esm and biohub layouts)")
        record = check_esmc_conversion_shapes(checkpoint)
        parameters[checkpoint] = int(record["parameters"])
        records.append(record)
        _write(out, report)

    for checkpoint in known:
        if checkpoint not in chosen:
            gb = parameters[checkpoint] * 4 / 1e9
            notes.append(
                f"{checkpoint}: forward not run (no oracle goldens: {gb:.1f} GB of FP32 weights per copy, so the "
                "official forward does not fit the machines the goldens and this report are made on); conversion "
                "shape check only."
            )
    notes.append(
        "Oracle: EvolutionaryScale esm ESMC (esm==3.2.1.post1, FP32 CPU, use_flash_attn=False), run once by "
        "tools/goldens/esmc.py in its own venv; its outputs are the committed goldens tests/goldens/esmc_*.safetensors "
        "(sha256-checked). The weights are regenerated here (esmc_reference, seed 0) in the official esm layout and "
        "converted with convert_esmc.from_esm."
    )
    notes.append(
        "mask default: the oracle ran with sequence_id=None (padding derived from <pad>), ours with the tokenizer's "
        "attention_mask; mask sequence_id: both with the panel's integer chain ids, the third row holding two chains "
        "joined by '|' (its residue length, 33, counts the '|')."
    )
    notes.append(
        "The goldens keep hidden states of the default-mask run only, at the first, middle and last blocks "
        "(ours: hidden_states[i + 1] is the official block i); the worst of those is reported, and sequence_id "
        "rows have none. Embeddings are the final-normed output (the official embeddings), compared in every row."
    )
    notes.append(
        "Logits, hidden-state and embedding metrics cover all non-padding tokens (<cls> and <eos> included). "
        "BF16 rows: ours under CPU BF16 autocast with FP32 parameters vs the FP32 goldens."
    )
    notes.append(
        "top1_agreement counts only positions where the oracle puts p >= 0.5 on its top token "
        "(confident_positions says how many); top1_agreement_all (argmax agreement over every valid position) "
        "is reported beside it."
    )
    _write(out, report, final=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m tools.measure_parity", description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=["esm2", "esmc"])
    parser.add_argument("--checkpoints", default="", help="comma-separated ids (default: every forward-feasible one)")
    parser.add_argument("--large-forward", default="", help="comma-separated ids for one short FP32 SDPA forward")
    parser.add_argument("--out", default="", help=f"report path (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(args.out or DEFAULT_OUT.format(family=args.family))
    if not out.is_absolute():
        out = REPO_ROOT / out
    report: dict[str, object] = {
        "family": args.family,
        "command": " ".join(["python -m tools.measure_parity", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": _machine(),
        "versions": _versions(args.family),
        "seed": args.seed,
        "notes": [],
        "records": [],
    }
    {"esm2": measure_family_esm2, "esmc": measure_family_esmc}[args.family](args, report, out)
    _log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
