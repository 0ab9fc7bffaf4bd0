"""Measure parity against the official implementations and write `reports/parity/<family>.json`.

    python -m tools.measure_parity esm2 [--checkpoints esm2_8m,esm2_35m,esm2_150m]
        [--large-forward esm2_650m] [--out reports/parity/esm2.json]
    python -m tools.measure_parity esmc [--checkpoints esmc_300m,esmc_600m] [--out reports/parity/esmc.json]
    python -m tools.measure_parity e1 [--checkpoints e1_150m,e1_300m] [--out reports/parity/e1.json]
    python -m tools.measure_parity dplm [--checkpoints dplm_150m] [--out reports/parity/dplm.json]
    python -m tools.measure_parity dplm2 [--out reports/parity/dplm2.json]
    python -m tools.measure_parity ankh [--out reports/parity/ankh.json]

What a family measures is its adapter's (`fastplms.families.<architecture>_parity.measure_report`):

ESM2, per listed checkpoint (default: every one whose forward fits this machine): FP32 on every CPU backend
against both oracles, and BF16 autocast on SDPA against the FP32 Transformers oracle. `--large-forward`
adds one short FP32 SDPA run against Transformers for a bigger checkpoint. Every manifest checkpoint
without a full forward run gets the conversion shape check at real dims.

ESMC, per listed checkpoint (default: every one with committed oracle goldens): FP32 and BF16 autocast on
every CPU backend, with the default padding mask and with explicit `sequence_id`, against the official
`esm` FP32 goldens. Every manifest checkpoint gets the conversion shape check (both official layouts).

E1, per listed checkpoint (default: every one with committed oracle goldens): FP32 and BF16 autocast on every
CPU backend against the official Profluent E1 FP32 goldens, at valid tokens and at padding. Every manifest
checkpoint gets the conversion shape check.

DPLM: dplm_150m FP32 on every CPU backend and BF16 autocast on SDPA against Transformers' EsmForMaskedLM (SDPA,
the official mask), every position compared; the official sampler's goldens token for token; conversion shapes.

DPLM2: dplm2_150m against the official ByProt network goldens (homogeneous batches; mixed batches show the
per-row split deviation) and the live Transformers recipe (FP32, BF16 autocast); the official sampler's goldens
token for token; conversion shapes.

ANKH: ankh_base at real dims and ANKH3-large's width at 4/2 layers against Transformers' T5 (eager): every encoder
state, decoder logits, greedy generation; FP32 eager and sdpa, BF16 autocast sdpa; conversion shapes.

`python -m tools.gen_docs` turns the report into docs/support.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from fastplms.families import adapter_for
from fastplms.manifest import REPO_ROOT, load_all
from fastplms.parity.driver import ParityRun

DEFAULT_OUT = "reports/parity/{family}.json"
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    families = load_all(resolve=False)
    parser = argparse.ArgumentParser(prog="python -m tools.measure_parity", description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=sorted(families))
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
    parity = adapter_for(families[args.family]).parity
    report: dict[str, object] = {
        "family": args.family,
        "command": " ".join(["python -m tools.measure_parity", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": _machine(),
        "versions": {"python": platform.python_version(), **parity.versions()},
        "seed": args.seed,
        "notes": [],
        "records": [],
    }
    run = ParityRun(
        checkpoints=tuple(_csv(args.checkpoints)),
        large_forward=tuple(_csv(args.large_forward)),
        seed=args.seed,
        save=lambda: _write(out, report),
        log=_log,
        records=report["records"],  # type: ignore[arg-type]
        notes=report["notes"],  # type: ignore[arg-type]
    )
    parity.measure(run)
    _write(out, report, final=True)
    _log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
