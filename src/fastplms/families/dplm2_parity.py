"""DPLM2 parity at real dims (dplm2_150m): the official network and sampler (goldens), and Transformers.

Two oracles on the same seeded official-layout weights (`oracles.dplm2`):

- the fully official ByProt network and sampler, run in their own environment (transformers 4.39.2) by
  `tools/goldens/dplm2.py`: network outputs on four batches and token outputs of `generate` for seven
  tasks (tests/goldens/dplm2_*);
- Transformers 5.13's `EsmForMaskedLM` given the official double embedding and split positions (the
  reference's recipe; `tools/goldens/dplm2.py` measured it bit-identical to the official network), live.

Ours decides the rotary split per row and the official code per batch: on batches whose rows are all
packed or all single-track the two agree and are compared; on mixed batches the records say which rows
differ and by how much (the documented deviation).
"""

from __future__ import annotations

import torch

from ..convert.dplm import from_byprot
from ..manifest import MANIFEST_DIR, Checkpoint, load_manifest
from ..modeling_dplm2 import DPLM2ForMaskedLM, tracks_of
from ..oracles.dplm2 import (
    dplm2_goldens,
    dplm2_official_state_dict,
    dplm2_transformers_network,
    run_dplm2_network,
)
from ..parity.driver import (
    ParityRun,
    cpu_autocast,
    dims_record,
    generation_record,
    hidden_states_record,
    logits_record,
    package_versions,
)
from ..parity.metrics import max_abs, relative_l2
from ..tokenization_dplm2 import VOCAB_SIZE
from .dplm_parity import build_dplm, check_byprot_conversion_shapes

CHECKPOINT_ID = "dplm2_150m"  # the goldens' dims
HOMOGENEOUS = ("packed", "aa_only")  # golden batches where the per-row and the batch-wide split agree
_PACKAGES = ("torch", "transformers", "numpy")


def dplm2_family():
    return load_manifest(MANIFEST_DIR / "dplm2.toml", resolve=False)


def build_dplm2(converted: dict[str, torch.Tensor], checkpoint: Checkpoint) -> DPLM2ForMaskedLM:
    return build_dplm(converted, checkpoint, DPLM2ForMaskedLM)


def golden_model() -> tuple[dict[str, torch.Tensor], DPLM2ForMaskedLM]:
    """(official state, ours converted from it) on the goldens' weights."""
    checkpoint = dplm2_family().checkpoint(CHECKPOINT_ID)
    official = dplm2_official_state_dict(*checkpoint.dims, seed=0)
    return official, build_dplm2(from_byprot(official, checkpoint.num_heads, tied=False), checkpoint)


def mixed_batch_rows(model: DPLM2ForMaskedLM, network: dict[str, torch.Tensor], batch: str) -> list[dict]:
    """Per row of a golden batch: ours against the official final state, and whether the row is packed."""
    ids = network[f"{batch}.input_ids"]
    with torch.no_grad():
        ours = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    official = network[f"{batch}.hidden_states"][-1]
    aa, struct = tracks_of(ids)
    return [
        {
            "row": row,
            "packed": bool(aa[row].any() and struct[row].any()),
            "final_state_max_abs": max_abs(ours[row], official[row]),
        }
        for row in range(ids.shape[0])
    ]


def measure_official_network(model: DPLM2ForMaskedLM, network: dict[str, torch.Tensor]) -> list[dict]:
    checkpoint = dplm2_family().checkpoint(CHECKPOINT_ID)
    layers = network["hidden_state_layers"].tolist()
    records = []
    for batch in HOMOGENEOUS:
        ids = network[f"{batch}.input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        everywhere = torch.ones_like(ids, dtype=torch.bool)
        pairs = [
            (out.hidden_states[i][everywhere], network[f"{batch}.hidden_states"][j][everywhere])
            for j, i in enumerate(layers)
        ]
        width = network[f"{batch}.logits_head"].shape[-1]
        subset = torch.cat([out.logits[..., :width], out.logits[..., -width:]], dim=-1)
        official = torch.cat([network[f"{batch}.logits_head"], network[f"{batch}.logits_tail"]], dim=-1)
        records.append(
            {
                "kind": "forward",
                "checkpoint": checkpoint.id,
                "dims": dims_record(checkpoint),
                "oracle": "official",
                "oracle_backend": "ByProt (goldens)",
                "backend": "sdpa",
                "dtype": "float32",
                "panel": {
                    "description": f"official golden batch `{batch}`, {ids.shape[0]} x {ids.shape[1]} tokens, "
                    f"{int((ids == 1).sum())} padding"
                },
                "positions": "all (padding included)",
                # The goldens keep the logits of the first and last 64 ids (and the argmax over all 8,229):
                # softmax metrics need every id, so these rows report the subset's differences.
                "logits_ids": f"0-{width - 1} and {out.logits.shape[-1] - width}-{out.logits.shape[-1] - 1}",
                "logits": {
                    "max_abs": max_abs(subset, official),
                    "relative_l2": relative_l2(subset, official),
                    "argmax_equal": bool(torch.equal(out.logits.argmax(-1), network[f"{batch}.logits_argmax"])),
                },
                # The goldens keep 3 of the 31 states (layers listed): the count is of the model's states.
                "hidden_states": {
                    "count": len(out.hidden_states),
                    "compared": layers,
                    **hidden_states_record(pairs, layers),
                },
            }
        )
    for batch in ("mixed", "odd_mixed"):
        records.append(
            {
                "kind": "split_rule",
                "checkpoint": checkpoint.id,
                "batch": batch,
                "rows": mixed_batch_rows(model, network, batch),
            }
        )
    return records


def _panel() -> torch.Tensor:
    """A padded batch of two packed rows (structure codes + residues, with both tracks' masks) and its
    amino-acid-only twin, for the live oracle."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in (37, 12):
        codes = torch.randint(36, 8228, (length,), generator=generator)
        residues = torch.randint(4, 24, (length,), generator=generator)
        codes[::7], residues[1::5] = 8228, 32
        rows.append((codes, residues))
    half = max(len(c) for c, _ in rows) + 2
    packed = torch.full((2, 2 * half), 1, dtype=torch.long)
    for row, (codes, residues) in enumerate(rows):
        n = len(codes)
        packed[row, 0], packed[row, 1 : n + 1], packed[row, n + 1] = 33, codes, 34
        packed[row, half], packed[row, half + 1 : half + n + 1], packed[row, half + n + 1] = 0, residues, 2
    return packed


def measure_transformers(model: DPLM2ForMaskedLM, official: dict[str, torch.Tensor]) -> list[dict]:
    checkpoint = dplm2_family().checkpoint(CHECKPOINT_ID)
    oracle = dplm2_transformers_network(official)
    records = []
    packed = _panel()
    for name, ids in (("packed", packed), ("aa_only", packed[:, packed.shape[1] // 2 :])):
        ref_logits, ref_hidden = run_dplm2_network(oracle, ids)
        everywhere = torch.ones_like(ids, dtype=torch.bool)
        for dtype in ("float32", "bfloat16"):
            with torch.no_grad(), cpu_autocast(dtype):
                out = model(input_ids=ids, output_hidden_states=True)
            pairs = [(a[everywhere].float(), b[everywhere]) for a, b in zip(out.hidden_states, ref_hidden, strict=True)]
            records.append(
                {
                    "kind": "forward",
                    "checkpoint": checkpoint.id,
                    "dims": dims_record(checkpoint),
                    "oracle": "transformers",
                    "oracle_backend": "sdpa",
                    "backend": "sdpa",
                    "dtype": dtype,
                    "panel": {
                        "description": f"{name} rows {ids.shape[0]} x {ids.shape[1]} tokens (37 and 12 residues), "
                        f"{int(((ids == 32) | (ids == 8228)).sum())} mask tokens, seed 0"
                    },
                    "positions": "all (padding included)",
                    "logits": logits_record(out.logits.float(), ref_logits, everywhere),
                    "hidden_states": {"count": len(pairs), **hidden_states_record(pairs, range(len(pairs)))},
                }
            )
    return records


def run_golden_case(model: DPLM2ForMaskedLM, case: dict) -> torch.Tensor:
    partial = case.get("partial_mask")
    torch.manual_seed(case["seed"])
    return model.generate(
        torch.tensor(case["input_tokens"]),
        max_iter=case["max_iter"],
        sampling_strategy=case["sampling_strategy"],
        unmasking_strategy=case["unmasking_strategy"],
        temperature=case["temperature"],
        partial_masks=None if partial is None else torch.tensor(partial, dtype=torch.bool),
    )


def measure_sampler(model: DPLM2ForMaskedLM, sampler: dict) -> list[dict]:
    records = []
    for name, case in sampler["cases"].items():
        official = torch.tensor(case["output_tokens"])
        ours = run_golden_case(model, case)
        strategy = f"{case['sampling_strategy']}, {case['unmasking_strategy']}"
        records.append(generation_record(CHECKPOINT_ID, name, strategy, case["max_iter"], ours, official))
    return records


def check_dplm2_conversion_shapes(checkpoint_id: str) -> dict[str, object]:
    checkpoint = dplm2_family().checkpoint(checkpoint_id)
    return check_byprot_conversion_shapes(checkpoint, DPLM2ForMaskedLM, vocab=VOCAB_SIZE, tied=False)


def versions() -> dict[str, str]:
    return package_versions(_PACKAGES)


def measure_report(run: ParityRun) -> None:
    if run.checkpoints and list(run.checkpoints) != [CHECKPOINT_ID]:
        raise SystemExit(f"DPLM2 forwards are measured at {CHECKPOINT_ID} (the goldens' dims) only")
    network, sampler, _manifest = dplm2_goldens()
    official, model = golden_model()
    run.log(f"{CHECKPOINT_ID}: official network goldens, split-rule rows")
    run.records += measure_official_network(model, network)
    run.log(f"{CHECKPOINT_ID}: live Transformers oracle, FP32 and BF16 autocast")
    run.records += measure_transformers(model, official)
    run.save()
    run.log("sampler: official goldens")
    run.records += measure_sampler(model, sampler)
    for checkpoint in dplm2_family().checkpoints:
        run.records.append(check_dplm2_conversion_shapes(checkpoint.id))
    run.save()
    run.notes.append(
        "Backend: sdpa only (the manifest); eager appears nowhere but in output_attentions/contacts calls. "
        "Metrics cover every position, padding included (padded queries attend the valid keys, as officially)."
    )
    run.notes.append(
        "Split rotary: ours splits a row at L/2 when that row holds both tracks; the official code splits "
        "every row when the batch holds both. Forward rows compare batches where the rules agree (all packed, "
        "all amino acids); split_rule rows show the mixed golden batches, where single-track rows differ."
    )
    run.notes.append(
        "dplm2_3b: conversion shape check only; the official code at 8b3425b has no working 3B inference path."
    )
