"""Whole-process jobs: `python -m benchmarks.embed --profile small` (issue 15's "small job").

A user with a few hundred proteins runs one command and waits for it to exit: interpreter start, imports,
model load and writing the output are part of the job. Each case here is one such process, timed from
spawn to exit (rate = the dataset's residues / those seconds), its peak RSS sampled from /proc while it
runs (its own VmHWM, read just before it exits, is not reachable from outside):

- `fastplms embed (whole process)`: the CLI, `python -m fastplms.cli embed --model <artifact> --out x.db`,
  default settings (SQLite output, mean pooling);
- `Transformers length-sorted N (whole process)` / `Transformers input order, batch 16 (whole process)`:
  `python -m benchmarks.process --job ...`, the script a Transformers user writes: `EsmModel` (sdpa) and
  `EsmTokenizer` from the snapshot, batches longest first under N padded tokens (or 16 in file order),
  mean over residues, one `.npy` of vectors in input order.

The parent compares the first records' vectors of every output with the Transformers FP32 one.
Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL_RECORDS = 250  # "a small job (about 250 records)"
PROCESS_BUDGETS = (2048, 4096)
CHECK = 16
POLL_S = 0.05


def small_cases() -> list[dict]:
    cases = [{"engine": "process", "label": "fastplms embed (whole process)", "job": "fastplms", "dtype": "float32"}]
    for budget in PROCESS_BUDGETS:
        cases.append(
            {
                "engine": "process",
                "label": f"Transformers length-sorted {budget} (whole process)",
                "job": "transformers",
                "batching": "sorted",
                "budget": budget,
                "dtype": "float32",
            }
        )
    cases.append(
        {
            "engine": "process",
            "label": "Transformers input order, batch 16 (whole process)",
            "job": "transformers",
            "batching": "input16",
            "dtype": "float32",
        }
    )
    return cases


def _command(case: dict, out: Path) -> list[str]:
    if case["job"] == "fastplms":
        return [
            sys.executable, "-m", "fastplms.cli", "embed", "--model", case["assets"]["ours"],
            "--out", str(out), case["dataset"],
        ]  # fmt: skip
    batching = ["--budget", str(case["budget"])] if case["batching"] == "sorted" else ["--input-order"]
    return [sys.executable, "-m", "benchmarks.process", "--job", case["assets"]["hf"], case["dataset"], str(out)] + (
        batching
    )


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _vectors(case: dict, out: Path):
    import numpy as np

    if case["job"] == "fastplms":
        from fastplms.embedding import read_embeddings

        return np.stack([r.pooled.numpy() for r in read_embeddings(out).records[:CHECK]])
    return np.load(out)[:CHECK]


def run_process_case(case: dict, repo: Path, timeout: float) -> dict:
    """Spawn the case's whole job once; wall seconds, rate, sampled peak RSS and the check vectors."""
    from benchmarks.embed import read_fasta

    residues = sum(len(s) for _, s in read_fasta(case["dataset"]))
    with tempfile.TemporaryDirectory(prefix="fastplms-job-") as tmp:
        out = Path(tmp) / ("out.db" if case["job"] == "fastplms" else "out.npy")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "src")])}
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        proc = subprocess.Popen(
            _command(case, out), cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _rss_mb(proc.pid))
            if time.perf_counter() - started > timeout:
                proc.kill()
                return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
            time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        stderr = proc.stderr.read() if proc.stderr else ""
        if proc.returncode != 0:
            return {"status": "error", "error": f"exit {proc.returncode}: {stderr[-2000:]}"}
        check = _vectors(case, out)
    return {
        "status": "ok",
        "residues": residues,
        "complete": True,
        "process_s": seconds,
        "steady_res_per_s": residues / seconds,  # whole process: the only rate there is
        "end_to_end_res_per_s": residues / seconds,
        "peak_rss_mb": peak,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "check": check.tolist(),
    }


# ---------------------------------------------------------------------------------------------- the job


def transformers_job(snapshot: str, dataset: str, out: str, budget: int | None) -> None:
    """What a Transformers user runs: EsmModel + EsmTokenizer, batches, mean over residues, one .npy."""
    import numpy as np
    import torch
    from transformers import EsmModel, EsmTokenizer

    from benchmarks.embed import HF_INPUT_BATCH, _length_sorted_batches, _mean_pool_hidden, read_fasta

    model = EsmModel.from_pretrained(snapshot, attn_implementation="sdpa", add_pooling_layer=False).eval()
    tokenizer = EsmTokenizer.from_pretrained(snapshot)
    records = read_fasta(dataset)
    lengths = [len(s) for _, s in records]
    if budget is None:
        batches = [list(range(i, min(i + HF_INPUT_BATCH, len(records)))) for i in range(0, len(records), 16)]
    else:
        batches = _length_sorted_batches(lengths, budget)
    vectors: list = [None] * len(records)
    for batch in batches:
        enc = tokenizer([records[i][1] for i in batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            pooled = _mean_pool_hidden(model(**enc).last_hidden_state, enc["attention_mask"])
        for i, row in zip(batch, pooled, strict=True):
            vectors[i] = row.numpy()
    np.save(out, np.stack(vectors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.process")
    parser.add_argument("--job", required=True, metavar="SNAPSHOT", help="Transformers ESM2 snapshot directory")
    parser.add_argument("dataset")
    parser.add_argument("out")
    order = parser.add_mutually_exclusive_group(required=True)
    order.add_argument("--budget", type=int)
    order.add_argument("--input-order", action="store_true")
    args = parser.parse_args(argv)
    transformers_job(args.job, args.dataset, args.out, None if args.input_order else args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
