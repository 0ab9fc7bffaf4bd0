"""Measure what `embed_dataset(dtype="bfloat16")` costs in accuracy against FP32, on CPU.

    python -m tools.measure_embedding_bf16 [--fasta examples/proteins.fasta] [--records 20]
        [--backends sdpa,eager,compiled] [--max-tokens 4096]

The model is ESM2 at the real 8M dimensions (6 layers, hidden 320, 20 heads) with the seeded
official-layout weights of `fastplms.oracles.esm2` (seed 0: the numbers the demo artifact holds),
converted by the real converter. The panel is the first `--records` proteins of the FASTA file. Per
backend it embeds the panel twice, FP32 and BF16 autocast (parameters stay float32; `compiled` is SDPA
with the BF16 run on `embed_dataset`'s compiled path, whose CPU BF16 attention is its own), and prints, over
the panel: the minimum and mean cosine of the pooled vectors (mean and max pooling), the maximum and
median relative L2 error of the mean-pooled vectors, and the 1st-percentile cosine of per-residue
vectors. Random weights, not a trained checkpoint: the numbers bound the pipeline's BF16 error at
these dimensions, not a real model's.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from fastplms.configuration_esm2 import ESM2Config
from fastplms.convert.esm2 import from_transformers
from fastplms.manifest import REPO_ROOT, find_checkpoint
from fastplms.modeling_esm2 import ESM2Model
from fastplms.oracles.esm2 import hf_esm2_state_dict

DIMS = find_checkpoint("esm2_8m")[1].dims


def seeded_esm2_8m(seed: int = 0) -> ESM2Model:
    layers, hidden, heads = DIMS
    state = from_transformers(hf_esm2_state_dict(layers, hidden, heads, seed=seed), heads)
    encoder = {key.removeprefix("esm."): value for key, value in state.items() if key.startswith("esm.")}
    model = ESM2Model(ESM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads))
    model.load_state_dict(encoder)
    return model.eval()


def read_panel(path: str, records: int) -> dict[str, str]:
    """The first `records` entries of a FASTA file (id = header up to the first whitespace)."""
    panel: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for block in handle.read().split(">")[1:]:
            header, *lines = block.splitlines()
            panel[header.split(maxsplit=1)[0]] = "".join("".join(lines).split()).removesuffix("*")
            if len(panel) == records:
                break
    return panel


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1)


def measure(model: ESM2Model, panel: dict[str, str], backend: str, max_tokens: int) -> dict[str, float]:
    compiled = backend == "compiled"
    model.set_attn_implementation("sdpa" if compiled else backend)
    options = dict(pooling=("mean", "max"), per_residue=True, max_tokens_per_batch=max_tokens)
    start = time.perf_counter()
    fp32 = model.embed_dataset(panel, compile=False, **options)
    fp32_s = time.perf_counter() - start
    if compiled:  # compile outside the timed run
        model.embed_dataset(panel, dtype="bfloat16", compile=True, **options)
    start = time.perf_counter()
    bf16 = model.embed_dataset(panel, dtype="bfloat16", compile=compiled, **options)
    bf16_s = time.perf_counter() - start
    assert bf16.ids == fp32.ids
    cosine = torch.nn.functional.cosine_similarity
    mean_cos = cosine(bf16.stack("mean"), fp32.stack("mean"), dim=-1)
    max_cos = cosine(bf16.stack("max"), fp32.stack("max"), dim=-1)
    rel = _relative_l2(bf16.stack("mean"), fp32.stack("mean"))
    residue_cos = torch.cat(
        [cosine(a.residues, b.residues, dim=-1) for a, b in zip(bf16.records, fp32.records, strict=True)]
    )
    return {
        "mean_pooled_cosine_min": float(mean_cos.min()),
        "mean_pooled_cosine_mean": float(mean_cos.mean()),
        "max_pooled_cosine_min": float(max_cos.min()),
        "mean_pooled_rel_l2_max": float(rel.max()),
        "mean_pooled_rel_l2_median": float(rel.median()),
        "residue_cosine_p1": float(torch.quantile(residue_cos.double(), 0.01)),
        "fp32_seconds": fp32_s,
        "bf16_seconds": bf16_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.measure_embedding_bf16", description=__doc__)
    parser.add_argument("--fasta", default=str(REPO_ROOT / "examples" / "proteins.fasta"))
    parser.add_argument("--records", type=int, default=20)
    parser.add_argument("--backends", default="sdpa,eager,compiled")
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args(argv)

    panel = read_panel(args.fasta, args.records)
    lengths = sorted(map(len, panel.values()))
    print(f"panel     {len(panel)} proteins from {args.fasta}")
    print(f"          lengths {lengths[0]}..{lengths[-1]}, {sum(lengths)} residues")
    print(f"model     ESM2 8M dims {DIMS} (layers, hidden, heads), seeded weights (seed 0)")
    print(f"machine   torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, CPU autocast")
    model = seeded_esm2_8m()
    for backend in args.backends.split(","):
        numbers = measure(model, panel, backend, args.max_tokens)
        print(f"\n[{backend}] BF16 autocast vs FP32")
        for key, value in numbers.items():
            print(f"  {key:<26} {value:.3f} s" if key.endswith("seconds") else f"  {key:<26} {value:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
