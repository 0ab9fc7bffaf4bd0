"""Embedding throughput, side by side: `python -m benchmarks.embed [--quick] [--records N] [--profile P]`.

One run writes the same seeded official-layout ESM2 weights once (HF snapshot for Transformers and
esm-cpp, fair-esm `.pt`, our artifact built from the snapshot), the same seeded FASTA, measures the
machine's FP32/BF16 matmul peak, then runs every case in its own subprocess, cases alternating, the
whole list repeated. Each child reports residues/s, time to first result, peak RSS and mean-pooled
embeddings of a fixed check panel; the parent compares those panels with Transformers FP32 and writes
one JSON record to reports/benchmarks/. `python -m benchmarks.report` renders docs/benchmarks.md.

Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.ankh import (
    ANKH_RECORDS,
    ANKH_RECORDS_QUICK,
    ankh_cases,
    ankh_dims,
    ankh_flops,
    ankh_model_record,
    child_transformers_t5,
    prepare_ankh_assets,
)
from benchmarks.ankh import FLOPS_FORMULA as ANKH_FLOPS_FORMULA
from benchmarks.dplm import DPLM_RECORDS, DPLM_RECORDS_QUICK, dplm_cases, is_dplm, prepare_dplm_assets
from benchmarks.e1 import (
    E1_RECORDS,
    E1_RECORDS_QUICK,
    child_e1_official,
    e1_cases,
    e1_dims,
    e1_flops,
    e1_model_record,
    is_e1,
    prepare_e1_assets,
)
from benchmarks.e1 import FLOPS_FORMULA as E1_FLOPS_FORMULA
from benchmarks.e1 import oracle_status as e1_oracle_status
from benchmarks.esmc import FLOPS_FORMULA as ESMC_FLOPS_FORMULA
from benchmarks.esmc import (
    ORACLE_PYTHON,
    child_esmc_official,
    esmc_cases,
    esmc_flops,
    oracle_status,
    prepare_esmc_assets,
)
from benchmarks.gpu import child_ours_padded, gpu_cases
from benchmarks.process import SMALL_RECORDS, run_process_case, small_cases
from benchmarks.venvs import side_venv

REPO = Path(__file__).resolve().parent.parent
REPORTS = REPO / "reports" / "benchmarks"
CACHE = Path(os.environ.get("FASTPLMS_BENCH_CACHE", Path.home() / ".cache" / "fastplms-bench"))
ESMCPP_PYTHON = REPO / ".venv-esmcpp" / "bin" / "python"
ESMCPP_CHILD = Path(__file__).resolve().parent / "esmcpp_child.py"

AMINO = "ACDEFGHIKLMNPQRSTVWY"
MAX_RESIDUES = 1022
CHECK_RECORDS = 16  # records of the dataset every engine embeds again for the output comparison
# A case with `warmup` first embeds this many residues of its first record, untimed (`warmup_s`): where a
# run is only one or two batches (ANKH), the first-call costs (first touch of the memory-mapped weights,
# kernel and allocator set-up, a lazily loaded tokenizer) would otherwise be most of its rate.
WARMUP_RESIDUES = 64
BUDGETS = (2048, 4096, 8192, 16384)
HF_INPUT_BATCH = 16
FAIR_TOKS_PER_BATCH = 4096  # fair-esm extract.py's default
OURS_DEFAULT_BUDGET = 4096  # embed_dataset's max_tokens_per_batch default
# The short profile runs these cases only (unless --all-cases): the comparison at a glance, with the
# Transformers budgets around the default so that its best budget is found on this profile too.
SHORT_PROFILE_CASES = (
    "fastplms default",
    "fastplms default, compile=False",
    "fastplms default, compile=True",
    "Transformers input order, batch 16",
    "Transformers length-sorted 2048",
    "Transformers length-sorted 4096",
    "Transformers length-sorted 8192",
    "fair-esm ESM2 toks_per_batch=4096",
    "esm-cpp",
)
# Manifest ids our builder accepts that the harness runs; esmc_* runs benchmarks/esmc.py, ankh_* benchmarks/ankh.py,
# dplm_* benchmarks/dplm.py, e1_* benchmarks/e1.py.
MODEL_IDS = ("esm2_8m", "esm2_35m", "esm2_650m", "esmc_300m", "esmc_600m", "ankh_base", "dplm_150m", "e1_150m")


def model_dims(model: str) -> tuple[int, int, int]:
    """(layers, hidden, heads) of a manifest checkpoint."""
    from fastplms.manifest import find_checkpoint

    return find_checkpoint(model)[1].dims


# ---------------------------------------------------------------------------------------------- dataset


def dataset_lengths(profile: str, records: int, seed: int) -> list[int]:
    if profile == "small":  # the whole-process job (benchmarks/process.py): log-normal lengths
        profile = "lognormal"
    """Seeded lengths: `lognormal` (median ~300, sigma 0.6, capped at 1022) or `short` (uniform 100-140)."""
    rng = random.Random(f"{profile}-{seed}")
    if profile == "lognormal":
        return [max(20, min(MAX_RESIDUES, round(rng.lognormvariate(math.log(300), 0.6)))) for _ in range(records)]
    if profile == "short":
        return [rng.randint(100, 140) for _ in range(records)]
    raise ValueError(f"unknown profile {profile!r}")


def write_dataset(path: Path, profile: str, records: int, seed: int) -> Path:
    if path.exists():
        return path
    rng = random.Random(f"residues-{seed}")
    lines = []
    for i, n in enumerate(dataset_lengths(profile, records, seed)):
        lines += [f">{profile}{i} len={n}", "".join(rng.choice(AMINO) for _ in range(n))]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def read_fasta(path: str | Path) -> list[tuple[str, str]]:
    records, rid, chunks = [], None, []
    for line in Path(path).read_text().splitlines():
        if line.startswith(">"):
            if rid is not None:
                records.append((rid, "".join(chunks)))
            rid, chunks = line[1:].split()[0], []
        elif line.strip():
            chunks.append(line.strip())
    if rid is not None:
        records.append((rid, "".join(chunks)))
    return records


def esm2_matmul_params(layers: int, hidden: int) -> int:
    """Weights and biases of ESM2's Q, K, V, output, fc1 and fc2 (intermediate = 4 * hidden), all layers."""
    return layers * (12 * hidden * hidden + 9 * hidden)


def useful_flops(lengths: list[int], layers: int, hidden: int) -> float:
    """Matmul FLOPs of an unpadded ESM2 encoder forward (no LM head) over sequences of these lengths.

    Per sequence of L residues (T = L + 2 tokens with <cls> and <eos>):
        T * 2 * P  +  layers * 4 * hidden * T^2
    where P = layers * (12 * hidden^2 + 9 * hidden) are the encoder's matmul weights and biases (Q, K, V,
    output, fc1 and fc2 with intermediate = 4 * hidden), and the second term is Q K^T plus P V.
    """
    params = esm2_matmul_params(layers, hidden)
    return float(sum((n + 2) * 2 * params + layers * 4 * hidden * (n + 2) ** 2 for n in lengths))


# ---------------------------------------------------------------------------------------------- assets


def runtime_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted((REPO / "src" / "fastplms").glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def prepare_assets(model: str, seed: int) -> dict[str, str]:
    """Write the seeded snapshot, fair-esm file and our artifact once per (model, seed, runtime code)."""
    from fastplms.artifact.build import build
    from fastplms.oracles.esm2 import write_fair_esm_pt, write_hf_snapshot

    layers, hidden, heads = model_dims(model)
    root = CACHE / f"{model}-seed{seed}"
    if model.startswith("esmc"):
        return prepare_esmc_assets(model, seed, root, root / f"artifact-{runtime_digest()}")
    if model.startswith("ankh"):
        return prepare_ankh_assets(model, seed, root, root / f"artifact-{runtime_digest()}")
    if is_dplm(model):
        return prepare_dplm_assets(model, seed, root, root / f"artifact-{runtime_digest()}")
    if is_e1(model):
        return prepare_e1_assets(model, seed, root, root / f"artifact-{runtime_digest()}")
    hf = root / "hf"
    if not (hf / "model.safetensors").exists():
        write_hf_snapshot(hf, layers, hidden, heads, seed=seed)
    fair = root / "fair" / f"esm2_t{layers}_{hidden}d_seed{seed}.pt"
    if not fair.exists():
        write_fair_esm_pt(fair, layers, hidden, heads, seed=seed)
    ours = root / f"artifact-{runtime_digest()}"
    if not (ours / "provenance.json").exists():
        build(model, hf, ours, allow_unpinned=True, force=True)
    return {"hf": str(hf), "fair": str(fair), "ours": str(ours)}


# ---------------------------------------------------------------------------------------------- children


class _Timer:
    """Batch completion times: time to first result, steady rate (after the first batch), end to end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[tuple[float, int]] = []

    def mark(self, residues_done: int) -> None:
        self.marks.append((time.perf_counter() - self.start, residues_done))

    def summary(self, total_residues: int) -> dict[str, object]:
        if not self.marks:
            return {"residues": 0, "complete": False}
        (t1, r1), (tn, rn) = self.marks[0], self.marks[-1]
        steady = (rn - r1) / (tn - t1) if len(self.marks) > 1 and tn > t1 else rn / tn
        return {
            "residues": rn,
            "complete": rn >= total_residues,
            "batches": len(self.marks),
            "seconds": tn,
            "time_to_first_result_s": t1,
            "first_batch_residues": r1,
            "steady_res_per_s": steady,
            "end_to_end_res_per_s": rn / tn,
        }


class _Deadline(Exception):
    pass


def _peak_rss_mb() -> float:
    """This process's peak RSS since it started: `VmHWM` of /proc/self/status. Not `getrusage`'s ru_maxrss,
    which Linux keeps across execve: in a child it is at least the parent's own peak at fork (the harness
    parent holds whole models while it builds artifacts), so every case would read the same floor."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _length_sorted_batches(lengths: list[int], budget: int, special: int = 2) -> list[list[int]]:
    """Longest first; a batch grows while (records * padded width) stays within `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, batch, width = [], [], 0
    for i in order:
        if batch and (len(batch) + 1) * width > budget:
            batches.append(batch)
            batch = []
        if not batch:
            width = lengths[i] + special
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def _mean_pool_hidden(hidden, mask):
    """Mean over residues (positions 1..L; <cls>, <eos> and padding excluded) of (b, s, d) states."""
    import torch

    keep = mask.clone().bool()
    keep[:, 0] = False
    lengths = mask.sum(1)
    keep[torch.arange(mask.shape[0]), lengths - 1] = False
    keep = keep.unsqueeze(-1)
    return (hidden.float().masked_fill(~keep, 0).sum(1) / keep.sum(1)).cpu()


def case_autocast(case: dict):
    """BF16 autocast on the case's device for BF16 cases (parameters stay FP32), else a no-op context."""
    import contextlib

    import torch

    if case["dtype"] != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(case["device"]).type, dtype=torch.bfloat16)


def timed_batches(run, batches: list[list[int]], lengths: list[int], case: dict) -> dict:
    """`run(record indices)` over the batches until done or past the case's time cap, then over the check
    panel (the first `check_records` records, default CHECK_RECORDS, 8 at a time): the timer's summary plus
    `check` embeddings. With `check_from_run` the panel's vectors are those of the timed run itself, and
    only records it did not reach (time cap) are embedded again."""
    import torch

    timer, deadline = _Timer(), time.perf_counter() + case["max_seconds"]
    panel = min(case.get("check_records", CHECK_RECORDS), len(lengths))
    kept: dict[int, torch.Tensor] = {}
    done = 0
    for batch in batches:
        out = run(batch)
        _sync(case["device"])
        done += sum(lengths[i] for i in batch)
        timer.mark(done)
        if case.get("check_from_run"):
            kept.update((i, row) for i, row in zip(batch, out, strict=True) if i < panel)
        if time.perf_counter() > deadline:
            break
    missing = [i for i in range(panel) if i not in kept]
    for start in range(0, len(missing), 8):
        chunk = missing[start : start + 8]
        kept.update(zip(chunk, run(chunk), strict=True))
    check = torch.stack([kept[i] for i in range(panel)])
    return {**timer.summary(sum(lengths)), "check": check.tolist()}


def child_matmul_peak(case: dict) -> dict:
    """Best GFLOP/s of square torch.mm per dtype; sizes grow until one product takes over a second."""
    import torch

    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        best, shapes = 0.0, {}
        for n in (256, 512, 1024, 2048, 3072):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.mm(a, b)
            reps, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                reps += 1
                elapsed = time.perf_counter() - t0
                if elapsed > case.get("seconds_per_size", 1.5):
                    break
            gflops = 2 * n**3 * reps / elapsed / 1e9
            shapes[n] = round(gflops, 2)
            best = max(best, gflops)
            if elapsed / reps > 1.0:
                break
        out[name] = {"gflops": best, "by_size": shapes}
    return {"status": "ok", "peak": out, "threads": torch.get_num_threads()}


def _hf_model(case: dict):
    import torch
    from transformers import EsmModel, EsmTokenizer

    model = EsmModel.from_pretrained(
        case["assets"]["hf"], attn_implementation="sdpa", dtype=torch.float32, add_pooling_layer=False
    )
    return model.eval().to(case["device"]), EsmTokenizer.from_pretrained(case["assets"]["hf"])


def child_transformers(case: dict) -> dict:
    """Transformers EsmModel, sdpa: `input16` (batches of 16 in input order) or `sorted` under a budget."""
    import contextlib

    import torch

    records = read_fasta(case["dataset"])
    lengths = [len(s) for _, s in records]
    device = case["device"]
    t_load = time.perf_counter()
    model, tokenizer = _hf_model(case)
    load_s = time.perf_counter() - t_load
    if case["batching"] == "input16":
        batches = [list(range(i, min(i + HF_INPUT_BATCH, len(records)))) for i in range(0, len(records), 16)]
    else:
        batches = _length_sorted_batches(lengths, case["budget"])
    autocast = case_autocast(case)

    def run(indices):
        enc = tokenizer([records[i][1] for i in indices], return_tensors="pt", padding=True)
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.inference_mode(), autocast:
            hidden = model(**enc).last_hidden_state
        return _mean_pool_hidden(hidden, enc["attention_mask"])

    profiler = contextlib.nullcontext()
    if case.get("profile_ops"):
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
    with profiler as prof:
        result = timed_batches(run, batches, lengths, case)
    out = {"status": "ok", "load_s": load_s, **result, **_memory(device)}
    if prof is not None:
        out["ops"] = _top_ops(prof)
    return out


def child_fair_esm(case: dict) -> dict:
    """fair-esm ESM2 the way its extract.py runs: FastaBatchedDataset.get_batch_indices(toks_per_batch)."""

    import torch
    from esm.data import FastaBatchedDataset

    from fastplms.oracles.esm2 import load_fair_esm_local

    device = case["device"]
    t_load = time.perf_counter()
    model, alphabet = load_fair_esm_local(case["assets"]["fair"])
    model = model.eval().to(device)
    load_s = time.perf_counter() - t_load
    dataset = FastaBatchedDataset.from_file(case["dataset"])
    batches = dataset.get_batch_indices(case["budget"], extra_toks_per_seq=1)
    loader = torch.utils.data.DataLoader(
        dataset, collate_fn=alphabet.get_batch_converter(MAX_RESIDUES), batch_sampler=batches
    )
    layers = model.num_layers
    autocast = case_autocast(case)

    def run(toks):
        toks = toks.to(device)
        with torch.inference_mode(), autocast:
            hidden = model(toks, repr_layers=[layers])["representations"][layers]
        return _mean_pool_hidden(hidden, toks != alphabet.padding_idx)

    timer, deadline = _Timer(), time.perf_counter() + case["max_seconds"]
    done = 0
    for _labels, strs, toks in loader:
        run(toks)
        _sync(device)
        done += sum(len(s) for s in strs)
        timer.mark(done)
        if time.perf_counter() > deadline:
            break
    result = timer.summary(sum(len(s) for s in dataset.sequence_strs))
    converter = alphabet.get_batch_converter(MAX_RESIDUES)
    check = []
    for i in range(0, CHECK_RECORDS, 8):
        chunk = [(dataset.sequence_labels[j], dataset.sequence_strs[j]) for j in range(i, i + 8)]
        check.append(run(converter(chunk)[2]))
    return {"status": "ok", "load_s": load_s, **result, "check": torch.cat(check).tolist(), **_memory(device)}


def child_ours(case: dict) -> dict:
    """fastplms `model.embed_dataset` with default settings (plus the case's backend and dtype)."""
    import torch
    from transformers import AutoModel

    device = case["device"]
    t_load = time.perf_counter()
    kwargs = {} if case["backend"] == "default" else {"attn_implementation": case["backend"]}
    model = AutoModel.from_pretrained(case["assets"]["ours"], trust_remote_code=True, **kwargs).to(device)
    load_s = time.perf_counter() - t_load
    options = {"dtype": case["dtype"]}
    if case.get("compile") is not None:
        options["compile"] = case["compile"]
    if case.get("max_tokens_per_batch"):
        options["max_tokens_per_batch"] = case["max_tokens_per_batch"]
    warmup_s = None
    if case.get("warmup"):  # one short untimed call first (see WARMUP_RESIDUES)
        t_warm = time.perf_counter()
        model.embed_dataset({"warmup": read_fasta(case["dataset"])[0][1][:WARMUP_RESIDUES]}, **options)
        warmup_s = time.perf_counter() - t_warm
    timer = _Timer()
    deadline = timer.start + case["max_seconds"]

    total = sum(len(s) for _, s in read_fasta(case["dataset"]))

    def progress(records_done, residues_done, _records_total):
        _sync(device)
        timer.mark(residues_done)
        if time.perf_counter() > deadline and residues_done < total:  # the last batch completes the run
            raise _Deadline

    profile = embedded = None
    try:
        if case.get("profile_ops"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as profile:
                model.embed_dataset(case["dataset"], progress=progress, **options)
        else:
            embedded = model.embed_dataset(case["dataset"], progress=progress, **options)
    except _Deadline:
        pass
    result = timer.summary(total)
    runner = getattr(model, "_fastplms_compiled", None)
    compiled = runner is not None and runner.calls > 0
    result["compiled"] = compiled
    if warmup_s is not None:
        result["warmup_s"] = warmup_s
    if compiled:
        result["compile_s"] = runner.compile_seconds
    panel = case.get("check_records", CHECK_RECORDS)
    if case.get("check_from_run") and embedded is not None:  # the timed run's own vectors (input order)
        check = embedded.records[:panel]
    else:
        check_records = dict(read_fasta(case["dataset"])[:panel])
        check = model.embed_dataset(check_records, **{**options, "compile": compiled}).records
    out = {
        "status": "ok",
        "load_s": load_s,
        **result,
        "check": torch.stack([r.pooled for r in check]).tolist(),
        **_memory(device),
    }
    if profile is not None:
        out["ops"] = _top_ops(profile)
    return out


def _top_ops(prof, top: int = 16) -> list[dict]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [
        {"op": e.key[:80], "share": e.self_cpu_time_total / total, "self_s": e.self_cpu_time_total / 1e6}
        for e in events[:top]
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _memory(device: str) -> dict:
    out = {"peak_rss_mb": _peak_rss_mb()}
    if device.startswith("cuda"):
        import torch

        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


CHILDREN = {
    "peak": child_matmul_peak,
    "transformers": child_transformers,
    "fair-esm": child_fair_esm,
    "ours": child_ours,
    "esmc-official": child_esmc_official,
    "transformers-t5": child_transformers_t5,
    "e1-official": child_e1_official,  # benchmarks/e1.py
    "ours-padded": child_ours_padded,  # benchmarks/gpu.py
}


def run_child(case: dict) -> None:
    try:
        result = CHILDREN[case["engine"]](case)
    except Exception as error:  # recorded, never hidden: the parent reports it as this case's status
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------- parent


def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        isa = sorted({f for f in flags.split() if f.startswith(("avx", "amx"))})
    except (OSError, StopIteration):
        isa = []
    import transformers

    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "isa_flags": isa,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_start": os.getloadavg(),
    }
    try:
        import esm

        info["fair_esm"] = getattr(esm, "__version__", "2.0.0")
    except ImportError:
        info["fair_esm"] = None
    return info


def esm_cpp_status() -> dict:
    """Set up .venv-esmcpp if missing; a structured 'unavailable' with the exact error if it fails."""
    probe = "import esm_cpp; print(esm_cpp.__version__, esm_cpp.current_isa())"
    status = side_venv(ESMCPP_PYTHON, REPO / "benchmarks" / "setup_esm_cpp.sh", probe, setup_timeout=900)
    if not status["available"]:
        return status
    version, isa = status["stdout"].split()
    return {"available": True, "version": version, "isa": isa}


def plan_cases(args, peaks: dict | None, esmcpp: dict) -> list[dict]:
    """Every case of the run; `skip` carries the reason a case is recorded without running."""
    cases: list[dict] = []
    gpu = args.device.startswith("cuda")
    dtypes = ("bfloat16",) if gpu else ("float32", "bfloat16")
    ours_backends = (
        ("default", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
        if gpu
        else ("default", "eager", "flex_attention")  # default is sdpa
    )
    if args.quick:
        ours_backends, dtypes = ("default",), ("float32",)
    for dtype in dtypes:
        for backend in ours_backends:
            cases.append({"engine": "ours", "label": f"fastplms {backend}", "backend": backend, "dtype": dtype})
        for compile_flag in () if args.quick else (False, True):  # the default picks per job (PathChoice)
            cases.append(
                {
                    "engine": "ours",
                    "label": f"fastplms default, compile={compile_flag}",
                    "backend": "default",
                    "dtype": dtype,
                    "compile": compile_flag,
                }
            )
    budgets = (4096,) if args.quick else tuple(args.budgets)
    for budget in () if args.quick else budgets:
        if budget != OURS_DEFAULT_BUDGET and budget <= 8192:
            cases.append(
                {
                    "engine": "ours",
                    "label": f"fastplms max_tokens_per_batch={budget}",
                    "backend": "default",
                    "dtype": "float32",
                    "max_tokens_per_batch": budget,
                }
            )
    for dtype in dtypes:
        if dtype == "float32":
            cases.append(
                {
                    "engine": "transformers",
                    "label": "Transformers input order, batch 16",
                    "batching": "input16",
                    "dtype": dtype,
                }
            )
        for budget in budgets:
            cases.append(
                {
                    "engine": "transformers",
                    "label": f"Transformers length-sorted {budget}",
                    "batching": "sorted",
                    "budget": budget,
                    "dtype": dtype,
                }
            )
    cases.append(
        {
            "engine": "fair-esm",
            "label": f"fair-esm ESM2 toks_per_batch={FAIR_TOKS_PER_BATCH}",
            "budget": FAIR_TOKS_PER_BATCH,
            "dtype": dtypes[0],
        }
    )
    if not gpu:
        for mode in ("float32",) if args.quick else ("float32", "int8"):
            cases.append({"engine": "esm-cpp", "label": "esm-cpp", "dtype": mode, "chunk": 1})
    for case in cases:
        if case["engine"] == "esm-cpp" and not esmcpp["available"]:
            case["skip"] = {"status": "unavailable", "error": esmcpp["error"]}
    return cases


def mark_slow_bf16(cases: list[dict], args, peaks: dict | None) -> list[dict]:
    """Record BF16 cases as skipped on a CPU without native BF16 matmul (unless --force-bf16)."""
    slow_bf16 = (
        peaks is not None
        and not args.device.startswith("cuda")
        and peaks["bfloat16"]["gflops"] < peaks["float32"]["gflops"] / 4
        and not args.force_bf16
    )
    for case in cases:
        if slow_bf16 and case["dtype"] == "bfloat16" and "skip" not in case:
            case["skip"] = {
                "status": "skipped",
                "error": (
                    f"no native BF16 matmul on this CPU: torch.mm BF16 peak {peaks['bfloat16']['gflops']:.2f} "
                    f"GFLOP/s vs FP32 {peaks['float32']['gflops']:.1f}; a single batch would take minutes "
                    "(pass --force-bf16 to run anyway)"
                ),
            }
    return cases


def spawn(case: dict, timeout: float) -> dict:
    if case["engine"] == "process":
        return run_process_case(case, REPO, timeout)
    if case["engine"] == "esm-cpp":
        command = [str(ESMCPP_PYTHON), str(ESMCPP_CHILD), json.dumps(case)]
    elif case["engine"] == "esmc-official":
        command = [str(ORACLE_PYTHON), "-m", "benchmarks.embed", "--child", json.dumps(case)]
    else:
        command = [sys.executable, "-m", "benchmarks.embed", "--child", json.dumps(case)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "src")])}
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"status": "error", "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(lines[-1][len("RESULT ") :])
    # One-minute load average around the child (it adds about its own thread count): other work on
    # the machine shows up here.
    result.update(process_s=time.perf_counter() - started, load_before=load_before, load_after=os.getloadavg()[0])
    return result


def _spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def summarize(case: dict, runs: list[dict], reference, flops_per_residue: float, peaks: dict | None) -> dict:
    import numpy as np

    ok = [r for r in runs if r.get("status") == "ok"]
    summary: dict = {"status": "ok" if ok else (runs[0]["status"] if runs else "skipped")}
    if not ok:
        summary["error"] = runs[0].get("error") if runs else None
        return summary
    for key in (
        "steady_res_per_s",
        "end_to_end_res_per_s",
        "time_to_first_result_s",
        "peak_rss_mb",
        "peak_gpu_mb",
        "load_s",
        "compile_s",
        "warmup_s",
    ):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            summary[key] = _spread(values)
    summary["complete"] = all(r.get("complete") for r in ok)
    summary["residues"] = statistics.median(r["residues"] for r in ok)
    if "compiled" in ok[0]:
        summary["compiled"] = [r["compiled"] for r in ok]
    # A case with an untimed warm-up (ANKH: one or two batches per case) is rated end to end: its "steady"
    # rate would leave out the first batch, which is most of its work.
    summary["rate_metric"] = "end_to_end_res_per_s" if case.get("warmup") else "steady_res_per_s"
    rate = summary[summary["rate_metric"]]["median"]
    summary["model_gflops"] = rate * flops_per_residue / 1e9
    if peaks is not None:
        peak_dtype = "bfloat16" if case["dtype"] == "bfloat16" else "float32"
        summary["fraction_of_fp32_peak"] = summary["model_gflops"] / peaks["float32"]["gflops"]
        summary["fraction_of_dtype_peak"] = summary["model_gflops"] / peaks[peak_dtype]["gflops"]
    if reference is not None and ok[0].get("check") is not None:
        check = np.asarray(ok[0]["check"], dtype=np.float64)
        ref = np.asarray(reference, dtype=np.float64)[: len(check)]  # esm-cpp embeds fewer (slow kernels)
        summary["max_rel_err_vs_transformers_fp32"] = float(np.abs(check - ref).max() / np.abs(ref).max())
        cos = (check * ref).sum(1) / np.linalg.norm(check, axis=1) / np.linalg.norm(ref, axis=1)
        summary["min_cosine_vs_transformers_fp32"] = float(cos.min())
    if ok[0].get("ops"):
        summary["ops"] = ok[0]["ops"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.embed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (about two minutes)")
    parser.add_argument(
        "--records",
        type=int,
        default=None,
        help="records per profile (default 400, ankh 8, dplm 48, e1 24; quick 48, ankh 4, dplm 16, e1 8)",
    )
    parser.add_argument(
        "--profile",
        action="append",
        choices=("lognormal", "short", "small"),
        help="length profile(s) (default: both; quick: lognormal)",
    )
    parser.add_argument(
        "--model", default=None, choices=MODEL_IDS, help="dims (default esm2_35m on CPU, esm2_650m on CUDA)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="alternating repeats (default 3; ankh, dplm, e1 1; quick 1)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop a case after this many seconds of embedding (default 60; quick 15)",
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run only cases whose label contains this text (A|B: either)")
    parser.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "int8"), help="run only cases in this dtype"
    )
    parser.add_argument("--all-cases", action="store_true", help="every case on the short profile too")
    parser.add_argument("--force-bf16", action="store_true", help="run BF16 cases even without native BF16")
    parser.add_argument("--no-profile-ops", action="store_true", help="skip the profiled runs")
    parser.add_argument("--out", type=Path, default=REPORTS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return 0

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = args.device.startswith("cuda")
    args.model = args.model or ("esm2_650m" if gpu else "esm2_35m")
    if args.model.startswith("ankh"):  # ~100 residues/s on 2 cores: a dataset one run gets through in minutes
        args.records = args.records or (ANKH_RECORDS_QUICK if args.quick else ANKH_RECORDS)
        args.repeats = args.repeats or 1
    # DPLM-150M, E1-150M: about four times ESM2-35M's cost per token (benchmarks/dplm.py, benchmarks/e1.py)
    if is_dplm(args.model):
        args.records = args.records or (DPLM_RECORDS_QUICK if args.quick else DPLM_RECORDS)
        args.repeats = args.repeats or 1
    if is_e1(args.model):
        args.records = args.records or (E1_RECORDS_QUICK if args.quick else E1_RECORDS)
        args.repeats = args.repeats or 1
    args.records = args.records or (48 if args.quick else 400)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.max_seconds = args.max_seconds or (15.0 if args.quick else 60.0)
    profiles = args.profile or (["lognormal"] if args.quick else ["lognormal", "short", "small"])
    command = "python -m benchmarks.embed " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    started = time.strftime("%Y%m%dT%H%M%S")
    machine = machine_info()
    print(f"[bench] preparing assets ({args.model}, seed {args.seed}) in {CACHE}", flush=True)
    assets = prepare_assets(args.model, args.seed)
    esmc, ankh = args.model.startswith("esmc"), args.model.startswith("ankh")
    dplm, e1 = is_dplm(args.model), is_e1(args.model)
    family_run = esmc or ankh or dplm or e1  # not ESM2: no esm-cpp, short-profile filter or profiled runs
    if esmc:
        oracle = oracle_status()
    elif e1:
        oracle = e1_oracle_status()
    elif not (ankh or dplm):
        esmcpp = esm_cpp_status() if not gpu else {"available": False, "error": "esm-cpp is a CPU engine"}
    layers, hidden, _heads = model_dims(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    timeout = args.max_seconds + 900

    for profile in profiles:
        small = profile == "small"  # whole processes (benchmarks/process.py), ESM2 on CPU only
        if small and (family_run or gpu):
            print("[bench] the small whole-process profile runs ESM2 on CPU only; skipped", flush=True)
            continue
        records = SMALL_RECORDS if small else args.records
        dataset = write_dataset(CACHE / f"{profile}-{records}-seed{args.seed}.fasta", profile, records, args.seed)
        lengths = dataset_lengths(profile, records, args.seed)
        if ankh:
            flops = ankh_flops(lengths, ankh_dims(args.model))
        elif e1:
            flops = e1_flops(lengths, e1_dims(args.model))
        else:  # ESM2 and DPLM (the ESM2 network): useful_flops
            flops = (esmc_flops if esmc else useful_flops)(lengths, layers, hidden)
        flops_per_residue = flops / sum(lengths)
        peak_runs = []
        peaks = None
        if not gpu:
            peak_runs.append(spawn({"engine": "peak", "device": args.device}, timeout))
            peaks = peak_runs[-1].get("peak")
        if small:
            cases = small_cases()
        elif ankh:
            cases = ankh_cases(args)
        elif dplm:
            cases = dplm_cases(args)
        elif e1:
            cases = e1_cases(args, oracle)
        else:
            cases = esmc_cases(args, oracle) if esmc else plan_cases(args, peaks, esmcpp)
            if gpu and not esmc:  # benchmarks/gpu.py completes the CUDA plan
                cases = gpu_cases(cases, args)
        cases = mark_slow_bf16(cases, args, peaks)
        if profile == "short" and not args.all_cases and not family_run:
            cases = [c for c in cases if c["label"] in SHORT_PROFILE_CASES]
        if args.only:
            cases = [c for c in cases if any(term in c["label"] for term in args.only.split("|"))]
        if args.dtype:
            cases = [c for c in cases if c["dtype"] == args.dtype]
        if not args.no_profile_ops and not args.quick and profile == "lognormal" and not family_run:
            # One profiled run each of ours and the best-known baseline: where each spends its time.
            profiled = {"dtype": "float32", "profile_ops": True, "repeats": 1}
            cases.append({"engine": "ours", "label": "fastplms default (profiled)", "backend": "default", **profiled})
            cases.append(
                {
                    "engine": "transformers",
                    "label": f"Transformers length-sorted {OURS_DEFAULT_BUDGET} (profiled)",
                    "batching": "sorted",
                    "budget": OURS_DEFAULT_BUDGET,
                    **profiled,
                }
            )
        for case in cases:
            case.update(
                dataset=str(dataset), assets=assets, max_seconds=args.max_seconds, model=args.model, device=args.device
            )
        runs: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
        for repeat in range(args.repeats):
            for i, case in enumerate(cases):
                if "skip" in case or repeat >= case.get("repeats", args.repeats):
                    continue
                print(
                    f"[bench] {profile} repeat {repeat + 1}/{args.repeats}: {case['label']} {case['dtype']}", flush=True
                )
                result = spawn(case, timeout)
                runs[i].append(result)
                if result.get("status") != "ok":
                    print(f"[bench]   {result.get('status')}: {result.get('error', '')[:300]}", flush=True)
                else:
                    first = result.get("time_to_first_result_s")  # whole-process cases have none
                    print(
                        f"[bench]   {result['steady_res_per_s']:.0f} res/s steady"
                        + ("" if first is None else f", first result {first:.1f} s"),
                        flush=True,
                    )
            if not gpu and repeat + 1 < args.repeats:
                peak_runs.append(spawn({"engine": "peak", "device": args.device}, timeout))
        if peak_runs and all(r.get("status") == "ok" for r in peak_runs):
            peaks = {
                name: {
                    "gflops": statistics.median(r["peak"][name]["gflops"] for r in peak_runs),
                    "runs": [r["peak"][name] for r in peak_runs],
                }
                for name in ("float32", "bfloat16")
            }
        reference_engine = (
            "esmc-official" if esmc else "transformers-t5" if ankh else "e1-official" if e1 else "transformers"
        )
        reference = next(
            (
                runs[i][0]["check"]
                for i, c in enumerate(cases)
                if c["engine"] in (reference_engine, "process" if c.get("job") == "transformers" else None)
                and c.get("batching") == "sorted"
                and c["dtype"] == "float32"
                and runs[i]
                and runs[i][0].get("status") == "ok"
            ),
            None,
        )
        results = []
        for i, case in enumerate(cases):
            public = {k: v for k, v in case.items() if k not in ("assets", "skip")}
            summary = case["skip"] if "skip" in case else summarize(case, runs[i], reference, flops_per_residue, peaks)
            raw = [{k: v for k, v in r.items() if k != "check"} for r in runs[i]]
            results.append({"case": public, "summary": summary, "runs": raw})
        record = {
            "kind": "fastplms-embedding-benchmark",
            "started": started,
            "command": command,
            "machine": machine,
            "load_average_end": os.getloadavg(),
            "model": {
                "id": args.model,
                "layers": layers,
                "hidden": hidden,
                "heads": _heads,
                "seed": args.seed,
                **(ankh_model_record(args.model) if ankh else e1_model_record(args.model) if e1 else {}),
            },
            "dataset": {
                "profile": profile,
                "records": records,
                "residues": sum(lengths),
                "median_length": statistics.median(lengths),
                "max_length": max(lengths),
                "seed": args.seed,
            },
            "flops_per_residue": flops_per_residue,
            "flops_formula": ESMC_FLOPS_FORMULA
            if esmc
            else ANKH_FLOPS_FORMULA
            if ankh
            else E1_FLOPS_FORMULA
            if e1
            else (
                "per sequence of L residues, T = L + 2 tokens: T * 2 * P + layers * 4 * hidden * T^2, "
                "P = layers * (12 * hidden^2 + 9 * hidden); divided by the residues of the dataset"
            ),
            "reference": "official ESMC FP32"
            if esmc
            else "Transformers T5 FP32"
            if ankh
            else "official E1 FP32"
            if e1
            else "Transformers FP32",
            "matmul_peak": peaks,
            **(
                {"esmc_official": oracle}
                if esmc
                else {"e1_official": oracle}
                if e1
                else {}
                if ankh or dplm
                else {"esm_cpp": esmcpp}
            ),
            "settings": {
                "repeats": args.repeats,
                "max_seconds": args.max_seconds,
                "quick": args.quick,
                "device": args.device,
                "rss": "VmHWM",  # per-process peak (_peak_rss_mb); older records used getrusage (parent's floor)
            },
            "results": results,
        }
        path = args.out / f"{started}-{args.model}-{profile}{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"[bench] wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
