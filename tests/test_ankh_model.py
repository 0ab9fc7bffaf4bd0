"""ANKH (T5 v1.1) against Transformers' T5 on the same seeded weights: every encoder state at every position,
decoder logits, losses, generation (greedy, sampling, beams) and the incremental cache; small dims, both
activations. Real dims: tests/test_ankh_artifact.py and `python -m tools.measure_parity ankh`."""

from __future__ import annotations

import copy

import pytest
import torch

from fastplms.convert.ankh import from_transformers
from fastplms.convert.common import ConversionError
from fastplms.families.ankh_parity import ankh_config, build_ankh
from fastplms.modeling_ankh import ANKHForSequenceClassification, ANKHModel, relative_buckets
from fastplms.oracles.t5 import T5Dims, t5_oracle, t5_state_dict

GELU = T5Dims(3, 2, 64, 4, 16, 96, 144, "gated-gelu")
SILU = T5Dims(2, 2, 96, 6, 32, 120, 256, "gated-silu")


@pytest.fixture(scope="module", params=[GELU, SILU], ids=["gated-gelu", "gated-silu"])
def pair(request):
    dims = request.param
    state = t5_state_dict(dims, seed=2, with_embed_copies=True)
    return dims, state, t5_oracle(dims, state), build_ankh(state, dims)


def _batch(vocab: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 25, (3, 140), generator=generator)  # past max_distance: the log buckets matter
    ids[0, 139], ids[1, 30], ids[2, 3] = 1, 1, 1
    ids[1, 31:], ids[2, 4:] = 0, 0
    decoder = torch.randint(3, 25, (3, 6), generator=generator)
    decoder[:, 0] = 0
    return ids, (ids != 0).long(), decoder


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_and_logits_match_transformers_everywhere(pair, backend) -> None:
    dims, _state, oracle, model = pair
    ids, mask, decoder = _batch(dims.vocab)
    model.set_attn_implementation(backend)
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_hidden_states=True)
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_hidden_states=True)
        encoder = model.encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.encoder_hidden_states) == dims.num_layers + 1
    for ours, ref_state in zip(out.encoder_hidden_states, ref.encoder_hidden_states, strict=True):
        torch.testing.assert_close(ours, ref_state, rtol=0, atol=5e-5)  # padding positions included
    torch.testing.assert_close(encoder.last_hidden_state, ref.encoder_last_hidden_state, rtol=0, atol=5e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=5e-5)
    for ours, ref_state in zip(out.decoder_hidden_states, ref.decoder_hidden_states, strict=True):
        torch.testing.assert_close(ours, ref_state, rtol=0, atol=5e-5)


def test_loss_with_labels_matches_transformers(pair) -> None:
    dims, _state, oracle, model = pair
    ids, mask, decoder = _batch(dims.vocab)
    labels = decoder.clone()
    labels[0, -2:] = -100
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, labels=labels)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{"do_sample": False}, {"do_sample": True, "top_k": 0}, {"num_beams": 3}],
    ids=["greedy", "sampling", "beams"],
)
def test_generate_matches_transformers_token_for_token(pair, kwargs) -> None:
    dims, _state, oracle, model = pair
    ids, mask, _ = _batch(dims.vocab)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.manual_seed(4)
        ref = oracle.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, **kwargs)
        torch.manual_seed(4)
        ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, **kwargs)
    assert torch.equal(ours, ref)


def test_incremental_cache_equals_the_full_decoder(pair) -> None:
    dims, _state, _oracle, model = pair
    ids, mask, decoder = _batch(dims.vocab)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, use_cache=False).logits
        first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder[:, :3], use_cache=True)
        rest = model(
            encoder_outputs=(first.encoder_last_hidden_state,),
            attention_mask=mask,
            decoder_input_ids=decoder[:, 3:],
            past_key_values=first.past_key_values,
            use_cache=True,
        )
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, rtol=0, atol=2e-5)


def test_relative_buckets_are_transformers_buckets() -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 301)[None, :] - torch.zeros(1, 1, dtype=torch.long)
    for bidirectional in (True, False):
        ref = T5Attention._relative_position_bucket(relative, bidirectional, 64, 128)
        assert torch.equal(relative_buckets(relative, bidirectional, 64, 128), ref)


def test_backends_are_eager_and_sdpa_per_instance(pair) -> None:
    dims, _state, _oracle, _model = pair
    config = ankh_config(dims)
    config.allowed_backends = ["eager", "sdpa"]
    model = ANKHModel(config)
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    model.set_attn_implementation("eager")
    for backend in ("flex_attention", "flash_attention_2"):
        with pytest.raises(ValueError, match="not supported by ANKH"):
            model.set_attn_implementation(backend)
    other = ANKHModel(copy.deepcopy(ankh_config(dims)))  # its own config, as from_pretrained gives
    assert other.attention_backend() == "sdpa" and model.attention_backend() == "eager"
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before


def test_sequence_head_mean_pools_residues(pair) -> None:
    dims, state, _oracle, model = pair
    config = ankh_config(dims)
    config.num_labels = 3
    head = ANKHForSequenceClassification(config).eval()
    head.encoder.load_state_dict(
        {k.removeprefix("encoder."): v for k, v in model.state_dict().items() if k.startswith("encoder.")}
    )
    ids, mask, _ = _batch(dims.vocab)
    with torch.no_grad():
        logits = head(input_ids=ids, attention_mask=mask).logits
        states = head.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        residues = (mask.bool() & (ids != 1)).float()[..., None]
        pooled = (states * residues).sum(1) / residues.sum(1)
        want = head.out_proj(torch.tanh(head.dense(pooled)))
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


def test_conversion_is_strict(pair) -> None:
    _dims, state, _oracle, _model = pair
    with pytest.raises(ConversionError, match="differs from shared.weight"):
        from_transformers({**state, "decoder.embed_tokens.weight": torch.zeros_like(state["shared.weight"])})
    with pytest.raises(ConversionError, match="unknown keys"):
        from_transformers({**state, "encoder.block.0.layer.0.SelfAttention.extra.weight": torch.zeros(1)})
    with pytest.raises(ConversionError, match="missing keys"):
        from_transformers({k: v for k, v in state.items() if k != "lm_head.weight"})


def test_inputs_are_checked(pair) -> None:
    dims, _state, _oracle, model = pair
    ids, mask, decoder = _batch(dims.vocab)
    with pytest.raises(ValueError, match="input_ids must lie"):
        model.encoder(input_ids=ids + 1000, attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask"):
        model.encoder(input_ids=ids, attention_mask=mask[:, :-1])
    with pytest.raises(TypeError, match="unexpected keyword"):
        model.encoder(input_ids=ids, attention_masks=mask)
    with pytest.raises(ValueError, match="decoder_input_ids or labels"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_embedding_path_skips_padding_and_equals_the_encoder(pair, backend) -> None:
    dims, _state, _oracle, model = pair
    ids, mask, _ = _batch(dims.vocab)
    model.set_attn_implementation(backend)
    with torch.no_grad():
        full = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = model.embedding_forward(ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(packed[valid], full[valid], rtol=0, atol=1e-5)
    assert packed[~valid].abs().max() == 0
