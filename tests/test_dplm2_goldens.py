"""DPLM2: the committed goldens of the official bytedance/dplm code, and the in-environment network oracle.

The goldens in ``tests/goldens/dplm2_*`` come from ``tools/goldens/dplm2.py`` running the official DPLM2 wrapper,
network and sampler (transformers 4.39.2, a folder outside this repository, ``FASTPLMS_DPLM2_ORACLE``) on
``dplm2_official_state_dict(30, 640, 20, seed=0)``. These tests need no oracle: they check the files against
their manifest, the sampler outputs against the official constraints, the inputs against our tokenizer, and the
in-environment oracle (Transformers 5.13 ``EsmForMaskedLM``, double embedding, batch-wide split rotary) against
the official network outputs. Only the re-run test needs the oracle folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastplms.modeling_dplm2 import SUPPRESSED
from fastplms.oracles.dplm2 import (
    SUPPRESSED_IDS,
    dplm2_goldens,
    dplm2_official_spec,
    dplm2_official_state_dict,
    dplm2_position_ids,
    dplm2_state_sha256,
    dplm2_transformers_network,
    dplm2_type_ids,
    run_dplm2_network,
)
from fastplms.tokenization_dplm2 import (
    AA_MASK_ID,
    AA_TRACK_SIZE,
    PAD_ID,
    STRUCT_CODE_OFFSET,
    STRUCT_MASK_ID,
    VOCAB_SIZE,
    DPLM2Tokenizer,
    modality_type_ids,
    write_vocab,
)

REPO = Path(__file__).resolve().parents[1]
NETWORK, SAMPLER, MANIFEST = dplm2_goldens()
BATCHES = MANIFEST["layout"]["dplm2_network.safetensors"]["batches"]
DIMS = (30, 640, 20)
HIDDEN = DIMS[1]
LAYERS = [0, 15, 30]
ORACLE = Path(os.environ.get("FASTPLMS_DPLM2_ORACLE", "/nonexistent"))
ALLOWED_AA = set(range(4, 24)) | {29, 30, 31}  # residues and . - <null_1>; X B U Z O and the specials suppressed


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> DPLM2Tokenizer:
    return DPLM2Tokenizer(str(write_vocab(tmp_path_factory.mktemp("dplm2_goldens") / "vocab.txt")))


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return dplm2_official_state_dict(*DIMS, seed=0)


@pytest.fixture(scope="module")
def network(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    torch.set_num_threads(1)  # the goldens were made with one thread; GEMM reduction order can depend on it
    return dplm2_transformers_network(state)


# ---------------------------------------------------------------------------- files and weights


def test_manifest_and_files() -> None:
    assert sorted(MANIFEST["models"]) == ["dplm2_network", "dplm2_sampler"]
    assert MANIFEST["upstream"]["commit"] == "8b3425b7b7134aaf931baa5c53e0328da6a48a1f"
    assert MANIFEST["versions_official"]["transformers"] == "4.39.2"
    for entry in MANIFEST["models"].values():
        assert (REPO / "tests" / "goldens" / entry["file"]).stat().st_size == entry["bytes"]
    checks = MANIFEST["official_checks"]
    assert checks["official_state_spec_equals_dplm2_official_spec"] and checks["official_state_equals_file"]
    assert checks["official_state_keys"] == len(dplm2_official_spec(*DIMS)) == 522
    assert checks["official_state_keys_not_in_file"] == checks["file_keys_not_in_official_state"] == []
    assert checks["contact_head_in_features"] == 600 and not checks["official_tie_word_embeddings"]
    assert checks["official_special_token_list"] == list(SUPPRESSED_IDS)
    assert checks["official_vocab_equals_reconstructed"] and checks["official_all_tokens_50"] == "0014"


def test_seeded_weights_are_the_recipes(state: dict[str, torch.Tensor]) -> None:
    assert {k: tuple(v.shape) for k, v in state.items()} == dplm2_official_spec(*DIMS)
    assert dplm2_state_sha256(state) == MANIFEST["weights"]["state_sha256"] == SAMPLER["weights"]["state_sha256"]
    assert not torch.equal(state["lm_head.decoder.weight"], state["esm.embeddings.word_embeddings.weight"])


def test_network_goldens_well_formed(tok: DPLM2Tokenizer) -> None:
    assert NETWORK["hidden_state_layers"].tolist() == LAYERS
    expected_keys = {"hidden_state_layers"}
    for name in BATCHES:
        ids, types = NETWORK[f"{name}.input_ids"], NETWORK[f"{name}.type_ids"]
        batch, length = ids.shape
        shapes = {
            "hidden_states": (3, batch, length, HIDDEN),
            "logits_head": (batch, length, 64),
            "logits_tail": (batch, length, 64),
            "logits_argmax": (batch, length),
            "logits_logsumexp": (batch, length),
        }
        for key, shape in shapes.items():
            value = NETWORK[f"{name}.{key}"]
            assert tuple(value.shape) == shape, (name, key)
            assert value.dtype == (torch.int64 if key == "logits_argmax" else torch.float32)
            assert value.dtype == torch.int64 or torch.isfinite(value).all()
        expected_keys |= {f"{name}.{k}" for k in (*shapes, "input_ids", "type_ids")}
        assert torch.equal(types, dplm2_type_ids(ids))
        # The inputs are our tokenizer's rows (packed rows packed together, single-track rows right-padded).
        rows = MANIFEST["panel"]["network_batches"][name]
        packed = [i for i, (s, a) in enumerate(rows) if s is not None and a is not None]
        if packed:
            out = tok.pack([rows[i][0] for i in packed], [rows[i][1] for i in packed])["input_ids"]
            for i, row in zip(packed, out, strict=True):
                assert ids[i].tolist() == row
        for i, (s, a) in enumerate(rows):
            if i not in packed:
                row = tok.pack(None if s is None else [s], None if a is None else [a])["input_ids"][0]
                assert ids[i].tolist() == row + [PAD_ID] * (length - len(row))
        assert MANIFEST["official_checks"]["network"][name]["official_cli_batch_equals_pack"]
    assert set(NETWORK) == expected_keys


def test_double_embedding_in_goldens(state: dict[str, torch.Tensor]) -> None:
    """hidden_states[0] is the input embedded twice: token dropout's 0.88 / (1 - r) rescale applies twice, r =
    the row's <mask_aa> count over its non-pad tokens; <mask_aa> rows and pads are zero, <mask_struct> rows not."""
    table = state["esm.embeddings.word_embeddings.weight"]
    for name in BATCHES:
        ids = NETWORK[f"{name}.input_ids"]
        golden = NETWORK[f"{name}.hidden_states"][0]
        valid = ids.ne(PAD_ID)
        ratio = ids.eq(AA_MASK_ID).sum(-1).float() / valid.sum(-1)
        x = table[ids].masked_fill(ids.eq(AA_MASK_ID).unsqueeze(-1), 0.0)
        for _ in range(2):
            x = x * (1 - 0.15 * 0.8) / (1 - ratio)[:, None, None] * valid.unsqueeze(-1)
        torch.testing.assert_close(golden, x, rtol=1e-6, atol=1e-7)
        struct_masks = ids.eq(STRUCT_MASK_ID)
        if struct_masks.any():
            assert golden[struct_masks].abs().sum(-1).gt(0).all()
        assert golden[ids.eq(AA_MASK_ID)].abs().sum() == 0 and golden[~valid].abs().sum() == 0


# ---------------------------------------------------------------------------- in-environment oracle


@pytest.mark.parametrize("name", BATCHES)
def test_in_env_oracle_reproduces_official_network(network: torch.nn.Module, name: str) -> None:
    ids, types = NETWORK[f"{name}.input_ids"], NETWORK[f"{name}.type_ids"]
    logits, hidden = run_dplm2_network(network, ids, types)
    assert len(hidden) == DIMS[0] + 1 and logits.shape[-1] == VOCAB_SIZE
    ours = {
        "hidden_states": torch.stack([hidden[i] for i in LAYERS]),
        "logits_head": logits[..., :64],
        "logits_tail": logits[..., -64:],
        "logits_logsumexp": logits.logsumexp(-1),
    }
    for key, value in ours.items():  # bit-exact on the recipe's machine (the manifest); 1e-5 elsewhere
        torch.testing.assert_close(value, NETWORK[f"{name}.{key}"], rtol=0, atol=1e-5, msg=f"{name}.{key}")
    assert torch.equal(logits.argmax(-1), NETWORK[f"{name}.logits_argmax"])
    assert MANIFEST["in_env_oracle"][name]["bitwise_equal"]


def test_split_rotary_is_batch_wide(network: torch.nn.Module) -> None:
    """The aa-only row of the mixed batch is split at L/2 because another row holds structure tokens: alone
    (no split) its logits differ; alone with the batch's split positions it matches the golden row."""
    ids = NETWORK["mixed.input_ids"]
    assert dplm2_position_ids(dplm2_type_ids(ids))[0].tolist() == [*range(11), *range(11)]
    row = ids[:1]
    assert set(dplm2_type_ids(row).flatten().tolist()) == {1, 2}
    golden = NETWORK["mixed.logits_head"][0]
    alone, _ = run_dplm2_network(network, row)
    valid = row[0].ne(PAD_ID)
    assert (alone[0, valid, :64] - golden[valid]).abs().max() > 0.1
    forced = torch.zeros_like(row)  # type 0 everywhere except one aa id: the batch-wide rule fires
    forced[0, 0] = 1
    split, _ = run_dplm2_network(network, row, forced)
    torch.testing.assert_close(split[0, :, :64], golden, rtol=0, atol=1e-5)
    # Odd width: halves of ceil and floor, both counted from 0.
    odd = NETWORK["odd_mixed.input_ids"]
    assert odd.shape[1] == 13
    assert dplm2_position_ids(dplm2_type_ids(odd))[0].tolist() == [*range(7), *range(6)]


# ---------------------------------------------------------------------------- sampler goldens


def test_sampler_record() -> None:
    assert SAMPLER["upstream"]["commit"] == MANIFEST["upstream"]["commit"]
    # The runtime's suppression list (which the oracle reuses) is the official one, in the official order.
    assert SUPPRESSED_IDS is SUPPRESSED
    assert SAMPLER["suppressed_ids"] == list(SUPPRESSED) and len(SUPPRESSED) == 14
    assert SAMPLER["device"] == "cpu" and SAMPLER["dtype"] == "float32" and SAMPLER["threads"] == 1
    assert SAMPLER["generate_defaults"] == {
        "temperature": 1.0,
        "unmasking_strategy": "stochastic1.0",
        "sampling_strategy": "annealing@2.2:1.0",
    }
    cases = SAMPLER["cases"]
    assert {c["sampling_strategy"] for c in cases.values()} >= {
        "annealing@2.2:1.0",
        "annealing@2.2:0.1",
        "argmax",
        "gumbel_argmax",
    }
    assert cases["co_generation_default"]["strategies_from"].startswith("generate() defaults")
    for case in cases.values():
        assert 4 <= case["max_iter"] <= 6 and len(case["output_tokens"]) == 2
        assert all(case["checks"].values())


@pytest.mark.parametrize("name", sorted(SAMPLER["cases"]))
def test_sampler_outputs_respect_constraints(name: str) -> None:
    case = SAMPLER["cases"][name]
    inp, out = torch.tensor(case["input_tokens"]), torch.tensor(case["output_tokens"])
    assert inp.shape == out.shape
    types = torch.tensor(case["type_ids"])
    assert torch.equal(types, dplm2_type_ids(inp))
    special = inp.eq(PAD_ID) | torch.isin(inp, torch.tensor([0, 2, 33, 34]))
    partial = torch.tensor(case["partial_mask"]) if case["partial_mask"] is not None else torch.zeros_like(special)
    mutable = ~special & ~partial
    assert torch.equal(mutable, torch.tensor(case["mutable"]))
    assert not torch.isin(out, torch.tensor([AA_MASK_ID, STRUCT_MASK_ID])).any()  # no masks left
    assert not torch.isin(out[mutable], torch.tensor(SUPPRESSED_IDS)).any()  # the 14 ids never emitted
    assert set(out[mutable & types.eq(1)].tolist()) <= ALLOWED_AA
    struct = out[mutable & types.eq(0)]
    assert ((struct >= STRUCT_CODE_OFFSET) & (struct < STRUCT_MASK_ID)).all()
    assert torch.equal(out[~mutable], inp[~mutable])  # specials, pads and the conditioning track kept
    if case["task"] == "folding":
        assert torch.equal(partial, types.eq(1))
    if case["task"] == "inverse_folding":
        assert torch.equal(partial, types.eq(0))


@pytest.mark.parametrize("name", sorted(SAMPLER["cases"]))
def test_sampler_inputs_are_our_tokenizers(tok: DPLM2Tokenizer, name: str) -> None:
    """generate_dplm2.py's inputs for each task, rebuilt with DPLM2Tokenizer.pack."""
    case = SAMPLER["cases"][name]
    n = 20
    task = case["task"]
    if task == "co_generation":
        ids = tok.pack([",".join(["0014"] * n)] * 2, ["A" * n] * 2)["input_ids"]
    elif task == "backbone_generation":
        ids = tok.pack(structures=[",".join(["0014"] * n)] * 2)["input_ids"]
    elif task == "sequence_generation":
        ids = tok.pack(sequences=["A" * n] * 2)["input_ids"]
    else:  # the CLI sorts the FASTA records by length
        records = sorted(case["fasta"], key=lambda r: len(r[1]) if task == "folding" else len(r[1].split(",")))
        if task == "folding":
            structures = [",".join(["<mask_struct>"] * len(s)) for _, s in records]
            ids = tok.pack(structures, [s for _, s in records])["input_ids"]
        else:
            sequences = ["<mask_aa>" * len(s.split(",")) for _, s in records]
            ids = tok.pack([s for _, s in records], sequences)["input_ids"]
    assert ids == case["input_tokens"]
    assert [modality_type_ids(r) for r in ids] == case["type_ids"]


@pytest.mark.parametrize("name", sorted(SAMPLER["cases"]))
def test_sampler_rng_draws(name: str) -> None:
    """RNG order per step: annealing = one multinomial over all B*L rows; gumbel_argmax = one (B, L, V) rand_like;
    then stochastic unmasking = one (B, L) rand_like per modality present (aa first, then struct)."""
    case = SAMPLER["cases"][name]
    batch, length = len(case["input_tokens"]), len(case["input_tokens"][0])
    types = {t for row in case["type_ids"] for t in row} & {0, 1}
    step: list[str] = []
    if case["sampling_strategy"].startswith("annealing"):
        step.append(f"multinomial[{batch * length}, {VOCAB_SIZE}]")
    elif case["sampling_strategy"] == "gumbel_argmax":
        step.append(f"rand_like[{batch}, {length}, {VOCAB_SIZE}]")
    if case["unmasking_strategy"].startswith("stochastic"):
        step += [f"rand_like[{batch}, {length}]"] * len(types)
    assert case["rng_draws"] == step * case["max_iter"]


def test_sampler_decoded_strings(tok: DPLM2Tokenizer) -> None:
    for case in SAMPLER["cases"].values():
        out = case["output_tokens"]
        if case["task"] in ("sequence_generation", "backbone_generation"):
            halves = [(None, r) if case["task"] == "sequence_generation" else (r, None) for r in out]
        else:
            halves = [(r[: len(r) // 2], r[len(r) // 2 :]) for r in out]
        for i, (struct, aa) in enumerate(halves):
            if struct is not None:
                assert tok.decode_structure(struct) == case["decoded"]["struct"][i]
            if aa is not None:
                assert all(t < AA_TRACK_SIZE for t in aa)
                assert tok.decode(aa, skip_special_tokens=True) == case["decoded"]["aa"][i]


@pytest.mark.skipif(
    os.environ.get("FASTPLMS_DPLM2_RECHECK") != "1" or not (ORACLE / "DPLM_COMMIT").is_file(),
    reason="set FASTPLMS_DPLM2_RECHECK=1 and FASTPLMS_DPLM2_ORACLE (about 70 s)",
)
def test_recipe_reproduces_the_goldens_bit_for_bit() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.goldens.dplm2", "--check", "--oracle", str(ORACLE)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
