"""The ANKH side of `python -m benchmarks.embed --model ankh_base`: ours against Transformers' T5 encoder.

What a user would otherwise run is what the official `ankh` package does (agemagician/Ankh
`load_base_model`): Transformers' `T5EncoderModel.from_pretrained` on the ElnaggarLab snapshot, which in
Transformers 5.13 runs eager attention only (T5 declares no SDPA). Both sides load the same seeded weights:
an official-layout snapshot at the checkpoint's real dims (`fastplms.oracles.t5.write_ankh_snapshot`), which is
also what our artifact is built from (`fastplms.artifact.build.build`). The Transformers side numbers residues
with the snapshot's own `tokenizer.json` through the `tokenizers` pipeline, as the official 4.25.1 stack does
(`residues </s>`, pad 0): Transformers 5.13's `T5Tokenizer` rebuilds that pipeline and would prepend `<unk>`s
(`fastplms.oracles.ankh`), which is not what the official code computes.

Not a runtime module: it may import anything the dev environment has.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

# The Transformers T5 encoder is measured length-sorted at these budgets (padded tokens per batch) and in
# input order; fastplms at its default (4096).
T5_BUDGETS = (2048, 4096)
T5_INPUT_BATCH = 16
# Default records per profile of an ANKH run (ESM2: 400): at about a hundred residues per second on 2 CPU cores,
# 8 records (lognormal ~2,100 residues, short ~900) keep a full run of both profiles under about 8 minutes.
ANKH_RECORDS = 8
ANKH_RECORDS_QUICK = 4
# Records whose mean-pooled vectors are compared with the Transformers T5 FP32 run's: taken from the timed
# run itself (`check_from_run`; only records a capped run did not reach are embedded again), since a
# 48-layer, 768-wide encoder embeds only about a hundred residues per second on a small CPU.
ANKH_CHECK_RECORDS = 4
# Tokenizer generation of each checkpoint the harness can seed (its dims must all be known offline).
GENERATIONS = {"ankh_base": "v1"}


def ankh_dims(model: str):
    """`fastplms.oracles.t5.T5Dims` of a manifest checkpoint."""
    from fastplms.families.ankh_parity import ankh_family, checkpoint_dims

    family = ankh_family()
    return checkpoint_dims(family.checkpoint(model), family)


def ankh_matmul_params(dims) -> int:
    """Weights of the encoder's q, k, v, o (heads * d_kv wide) and gated FFN (wi_0, wi_1, wo), all layers."""
    inner = dims.heads * dims.d_kv
    return dims.num_layers * (4 * dims.hidden * inner + 3 * dims.hidden * dims.d_ff)


def ankh_flops(lengths: list[int], dims) -> float:
    """Matmul FLOPs of an unpadded T5 encoder forward over sequences of these lengths.

    Per sequence of L residues (T = L + 1 tokens with `</s>`): T * 2 * P + layers * 4 * inner * T^2, where
    P = layers * (4 * hidden * inner + 3 * hidden * d_ff) are the bias-free q, k, v, o (inner = heads * d_kv)
    and gated FFN weights, and the second term is Q K^T plus P V. The relative position bias is a gather and
    an add per score, not a matmul, and is not counted.
    """
    params = ankh_matmul_params(dims)
    inner = dims.heads * dims.d_kv
    return float(sum((n + 1) * 2 * params + dims.num_layers * 4 * inner * (n + 1) ** 2 for n in lengths))


FLOPS_FORMULA = (
    "per sequence of L residues, T = L + 1 tokens (</s>): T * 2 * P + layers * 4 * inner * T^2, "
    "P = layers * (4 * hidden * inner + 3 * hidden * d_ff), inner = heads * d_kv (bias-free q, k, v, o and "
    "gated FFN; the relative bias is not a matmul); divided by the residues"
)


def ankh_model_record(model: str) -> dict:
    """Extra dims of the record's `model` entry (T5 has more than layers, hidden and heads)."""
    dims = ankh_dims(model)
    return {
        "d_kv": dims.d_kv,
        "d_ff": dims.d_ff,
        "activation": dims.activation,
        "decoder_layers": dims.num_decoder_layers,
        "encoder_matmul_params": ankh_matmul_params(dims),
    }


def prepare_ankh_assets(model: str, seed: int, root: Path, artifact: Path) -> dict[str, str]:
    """The seeded ElnaggarLab-layout snapshot once per (model, seed), and our artifact built from it once per
    runtime code. An ANKH artifact holds the whole sequence-to-sequence model (about 3 GB in FP32 for
    ankh_base), so artifacts built from older runtime code are removed."""
    from fastplms.artifact.build import build
    from fastplms.oracles.t5 import write_ankh_snapshot

    snapshot = root / "snapshot"
    if not (snapshot / "model.safetensors").exists():
        tmp = root / "snapshot.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_ankh_snapshot(tmp, ankh_dims(model), generation=GENERATIONS[model], seed=seed)
        shutil.rmtree(snapshot, ignore_errors=True)
        tmp.replace(snapshot)
    for stale in root.glob("artifact-*"):
        if stale != artifact:
            shutil.rmtree(stale, ignore_errors=True)
    if not (artifact / "provenance.json").exists():
        build(model, snapshot, artifact, allow_unpinned=True, force=True)
    return {"snapshot": str(snapshot), "ours": str(artifact)}


def ankh_cases(args) -> list[dict]:
    """fastplms (default = sdpa, and eager) and Transformers' T5 encoder (eager) in input order and
    length-sorted at each budget. FP32; BF16 (autocast on both sides) with `--dtype bfloat16`."""
    dtypes = ("bfloat16",) if args.dtype == "bfloat16" else ("float32",)
    backends = ("default",) if args.quick else ("default", "eager")
    cases = []
    for dtype in dtypes:
        cases += [
            {"engine": "ours", "label": f"fastplms {backend}", "backend": backend, "dtype": dtype}
            for backend in backends
        ]
        if not args.quick:
            cases.append(
                {
                    "engine": "transformers-t5",
                    "label": f"Transformers T5 input order, batch {T5_INPUT_BATCH}",
                    "batching": "input16",
                    "dtype": dtype,
                }
            )
        for budget in (4096,) if args.quick else T5_BUDGETS:
            cases.append(
                {
                    "engine": "transformers-t5",
                    "label": f"Transformers T5 length-sorted {budget}",
                    "batching": "sorted",
                    "budget": budget,
                    "dtype": dtype,
                }
            )
    for case in cases:  # the output check reuses the timed run's vectors: re-embedding costs as much again
        case.update(check_records=ANKH_CHECK_RECORDS, check_from_run=True, warmup=True)
    return cases


def _mean_pool_t5(hidden, mask):
    """Mean over residues of (b, s, d) states: every valid position but the last (`</s>`); no prefix token."""
    import torch

    keep = mask.clone().bool()
    keep[torch.arange(mask.shape[0]), mask.sum(1) - 1] = False
    keep = keep.unsqueeze(-1)
    return (hidden.float().masked_fill(~keep, 0).sum(1) / keep.sum(1)).cpu()


def child_transformers_t5(case: dict) -> dict:
    """Transformers' `T5EncoderModel` (eager, FP32 weights) from the snapshot, as the official `ankh` loader
    runs it: `input16` (batches of 16 in file order) or `sorted` (longest first under a padded-token budget)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import T5EncoderModel

    from benchmarks.embed import (
        WARMUP_RESIDUES,
        _length_sorted_batches,
        _memory,
        case_autocast,
        read_fasta,
        timed_batches,
    )

    device = case["device"]
    snapshot = Path(case["assets"]["snapshot"])
    t_load = time.perf_counter()
    model = T5EncoderModel.from_pretrained(snapshot, attn_implementation="eager", dtype=torch.float32)
    model = model.eval().to(device)
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    load_s = time.perf_counter() - t_load
    records = read_fasta(case["dataset"])
    lengths = [len(s) for _, s in records]
    if case["batching"] == "input16":
        batches = [list(range(i, min(i + T5_INPUT_BATCH, len(records)))) for i in range(0, len(records), 16)]
    else:
        batches = _length_sorted_batches(lengths, case["budget"], special=1)
    pad = model.config.pad_token_id
    autocast = case_autocast(case)

    def embed(sequences: list[str]):
        # The official extraction: list(residues), is_split_into_words=True, </s> appended, right padding.
        ids = [e.ids for e in tokenizer.encode_batch([list(s) for s in sequences], is_pretokenized=True)]
        width = max(len(row) for row in ids)
        input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in ids], device=device)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids], device=device)
        with torch.inference_mode(), autocast:
            hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return _mean_pool_t5(hidden, mask)

    out = {"status": "ok", "load_s": load_s}
    if case.get("warmup"):  # the same short untimed call as fastplms' (benchmarks.embed.WARMUP_RESIDUES)
        t_warm = time.perf_counter()
        embed([records[0][1][:WARMUP_RESIDUES]])
        out["warmup_s"] = time.perf_counter() - t_warm
    timed = timed_batches(lambda indices: embed([records[i][1] for i in indices]), batches, lengths, case)
    return {**out, **timed, **_memory(device)}
