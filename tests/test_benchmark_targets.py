"""Issue 15's targets as benchmarks/report.py checks them on one ESM2 record, and the small job's plan.

The records here are synthetic (built in the test, never committed): they check the bookkeeping (which
rows are compared, how verdicts and margins read), not any speed.
"""

from __future__ import annotations

import sys

from benchmarks.embed import dataset_lengths
from benchmarks.process import _command, small_cases
from benchmarks.report import esm2_targets


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1], "n": len(values)}


def _row(case: dict, rates: list[float], first: float = 1.0, rss: float = 800.0, **summary) -> dict:
    return {
        "case": {"dtype": "float32", **case},
        "summary": {
            "status": "ok",
            "steady_res_per_s": _spread(rates),
            "time_to_first_result_s": _spread([first]),
            "peak_rss_mb": _spread([rss]),
            **summary,
        },
        "runs": [],
    }


def _ours(label: str, rates: list[float], **extra) -> dict:
    return _row({"engine": "ours", "label": label, "backend": "default"}, rates, **extra)


def _hf(budget: int | None, rates: list[float], **extra) -> dict:
    case = {"engine": "transformers", "batching": "sorted" if budget else "input16", "budget": budget}
    case["label"] = f"Transformers length-sorted {budget}" if budget else "Transformers input order, batch 16"
    return _row(case, rates, **extra)


def _record(profile: str, results: list[dict], bf16: str | None = "skipped") -> dict:
    if bf16 == "skipped":
        results = results + [
            {
                "case": {"engine": "ours", "label": "fastplms default", "dtype": "bfloat16", "backend": "default"},
                "summary": {"status": "skipped", "error": "no native BF16 matmul"},
                "runs": [],
            }
        ]
    return {
        "dataset": {"profile": profile},
        "matmul_peak": {"float32": {"gflops": 176.0}, "bfloat16": {"gflops": 1.4}},
        "results": results,
    }


def _verdicts(rows) -> dict[str, tuple[str, str]]:
    return {name.split(" (")[0]: (measured, verdict) for name, measured, verdict in rows}


def test_every_target_is_checked_and_missed_ones_say_by_how_much():
    results = [
        _ours("fastplms default", [1700, 1750], first=0.8, fraction_of_fp32_peak=0.72, model_gflops=127.0),
        _ours("fastplms default, compile=False", [1760, 1700]),
        _ours("fastplms max_tokens_per_batch=2048", [1790, 1780]),
        _hf(2048, [1000, 990], first=2.6),
        _hf(4096, [1200, 1250], first=4.1, rss=900.0),
        _hf(None, [500, 480]),
    ]
    rows = esm2_targets(_record("lognormal", results))
    by = {name: verdict for name, _, verdict in rows}
    measured = {name: text for name, text, _ in rows}
    sorted_target = "FP32 >= 1.3x Transformers length-sorted at its best budget"
    assert by[sorted_target] == "met"  # 1750 / 1250 = 1.40x against its best budget (4096)
    assert "its best: Transformers length-sorted 4096" in measured[sorted_target]
    assert by["FP32 >= 3x Transformers input order, batch 16"] == "met"  # 1750 / 500
    assert by["FP32 >= 80% of the FP32 matmul peak (model FLOP/s / measured peak)"] == "missed by 8% of the peak"
    bf16 = "BF16 >= 1.5x Transformers BF16 at its best budget"
    assert by[bf16] == "n/a: no native BF16 here" and "1.40 vs FP32 176.0" in measured[bf16]
    never = "the default never loses to an alternative (compile on/off, budget, backend) by more than noise"
    # 1750 vs 1790: 2.2% behind, within the 5% noise floor (the repeats spread 2.9%).
    assert by[never] == "met" and "max_tokens_per_batch=2048" in measured[never]
    assert by["first result no later than Transformers' first result + 1 s"] == "met"  # 0.8 vs 2.6 + 1
    assert by["peak RSS <= Transformers length-sorted at the same budget (4096)"] == "met"


def test_a_default_behind_an_alternative_beyond_noise_is_missed():
    results = [
        _ours("fastplms default", [1500, 1500], first=6.0, rss=950.0),
        _ours("fastplms default, compile=True", [1800, 1800]),
        _hf(4096, [1400, 1400], first=2.0, rss=900.0),
    ]
    by = {name: verdict for name, _, verdict in esm2_targets(_record("short", results))}
    assert by["FP32 >= 1.3x Transformers length-sorted at its best budget"] == "missed by 18% (needs 1,820)"
    never = "the default never loses to an alternative (compile on/off, budget, backend) by more than noise"
    assert by[never] == "missed by 12% beyond noise"  # 1500 vs 1800: 17% behind, 5% noise
    assert by["first result no later than Transformers' first result + 1 s"] == "missed by 3.0 s"
    assert by["peak RSS <= Transformers length-sorted at the same budget (4096)"] == "missed by 50 MB"
    assert "FP32 >= 80% of the FP32 matmul peak (model FLOP/s / measured peak)" not in by  # log-normal only


def test_the_small_job_compares_whole_processes():
    def process(label: str, job: str, batching: str | None, budget: int | None, rate: float, rss: float) -> dict:
        case = {"engine": "process", "label": label, "job": job, "batching": batching, "budget": budget}
        return _row(case, [rate], rss=rss)

    results = [
        process("fastplms embed (whole process)", "fastplms", None, None, 1400, 700),
        process("Transformers length-sorted 2048 (whole process)", "transformers", "sorted", 2048, 1000, 650),
        process("Transformers length-sorted 4096 (whole process)", "transformers", "sorted", 4096, 1050, 750),
        process("Transformers input order, batch 16 (whole process)", "transformers", "input16", None, 450, 1200),
    ]
    rows = esm2_targets(_record("small", results, bf16=None))
    by = {name: verdict for name, _, verdict in rows}
    how = " as whole processes (start, imports, model load, output written)"
    assert by["FP32 >= 1.3x Transformers length-sorted at its best budget" + how] == "met"  # 1400 / 1050
    assert by["FP32 >= 3x Transformers input order, batch 16" + how] == "met"  # 1400 / 450
    assert by["peak RSS <= Transformers length-sorted at the same budget (4096) (sampled every 50 ms)"] == "met"
    assert not any(name.startswith(("BF16", "the default", "first result")) for name in by)


def test_small_job_plan_runs_the_cli_and_the_transformers_script():
    cases = small_cases()
    assert [c["label"] for c in cases] == [
        "fastplms embed (whole process)",
        "Transformers length-sorted 2048 (whole process)",
        "Transformers length-sorted 4096 (whole process)",
        "Transformers input order, batch 16 (whole process)",
    ]
    assets = {"ours": "/a/ours", "hf": "/a/hf"}
    ours = _command({**cases[0], "assets": assets, "dataset": "d.fasta"}, "out.db")
    assert ours == [sys.executable, "-m", "fastplms.cli", "embed", "--model", "/a/ours", "--out", "out.db", "d.fasta"]
    theirs = _command({**cases[1], "assets": assets, "dataset": "d.fasta"}, "out.npy")
    assert theirs[1:] == ["-m", "benchmarks.process", "--job", "/a/hf", "d.fasta", "out.npy", "--budget", "2048"]
    assert _command({**cases[3], "assets": assets, "dataset": "d.fasta"}, "x.npy")[-1] == "--input-order"
    assert dataset_lengths("small", 250, 0) == dataset_lengths("lognormal", 250, 0)
