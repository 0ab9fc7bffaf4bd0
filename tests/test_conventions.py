"""Conventions every family keeps, for every model class of every family (issue 11).

- `hidden_states`: L + 1 entries (the input to each layer, then the final normalized output), so
  `hidden_states[-1]` equals `last_hidden_state`;
- forward keywords: one the model does not use is a TypeError naming it; the neutral ones Trainer and PEFT
  pass are accepted; `return_dict=False` returns `ModelOutput.to_tuple()`; non-integer `input_ids` and a
  non-None `inputs_embeds` are clear errors;
- weights loaded by `from_pretrained` are never re-initialized;
- task losses, and the `embed_dataset` resume fingerprint (hashed only for an output, once per weights).

Tiny random configs: nothing here depends on trained weights.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import fastplms.plm_base as plm_base
from fastplms.configuration_dplm import DPLMConfig
from fastplms.configuration_esm2 import ESM2Config
from fastplms.configuration_esmc import ESMCConfig
from fastplms.heads import classification_loss
from fastplms.modeling_dplm import (
    DPLMForMaskedLM,
    DPLMForSequenceClassification,
    DPLMForTokenClassification,
    DPLMModel,
)
from fastplms.modeling_esm2 import (
    ESM2ForMaskedLM,
    ESM2ForSequenceClassification,
    ESM2ForTokenClassification,
    ESM2Model,
)
from fastplms.modeling_esmc import (
    ESMCForMaskedLM,
    ESMCForSequenceClassification,
    ESMCForTokenClassification,
    ESMCModel,
)

LAYERS, HIDDEN, HEADS = 2, 32, 4
FAMILIES = {"ESM2": ESM2Config, "ESMC": ESMCConfig, "DPLM": DPLMConfig}
CLASSES = {
    "ESM2": (ESM2Model, ESM2ForMaskedLM, ESM2ForSequenceClassification, ESM2ForTokenClassification),
    "ESMC": (ESMCModel, ESMCForMaskedLM, ESMCForSequenceClassification, ESMCForTokenClassification),
    "DPLM": (DPLMModel, DPLMForMaskedLM, DPLMForSequenceClassification, DPLMForTokenClassification),
}
ALL = [(family, cls) for family, classes in CLASSES.items() for cls in classes]
# DPLM's official padded positions are outputs (padded queries attend the valid keys): not zeros.
PADDING_IS_OUTPUT = {"DPLM"}
IDS = [cls.__name__ for _, cls in ALL]
NUM_LABELS = 3


def make(family: str, cls: type, **config):
    torch.manual_seed(0)
    config.setdefault("num_labels", NUM_LABELS)
    cfg = FAMILIES[family](num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, **config)
    model = cls(cfg).eval()
    # Eager, so that output_attentions runs the configured backend (no warning).
    model.set_attn_implementation("eager")
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, <cls> ... <eos>, the second padded (the ESM vocabularies share <cls>=0, <pad>=1, <eos>=2)."""
    ids = torch.randint(4, 24, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    ids[:, 0] = 0
    ids[0, -1], ids[1, 7] = 2, 2
    ids[mask == 0] = 1
    return ids, mask


def labels_for(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return torch.tensor([0, 2])
    if name.endswith("ForMaskedLM") or name.endswith("ForTokenClassification"):
        high = model.config.vocab_size if name.endswith("ForMaskedLM") else NUM_LABELS
        labels = torch.randint(0, high, ids.shape, generator=torch.Generator().manual_seed(2))
        return labels.masked_fill(mask == 0, -100)
    return None


def last_hidden_state(model, ids, mask) -> torch.Tensor:
    return model.base_model(ids, mask).last_hidden_state


# ------------------------------------------------------------------ hidden states


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_hidden_states_are_layer_inputs_then_the_final_normalized_output(family, cls):
    model = make(family, cls)
    ids, mask = batch()
    with torch.no_grad():
        out = model(ids, mask, output_hidden_states=True, output_attentions=True)
        final = last_hidden_state(model, ids, mask)
        embeddings = model.base_model.embed_tokens(ids)
    assert len(out.hidden_states) == LAYERS + 1
    assert len(out.attentions) == LAYERS
    assert torch.equal(out.hidden_states[-1], final)
    # The first entry is the input to layer 0: the embeddings (ESM2 scales them for token dropout).
    valid = mask.bool()
    scale = out.hidden_states[0][valid].norm() / embeddings[valid].norm()
    assert torch.allclose(out.hidden_states[0][valid], embeddings[valid] * scale)
    for state in out.hidden_states:
        assert state.shape == (*ids.shape, HIDDEN)
        assert family in PADDING_IS_OUTPUT or state[~valid].abs().max() == 0


# ------------------------------------------------------------------ forward keywords


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
@pytest.mark.parametrize("keyword", ["attention_masks", "position_ids", "token_type_ids", "warn_eager"])
def test_a_keyword_the_model_does_not_use_is_a_type_error(family, cls, keyword):
    model = make(family, cls)
    ids, mask = batch()
    with pytest.raises(TypeError, match=f"{cls.__name__}.forward.. got an unexpected keyword argument '{keyword}'"):
        model(ids, **{keyword: mask})


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_neutral_keywords_from_trainer_and_peft_are_accepted(family, cls):
    model = make(family, cls)
    ids, mask = batch()
    labels = labels_for(model, ids, mask)
    with torch.no_grad():
        plain = model(ids, mask, labels=labels)
        neutral = model(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            inputs_embeds=None,
            return_dict=True,
            output_hidden_states=False,
            output_attentions=False,
            num_items_in_batch=7,
        )
    assert plain.keys() == neutral.keys()
    assert all(torch.equal(plain[k], neutral[k]) for k in plain.keys())
    assert model.accepts_loss_kwargs is False  # Trainer then averages over gradient accumulation itself
    parameters = inspect.signature(model.forward).parameters
    assert {"input_ids", "attention_mask", "labels"} <= set(parameters)
    if family == "ESMC":
        assert "sequence_id" in parameters  # named, so Trainer keeps a sequence_id column


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_return_dict_false_returns_the_tuple_of_the_output(family, cls):
    model = make(family, cls)
    ids, mask = batch()
    labels = labels_for(model, ids, mask)
    with torch.no_grad():
        full = model(ids, mask, labels=labels, output_hidden_states=True, output_attentions=True)
        as_tuple = model(ids, mask, labels=labels, output_hidden_states=True, output_attentions=True, return_dict=False)
        model.config.return_dict = False
        from_config = model(ids, mask, labels=labels)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(full.to_tuple())
    for ours, theirs in zip(as_tuple, full.to_tuple(), strict=True):
        if isinstance(theirs, tuple):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        else:
            assert torch.equal(ours, theirs)
    # None fields are dropped, as Transformers does: no hidden states or attentions were asked for here.
    assert isinstance(from_config, tuple) and len(from_config) == (1 if labels is None else 2)


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_config_output_flags_are_the_defaults(family, cls):
    model = make(family, cls, output_hidden_states=True)
    ids, mask = batch()
    with torch.no_grad():
        assert len(model(ids, mask).hidden_states) == LAYERS + 1
        assert model(ids, mask, output_hidden_states=False).hidden_states is None


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_bad_input_ids_and_inputs_embeds_are_clear_errors(family, cls):
    model = make(family, cls)
    ids, mask = batch()
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(ValueError, match=f"input_ids must be integer token ids; received dtype {dtype}"):
            model(ids.to(dtype), mask)
    with pytest.raises(ValueError, match=r"input_ids must be a tensor of shape \(batch, seq\); received list"):
        model(ids.tolist(), mask)
    with pytest.raises(ValueError, match=r"input_ids must be a tensor of shape \(batch, seq\); received \(12,\)"):
        model(ids[0], mask[0])
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, \d+\)"):
        model(ids + 100, mask)
    with pytest.raises(ValueError, match="takes input_ids only; inputs_embeds is not supported"):
        model(ids, mask, inputs_embeds=torch.zeros(*ids.shape, HIDDEN))


def test_length_limit_where_the_family_has_one():
    ids = torch.full((1, 1027), 5)
    with pytest.raises(ValueError, match="1027 tokens; ESM2 supports at most 1026"):
        make("ESM2", ESM2Model)(ids)
    with torch.no_grad():  # ESMC's positions are rotary only: no limit of its own
        assert make("ESMC", ESMCModel)(ids).last_hidden_state.shape == (1, 1027, HIDDEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_on_a_base_model_are_an_error(family):
    model = make(family, CLASSES[family][0])
    ids, mask = batch()
    with pytest.raises(ValueError, match="has no task head to compute a loss"):
        model(ids, mask, labels=torch.zeros_like(ids))


# ------------------------------------------------------------------ weights survive from_pretrained


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_from_pretrained_keeps_every_loaded_tensor(family, cls, tmp_path):
    model = make(family, cls)
    with torch.no_grad():  # values that no initializer draws: ones, zeros and N(0, 0.02) would all show
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) + 3.0)
    model.save_pretrained(tmp_path)
    loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for key, tensor in state.items():
        assert torch.equal(tensor, loaded_state[key]), key
    ids, mask = batch()
    loaded.set_attn_implementation("eager")
    with torch.no_grad():
        assert torch.equal(model(ids, mask)[0], loaded.eval()(ids, mask)[0])


@pytest.mark.parametrize(("family", "cls"), ALL, ids=IDS)
def test_a_partial_checkpoint_initializes_only_what_is_missing(family, cls, tmp_path):
    """A module with one tensor missing is initialized; its loaded sibling must not be re-drawn (plain
    in-place init, as ESMC had, reset the loaded LayerNorm weight to ones here)."""
    from safetensors.torch import load_file, save_file

    model = make(family, cls)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) + 3.0)
    model.save_pretrained(tmp_path)
    prefix = "" if cls in (ESM2Model, ESMCModel, DPLMModel) else f"{cls.base_model_prefix}."
    missing = f"{prefix}layers.0.attn_norm.bias"
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state[missing]
    save_file(state, weights, metadata={"format": "pt"})
    loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {missing}
    loaded_state = loaded.state_dict()
    assert loaded_state[missing].abs().max() == 0
    for key, tensor in model.state_dict().items():
        assert key == missing or torch.equal(tensor, loaded_state[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_lm_checkpoint_loads_into_every_class(family, tmp_path):
    """Artifacts hold the masked-LM checkpoint: every class takes its encoder and ignores its LM head."""
    _, masked_lm, *others = CLASSES[family]
    source = make(family, masked_lm)
    source.save_pretrained(tmp_path)
    expected = source.base_model.state_dict()
    for cls in (CLASSES[family][0], *others):
        loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
        assert not info["unexpected_keys"] and not any(
            k.startswith(source.base_model_prefix) for k in info["missing_keys"]
        )
        assert all(torch.equal(v, loaded.base_model.state_dict()[k]) for k, v in expected.items())


@pytest.mark.parametrize(
    ("family", "keys"),
    [
        ("ESM2", {"lm_head.dense.weight", "lm_head.norm.weight", "lm_head.decoder.weight", "lm_head.bias"}),
        ("ESMC", {"lm_head.dense.weight", "lm_head.norm.weight", "lm_head.decoder.weight", "lm_head.decoder.bias"}),
    ],
)
def test_state_dict_keys_of_the_heads(family, keys):
    _, masked_lm, sequence, token = CLASSES[family]
    lm_keys = {k for k in make(family, masked_lm).state_dict() if k.startswith("lm_head.")}
    assert keys <= lm_keys and len(lm_keys) == len(keys) + 2  # plus dense.bias and norm.bias
    heads = {k for k in make(family, sequence).state_dict() if not k.startswith(sequence.base_model_prefix)}
    assert heads == {"dense.weight", "dense.bias", "out_proj.weight", "out_proj.bias"}
    heads = {k for k in make(family, token).state_dict() if not k.startswith(token.base_model_prefix)}
    assert heads == {"classifier.weight", "classifier.bias"}


# ------------------------------------------------------------------ losses


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("num_labels", "problem_type", "labels", "expected"),
    [
        (1, None, torch.tensor([0.5, -1.0]), lambda logits, y: F.mse_loss(logits.squeeze(-1), y)),
        (3, "regression", torch.tensor([[0.1, 0.2, 0.3], [1.0, 0.0, -1.0]]), F.mse_loss),
        (3, None, torch.tensor([2, 0]), F.cross_entropy),
        (3, None, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]), F.binary_cross_entropy_with_logits),
    ],
    ids=["regression", "multi-target-regression", "single-label", "multi-label"],
)
def test_sequence_classification_loss(family, num_labels, problem_type, labels, expected):
    model = make(family, CLASSES[family][2], num_labels=num_labels, problem_type=problem_type)
    ids, mask = batch()
    out = model(ids, mask, labels=labels)
    assert out.logits.shape == (2, num_labels)
    assert torch.allclose(out.loss, expected(out.logits, labels))
    assert torch.equal(out.loss, classification_loss(model.config, out.logits, labels))
    out.loss.backward()
    assert model.base_model.layers[0].qkv.weight.grad is not None
    with torch.no_grad():  # the head: dense, tanh, projection on the <cls> state (dropout is 0)
        cls_state = last_hidden_state(model, ids, mask)[:, 0]
        assert torch.allclose(out.logits, model.out_proj(torch.tanh(model.dense(cls_state))), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", [1, 3], ids=["masked-lm", "token-classification"])
def test_token_losses_ignore_minus_100(family, task):
    model = make(family, CLASSES[family][task])
    ids, mask = batch()
    labels = labels_for(model, ids, mask)
    labels[:, 0] = -100
    out = model(ids, mask, labels=labels)
    keep = labels != -100
    assert torch.allclose(out.loss, F.cross_entropy(out.logits[keep], labels[keep]))
    # heads run on valid tokens: padding stays zero
    assert family in PADDING_IS_OUTPUT or out.logits[~mask.bool()].abs().max() == 0
    with torch.no_grad():
        assert model(ids, mask).loss is None


# ------------------------------------------------------------------ resume fingerprint


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_is_hashed_only_for_an_output_and_once_per_weights(family, tmp_path, monkeypatch):
    model = make(family, CLASSES[family][0])
    hashed = []
    real = plm_base.weights_sha256

    def counting(*args):
        hashed.append(1)
        return real(*args)

    monkeypatch.setattr(plm_base, "weights_sha256", counting)
    sequences = {"a": "MKTAYIAKQ", "b": "ACDE"}
    in_memory = model.embed_dataset(sequences)
    assert not hashed and "model_sha256" not in in_memory.fingerprint
    first = model.embed_dataset(sequences, output=tmp_path / "one.db")
    second = model.embed_dataset(sequences, output=tmp_path / "two.db")
    assert len(hashed) == 1  # the second output reuses the hash of the same weights
    assert first.fingerprint == second.fingerprint and first.fingerprint["model_sha256"]
    with torch.no_grad():  # modified in place: same tensor objects, so only the version counter tells
        weight = model.layers[0].fc1.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    third = model.embed_dataset(sequences, output=tmp_path / "three.db")
    assert len(hashed) == 2 and third.fingerprint["model_sha256"] != first.fingerprint["model_sha256"]
    model.config.layer_norm_eps = 1e-6  # the config is part of the identity too
    assert model.model_fingerprint()["model_sha256"] != third.fingerprint["model_sha256"] and len(hashed) == 3
