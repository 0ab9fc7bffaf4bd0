"""CPU attention kernels at ESM2's and ESMC's head shapes: `python -m benchmarks.attention_cpu`.

The measurement behind `compiled.attend_spans`' BF16 choice: per sequence length, GFLOP/s (4 * heads *
head_dim * L^2 per sequence) of `attend_spans` in BF16 (compiled head chunks for L up to 724, SDPA above)
against ATen's SDPA in BF16 and in FP32, on two packed sequences of that length. Prints a table.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fastplms.compiled import attend_spans

SHAPES = {"ESM2 (20 heads x 24)": (20, 24), "ESMC (15 heads x 64)": (15, 64)}
LENGTHS = (100, 300, 600, 1000)


def _seconds(fn, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _sdpa(q, k, v, spans, scale: float) -> None:
    for a, b in spans:
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), scale=scale)


def measure(heads: int, dim: int, length: int, compile) -> tuple[float, float, float]:
    """GFLOP/s of attend_spans BF16, SDPA BF16 and SDPA FP32 on two packed sequences of `length` tokens."""
    spans, scale = [(0, length), (length, 2 * length)], dim**-0.5
    q, k, v = (torch.randn(2 * length, heads, dim, dtype=torch.bfloat16) for _ in range(3))
    q32, k32, v32 = (t.float() for t in (q, k, v))
    seconds = (
        _seconds(lambda: attend_spans(q, k, v, spans, compile, scale)),
        _seconds(lambda: _sdpa(q, k, v, spans, scale)),
        _seconds(lambda: _sdpa(q32, k32, v32, spans, scale)),
    )
    flops = 2 * 4 * heads * dim * length**2
    return tuple(flops / s / 1e9 for s in seconds)


def main() -> int:
    compiled: dict = {}

    def compile(fn):
        return compiled.setdefault(fn, torch.compile(fn, dynamic=True))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s")
    print("| shape | tokens | attend_spans BF16 | SDPA BF16 | SDPA FP32 |")
    print("| --- | --- | --- | --- | --- |")
    for name, (heads, dim) in SHAPES.items():
        for length in LENGTHS:
            rates = measure(heads, dim, length, compile)
            print(f"| {name} | {length} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
