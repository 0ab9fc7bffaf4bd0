"""DPLM2 on DPLM's classes: double embedding, per-row split rotary, padding, tracks, the backend boundary.

Small seeded weights in the official `EsmForDPLM2` layout; the oracle is Transformers' `EsmForMaskedLM` given
the official double embedding and the official (batch-wide) split positions (`oracles.dplm2`). The real-dims
checks against the official code's goldens are in test_dplm2_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from fastplms.configuration_dplm2 import DPLM2Config
from fastplms.convert.common import ConversionError
from fastplms.convert.dplm import from_byprot
from fastplms.modeling_dplm import DPLMForMaskedLM
from fastplms.modeling_dplm2 import SUPPRESSED, DPLM2ForMaskedLM, DPLM2Model
from fastplms.oracles.dplm2 import (
    SUPPRESSED_IDS,
    dplm2_embed,
    dplm2_official_state_dict,
    dplm2_transformers_network,
    run_dplm2_network,
)
from fastplms.oracles.esm2 import hf_esm2_config
from fastplms.tokenization_dplm2 import AA_MASK_ID, PAD_ID, STRUCT_MASK_ID, VOCAB_SIZE

DIMS = (2, 64, 4)


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    return dplm2_official_state_dict(*DIMS, seed=5)


@pytest.fixture(scope="module")
def model(official) -> DPLM2ForMaskedLM:
    layers, hidden, heads = DIMS
    model = DPLM2ForMaskedLM(DPLM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads))
    model.load_state_dict(from_byprot(official, heads, tied=False), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def oracle(official):
    return dplm2_transformers_network(official)


def _packed() -> torch.Tensor:
    """Two packed rows (structure + residues, both tracks' masks, padding in each half)."""
    ids = torch.full((2, 2 * 11), PAD_ID)
    for row, n in enumerate((9, 5)):
        codes = torch.arange(40, 40 + n) * (row + 3)
        codes[1] = STRUCT_MASK_ID
        residues = torch.arange(4, 4 + n)
        residues[2] = AA_MASK_ID
        ids[row, 0], ids[row, 1 : n + 1], ids[row, n + 1] = 33, codes, 34
        ids[row, 11], ids[row, 12 : n + 12], ids[row, n + 12] = 0, residues, 2
    return ids


def test_packed_rows_match_the_official_network_everywhere(model, oracle) -> None:
    ids = _packed()
    ref_logits, ref_hidden = run_dplm2_network(oracle, ids)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[0], ref_hidden[0], rtol=0, atol=1e-6)  # twice embedded
    for ours, ref in zip(out.hidden_states, ref_hidden, strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=2e-5)


def test_double_embedding_rescales_twice(model, oracle) -> None:
    ids = _packed()
    with torch.no_grad():
        embedded = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
    rows = model.esm.embed_tokens.weight[ids]
    valid = ids != PAD_ID
    ratio = (ids == AA_MASK_ID).sum(-1) / valid.sum(-1)
    factor = (0.88 / (1 - ratio)) ** 2
    want = rows.masked_fill((ids == AA_MASK_ID)[..., None], 0) * factor[:, None, None] * valid[..., None]
    torch.testing.assert_close(embedded, want, rtol=1e-6, atol=1e-7)
    assert embedded[ids == STRUCT_MASK_ID].abs().sum() > 0  # <mask_struct> rows are not zeroed
    torch.testing.assert_close(embedded, dplm2_embed(oracle, ids), rtol=0, atol=1e-6)


def test_split_is_per_row(model, oracle) -> None:
    """The documented deviation: the official code splits every row of a batch holding both tracks; ours
    splits only rows that hold both. Homogeneous batches agree, and a row's output never depends on the
    other rows of its batch."""
    aa_only = torch.tensor([[0, *range(4, 16), 2]])  # 14 tokens: reaches past the middle of a 16-wide batch
    packed = torch.tensor([[33, *range(40, 46), 34, 0, *range(4, 10), 2]])  # two halves of 8
    mixed = torch.cat([torch.cat([aa_only, torch.full((1, 2), PAD_ID)], dim=1), packed])
    with torch.no_grad():
        alone = model(input_ids=aa_only).logits[0]
        in_mixed = model(input_ids=mixed).logits
    torch.testing.assert_close(in_mixed[0, :14], alone, rtol=0, atol=1e-5)
    ref_alone, _ = run_dplm2_network(oracle, aa_only)
    ref_mixed, _ = run_dplm2_network(oracle, mixed)
    torch.testing.assert_close(alone, ref_alone[0], rtol=0, atol=2e-5)  # aa-only batch: the rules agree
    torch.testing.assert_close(in_mixed[1], ref_mixed[1], rtol=0, atol=2e-5)  # the packed row: agree
    assert (ref_mixed[0, :14] - ref_alone[0]).abs().max() > 1e-2  # officially the aa-only row moves


def test_type_ids_must_be_the_official_ones(model) -> None:
    ids = _packed()
    types = torch.where(ids == PAD_ID, 2, (ids < 33).long())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, type_ids=types).logits, model(input_ids=ids).logits)
    types[0, 3] = 1
    with pytest.raises(ValueError, match="type_ids disagree"):
        model(input_ids=ids, type_ids=types)


def test_only_sdpa_with_the_reason(official) -> None:
    layers, hidden, heads = DIMS
    from fastplms.families import adapter_for
    from fastplms.manifest import MANIFEST_DIR, load_manifest

    family = load_manifest(MANIFEST_DIR / "dplm2.toml", resolve=False)
    config = adapter_for(family).make_config(family, family.representative_checkpoint)
    config.update({"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads})
    model = DPLM2ForMaskedLM(config)
    assert model.attention_backend() == "sdpa"
    for backend in ("eager", "flex_attention", "flash_attention_2", "flash_attention_3"):
        with pytest.raises(ValueError, match=rf"{backend}.*0\.01 target"):
            model.set_attn_implementation(backend)
    with pytest.raises(ValueError, match="stored as torch.bfloat16"):
        model.to(torch.bfloat16)(input_ids=_packed())


def test_contacts_on_amino_acid_rows(model, oracle) -> None:
    ids = _packed()[:, 11:]
    mask = (ids != PAD_ID).long()
    contacts = model.predict_contacts(ids, mask)
    oracle.set_attn_implementation("eager")  # Transformers returns attention maps from eager only
    try:
        with torch.no_grad():
            out = oracle(
                inputs_embeds=dplm2_embed(oracle, ids),
                attention_mask=mask,
                output_attentions=True,
                position_ids=torch.arange(ids.shape[1]).expand_as(ids),
            )
    finally:
        oracle.set_attn_implementation("sdpa")
    # Transformers' EsmModel.predict_contacts, given DPLM2's double embedding: maps masked, then the head.
    maps = torch.stack(out.attentions, 1) * mask[:, None, None, None, :] * mask[:, None, None, :, None]
    want = oracle.esm.contact_head(ids, maps)
    pairs = torch.zeros_like(want, dtype=torch.bool)
    for row, n in enumerate((9, 5)):
        pairs[row, :n, :n] = True
    torch.testing.assert_close(contacts[pairs], want[pairs], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="amino-acid rows"):
        model.predict_contacts(_packed())


def test_conversion_needs_the_untied_decoder(official) -> None:
    with pytest.raises(ConversionError, match="untied"):
        from_byprot({k: v for k, v in official.items() if k != "lm_head.decoder.weight"}, DIMS[2], tied=False)
    with pytest.raises(ConversionError, match="differs"):
        from_byprot(official, DIMS[2])  # read as DPLM (tied): the stored decoder is not the embeddings


def test_generate_inputs_by_task(model) -> None:
    ids, fixed = model.generate_inputs([4, 2])
    assert ids.shape == (2, 12) and not fixed.any()
    assert ids[0].tolist() == [33, *[STRUCT_MASK_ID] * 4, 34, 0, *[AA_MASK_ID] * 4, 2]
    assert ids[1].tolist() == [33, STRUCT_MASK_ID, STRUCT_MASK_ID, 34, 1, 1, 0, AA_MASK_ID, AA_MASK_ID, 2, 1, 1]
    ids, fixed = model.generate_inputs(sequences=["MKV"])
    assert ids[0, 5:].tolist() == [0, 20, 15, 7, 2] and fixed[0].tolist() == [False] * 5 + [True] * 5
    ids, fixed = model.generate_inputs(structures=["0000,8191"])
    assert ids[0, :4].tolist() == [33, 36, 8227, 34] and fixed[0].tolist() == [True] * 4 + [False] * 4
    with pytest.raises(ValueError, match="exactly one"):
        model.generate_inputs([3], sequences=["MKV"])
    with pytest.raises(ValueError, match="'J' at position 1"):
        model.generate_inputs(sequences=["MJ"])
    with pytest.raises(ValueError, match="structure track"):
        model.generate_inputs(structures=["12,9999"])


@pytest.mark.parametrize(
    ("task", "strategy", "unmasking"),
    [
        ("co", "annealing@2.2:1.0", "stochastic1.0"),
        ("fold", "argmax", "deterministic"),
        ("inverse", "gumbel_argmax", "stochastic0.5"),
        ("co", "vanilla", "deterministic"),
    ],
)
def test_generate_respects_tracks_and_fixed_positions(model, task, strategy, unmasking) -> None:
    if task == "co":
        ids, fixed = model.generate_inputs([6, 3])
    elif task == "fold":
        ids, fixed = model.generate_inputs(sequences=["MKTAY", "ML"])
    else:
        ids, fixed = model.generate_inputs(structures=["0001,0002,0003", "8191"])
    out = model.generate(
        ids,
        max_iter=3,
        sampling_strategy=strategy,
        unmasking_strategy=unmasking,
        partial_masks=fixed,
        generator=torch.Generator().manual_seed(0),
    )
    mutable = (ids == AA_MASK_ID) | (ids == STRUCT_MASK_ID)
    assert torch.equal(out[~mutable], ids[~mutable])
    assert (out[ids == AA_MASK_ID] < 33).all() and (out[ids == STRUCT_MASK_ID] >= 36).all()
    assert not any((out[mutable] == banned).any() for banned in SUPPRESSED)


def test_generate_refuses_bad_arguments(model) -> None:
    ids, fixed = model.generate_inputs([4])
    for kwargs, match in (
        ({"max_iter": 0}, "max_iter"),
        ({"max_iter": 2, "sampling_strategy": "annealing@1.0"}, "annealing@<max>:<min>"),
        ({"max_iter": 2, "sampling_strategy": "annealing@0.5:1.0"}, "max >= min"),
        ({"max_iter": 2, "sampling_strategy": "greedy"}, "is not one of"),
        ({"max_iter": 2, "unmasking_strategy": "stochastic"}, "unmasking_strategy"),
        ({"max_iter": 2, "temperature": -1.0}, "temperature"),
        ({"max_iter": 2, "partial_masks": torch.ones_like(fixed)}, "keeps a mask token"),
    ):
        with pytest.raises(ValueError, match=match):
            model.generate(ids, **kwargs)
    with pytest.raises(TypeError):
        model.generate(ids, max_iter=2, disable_resample=True)  # DPLM's option; DPLM2 has no resampling


def test_family_constants() -> None:
    assert sorted(SUPPRESSED) == sorted(SUPPRESSED_IDS)
    assert issubclass(DPLM2ForMaskedLM, DPLMForMaskedLM) and DPLM2ForMaskedLM.encoder_class is DPLM2Model
    assert DPLM2Config().vocab_size == VOCAB_SIZE
    assert hf_esm2_config(1, 64, 4).vocab_size == 33  # untouched by DPLM2


def test_embed_dataset_equals_forward_on_amino_acid_rows(model) -> None:
    result = model.embed_dataset({"a": "MKTAYIAKQ", "b": "MLV"}, pooling=(), per_residue=True)
    for record in result.records:
        ids = torch.tensor([[0, *[model.vocabulary.index(c) for c in record.sequence], 2]])
        with torch.no_grad():
            want = model.esm(input_ids=ids).last_hidden_state[0, 1:-1]
        torch.testing.assert_close(record.residues, want, rtol=0, atol=1e-5)
