"""Time for M queries over one retrieval context, with and without the E1 context cache.

    .venv/bin/python -m benchmarks.e1_cache [--checkpoint e1_150m] [--context 4] [--queries 8]
        [--length 100] [--batch 4] [--backend sdpa] [--out reports/e1_cache.json]

Seeded official-layout weights at the checkpoint's real dims (`fastplms.families.e1_parity.build_e1`), a
seeded context of `--context` homologs and `--queries` queries of `--length` residues. Without the cache every
batch of `--batch` queries runs as full rows (context + query); with it the context is encoded once
(`model.encode_context`, timed) and each batch runs against it. Both give the same outputs (checked: the
worst relative L2 of the logits is reported). One warm-up batch each, then the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from fastplms.families.e1_parity import build_e1
from fastplms.modeling_e1 import prepare_e1_inputs

RESIDUES = "ACDEFGHIKLMNPQRSTVWY"


def _sequences(count: int, length: int, generator: torch.Generator) -> list[str]:
    picks = torch.randint(len(RESIDUES), (count, length), generator=generator)
    return ["".join(RESIDUES[i] for i in row) for row in picks.tolist()]


def _timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="e1_150m")
    parser.add_argument("--context", type=int, default=4, help="context sequences")
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--length", type=int, default=100, help="residues per sequence")
    parser.add_argument("--batch", type=int, default=4, help="queries per forward")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("reports/e1_cache.json"))
    args = parser.parse_args(argv)

    generator = torch.Generator().manual_seed(0)
    context = _sequences(args.context, args.length, generator)
    queries = _sequences(args.queries, args.length, generator)
    batches = [queries[i : i + args.batch] for i in range(0, len(queries), args.batch)]
    model = build_e1(args.checkpoint)
    model.set_attn_implementation(args.backend)

    def without_cache():
        with torch.inference_mode():
            return [model(**prepare_e1_inputs(b, [context] * len(b))).logits for b in batches]

    def with_cache():
        with torch.inference_mode():
            cache = model.encode_context(context)
            return [model(**prepare_e1_inputs(b), context_cache=cache).logits for b in batches]

    def encode_only():
        with torch.inference_mode():
            return model.encode_context(context)

    full_s, full = _timed(without_cache, args.repeats)
    cached_s, cached = _timed(with_cache, args.repeats)
    encode_s, _ = _timed(encode_only, args.repeats)
    context_tokens = sum(len(s) + 4 for s in context)
    worst = max(
        float((c - f[:, context_tokens:]).norm() / f[:, context_tokens:].norm())
        for c, f in zip(cached, full, strict=True)
    )
    report = {
        "checkpoint": args.checkpoint,
        "backend": args.backend,
        "context_sequences": args.context,
        "context_tokens": context_tokens,
        "queries": args.queries,
        "query_tokens": args.length + 4,
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "seconds_without_cache": round(full_s, 3),
        "seconds_with_cache": round(cached_s, 3),
        "seconds_encode_context": round(encode_s, 3),
        "speedup": round(full_s / cached_s, 2),
        "logits_worst_relative_l2": worst,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
