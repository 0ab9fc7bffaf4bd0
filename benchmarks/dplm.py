"""The DPLM side of `python -m benchmarks.embed --model dplm_150m`: ours against Transformers' `EsmModel`.

DPLM (bytedance/dplm) is the ESM2 network trained with a diffusion objective; ByteDance's `EsmForDPLM` is
Transformers' Esm classes with the mask fixed to `input_ids != <pad>` (every position a query, valid keys only),
and this repository's DPLM network oracle is Transformers' Esm on the official weights
(`fastplms.oracles.dplm.official_transformers_network`, measured bit-identical to the official network). What a
user would otherwise run to embed is therefore Transformers' `EsmModel` (SDPA) on the airkingbd snapshot, whose
tokenizer mask is exactly `input_ids != <pad>`. Both sides load the same seeded weights: an official-layout
(ByProt) snapshot at the checkpoint's real dims (`fastplms.oracles.dplm.write_dplm_snapshot`), which
`EsmModel.from_pretrained` loads as it is (its `esm.` prefix is the base model's; the LM head is left unused)
and from which our artifact is built (`fastplms.artifact.build.build`). The cases run through the ESM2 children
(`child_ours`, `child_transformers`) unchanged; embeddings are the mean over residues on both sides.

Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Transformers' EsmModel is measured length-sorted at these budgets (padded tokens per batch) and in input order
# (batches of 16, benchmarks.embed.HF_INPUT_BATCH); fastplms at its default (4096).
DPLM_BUDGETS = (2048, 4096)
# Default records per profile (ESM2-35M: 400). DPLM-150M (30 layers, hidden 640) costs about 0.3 GFLOP per token,
# four times ESM2-35M (about 340 res/s for fastplms, 110-330 for Transformers on 2 CPU cores): 48 records (lognormal
# ~15,000 residues) let fastplms and the length-sorted Transformers runs finish within the 60 s cap, and keep one
# repeat of both profiles near eight minutes.
DPLM_RECORDS = 48
DPLM_RECORDS_QUICK = 16


def is_dplm(model: str) -> bool:
    return model.startswith("dplm_")


def prepare_dplm_assets(model: str, seed: int, root: Path, artifact: Path) -> dict[str, str]:
    """The seeded airkingbd-layout snapshot once per (model, seed), our artifact built from it once per runtime
    code. `hf` is the snapshot itself: `benchmarks.embed.child_transformers` loads it with `EsmModel`."""
    from fastplms.artifact.build import build
    from fastplms.manifest import find_checkpoint
    from fastplms.oracles.dplm import write_dplm_snapshot

    layers, hidden, heads = find_checkpoint(model)[1].dims
    snapshot = root / "snapshot"
    if not (snapshot / "model.safetensors").exists():
        tmp = root / "snapshot.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_dplm_snapshot(tmp, layers, hidden, heads, seed=seed)
        shutil.rmtree(snapshot, ignore_errors=True)
        tmp.replace(snapshot)
    if not (artifact / "provenance.json").exists():
        build(model, snapshot, artifact, allow_unpinned=True, force=True)
    return {"hf": str(snapshot), "ours": str(artifact)}


def dplm_cases(args) -> list[dict]:
    """fastplms default against Transformers' EsmModel (SDPA) in input order (batch 16, FP32) and length-sorted
    at each budget; FP32 and BF16 (autocast on both sides; `mark_slow_bf16` decides whether BF16 runs).
    `--quick`: fastplms default and Transformers length-sorted 4096, FP32."""
    from benchmarks.embed import HF_INPUT_BATCH

    gpu = args.device.startswith("cuda")
    dtypes = ("bfloat16",) if gpu else ("float32", "bfloat16")
    if args.quick:
        dtypes = ("float32",)
    cases: list[dict] = []
    for dtype in dtypes:
        cases.append({"engine": "ours", "label": "fastplms default", "backend": "default", "dtype": dtype})
        if dtype == "float32" and not args.quick:
            cases.append(
                {
                    "engine": "transformers",
                    "label": f"Transformers input order, batch {HF_INPUT_BATCH}",
                    "batching": "input16",
                    "dtype": dtype,
                }
            )
        for budget in (4096,) if args.quick else DPLM_BUDGETS:
            cases.append(
                {
                    "engine": "transformers",
                    "label": f"Transformers length-sorted {budget}",
                    "batching": "sorted",
                    "budget": budget,
                    "dtype": dtype,
                }
            )
    return cases


def _steady(row: dict) -> float:
    return row["summary"]["steady_res_per_s"]["median"]


def dplm_comparisons(data: dict) -> list[tuple[str, str, str]]:
    """DPLM has no numeric targets: fastplms default against Transformers' EsmModel at its best budget and in
    input order, per dtype, peak RSS at the same budget, and the FP32 output check (pooled panel, max relative
    error against the Transformers FP32 run, the harness's reference)."""
    from benchmarks.report import _find, _num, memory_and_output_rows

    results, rows = data["results"], []
    for dtype in ("float32", "bfloat16"):
        ours = _find(results, engine="ours", label="fastplms default", dtype=dtype)
        hf = _find(results, engine="transformers", dtype=dtype)
        best = max((r for r in hf if r["case"]["batching"] == "sorted"), key=_steady, default=None)
        input16 = next((r for r in hf if r["case"]["batching"] == "input16"), None)
        for name, other in (
            (f"length-sorted at its best budget ({best and best['case']['budget']})", best),
            ("in input order, batch 16", input16),
        ):
            if not ours or other is None:
                continue
            value = _steady(ours[0]) / _steady(other)
            rows.append(
                (
                    f"{dtype}: faster than Transformers EsmModel (sdpa) {name}",
                    f"{value:.2f}x ({_num(_steady(ours[0]))} vs {_num(_steady(other))} res/s)",
                    "met" if value > 1 else "missed",
                )
            )
    return rows + memory_and_output_rows(results, "transformers", "Transformers EsmModel", "Transformers EsmModel's")
