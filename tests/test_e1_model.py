"""Profluent-E1 model at small dims: the conversion, inputs, the forward contract, padding, GQA, backends.

Real-dimension parity against the official goldens is tests/test_e1_parity.py; here a 3-layer model (one
global layer, GQA with 2 key/value heads for 4 query heads) runs in milliseconds. When an official checkout is
available (FASTPLMS_E1_ORACLE, as for tests/test_e1_goldens.py), the GQA model is also run by the official code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastplms.attention as A
from fastplms.configuration_e1 import E1Config
from fastplms.convert.common import ConversionError
from fastplms.convert.e1 import canonical_spec, from_official, official_dims
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.modeling_e1 import (
    ATTRIBUTION,
    E1ForMaskedLM,
    E1ForSequenceClassification,
    E1ForTokenClassification,
    E1Model,
    default_positions,
    prepare_e1_inputs,
)
from fastplms.oracles.e1 import (
    e1_batch,
    e1_config_kwargs,
    e1_dims,
    e1_official_spec,
    e1_official_state_dict,
    write_e1_snapshot,
)

REPO = Path(__file__).resolve().parents[1]
ORACLE = Path(os.environ.get("FASTPLMS_E1_ORACLE", "/nonexistent"))
DIMS = e1_dims("e1_150m")._replace(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
INSTANCES = ["MKTAYIAKQRQISFV,MRTAYLAKQ?QISW,MKSAYI?KQRQLSF", "M?K", "GSHMSEQNDRFILX,GSHM?EQNDKFIL?"]


def small_config(**extra) -> E1Config:
    kwargs = e1_config_kwargs(DIMS)
    return E1Config(**kwargs, **extra)


@pytest.fixture(scope="module")
def model() -> E1ForMaskedLM:
    m = E1ForMaskedLM(small_config())
    m.load_state_dict(from_official(e1_official_state_dict(DIMS), DIMS.num_heads), strict=True)
    return m.eval()


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    inputs = e1_batch(INSTANCES)
    inputs.pop("context_len")
    return inputs


@pytest.fixture
def uncompiled_flex(monkeypatch):
    monkeypatch.setitem(A._DISPATCH, "flex_attention", functools.partial(A.flex_attention_forward, compiled=False))


# ------------------------------------------------------------------------------------------- conversion


def test_conversion_is_a_strict_rename_with_ours_layout() -> None:
    official = e1_official_state_dict(DIMS)
    ours = from_official(official, DIMS.num_heads)
    assert {k: tuple(v.shape) for k, v in ours.items()} == canonical_spec(3, 64, 4, 2, 96)
    assert torch.equal(ours["e1.layers.2.w3.weight"], official["model.layers.2.ffn.mlp.w3.weight"])
    assert torch.equal(ours["lm_head.norm.bias"], official["mlm_head.2.bias"])
    assert official_dims(official, 4) == {
        "num_layers": 3,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 34,
        "max_num_sequences": 512,
    }
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in E1ForMaskedLM(small_config()).state_dict().items()}
    assert expected == {k: tuple(v.shape) for k, v in ours.items()}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}), "unknown keys"),
        (lambda s: s.pop("model.layers.1.ffn.mlp.w2.weight"), "missing keys: e1.layers.1.w2.weight"),
        (lambda s: s.pop("mlm_head.3.bias"), "missing keys: lm_head.decoder.bias"),
        (lambda s: s.update({"model.layers.0.ffn.mlp.w2.weight": torch.zeros(64, 95)}), "shapes do not fit"),
        (lambda s: s.update({"model.layers.3.ffn.mlp.w2.weight": torch.zeros(64, 96)}), "missing keys"),
    ],
)
def test_conversion_rejects(change, match: str) -> None:
    state = e1_official_state_dict(DIMS)
    change(state)
    with pytest.raises(ConversionError, match=match):
        from_official(state, DIMS.num_heads)


def test_conversion_of_600m_on_meta() -> None:
    dims = e1_dims("e1_600m")
    official = {k: torch.empty(s, device="meta") for k, s in e1_official_spec(dims).items()}
    ours = from_official(official, dims.num_heads)
    assert all(v.is_meta for v in ours.values()) and len(ours) == len(official)


# ------------------------------------------------------------------------------------------- inputs


def test_prepare_inputs_is_the_official_layout() -> None:
    queries = [s.split(",")[-1] for s in INSTANCES]
    contexts = [s.split(",")[:-1] for s in INSTANCES]
    got = prepare_e1_inputs(queries, contexts)
    want = e1_batch(INSTANCES)
    for key in ("input_ids", "sequence_ids", "within_seq_position_ids", "global_position_ids"):
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got["attention_mask"], (want["sequence_ids"] >= 0).long())
    single = prepare_e1_inputs("MKV", ["MKL", "MRV"])
    assert single["sequence_ids"].tolist() == [[0] * 7 + [1] * 7 + [2] * 7]
    assert torch.equal(default_positions(got["sequence_ids"])[0], got["within_seq_position_ids"])
    assert torch.equal(default_positions(got["sequence_ids"])[1], got["global_position_ids"])


@pytest.mark.parametrize(
    ("query", "context", "match"),
    [
        ("mkv", None, "lowercase"),
        ("MK V", None, "outside A-Z"),
        ("MK1", None, "outside A-Z"),
        ("", None, "empty"),
        ("???", None, "only \\? masks"),
        ("MKV", ["MK", ""], "context sequence 1 is empty"),
        ("MKV", "MKL", "not one string"),
        (["MKV", "MKL"], ["MK", "ML"], "one list of sequences per query"),
        (["MKV", "MKL"], [["MK"]], "one list of sequences per query"),
        ("M" * 8189, None, "at most 8188"),
        ("MKV", ["M"] * 512, "513 sequences"),
        ([], None, "at least one query"),
    ],
)
def test_prepare_inputs_rejects(query, context, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prepare_e1_inputs(query, context)


def test_prepare_inputs_limits() -> None:
    assert prepare_e1_inputs("M" * 8188)["input_ids"].shape == (1, 8192)
    assert prepare_e1_inputs("MKV", ["M"] * 511)["sequence_ids"].max() == 511
    with pytest.raises(TypeError, match="string"):
        prepare_e1_inputs(["MKV", 3])


# ------------------------------------------------------------------------------------------- forward


def test_attribution_printed_once_per_construction(capsys) -> None:
    E1ForMaskedLM(small_config())
    assert capsys.readouterr().err.count("Built with Profluent-E1") == 1
    E1Model(small_config())
    E1ForTokenClassification(small_config(num_labels=3))
    err = capsys.readouterr().err
    assert err.count("Built with Profluent-E1") == 2 and ATTRIBUTION in err


def test_layer_kinds_and_outputs(model, batch) -> None:
    assert [layer.is_global for layer in model.e1.layers] == [False, False, True]
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        base = model.e1(**batch)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, batch["input_ids"].shape[1], 34)
    assert len(out.hidden_states) == 4
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state)
    tup = model(**batch, return_dict=False)
    assert torch.equal(tup[0], out.logits)


def test_padding_outputs_are_the_official_ones(model, batch) -> None:
    """A padded token's attention output is zero: its state is its embedding run through the FFNs only."""
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        e1 = model.e1
        x = e1.embed_tokens.weight[0] + e1.embed_seq_id.weight[0]
        states = [x]
        for layer in e1.layers:
            x = layer.finish(x[None], torch.zeros(1, 4, 16))[0]
            states.append(x)
        states[-1] = e1.final_norm(states[-1])
        logits = model.lm_head(states[-1])
    pad = batch["sequence_ids"] < 0
    assert int(pad.sum()) > 10
    # Close, not equal: a one-row matmul may round differently from the batch's (the goldens check bits).
    close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=1e-6)
    for state, ours in zip(states, out.hidden_states, strict=True):
        close(ours[pad], state.expand(int(pad.sum()), -1))
    close(out.logits[pad], logits.expand(int(pad.sum()), -1))


@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
def test_backends_match_eager_with_gqa(model, batch, backend: str) -> None:
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(**batch, output_hidden_states=True)
        model.set_attn_implementation(backend)
        got = model(**batch, output_hidden_states=True)
        model.set_attn_implementation("eager")
    assert torch.allclose(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(got.hidden_states, ref.hidden_states, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_block_causal_context_does_not_see_the_query(model) -> None:
    a = prepare_e1_inputs("MKTAYIAKQRQ", ["MKSAYIAKQ", "MRTAYLAK"])
    b = prepare_e1_inputs("GSHMSEQNDRFILV", ["MKSAYIAKQ", "MRTAYLAK"])
    context = 11 + 13 - 1
    with torch.no_grad():
        ha = model(**a).logits[0, :context]
        hb = model(**b).logits[0, :context]
        # and a context sequence sees the earlier one: changing the first changes the second's outputs
        c = prepare_e1_inputs("MKTAYIAKQRQ", ["MKSAYIAKW", "MRTAYLAK"])
        hc = model(**c).logits[0, 13:context]
    assert torch.equal(ha, hb)
    assert not torch.allclose(hc, ha[13:context])


def test_defaults_derive_masks_and_positions(model, batch) -> None:
    with torch.no_grad():
        full = model(**batch).logits
        derived = model(batch["input_ids"], sequence_ids=batch["sequence_ids"]).logits
        single = prepare_e1_inputs(["MKTAYIAK", "MLV"])
        one = model(**single).logits
        by_mask = model(single["input_ids"], attention_mask=single["attention_mask"]).logits
        by_pad = model(single["input_ids"]).logits
    assert torch.equal(full, derived)
    assert torch.equal(one, by_mask) and torch.equal(one, by_pad)


def test_forward_contract_errors(model, batch) -> None:
    with pytest.raises(TypeError, match="position_ids"):
        model(**batch, position_ids=batch["global_position_ids"])
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(**batch, inputs_embeds=torch.zeros(1))
    with pytest.raises(ValueError, match="disagree"):
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
    too_many = batch["sequence_ids"].clone()
    too_many[0, 0] = 512
    with pytest.raises(ValueError, match="at most 512"):
        model(batch["input_ids"], sequence_ids=too_many)
    far = batch["within_seq_position_ids"].clone()
    far[0, 1] = 8192
    with pytest.raises(ValueError, match="within_seq_position_ids"):
        model(**{**batch, "within_seq_position_ids": far})
    with pytest.raises(ValueError, match="integers"):
        model(**{**batch, "global_position_ids": batch["global_position_ids"].float()})
    with pytest.raises(ValueError, match="input_ids must lie"):
        model(batch["input_ids"] + 40)


def test_output_attentions_runs_eager_with_a_warning(model, batch) -> None:
    model.set_attn_implementation("sdpa")
    try:
        with pytest.warns(RuntimeWarning, match="eager"), torch.no_grad():
            out = model(**batch, output_attentions=True)
    finally:
        model.set_attn_implementation("eager")
    assert len(out.attentions) == 3 and out.attentions[0].shape[:2] == (3, 4)


def test_bf16_autocast_gives_float32_logits(model, batch) -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch, output_hidden_states=True)
    assert out.logits.dtype == torch.float32 and out.hidden_states[1].dtype == torch.bfloat16


def test_task_heads(batch) -> None:
    state = from_official(e1_official_state_dict(DIMS), DIMS.num_heads)
    base = {k: v for k, v in state.items() if k.startswith("e1.")}
    seq = E1ForSequenceClassification(small_config(num_labels=2)).eval()
    seq.load_state_dict(base, strict=False)
    out = seq(**batch, labels=torch.tensor([0, 1, 1]))
    assert out.logits.shape == (3, 2) and out.loss is not None
    tok = E1ForTokenClassification(small_config(num_labels=3)).eval()
    labels = torch.full(batch["input_ids"].shape, -100)
    labels[:, 2] = 1
    out = tok(**batch, labels=labels)
    assert out.logits.shape == (*batch["input_ids"].shape, 3) and torch.isfinite(out.loss)


# ------------------------------------------------------------------------------------------- official code

ORACLE_RUN = r"""
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path[:0] = [sys.argv[1] + "/tree/src", sys.argv[1] + "/site"]
import torch
from E1.config import E1Config
from E1.modeling import E1ForMaskedLM
from fastplms.oracles import e1 as ref

dims = ref.e1_dims("e1_150m")._replace(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
model = E1ForMaskedLM(E1Config(**ref.e1_config_kwargs(dims))).eval()
model.load_state_dict(ref.e1_official_state_dict(dims), strict=True)
inputs = ref.e1_batch(sys.argv[3].split(";"))
inputs.pop("context_len")
with torch.inference_mode():
    out = model(**inputs, output_hidden_states=True)
torch.save({"logits": out.logits, "hidden_states": list(out.hidden_states)}, sys.argv[2])
"""


@pytest.mark.skipif(
    not (ORACLE / "tree" / "src" / "E1" / "modeling.py").is_file(),
    reason="no official E1 checkout (FASTPLMS_E1_ORACLE, made by tools/goldens/setup_e1_oracle.sh)",
)
def test_gqa_model_matches_the_official_code(model, batch, tmp_path: Path) -> None:
    """The goldens' checkpoints have as many key/value heads as query heads; GQA is checked here."""
    out_file = tmp_path / "official.pt"
    result = subprocess.run(
        [sys.executable, "-c", ORACLE_RUN, str(ORACLE), str(out_file), ";".join(INSTANCES)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    official = torch.load(out_file, weights_only=True)
    with torch.no_grad():
        ours = model(**batch, output_hidden_states=True)
    assert torch.equal(ours.logits, official["logits"])  # eager, every position, padding included
    for a, b in zip(ours.hidden_states, official["hidden_states"], strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- snapshots


def small_family():
    """The E1 manifest with one checkpoint at DIMS (the snapshot reader checks the manifest's dims)."""
    family = load_manifest(MANIFEST_DIR / "e1.toml", resolve=False)
    ckpt = dataclasses.replace(
        family.checkpoint("e1_150m"),
        num_layers=DIMS.num_layers,
        hidden_size=DIMS.hidden_size,
        num_heads=DIMS.num_heads,
        config={"num_kv_heads": DIMS.num_kv_heads, "intermediate_size": DIMS.intermediate_size},
    )
    return dataclasses.replace(family, checkpoints=(ckpt,)), ckpt


def test_read_snapshot_of_the_official_hub_layout(tmp_path: Path) -> None:
    from fastplms.families.e1 import make_config, read_snapshot

    family, ckpt = small_family()
    snapshot = write_e1_snapshot(tmp_path / "snap", DIMS)
    source, files, state = read_snapshot(snapshot, family, ckpt)
    assert source.kind == "profluent" and sorted(files) == ["config.json", "model.safetensors"]
    bf16 = {k: v.to(torch.bfloat16) for k, v in e1_official_state_dict(DIMS).items()}
    want = from_official(bf16, DIMS.num_heads)
    assert all(torch.equal(state[k], want[k]) and state[k].dtype == torch.float32 for k in want)
    config = make_config(family, ckpt)
    assert (config.num_key_value_heads, config.rope_theta_global, config.allowed_backends) == (
        2,
        500000.0,
        ["eager", "sdpa", "flex_attention"],
    )
    model = E1ForMaskedLM(config)
    model.load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(rope_theta_global=100000.0), "rope_theta_global is 100000.0, expected 500000.0"),
        (lambda c: c.pop("intermediate_size"), "intermediate_size is '<missing>', expected 96"),
        (lambda c: c.update(num_hidden_layers=4), "num_hidden_layers is 4"),
    ],
)
def test_read_snapshot_refuses_a_config_that_is_not_the_checkpoint(tmp_path: Path, edit, match: str) -> None:
    from fastplms.artifact.snapshot import BuildError
    from fastplms.families.e1 import read_snapshot

    family, ckpt = small_family()
    snapshot = write_e1_snapshot(tmp_path / "snap", DIMS)
    config = json.loads((snapshot / "config.json").read_text())
    edit(config)
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match=match):
        read_snapshot(snapshot, family, ckpt)


# ------------------------------------------------------------------------------------------- context cache

CONTEXT = ["MKSAYIAKQRQLSF", "MRTAYLAKQ?QISW"]
QUERIES = ["MKTAYIAKQRQISFV", "GSHM?EQ"]


def _cached_vs_single_shot(model, queries=QUERIES, context=CONTEXT):
    """(cached outputs of the query batch, [single-shot context + query forward per query], context length)."""
    cache = model.encode_context(context)
    with torch.no_grad():
        cached = model(**prepare_e1_inputs(list(queries)), context_cache=cache, output_hidden_states=True)
        full = [model(**prepare_e1_inputs(q, list(context)), output_hidden_states=True) for q in queries]
    return cached, full, cache.length


def test_context_cache_is_bit_exact_in_float64_on_eager(model, monkeypatch) -> None:
    """The seed's contract: a query against the cached context is the single-shot forward over context + query."""
    monkeypatch.setattr(E1Model, "check_dtypes", lambda self, device_type: None)  # float64 is not a declared dtype
    m64 = E1ForMaskedLM(small_config())
    m64.load_state_dict(model.state_dict())
    m64 = m64.double().eval()
    for query in QUERIES:
        cached, (full,), context = _cached_vs_single_shot(m64, [query])
        assert torch.equal(cached.logits[0], full.logits[0, context:])
        for a, b in zip(cached.hidden_states, full.hidden_states, strict=True):
            assert torch.equal(a[0], b[0, context:])


@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_context_cache_matches_single_shot_in_float32(model, backend: str) -> None:
    model.set_attn_implementation(backend)
    try:
        cached, full, context = _cached_vs_single_shot(model)
    finally:
        model.set_attn_implementation("eager")
    for b, (query, ref) in enumerate(zip(QUERIES, full, strict=True)):
        n = len(query) + 4
        got, want = cached.logits[b, :n], ref.logits[0, context : context + n]
        assert float((got - want).norm() / want.norm()) <= 1e-6
        assert float((cached.hidden_states[-1][b, :n] - ref.hidden_states[-1][0, context:]).abs().max()) <= 1e-5


def test_multi_sequence_query_against_a_cache_is_exact(model) -> None:
    """The official cached path gets a query of several sequences wrong (each is its own segment); ours numbers
    them after the context, so each sees the context and the query sequences before it, as in one forward."""
    cache = model.encode_context(CONTEXT[:1])
    with torch.no_grad():
        cached = model(**prepare_e1_inputs(QUERIES[0], CONTEXT[1:]), context_cache=cache).logits
        full = model(**prepare_e1_inputs(QUERIES[0], CONTEXT)).logits
    assert torch.equal(cached[0], full[0, cache.length :])


def test_context_cache_is_bounded_keyed_and_clearable(model) -> None:
    model.set_attn_implementation("eager")
    model.clear_context_cache()
    first = model.context_cache(CONTEXT)
    assert model.context_cache(list(CONTEXT)) is first  # keyed by content
    assert first.length == sum(len(s) + 4 for s in CONTEXT) and first.num_sequences == 2
    assert len(first.keys) == len(model.e1.layers) and first.keys[0].shape == (first.length, 2, 16)
    assert first.nbytes == 2 * 3 * first.length * 2 * 16 * 4
    for i in range(model.context_cache_entries):
        model.context_cache([f"MK{'A' * (i + 1)}"])
    again = model.context_cache(CONTEXT)
    assert again is not first  # evicted: an LRU of context_cache_entries
    model.set_attn_implementation("sdpa")
    try:
        assert model.context_cache(CONTEXT) is not again  # keyed by backend too
    finally:
        model.set_attn_implementation("eager")
    assert model.context_cache(CONTEXT) is again
    assert len(model.__dict__["_fastplms_context_caches"]) == model.context_cache_entries
    model.clear_context_cache()
    assert "_fastplms_context_caches" not in model.__dict__
    with pytest.raises(ValueError, match="non-empty list"):
        model.encode_context([])
    with pytest.raises(ValueError, match="not one string"):
        model.context_cache("MKV")


def test_embed_dataset_with_and_without_a_context(model, tmp_path: Path) -> None:
    queries = ["MKTAYIAKQRQISFV", "GSHMSEQ"]  # residues only: '?' is not an embedding input
    records = [("a", queries[0]), ("b", queries[1])]
    plain = model.embed_dataset(records, pooling=("mean",))
    with_context = model.embed_dataset(records, pooling=("mean",), context=CONTEXT)
    with torch.no_grad():
        for i, query in enumerate(queries):
            alone = model.e1(**prepare_e1_inputs(query)).last_hidden_state[0, 2 : 2 + len(query)]
            after = model.e1(**prepare_e1_inputs(query, CONTEXT)).last_hidden_state[0]
            start = sum(len(s) + 4 for s in CONTEXT) + 2
            torch.testing.assert_close(plain.stack("mean")[i], alone.mean(0), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                with_context.stack("mean")[i], after[start : start + len(query)].mean(0), rtol=1e-5, atol=1e-6
            )
    out = tmp_path / "emb"
    model.embed_dataset(records, context=CONTEXT, output=out)
    with pytest.raises(ValueError):
        model.embed_dataset(records, context=CONTEXT[:1], output=out, resume=True)
    with pytest.raises(ValueError, match="not one string"):
        model.embed_dataset(records, context="MKV")


def test_read_context_of_an_a3m_file_and_embedding_from_it(model, tmp_path: Path) -> None:
    from fastplms.modeling_e1 import read_context

    a3m = tmp_path / "homologs.a3m"
    a3m.write_text(">query\nMKSAYIAKQRQLSF\n>hit1 some description\nMRT-AYlaKQ.QISW\n>hit2\n--KSAY\n")
    assert read_context(a3m) == ["MKSAYIAKQRQLSF", "MRTAYLAKQQISW", "KSAY"]
    assert read_context(str(a3m)) == read_context(a3m)
    records = [("a", "MKTAYIAKQRQISFV")]
    from_file = model.embed_dataset(records, context=str(a3m))
    from_list = model.embed_dataset(records, context=["MKSAYIAKQRQLSF", "MRTAYLAKQQISW", "KSAY"])
    assert torch.equal(from_file.stack("mean"), from_list.stack("mean"))
    empty = tmp_path / "empty.fasta"
    empty.write_text("")
    with pytest.raises(ValueError, match="no context sequences"):
        read_context(empty)
