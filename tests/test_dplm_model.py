"""DPLM on ESM2's classes: the official forward (padding included), conversion, generation contract.

Small seeded weights in the official `EsmForDPLM` layout; the oracle is Transformers' `EsmForMaskedLM`
with SDPA and the mask `input_ids != <pad>` (bit-identical to ByProt's network per the reference). The
real-dimension checks and the official sampler goldens are in test_dplm_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from fastplms.configuration_dplm import DPLMConfig
from fastplms.convert.common import ConversionError
from fastplms.convert.dplm import from_byprot
from fastplms.diffusion import lowest_scores, remask_cutoff, top_p_filter
from fastplms.modeling_dplm import DPLMForMaskedLM, DPLMForSequenceClassification, DPLMModel
from fastplms.modeling_esm2 import ESM2ForMaskedLM
from fastplms.oracles.dplm import dplm_official_state_dict, dplm_transformers_network, run_dplm_network

DIMS = (3, 64, 4)
PAD, CLS, EOS, MASK, X = 1, 0, 2, 32, 24


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    return dplm_official_state_dict(*DIMS, seed=3)


@pytest.fixture(scope="module")
def model(official) -> DPLMForMaskedLM:
    layers, hidden, heads = DIMS
    config = DPLMConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    model = DPLMForMaskedLM(config)
    model.load_state_dict(from_byprot(official, heads), strict=True)
    return model.eval()


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 24, (3, 19), generator=generator)
    ids[:, 0] = CLS
    ids[0, 18] = EOS
    ids[1, 11], ids[1, 12:] = EOS, PAD
    ids[2, 4], ids[2, 5:] = EOS, PAD
    ids[0, 3] = ids[1, 7] = MASK
    return ids


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_forward_matches_transformers_everywhere_padding_included(model, official, backend) -> None:
    ids = _batch()
    ref_logits, ref_hidden = run_dplm_network(dplm_transformers_network(official), ids)
    model.set_attn_implementation(backend)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref_hidden) == DIMS[0] + 1
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=2e-5)
    for ours, ref in zip(out.hidden_states, ref_hidden, strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
    pads = ids == PAD
    assert out.logits[pads].abs().sum() > 0  # padded queries attend the valid keys, as officially


def test_valid_positions_do_not_depend_on_padding(model) -> None:
    ids = _batch()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        batched = model(input_ids=ids).logits
        alone = model(input_ids=ids[2:, :5]).logits
    torch.testing.assert_close(batched[2, :5], alone[0], rtol=0, atol=1e-5)


def test_caller_mask_must_be_the_pad_mask(model) -> None:
    ids = _batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=(ids != PAD).long())  # the tokenizer's mask: accepted
    wrong = (ids != PAD).long()
    wrong[0, 10:] = 0
    with pytest.raises(ValueError, match="row 0.*<pad>"):
        model(input_ids=ids, attention_mask=wrong)


def test_embed_dataset_equals_forward_at_residues(model) -> None:
    sequences = {"a": "MKTAYIAKQRQISFVKSHFSRQ", "b": "MLVK"}
    result = model.embed_dataset(sequences, pooling=(), per_residue=True)
    ids = torch.tensor([[CLS, *[model.vocabulary.index(c) for c in sequences["b"]], EOS]])
    with torch.no_grad():
        hidden = model.esm(input_ids=ids).last_hidden_state[0, 1:-1]
    record = next(r for r in result.records if r.id == "b")
    torch.testing.assert_close(record.residues, hidden, rtol=0, atol=1e-5)


def test_no_contact_head(model) -> None:
    with pytest.raises(NotImplementedError, match="no trained contact head"):
        model.predict_contacts(_batch())


def test_classes_subclass_esm2_by_import() -> None:
    assert issubclass(DPLMForMaskedLM, ESM2ForMaskedLM)
    assert DPLMForSequenceClassification.encoder_class is DPLMModel
    config = DPLMConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_labels=3)
    assert isinstance(DPLMForSequenceClassification(config).esm, DPLMModel)


# --------------------------------------------------------------------------- conversion


def test_conversion_materialises_the_tied_decoder(official) -> None:
    converted = from_byprot(official, DIMS[2])
    torch.testing.assert_close(converted["lm_head.decoder.weight"], official["esm.embeddings.word_embeddings.weight"])
    assert not any("position_embeddings" in key for key in converted)


def test_conversion_refuses_unknown_missing_and_untied(official) -> None:
    with pytest.raises(ConversionError, match="position_embeddings"):
        from_byprot({k: v for k, v in official.items() if "position_embeddings" not in k}, DIMS[2])
    with pytest.raises(ConversionError, match="unknown|unexpected"):
        from_byprot({**official, "esm.extra.weight": torch.zeros(1)}, DIMS[2])
    with pytest.raises(ConversionError):
        from_byprot({k: v for k, v in official.items() if "layer.1.output.dense.weight" not in k}, DIMS[2])
    untied = {**official, "lm_head.decoder.weight": torch.zeros_like(official["esm.embeddings.word_embeddings.weight"])}
    with pytest.raises(ConversionError, match="differs"):
        from_byprot(untied, DIMS[2])
    tied = {**official, "lm_head.decoder.weight": official["esm.embeddings.word_embeddings.weight"].clone()}
    from_byprot(tied, DIMS[2])


# --------------------------------------------------------------------------- generation


def test_generate_keeps_fixed_positions_and_leaves_no_mask(model) -> None:
    input_ids, partial = model.generate_inputs([14, 9], template="MK__W")
    assert input_ids[1, 10] == EOS and (input_ids[1, 11:] == PAD).all()
    for strategy, temperature in (("gumbel_argmax", None), ("argmax", None), ("vanilla", 1.0), ("vanilla", None)):
        torch.manual_seed(0)
        out = model.generate(
            input_ids, max_iter=4, sampling_strategy=strategy, temperature=temperature, partial_masks=partial
        )
        assert torch.equal(out[partial], input_ids[partial])
        assert torch.equal(out[input_ids == PAD], input_ids[input_ids == PAD])
        assert (out[:, 0] == CLS).all() and out[0, 15] == EOS
        mutable = input_ids == MASK
        for banned in (MASK, X, PAD, CLS, EOS):
            assert not (out[mutable] == banned).any(), (strategy, banned)


def test_generate_is_seeded(model) -> None:
    input_ids, partial = model.generate_inputs([12, 12])
    torch.manual_seed(5)
    first = model.generate(input_ids, max_iter=3, partial_masks=partial)
    again = model.generate(input_ids, max_iter=3, partial_masks=partial, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, again)
    other = model.generate(input_ids, max_iter=3, partial_masks=partial, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(first, other)


def test_generate_refuses_bad_arguments(model) -> None:
    input_ids, partial = model.generate_inputs([10])
    with pytest.raises(ValueError, match="max_iter"):
        model.generate(input_ids, max_iter=0)
    with pytest.raises(ValueError, match="sampling_strategy"):
        model.generate(input_ids, max_iter=2, sampling_strategy="gumbel")
    with pytest.raises(ValueError, match="temperature is only used"):
        model.generate(input_ids, max_iter=2, temperature=0.7)
    with pytest.raises(ValueError, match="shape"):
        model.generate(input_ids, max_iter=2, partial_masks=partial[:, :-1])
    with pytest.raises(ValueError, match="bool"):
        model.generate(input_ids, max_iter=2, partial_masks=partial.long())
    with pytest.raises(ValueError, match="keeps a mask token"):
        model.generate(input_ids, max_iter=2, partial_masks=torch.ones_like(partial))
    with pytest.raises(TypeError):
        model.generate(input_ids, max_iter=2, steps=3)
    with pytest.raises(ValueError, match="longer than the requested length 3"):
        model.generate_inputs([3], template="MKTA")
    with pytest.raises(ValueError, match="position 2"):
        model.generate_inputs([8], template="MK?")
    with pytest.raises(ValueError, match="length"):
        model.generate_inputs([0])
    with pytest.raises(ValueError, match="input_ids must lie"):
        model.generate(torch.full((1, 4), 40), max_iter=2)


def test_remask_cutoff_uses_the_official_float32_rounding() -> None:
    # T = 50 steps, step 8 (1-based), 75 mutable positions: trunc(fp32(75) * 0.84) is 62, not 63.
    mutable = torch.ones(1, 75, dtype=torch.bool)
    assert int(remask_cutoff(mutable, 1 - 8 / 50)) == 62


def test_lowest_scores_is_strict_and_ignores_fixed_positions() -> None:
    scores = torch.tensor([[-1.0, -2.0, -2.0, -0.5, 5.0]])
    mutable = torch.tensor([[True, True, True, True, False]])
    # cutoff 2: the threshold is the third-lowest score (-1.0); the two tied -2.0 are below it.
    assert lowest_scores(scores, mutable, torch.tensor([[2]])).tolist() == [[False, True, True, False, False]]
    # cutoff 1: the threshold is -2.0 itself; nothing is strictly below it, so ties re-mask fewer.
    assert not lowest_scores(scores, mutable, torch.tensor([[1]])).any()


def test_top_p_keeps_the_token_crossing_the_threshold() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = top_p_filter(logits, 0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert top_p_filter(torch.tensor([[0.0, 10.0]]), 0.95).isfinite().tolist() == [[False, True]]


def test_structure_tokens_are_refused_by_the_sequence_only_model(model) -> None:
    ids = torch.tensor([[CLS, 5, 6, EOS]])
    ids[0, 1] = 40  # a DPLM2 structure-code id: DPLM has 33 tokens
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 33\)"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 33\)"):
        model.generate(ids, max_iter=2)
