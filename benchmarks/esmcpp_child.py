"""One esm-cpp benchmark case; run by benchmarks/embed.py with .venv-esmcpp's python (numpy<2, no torch).

Throughput goes through `Model.forward_scheduled` (esm-cpp's packed, length-bucketed batch entry point),
which returns LM logits: its work is the encoder plus the small LM head (about 1% of the FLOPs at ESM2-35M).
The check panel's embeddings come from `forward_with_hidden_states` (last state, post final LayerNorm).
Prints one line `RESULT {json}` like every other child.
"""

from __future__ import annotations

import json
import resource
import sys
import time

# Fewer than the other engines' 16: without AVX-512 its reference kernels run ~20 residues/s.
CHECK_RECORDS = 4


def read_fasta(path):
    records, rid, chunks = [], None, []
    with open(path) as handle:
        for line in handle.read().splitlines():
            if line.startswith(">"):
                if rid is not None:
                    records.append((rid, "".join(chunks)))
                rid, chunks = line[1:].split()[0], []
            elif line.strip():
                chunks.append(line.strip())
    if rid is not None:
        records.append((rid, "".join(chunks)))
    return records


def main(case):
    import esm_cpp
    import numpy as np

    t_load = time.perf_counter()
    model = esm_cpp.Model.load_from_safetensors(case["assets"]["hf"] + "/model.safetensors")
    if case["dtype"] == "int8":
        model.quantize_weights()  # per-channel symmetric INT8 weights, in memory (its own bench does this)
    load_s = time.perf_counter() - t_load
    tokenizer = esm_cpp.Tokenizer()
    records = read_fasta(case["dataset"])
    ids = [np.asarray(tokenizer.encode(seq), dtype=np.int32) for _, seq in records]
    total = sum(len(seq) for _, seq in records)
    start = time.perf_counter()
    deadline = start + case["max_seconds"]
    marks, done = [], 0
    chunk = case.get("chunk", 1)  # records per forward_scheduled call, in input order (it buckets inside)
    for i in range(0, len(ids), chunk):
        model.forward_scheduled(ids[i : i + chunk])
        done += sum(len(seq) for _, seq in records[i : i + chunk])
        marks.append((time.perf_counter() - start, done))
        if time.perf_counter() > deadline:
            break
    (t1, r1), (tn, rn) = marks[0], marks[-1]
    check = []
    for _, seq in records[:CHECK_RECORDS]:
        _, states = model.forward_with_hidden_states(np.asarray(tokenizer.encode(seq), dtype=np.int32))
        check.append(states[-1][1 : len(seq) + 1].mean(0).tolist())
    return {
        "status": "ok",
        "load_s": load_s,
        "residues": rn,
        "complete": rn >= total,
        "batches": len(marks),
        "seconds": tn,
        "time_to_first_result_s": t1,
        "first_batch_residues": r1,
        "steady_res_per_s": (rn - r1) / (tn - t1) if len(marks) > 1 else rn / tn,
        "end_to_end_res_per_s": rn / tn,
        "isa": esm_cpp.current_isa(),
        "threads": esm_cpp.Model.num_threads,
        "peak_rss_mb": _peak_rss_mb(),
        "check": check,
    }


def _peak_rss_mb() -> float:
    """Peak RSS of this process (VmHWM): getrusage's ru_maxrss survives execve, so here it would be at least
    the harness parent's peak (as in benchmarks.embed._peak_rss_mb)."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    try:
        result = main(json.loads(sys.argv[1]))
    except Exception as error:  # reported by the parent as this case's status
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
    print("RESULT " + json.dumps(result), flush=True)
