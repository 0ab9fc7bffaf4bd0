import argparse
import math

import esm
import esm.pretrained
import pytest
import torch
from esm.model.esm2 import ESM2
from safetensors import safe_open
from transformers import AutoTokenizer, EsmForMaskedLM

from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.oracles.esm2 import (
    ESM2_VOCAB,
    esm2_rule,
    fair_esm2_key,
    fair_esm2_state_dict,
    hf_esm2_spec,
    hf_esm2_state_dict,
    load_fair_esm_local,
    write_fair_esm_pt,
    write_hf_snapshot,
)
from fastplms.parity.metrics import parity_report

DIMS = (2, 64, 4)  # layers, hidden, heads: tiny but with a real multi-head rotary path
SEED = 11
SEQUENCES = [
    ("a", "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"),
    ("b", "GSHML<mask>DKWC"),  # a mask token exercises the token-dropout rescaling in both models
    ("c", "ACDEFGHIKLMNPQRSTVWYXBUZO"),
]


def _model_key(file_key: str) -> str:
    # Transformers 5.13 keeps one shared rotary buffer; the per-layer file keys all map onto it.
    if file_key.endswith(".attention.self.rotary_embeddings.inv_freq"):
        return "esm.rotary_embeddings.inv_freq"
    return file_key


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_snapshot(tmp_path_factory.mktemp("hf"), *DIMS, seed=SEED)


@pytest.fixture(scope="module")
def fair_pt(tmp_path_factory):
    return write_fair_esm_pt(tmp_path_factory.mktemp("fair"), *DIMS, seed=SEED)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hf_snapshot_loads_without_missing_or_unexpected_keys(tmp_path, fmt):
    directory = write_hf_snapshot(tmp_path, *DIMS, seed=SEED, format=fmt)
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    expected_files = {"config.json", weights, "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"}
    assert {p.name for p in directory.iterdir()} == expected_files

    model, info = EsmForMaskedLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]

    written = hf_esm2_state_dict(*DIMS, seed=SEED)
    loaded = model.state_dict()
    for key, value in written.items():
        assert torch.equal(loaded[_model_key(key)], value), key
    decoder = model.lm_head.decoder.weight
    embeddings = model.esm.embeddings.word_embeddings.weight
    assert torch.equal(decoder, written["lm_head.decoder.weight"])
    # Loaded as its own tensor, not re-tied to the embedding Parameter.
    assert decoder.data_ptr() != embeddings.data_ptr()
    assert model.config.tie_word_embeddings is False


def test_untied_decoder_survives_loading(tmp_path):
    directory = write_hf_snapshot(tmp_path, *DIMS, seed=SEED, tie_decoder=False)
    written = hf_esm2_state_dict(*DIMS, seed=SEED, tie_decoder=False)
    embeddings = written["esm.embeddings.word_embeddings.weight"]
    assert not torch.equal(written["lm_head.decoder.weight"], embeddings)
    model, info = EsmForMaskedLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.decoder.weight, written["lm_head.decoder.weight"])
    assert not torch.equal(model.lm_head.decoder.weight, model.esm.embeddings.word_embeddings.weight)


def test_snapshot_file_uses_official_key_names(hf_dir):
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert handle.metadata() == {"format": "pt"}
        dtypes = {handle.get_tensor(k).dtype for k in keys}
    assert keys == set(hf_esm2_spec(*DIMS))
    assert dtypes == {torch.float32}
    assert "esm.encoder.layer.1.attention.self.rotary_embeddings.inv_freq" in keys
    assert "esm.encoder.layer.0.attention.LayerNorm.weight" in keys
    assert not any(k.endswith((".gamma", ".beta")) for k in keys)


def test_config_matches_esm2_hub_values(hf_dir):
    config = EsmForMaskedLM.config_class.from_pretrained(hf_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == DIMS
    assert config.intermediate_size == 4 * DIMS[1]
    assert (config.vocab_size, config.pad_token_id, config.mask_token_id) == (33, 1, 32)
    assert config.token_dropout is True and config.emb_layer_norm_before is False
    assert config.position_embedding_type == "rotary"
    assert config.max_position_embeddings == 1026 and config.layer_norm_eps == 1e-5


def test_tokenizer_matches_fair_esm_alphabet(hf_dir):
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    assert tuple(alphabet.all_toks) == ESM2_VOCAB
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    _, _, fair_tokens = alphabet.get_batch_converter()(SEQUENCES)
    encoded = tokenizer([s for _, s in SEQUENCES], padding=True, return_tensors="pt")
    assert torch.equal(encoded.input_ids, fair_tokens)


def test_fair_esm_checkpoint_loads_through_official_loader(fair_pt):
    assert fair_pt.name.startswith("esm2")
    assert fair_pt.with_name(f"{fair_pt.stem}-contact-regression.pt").exists()
    with torch.serialization.safe_globals([argparse.Namespace]):
        model, alphabet = esm.pretrained.load_model_and_alphabet_local(str(fair_pt))
    assert isinstance(model, ESM2) and len(alphabet) == 33
    expected = fair_esm2_state_dict(*DIMS, seed=SEED)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key

    raw = torch.load(fair_pt, weights_only=False)
    assert "encoder.sentence_encoder.layers.0.self_attn.rot_emb.inv_freq" in raw["model"]
    assert "encoder.lm_head.weight" in raw["model"]
    assert not any("contact_head" in k for k in raw["model"])  # lives in the regression file


def test_fair_esm_and_transformers_agree(hf_dir, fair_pt):
    fair_model, alphabet = load_fair_esm_local(fair_pt)
    fair_model.eval()
    _, _, tokens = alphabet.get_batch_converter()(SEQUENCES)
    mask = tokens.ne(alphabet.padding_idx)
    with torch.no_grad():
        ref = fair_model(tokens, repr_layers=[DIMS[0]], return_contacts=True)
        for impl in ("eager", "sdpa"):
            hf_model = EsmForMaskedLM.from_pretrained(hf_dir, attn_implementation=impl).eval()
            out = hf_model(input_ids=tokens, attention_mask=mask.long(), output_hidden_states=True)
            report = parity_report(out.logits, ref["logits"], mask, logits=True)
            assert report["max_abs"] <= 1e-5, (impl, report)
            assert report["relative_l2"] <= 1e-5, (impl, report)
            hidden = parity_report(out.hidden_states[-1], ref["representations"][DIMS[0]], mask)
            assert hidden["max_abs"] <= 1e-5, (impl, hidden)
    # Contacts need attention probabilities, which only the eager path returns.
    hf_eager = EsmForMaskedLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        contacts = hf_eager.predict_contacts(tokens, mask.long())
    assert torch.allclose(contacts, ref["contacts"], atol=1e-6, rtol=0)


def test_seeded_weights_are_not_degenerate(hf_dir):
    # std=0.02 weights would give near-uniform attention and flat logits, hiding rotary/masking bugs.
    model = EsmForMaskedLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    tokens = esm.data.Alphabet.from_architecture("ESM-1b").get_batch_converter()(SEQUENCES[:1])[2]
    with torch.no_grad():
        out = model(input_ids=tokens, output_attentions=True)
    length = tokens.shape[1]
    peak = torch.stack(out.attentions).amax(dim=-1).mean()
    assert peak > 3.0 / length
    assert out.logits.std(dim=-1).mean() > 0.5


def test_fair_key_mapping_covers_esm2_module():
    module_keys = set(ESM2(num_layers=DIMS[0], embed_dim=DIMS[1], attention_heads=DIMS[2]).state_dict())
    mapped = [fair_esm2_key(k) for k in hf_esm2_spec(*DIMS)]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == module_keys
    with pytest.raises(KeyError):
        fair_esm2_key("esm.encoder.layer.0.attention.self.unknown.weight")


@pytest.mark.parametrize(
    "checkpoint", load_manifest(MANIFEST_DIR / "esm2.toml", resolve=False).checkpoints, ids=lambda c: c.id
)
def test_release_dims_build_specs(checkpoint):
    layers, hidden, heads = checkpoint.dims
    spec = hf_esm2_spec(layers, hidden, heads)
    # embeddings + 17 tensors per layer + final norm (2) + contact head (2) + LM head (6)
    assert len(spec) == 1 + 17 * layers + 2 + 2 + 6
    assert spec["esm.encoder.layer.0.attention.self.rotary_embeddings.inv_freq"] == (hidden // heads // 2,)
    assert spec["esm.contact_head.regression.weight"] == (1, layers * heads)


def test_esm2_rule():
    assert esm2_rule("esm.encoder.emb_layer_norm_after.weight", (64,)) == ("ones_jitter", 0.1)
    assert esm2_rule("esm.encoder.layer.3.attention.LayerNorm.bias", (64,)) == ("zeros_jitter", 0.02)
    assert esm2_rule("lm_head.layer_norm.weight", (64,)) == ("ones_jitter", 0.1)
    assert esm2_rule("lm_head.bias", (33,)) == ("zeros_jitter", 0.02)
    kind, std = esm2_rule("esm.encoder.layer.0.output.dense.weight", (64, 256))
    assert kind == "normal" and math.isclose(std, 1 / 16)


def test_layouts_hold_identical_numbers():
    hf = hf_esm2_state_dict(*DIMS, seed=SEED)
    fair = fair_esm2_state_dict(*DIMS, seed=SEED)
    for key, value in hf.items():
        assert torch.equal(fair[fair_esm2_key(key)], value)
    assert torch.equal(fair["lm_head.weight"], fair["embed_tokens.weight"])  # fair-esm ties these


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="esm2"):
        write_fair_esm_pt(tmp_path / "model.pt", *DIMS)
    with pytest.raises(ValueError, match="format"):
        write_hf_snapshot(tmp_path, *DIMS, format="npz")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dims"):
        hf_esm2_spec(2, 65, 4)
    with pytest.raises(ValueError, match="even"):
        hf_esm2_spec(2, 60, 4)
