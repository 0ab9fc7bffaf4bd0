"""The benchmark harness's own logic: batching, FLOP models, and the generated page being current.

The measurements themselves are not tests (timed tests prove nothing on a shared CI machine); these
check the pieces every number in docs/benchmarks.md rests on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.ankh import ankh_flops
from benchmarks.dplm import dplm_cases
from benchmarks.e1 import e1_cases, e1_dims, e1_flops, e1_matmul_params
from benchmarks.embed import (
    BUDGETS,
    MODEL_IDS,
    _length_sorted_batches,
    dataset_lengths,
    mark_slow_bf16,
    plan_cases,
    useful_flops,
)
from benchmarks.esmc import esmc_flops
from benchmarks.gpu import gpu_cases
from benchmarks.report import OUT, pick_records, render
from fastplms.configuration_ankh import ANKHConfig
from fastplms.configuration_dplm import DPLMConfig
from fastplms.configuration_e1 import E1Config
from fastplms.configuration_esm2 import ESM2Config
from fastplms.configuration_esmc import ESMCConfig
from fastplms.modeling_ankh import ANKHModel
from fastplms.modeling_dplm import DPLMModel
from fastplms.modeling_e1 import E1Model
from fastplms.modeling_esm2 import ESM2Model
from fastplms.modeling_esmc import ESMCModel
from fastplms.oracles.t5 import T5Dims


def test_docs_benchmarks_page_is_generated_from_the_committed_records():
    assert OUT.read_text() == render(pick_records([])), "stale: run `python -m benchmarks.report`"


def test_length_sorted_batches_cover_every_record_once_within_the_budget():
    lengths = dataset_lengths("lognormal", 300, seed=3)
    for budget in (1024, 2048, 4096):
        batches = _length_sorted_batches(lengths, budget)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        for batch in batches:
            width = max(lengths[i] for i in batch) + 2
            assert len(batch) == 1 or len(batch) * width <= budget
            assert lengths[batch[0]] == max(lengths[i] for i in batch)  # longest first


def test_dataset_profiles_have_the_documented_shape():
    lognormal = sorted(dataset_lengths("lognormal", 2000, seed=0))
    assert 260 <= lognormal[1000] <= 340 and lognormal[-1] <= 1022
    short = dataset_lengths("short", 500, seed=0)
    assert min(short) >= 100 and max(short) <= 140


def _matmul_weights(model: torch.nn.Module) -> int:
    """Weights and biases of every Linear inside the encoder layers (what a token multiplies through)."""
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers.") and "norm" not in name)


def _flops_from_modules(model: torch.nn.Module, layers: int, hidden: int, lengths: list[int]) -> float:
    params = _matmul_weights(model)
    return float(sum((n + 2) * 2 * params + layers * 4 * hidden * (n + 2) ** 2 for n in lengths))


def test_flop_models_count_the_models_matmul_weights():
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    esm2 = ESM2Model(ESM2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256))
    assert useful_flops(lengths, 3, 64) == _flops_from_modules(esm2, 3, 64, lengths)
    esmc = ESMCModel(ESMCConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4))
    assert esmc_flops(lengths, 2, 96) == _flops_from_modules(esmc, 2, 96, lengths)


def test_ankh_flop_model_counts_the_t5_encoders_matmul_weights():
    """T5: T = L + 1 tokens (</s>), heads * d_kv-wide attention (here narrower than hidden), gated FFN, no biases;
    the relative bias table lives outside the layers and is no matmul."""
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    dims = T5Dims(2, 1, 64, 4, 8, 96, 144, "gated-gelu")
    encoder = ANKHModel(
        ANKHConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_decoder_layers=1,
            num_attention_heads=4,
            d_kv=8,
            intermediate_size=96,
        )
    )
    params, inner = _matmul_weights(encoder), dims.heads * dims.d_kv
    assert ankh_flops(lengths, dims) == float(sum((n + 1) * 2 * params + 2 * 4 * inner * (n + 1) ** 2 for n in lengths))


# ---------------------------------------------------------------------------------- DPLM, E1 and the GPU mode


def test_dplm_flop_model_is_esm2s_on_the_dplm_network():
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    dplm = DPLMModel(DPLMConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256))
    assert useful_flops(lengths, 3, 64) == _flops_from_modules(dplm, 3, 64, lengths)


def test_e1_flop_model_counts_the_encoders_matmul_weights():
    """E1: T = L + 4 tokens (<bos> 1 ... 2 <eos>), bias-free q/o and (GQA-narrow) k/v, gated SiLU FFN."""
    lengths = [random.Random(i).randint(1, 900) for i in range(20)]
    config = E1Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    dims = e1_dims("e1_150m")._replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    params = _matmul_weights(E1Model(config))
    assert e1_matmul_params(dims) == params
    assert e1_flops(lengths, dims) == float(sum((n + 4) * 2 * params + 2 * 4 * 64 * (n + 4) ** 2 for n in lengths))


def _args(**values) -> argparse.Namespace:
    defaults = dict(device="cpu", quick=False, budgets=list(BUDGETS), dtype=None, force_bf16=False)
    return argparse.Namespace(**{**defaults, **values})


def _plan(cases: list[dict]) -> set[tuple[str, str, str]]:
    return {(c["engine"], c["label"], c["dtype"]) for c in cases}


def test_dplm_and_e1_plans_compare_with_what_people_run():
    assert {"dplm_150m", "e1_150m"} <= set(MODEL_IDS)
    cases = dplm_cases(_args())
    fp32 = {
        ("ours", "fastplms default", "float32"),
        ("transformers", "Transformers input order, batch 16", "float32"),
        ("transformers", "Transformers length-sorted 2048", "float32"),
        ("transformers", "Transformers length-sorted 4096", "float32"),
    }
    bf16 = {
        ("ours", "fastplms default", "bfloat16"),
        ("transformers", "Transformers length-sorted 2048", "bfloat16"),
        ("transformers", "Transformers length-sorted 4096", "bfloat16"),
    }
    assert _plan(cases) == fp32 | bf16 and len(cases) == len(fp32 | bf16)
    assert {c["budget"] for c in cases if c.get("batching") == "sorted"} == {2048, 4096}
    error = "setup_e1_oracle.sh: git clone failed"
    cases = e1_cases(_args(), {"available": False, "error": error})
    assert _plan(cases) == {
        ("ours", "fastplms default", "float32"),
        ("e1-official", "official E1 length-sorted 2048", "float32"),
        ("e1-official", "official E1 length-sorted 4096", "float32"),
        ("ours", "fastplms default", "bfloat16"),
        ("e1-official", "official E1 length-sorted 2048", "bfloat16"),
        ("e1-official", "official E1 length-sorted 4096", "bfloat16"),
        ("e1-official", "official E1Predictor max_batch_tokens=4096", "bfloat16"),
    }
    for case in cases:  # an oracle that cannot run is recorded with its exact error, never measured
        assert case["warmup"] and case["check_from_run"]
        if case["engine"] == "e1-official":
            assert case["skip"] == {"status": "unavailable", "error": error}
        else:
            assert "skip" not in case
    assert _plan(e1_cases(_args(quick=True), {"available": True})) == {
        ("ours", "fastplms default", "float32"),
        ("e1-official", "official E1 length-sorted 4096", "float32"),
    }


def test_gpu_plan_lists_every_case_in_bf16_with_one_fp32_reference():
    """The CUDA plan, checked on CPU: ESM2 cases of plan_cases completed by benchmarks.gpu."""
    args = _args(device="cuda")
    cases = mark_slow_bf16(
        gpu_cases(plan_cases(args, None, {"available": False, "error": "CPU engine"}), args), args, None
    )
    backends = ("default", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
    expected = {("ours", f"fastplms {b}", "bfloat16") for b in backends} | {
        ("ours", "fastplms default, compile=False", "bfloat16"),
        ("ours", "fastplms default, compile=True", "bfloat16"),
        ("ours", "fastplms max_tokens_per_batch=2048", "bfloat16"),
        ("ours", "fastplms max_tokens_per_batch=8192", "bfloat16"),
        ("ours-padded", "fastplms padded forward, length-sorted 4096", "bfloat16"),
        ("transformers", "Transformers input order, batch 16", "bfloat16"),
        ("transformers", "Transformers length-sorted 4096", "float32"),  # the output check's reference
        ("fair-esm", "fair-esm ESM2 toks_per_batch=4096", "bfloat16"),
    }
    expected |= {("transformers", f"Transformers length-sorted {b}", "bfloat16") for b in BUDGETS}
    assert _plan(cases) == expected and len(cases) == len(expected)
    assert not any("skip" in c for c in cases)  # no esm-cpp, no BF16 skip on CUDA
    assert {c["backend"] for c in cases if c["engine"] == "ours"} == set(backends)
    compiled = [c for c in cases if c["label"] == "fastplms default, compile=False"]
    assert compiled[0]["compile"] is False


def _spread(value: float) -> dict:
    return {"median": value, "min": value, "max": value, "n": 1, "values": [value]}


def _row(case: dict, rate: float, gpu_mb: float | None = None, **summary) -> dict:
    values = {
        "status": "ok",
        "steady_res_per_s": _spread(rate),
        "end_to_end_res_per_s": _spread(rate * 0.9),
        "time_to_first_result_s": _spread(1.0),
        "load_s": _spread(0.5),
        "peak_rss_mb": _spread(900.0),
        "complete": True,
        "residues": 1000,
        "model_gflops": 1.0,
        **summary,
    }
    if gpu_mb is not None:
        values["peak_gpu_mb"] = _spread(gpu_mb)
    return {"case": case, "summary": values, "runs": [{"load_after": 1.0}]}


def _record(tmp_path: Path, model: tuple, device: str, results: list[dict], **extra) -> Path:
    machine = {
        "cpu": "synthetic",
        "cores": 16,
        "isa_flags": [],
        "torch_cpu_capability": "AVX2",
        "torch_threads": 16,
        "torch": "2",
        "transformers": "5",
        "python": "3",
        "cuda": "NVIDIA H100" if device == "cuda" else None,
        "load_average_start": [0.0, 0.0, 0.0],
    }
    record = {
        "kind": "fastplms-embedding-benchmark",
        "started": "20990101T000000",
        "command": f"python -m benchmarks.embed --device {device}",
        "machine": machine,
        "load_average_end": [0.0, 0.0, 0.0],
        "model": dict(zip(("id", "layers", "hidden", "heads"), model, strict=True), seed=0),
        "dataset": {"profile": "lognormal", "records": 4, "residues": 1000, "median_length": 250, "max_length": 400},
        "flops_per_residue": 1e9,
        "matmul_peak": None,
        "settings": {"repeats": 1, "max_seconds": 5, "quick": False, "device": device, "rss": "VmHWM"},
        "results": results,
        **extra,
    }
    path = tmp_path / f"{model[0]}-{device}.json"
    path.write_text(json.dumps(record))
    return path


def test_report_renders_the_gpu_section_from_a_gpu_record(tmp_path):
    def ours(label, rate, mb, **case):
        return _row({"engine": "ours", "label": label, "backend": "default", "dtype": "bfloat16", **case}, rate, mb)

    def hf(budget, rate, mb):
        case = {"engine": "transformers", "label": f"Transformers length-sorted {budget}", "batching": "sorted"}
        return _row({**case, "budget": budget, "dtype": "bfloat16"}, rate, mb)

    results = [
        _row(
            {"engine": "ours", "label": "fastplms default", "backend": "default", "dtype": "bfloat16"},
            9000,
            3000,
            compiled=[True],
            compile_s=_spread(40.0),
            max_rel_err_vs_transformers_fp32=4e-3,
        ),
        ours("fastplms flash_attention_2", 8000, 2900, backend="flash_attention_2"),
        ours("fastplms default, compile=False", 6000, 3100, compile=False),
        _row(
            {"engine": "ours-padded", "label": "fastplms padded forward, length-sorted 4096", "dtype": "bfloat16"},
            5000,
            4500,
            batching="sorted",
        ),
        hf(4096, 4000, 5000),
        hf(8192, 5000, 8000),
        _row({"engine": "fair-esm", "label": "fair-esm ESM2 toks_per_batch=4096", "dtype": "bfloat16"}, 3000, 7000),
    ]
    results[3]["case"]["batching"], results[3]["case"]["budget"] = "sorted", 4096
    page = render([_record(tmp_path, ("esm2_650m", 33, 1280, 20), "cuda", results)])
    assert "### GPU: targets and comparisons (same run)" in page
    target = (
        "| BF16 at least 1.5x Transformers sdpa on mixed lengths at lower peak memory (Transformers length-sorted "
        "at its best budget, 8192) | 1.80x (9,000 vs 5,000 res/s); peak GPU 3,000 vs 8,000 MB | met |"
    )
    assert target in page
    assert "| fastplms flash_attention_2 against the best Transformers sdpa (BF16) | 1.60x" in page
    assert "padding-free (`embed_dataset`) against padded (model forward, 4096) | 1.80x" in page
    assert (
        "compiled (steady) against eager | 1.50x (9,000 vs 6,000 res/s); peak GPU 3,000 vs 3,100 MB; compile 40.0 s"
        in page
    )
    assert "against fair-esm (FAESM's baseline" in page and "3.00x" in page
    assert "GPU records on this page: esm2_650m lognormal" in page and "has not run" not in page
    assert "up to 60% less peak memory and up to 70% less inference time" in page
    assert "https://github.com/pengzhangzhi/faesm" in page
    assert "### Targets" not in page  # the CPU (ESM2 FP32) targets are not applied to a GPU run


def test_report_says_plainly_that_the_gpu_mode_has_not_run():
    page = render(pick_records([]))
    assert "**The GPU mode has not run: no GPU was available in any session so far**" in page
    assert "`python -m benchmarks.embed --device cuda`" in page
    assert "at least 1.5x Transformers sdpa on mixed lengths at lower peak memory" in page


def test_report_renders_dplm_and_e1_comparisons_without_invented_targets(tmp_path):
    def case(engine, label, dtype="float32", **extra):
        return {"engine": engine, "label": label, "dtype": dtype, **extra}

    dplm = [
        _row(case("ours", "fastplms default", backend="default"), 600, max_rel_err_vs_transformers_fp32=2e-7),
        _row(case("transformers", "Transformers input order, batch 16", batching="input16"), 200),
        _row(case("transformers", "Transformers length-sorted 2048", batching="sorted", budget=2048), 500),
        _row(case("transformers", "Transformers length-sorted 4096", batching="sorted", budget=4096), 400),
    ]
    e1 = [
        _row(
            case("ours", "fastplms default", backend="default", warmup=True), 500, max_rel_err_vs_transformers_fp32=3e-6
        ),
        _row(case("e1-official", "official E1 length-sorted 4096", batching="sorted", budget=4096, warmup=True), 250),
        {
            "case": case("e1-official", "official E1Predictor max_batch_tokens=4096", "bfloat16"),
            "summary": {"status": "skipped", "error": "no native BF16 matmul on this CPU"},
            "runs": [],
        },
    ]
    oracle = {"available": True, "commit": "219c7c7a3a803b8552ae6a44ce6dd24f133fefbd", "folder": "/x"}
    page = render(
        [
            _record(tmp_path, ("dplm_150m", 30, 640, 20), "cpu", dplm),
            _record(tmp_path, ("e1_150m", 20, 768, 12), "cpu", e1, e1_official=oracle, reference="official E1 FP32"),
        ]
    )
    assert "### fastplms against Transformers' EsmModel (same run, no targets)" in page
    assert "| float32: faster than Transformers EsmModel (sdpa) length-sorted at its best budget (2048) | 1.20x" in page
    assert "| float32: faster than Transformers EsmModel (sdpa) in input order, batch 16 | 3.00x" in page
    assert "equal Transformers EsmModel's (max relative error <= 1e-5) | 2.0e-07 | met |" in page
    assert "### fastplms against the official E1 (same run, no targets)" in page
    assert "| float32: faster than the official E1 length-sorted at its best budget (4096) | 2.00x" in page
    assert "equal the official E1's (max relative error <= 1e-5) | 3.0e-06 | met |" in page
    assert "| official E1 | Profluent-AI/E1 `219c7c7`" in page
    assert ">= 1.3x" not in page  # ESM2's targets are not applied to DPLM or E1
