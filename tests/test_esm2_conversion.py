"""ESM2 state transforms: both official layouts give one canonical state dict, and every irregular state dict
(missing, unknown or colliding keys, a foreign rotary buffer, wrong dims) is refused with the keys named.
"""

from __future__ import annotations

import re

import pytest
import torch

from fastplms.configuration_esm2 import ESM2Config
from fastplms.convert.common import DROP, ConversionError, load_weights, rename_strict, rule_renamer
from fastplms.convert.esm2 import from_fair_esm, from_transformers
from fastplms.modeling_esm2 import ESM2ForMaskedLM
from fastplms.oracles.esm2 import (
    fair_esm2_state_dict,
    hf_esm2_state_dict,
    rotary_inv_freq,
    write_fair_esm_pt,
    write_hf_snapshot,
)

DIMS = (2, 64, 4)  # layers, hidden, heads
LAYERS, HIDDEN, HEADS = DIMS
SEED = 7


@pytest.fixture(scope="module")
def hf() -> dict[str, torch.Tensor]:
    return hf_esm2_state_dict(*DIMS, seed=SEED)


@pytest.fixture(scope="module")
def fair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fair-esm module keys, split like the release files: body and `-contact-regression.pt` tensors."""
    state = fair_esm2_state_dict(*DIMS, seed=SEED)
    contact = {k: state.pop(k) for k in list(state) if k.startswith("contact_head.")}
    return state, contact


@pytest.fixture(scope="module")
def canonical(hf) -> dict[str, torch.Tensor]:
    return from_transformers(hf, HEADS)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------ one canonical form


def test_canonical_state_fits_the_model_exactly(canonical, hf):
    model = ESM2ForMaskedLM(ESM2Config(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS))
    expected = model.state_dict()
    assert set(canonical) == set(expected)
    assert all(canonical[k].shape == expected[k].shape for k in expected)
    assert list(canonical) == sorted(canonical)
    assert all(v.is_contiguous() for v in canonical.values())
    model.load_state_dict(canonical, strict=True)
    # q, k, v are fused in that order.
    prefix = "esm.encoder.layer.1.attention.self."
    for kind in ("weight", "bias"):
        parts = [hf[f"{prefix}{p}.{kind}"] for p in ("query", "key", "value")]
        assert torch.equal(canonical[f"esm.layers.1.qkv.{kind}"], torch.cat(parts))
    assert torch.equal(canonical["lm_head.decoder.weight"], hf["lm_head.decoder.weight"])
    assert torch.equal(canonical["esm.contact_head.weight"], hf["esm.contact_head.regression.weight"])


def test_both_official_layouts_give_identical_canonical_states(canonical, fair):
    body, contact = fair
    assert_same_state(from_fair_esm(body, HEADS, contact=contact), canonical)
    # The module's own state_dict() holds the contact head already; that works without a separate file.
    assert_same_state(from_fair_esm({**body, **contact}, HEADS), canonical)


def test_release_files_of_both_layouts_give_identical_canonical_states(tmp_path, canonical):
    hf_dir = write_hf_snapshot(tmp_path / "hf", *DIMS, seed=SEED)
    assert_same_state(from_transformers(load_weights(hf_dir / "model.safetensors"), HEADS), canonical)
    pt = write_fair_esm_pt(tmp_path / "fair", *DIMS, seed=SEED)
    body = load_weights(pt)  # fairseq names: encoder.sentence_encoder.* and encoder.lm_head.*
    assert any(k.startswith("encoder.sentence_encoder.layers.") for k in body)
    contact = load_weights(pt.with_name(f"{pt.stem}-contact-regression.pt"))
    assert_same_state(from_fair_esm(body, HEADS, contact=contact), canonical)


def test_layer_norm_gamma_beta_naming_gives_the_same_state(hf, canonical):
    norm = r"(LayerNorm|layer_norm|emb_layer_norm_after)"

    def gamma_beta(key: str) -> str:
        return re.sub(norm + r"\.weight$", r"\1.gamma", re.sub(norm + r"\.bias$", r"\1.beta", key))

    renamed = {gamma_beta(k): v for k, v in hf.items()}
    assert sum(k.endswith(".gamma") for k in renamed) == 2 * LAYERS + 2
    assert_same_state(from_transformers(renamed, HEADS), canonical)


def test_transformers_save_layout_without_per_layer_inv_freq(hf, canonical):
    # What Transformers' own save_pretrained may write: one shared rotary buffer, or none at all.
    stripped = {k: v for k, v in hf.items() if not k.endswith("inv_freq")}
    assert_same_state(from_transformers(stripped, HEADS), canonical)
    shared = {**stripped, "esm.rotary_embeddings.inv_freq": rotary_inv_freq(HIDDEN // HEADS)}
    assert_same_state(from_transformers(shared, HEADS), canonical)


def test_conversion_does_not_modify_its_input(hf):
    before = {k: v.clone() for k, v in hf.items()}
    from_transformers(hf, HEADS)
    assert_same_state(dict(hf), before)


# ------------------------------------------------------------------ rotary buffer and dims


def test_wrong_inv_freq_is_refused(hf, fair):
    key = "esm.encoder.layer.1.attention.self.rotary_embeddings.inv_freq"
    head_dim = HIDDEN // HEADS
    foreign = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    with pytest.raises(ConversionError, match=re.escape(key) + ".*not the ESM2 rotary inv_freq for head_dim 16"):
        from_transformers({**hf, key: foreign}, HEADS)
    body, contact = fair
    fair_key = "layers.0.self_attn.rot_emb.inv_freq"
    with pytest.raises(ConversionError, match=re.escape(fair_key)):
        from_fair_esm({**body, fair_key: rotary_inv_freq(head_dim) * 1.001}, HEADS, contact=contact)


def test_wrong_head_count_is_refused(hf, fair):
    # inv_freq has the wrong length for head_dim 8: a ConversionError, not a shape error from torch.
    with pytest.raises(ConversionError, match="head_dim 8"):
        from_transformers(hf, 8)
    body, contact = fair
    stripped = {k: v for k, v in body.items() if not k.endswith("inv_freq")}
    with pytest.raises(ConversionError, match=r"contact regression has shape \(1, 8\); expected \(1, 16\)"):
        from_fair_esm(stripped, 8, contact=contact)


# ------------------------------------------------------------------ missing, unknown and colliding keys

HF_EMBED = "esm.embeddings.word_embeddings.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("esm.encoder.layer.1.attention.self.key.bias"), r"missing keys: esm\.layers\.1\.k\.bias"),
        (lambda s: s.pop(HF_EMBED), r"missing keys: esm\.embed_tokens\.weight"),
        (lambda s: s.pop("lm_head.decoder.weight"), r"missing keys: lm_head\.decoder\.weight"),
        (lambda s: s.update({"esm.encoder.layer.0.attention.self.bogus.weight": s[HF_EMBED]}), "unknown keys: esm"),
        (lambda s: s.update({"classifier.weight": s[HF_EMBED]}), r"unknown keys: classifier\.weight"),
        (
            lambda s: s.update({"esm.encoder.layer.0.LayerNorm.gamma": s["esm.encoder.layer.0.LayerNorm.weight"]}),
            r"colliding keys: esm\.encoder\.layer\.0\.LayerNorm\.weight and esm\.encoder\.layer\.0\.LayerNorm\.gamma"
            r" -> esm\.layers\.0\.mlp_norm\.weight",
        ),
    ],
    ids=["missing-layer-key", "missing-embedding", "missing-decoder", "unknown-in-layer", "unknown-head", "collision"],
)
def test_from_transformers_refuses_irregular_state(edit, message, hf):
    state = dict(hf)
    edit(state)
    with pytest.raises(ConversionError, match=r"^Transformers ESM2 state dict: .*" + message):
        from_transformers(state, HEADS)


def test_from_transformers_lists_every_problem_at_once(hf):
    state = dict(hf)
    state.pop("esm.encoder.layer.0.output.dense.bias")
    state["esm.unexpected"] = state[HF_EMBED]
    state["esm.encoder.emb_layer_norm_after.gamma"] = state["esm.encoder.emb_layer_norm_after.weight"]
    with pytest.raises(ConversionError) as info:
        from_transformers(state, HEADS)
    text = str(info.value)
    assert "unknown keys: esm.unexpected" in text
    assert "colliding keys: esm.encoder.emb_layer_norm_after.weight and esm.encoder.emb_layer_norm_after.gamma" in text
    assert "missing keys: esm.layers.0.fc2.bias" in text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("layers.0.fc1.weight"), r"missing keys: esm\.layers\.0\.fc1\.weight"),
        (lambda s: s.pop("embed_tokens.weight"), r"missing keys: esm\.embed_tokens\.weight"),
        (lambda s: s.pop("lm_head.weight"), r"missing keys: lm_head\.decoder\.weight"),
        (lambda s: s.update({"layers.0.self_attn.bias_k": s["lm_head.bias"]}), r"unknown keys: layers\.0\.self_attn"),
        (lambda s: s.update({"encoder.version": s["lm_head.bias"]}), r"unknown keys: encoder\.version"),
        (
            lambda s: s.update({"encoder.sentence_encoder.layers.0.fc2.bias": s["layers.0.fc2.bias"]}),
            r"colliding keys: .*layers\.0\.fc2\.bias -> esm\.layers\.0\.fc2\.bias",
        ),
    ],
    ids=["missing-layer-key", "missing-embedding", "missing-decoder", "unknown-in-layer", "unknown", "collision"],
)
def test_from_fair_esm_refuses_irregular_state(edit, message, fair):
    body, contact = fair
    state = dict(body)
    edit(state)
    with pytest.raises(ConversionError, match=r"^fair-esm ESM2 state dict: .*" + message):
        from_fair_esm(state, HEADS, contact=contact)


def test_from_fair_esm_without_contact_regression_names_it(fair):
    body, _ = fair
    with pytest.raises(ConversionError, match=r"missing keys: esm\.contact_head\.bias, esm\.contact_head\.weight"):
        from_fair_esm(body, HEADS)


# ------------------------------------------------------------------ rename_strict itself

RULES = rule_renamer([(r"a\.(\d+)", r"x.\1"), (r"b", r"y"), (r"b_alias", r"y"), (r"buffer", DROP)])
T = torch.zeros(1)


def test_rename_strict_renames_and_drops():
    out = rename_strict({"a.1": T, "b": T, "buffer": T}, RULES, {"x.1", "y"}, source="toy")
    assert set(out) == {"x.1", "y"}


def test_rename_strict_is_a_value_error_listing_each_kind_of_problem():
    state = {"a.1": T, "b": T, "b_alias": T, "buffer": T, "stray": T, "a.9": T}
    with pytest.raises(ValueError) as info:
        rename_strict(state, RULES, {"x.1", "x.2", "y"}, source="toy")
    assert isinstance(info.value, ConversionError)
    assert str(info.value) == (
        "toy state dict: unknown keys: stray; colliding keys: b and b_alias -> y; "
        "missing keys: x.2; keys with no place in the model: x.9"
    )


def test_rename_strict_shortens_long_listings():
    state = {f"a.{i}": T for i in range(20)}
    with pytest.raises(ConversionError, match=r"keys with no place in the model: x\.0, .*, \.\.\. \(20 in all\)$"):
        rename_strict(state, RULES, set(), source="toy")
    with pytest.raises(ConversionError, match=r"missing keys: y$"):
        rename_strict({}, RULES, {"y"}, source="toy")


def test_rule_renamer_needs_a_full_match():
    assert RULES("a.12") == "x.12"
    assert RULES("a.12.weight") is None
    assert RULES("xb") is None
    assert RULES("buffer") is DROP


def test_load_weights_refuses_non_tensor_content(tmp_path):
    path = tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.zeros(1), "step": 3}}, path)
    with pytest.raises(ConversionError, match="not a state dict of tensors"):
        load_weights(path)
