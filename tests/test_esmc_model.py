"""ESM++ (ESMC) model contract on CPU: a dense reference of the official forward, backend agreement, the
official sequence_id masking contract, strict conversion of both official layouts, bad input, and one
artifact built from a seeded `esm`-layout snapshot and loaded in a fresh process.

Tiny dims (2 layers, 64 wide, 4 heads) with seeded weights in the official key layout keep every test
fast. The official key names and the Biohub Transformer-Engine names are written out here by hand, from
the official module tree, independently of the converter's rules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fastplms.flash
from fastplms.artifact import build as build_module
from fastplms.artifact.build import BuildError, build
from fastplms.attention import clear_flex_attention_caches
from fastplms.configuration_esmc import ESMCConfig
from fastplms.convert.common import ConversionError
from fastplms.convert.esmc import canonical_spec, from_biohub, from_esm
from fastplms.manifest import MANIFEST_DIR, ManifestError, find_checkpoint, load_manifest
from fastplms.modeling_esmc import (
    ESMCForMaskedLM,
    ESMCForSequenceClassification,
    ESMCForTokenClassification,
    ESMCModel,
)
from fastplms.oracles.esmc import biohub_state
from fastplms.oracles.seeded_weights import seeded_state_dict
from fastplms.tokenization_esm import ESMC_VOCAB, ESMTokenizer, write_vocab

DIMS = (2, 64, 4)  # layers, hidden, heads
LAYERS, HIDDEN, HEADS = DIMS
SEED = 11
PAD, CLS, EOS, BREAK = (ESMC_VOCAB.index(t) for t in ("<pad>", "<cls>", "<eos>", "|"))
TOL = 1e-5


def ffn_width(d: int) -> int:
    return int(((8 / 3) * d + 255) // 256 * 256)


# ------------------------------------------------------------------ official layouts, written out by hand


def official_spec(n_layers: int, d: int) -> dict[str, tuple[int, ...]]:
    """The `esm` package's ESMC(d, heads, n_layers).state_dict(): key -> shape."""
    h = ffn_width(d)
    spec: dict[str, tuple[int, ...]] = {"embed.weight": (64, d)}
    for i in range(n_layers):
        p = f"transformer.blocks.{i}."
        spec |= {
            p + "attn.layernorm_qkv.0.weight": (d,),
            p + "attn.layernorm_qkv.0.bias": (d,),
            p + "attn.layernorm_qkv.1.weight": (3 * d, d),
            p + "attn.out_proj.weight": (d, d),
            p + "attn.q_ln.weight": (d,),
            p + "attn.k_ln.weight": (d,),
            p + "ffn.0.weight": (d,),
            p + "ffn.0.bias": (d,),
            p + "ffn.1.weight": (2 * h, d),
            p + "ffn.3.weight": (d, h),
        }
    spec["transformer.norm.weight"] = (d,)
    spec |= {
        "sequence_head.0.weight": (d, d),
        "sequence_head.0.bias": (d,),
        "sequence_head.2.weight": (d,),
        "sequence_head.2.bias": (d,),
        "sequence_head.3.weight": (64, d),
        "sequence_head.3.bias": (64,),
    }
    return spec


_NORM_SCALES = ("layernorm_qkv.0.weight", "q_ln.weight", "k_ln.weight", "ffn.0.weight", "norm.weight", "head.2.weight")


def _rule(key: str, shape: tuple[int, ...]) -> tuple[str, float]:
    if key.endswith(_NORM_SCALES):
        return "ones_jitter", 0.1
    if key.endswith("bias"):
        return "zeros_jitter", 0.05
    # Larger than init scale, so attention is far from uniform and any mask leak shows.
    return "normal", 0.08 if key != "embed.weight" else 1.0


def official_state(n_layers: int = LAYERS, d: int = HIDDEN, seed: int = SEED) -> dict[str, torch.Tensor]:
    arrays = seeded_state_dict(official_spec(n_layers, d), seed=seed, rules=_rule)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


# ------------------------------------------------------------------ a dense reference of the official forward


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def reference_forward(sd, tokens: torch.Tensor, sequence_id: torch.Tensor, heads: int = HEADS):
    """The official ESMC forward in dense (batch, seq) form on the official layout: logits, post-norm
    embeddings, and the per-block outputs the official `hidden_states` holds."""
    x = sd["embed.weight"][tokens]
    b, s, d = x.shape
    n_layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.blocks."))
    dh = d // heads
    inv_freq = 1 / (10000.0 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :]
    sin = torch.cat((freqs.sin(), freqs.sin()), -1)[:, None, :]
    allowed = (sequence_id[:, :, None] == sequence_id[:, None, :])[:, None]
    scale = math.sqrt(n_layers / 36)
    hiddens = []
    for i in range(n_layers):
        p = f"transformer.blocks.{i}."
        y = F.layer_norm(x, (d,), sd[p + "attn.layernorm_qkv.0.weight"], sd[p + "attn.layernorm_qkv.0.bias"])
        q, k, v = (y @ sd[p + "attn.layernorm_qkv.1.weight"].T).chunk(3, dim=-1)
        q = F.layer_norm(q, (d,), sd[p + "attn.q_ln.weight"])
        k = F.layer_norm(k, (d,), sd[p + "attn.k_ln.weight"])
        q, k, v = (t.view(b, s, heads, dh) for t in (q, k, v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        context = (probs @ v).transpose(1, 2).reshape(b, s, d)
        x = x + (context @ sd[p + "attn.out_proj.weight"].T) / scale
        y = F.layer_norm(x, (d,), sd[p + "ffn.0.weight"], sd[p + "ffn.0.bias"]) @ sd[p + "ffn.1.weight"].T
        gate, value = y.chunk(2, dim=-1)
        x = x + ((F.silu(gate) * value) @ sd[p + "ffn.3.weight"].T) / scale
        hiddens.append(x)
    emb = F.layer_norm(x, (d,), sd["transformer.norm.weight"])
    y = F.gelu(emb @ sd["sequence_head.0.weight"].T + sd["sequence_head.0.bias"])
    y = F.layer_norm(y, (d,), sd["sequence_head.2.weight"], sd["sequence_head.2.bias"])
    logits = y @ sd["sequence_head.3.weight"].T + sd["sequence_head.3.bias"]
    return logits, emb, hiddens


# ------------------------------------------------------------------ fixtures and helpers


def tiny_config(**overrides) -> ESMCConfig:
    return ESMCConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, **overrides)


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    return official_state()


@pytest.fixture(scope="module")
def canonical(official) -> dict[str, torch.Tensor]:
    return from_esm(official)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ESMTokenizer:
    return ESMTokenizer(write_vocab(tmp_path_factory.mktemp("tok") / "vocab.txt", ESMC_VOCAB), model_max_length=2048)


def load(cls, canonical, **config):
    torch.manual_seed(0)
    model = cls(tiny_config(**config))
    base = model if isinstance(model, ESMCModel) else model.esmc
    base.load_state_dict({k.removeprefix("esmc."): v for k, v in canonical.items() if k.startswith("esmc.")})
    if isinstance(model, ESMCForMaskedLM):
        model.lm_head.load_state_dict({k.removeprefix("lm_head."): v for k, v in canonical.items() if "lm_head" in k})
    return model.eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def multi_chain_batch(tokenizer):
    """Row 0: two chains (A | B) as ids 0 and 1; row 1: one chain; padding as -1."""
    chain_a, chain_b, single = "MKTAYIAKQRQISF", "GSHMLDKWC", "ACDEFGHIKLMNPQRSTVWY"
    row0 = tokenizer(chain_a)["input_ids"] + tokenizer(chain_b)["input_ids"]
    row1 = tokenizer(single)["input_ids"]
    seq = max(len(row0), len(row1))
    ids = torch.full((2, seq), PAD)
    sid = torch.full((2, seq), -1)
    ids[0, : len(row0)], ids[1, : len(row1)] = torch.tensor(row0), torch.tensor(row1)
    na = len(chain_a) + 2
    sid[0, :na], sid[0, na : len(row0)], sid[1, : len(row1)] = 0, 1, 0
    return ids, sid, na


# ------------------------------------------------------------------ architecture against the dense reference


def test_hand_written_layout_matches_the_reference_spec():
    # esmc_reference's spec is checked against a constructed official model by the goldens recipe.
    from fastplms.oracles.esmc import esmc_official_spec

    assert list(official_spec(LAYERS, HIDDEN).items()) == list(esmc_official_spec(*DIMS).items())


def test_config_follows_official_dims():
    widths = [ESMCConfig(hidden_size=d, num_attention_heads=4).intermediate_size for d in (64, 960, 1152, 2560)]
    assert widths == [256, 2560, 3072, 6912]
    assert ESMCModel(tiny_config()).layers[0].residual_scale == math.sqrt(2 / 36)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_matches_dense_reference_with_chains_and_padding(backend, official, canonical, tokenizer):
    ids, sid, _ = multi_chain_batch(tokenizer)
    model = load(ESMCForMaskedLM, canonical, attn_implementation=backend)
    with torch.no_grad():
        out = model(ids, sequence_id=sid, output_hidden_states=True)
        base = model.esmc(ids, sequence_id=sid)
        ref_logits, ref_emb, ref_hidden = reference_forward(official, ids, sid)
    valid = sid >= 0
    assert rel(out.logits[valid], ref_logits[valid]) <= TOL
    assert rel(base.last_hidden_state[valid], ref_emb[valid]) <= TOL
    assert len(out.hidden_states) == LAYERS + 1
    assert rel(out.hidden_states[0][valid], official["embed.weight"][ids][valid]) == 0
    # Block inputs, then the final-norm output: the official block outputs but the last, then `embeddings`.
    for ours, theirs in zip(out.hidden_states[1:-1], ref_hidden[:-1], strict=True):
        assert rel(ours[valid], theirs[valid]) <= TOL
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state)
    for tensor in (out.logits, base.last_hidden_state, *out.hidden_states):
        assert tensor[~valid].abs().max() == 0


@pytest.mark.slow
def test_backends_agree_flex(canonical, tokenizer):
    # Two compiled mask functions (padding and sequence semantics): the costliest test in this file.
    ids, sid, _ = multi_chain_batch(tokenizer)
    eager = load(ESMCForMaskedLM, canonical, attn_implementation="eager")
    flex = load(ESMCForMaskedLM, canonical, attn_implementation="flex_attention")
    try:
        with torch.no_grad():
            for kwargs in ({"sequence_id": sid}, {"attention_mask": (sid >= 0).long()}):
                a = eager(ids, output_hidden_states=True, **kwargs)
                b = flex(ids, output_hidden_states=True, **kwargs)
                valid = sid >= 0
                assert rel(b.logits[valid], a.logits[valid]) <= TOL
                for x, y in zip(b.hidden_states, a.hidden_states, strict=True):
                    assert rel(x[valid], y[valid]) <= TOL
                assert b.logits[~valid].abs().max() == 0
    finally:
        clear_flex_attention_caches()


# ------------------------------------------------------------------ masking contract


def test_chains_do_not_see_each_other(canonical, tokenizer):
    ids, sid, na = multi_chain_batch(tokenizer)
    model = load(ESMCModel, canonical, attn_implementation="sdpa")
    changed = ids.clone()
    changed[0, na + 1 : na + 6] = torch.tensor([ESMC_VOCAB.index(r) for r in "WWWWW"])
    with torch.no_grad():
        before = model(ids, sequence_id=sid).last_hidden_state
        after = model(changed, sequence_id=sid).last_hidden_state
        merged = model(changed, sequence_id=torch.where(sid >= 0, 0, -1)).last_hidden_state
    assert torch.equal(before[0, :na], after[0, :na])  # chain A ignores chain B entirely
    assert not torch.allclose(before[0, na:], after[0, na:])
    assert torch.equal(before[1], after[1])
    assert not torch.allclose(merged[0, :na], after[0, :na])  # one id for both chains: they interact


def test_bool_int_and_attention_mask_forms_agree(canonical, tokenizer):
    batch = tokenizer(["MKTAYIAKQRQISF", "ACDE|GHIK"], padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert BREAK in ids[1].tolist()
    model = load(ESMCForMaskedLM, canonical, attn_implementation="sdpa")
    with torch.no_grad():
        forms = [
            model(ids, mask).logits,
            model(ids, sequence_id=mask.bool()).logits,
            model(ids, sequence_id=torch.where(mask.bool(), 0, -1)).logits,
            model(ids, mask, sequence_id=mask.bool()).logits,
            model(ids).logits,  # official default: every non-<pad> token is one sequence
        ]
    for other in forms[1:]:
        assert torch.equal(other, forms[0])


def test_sequence_id_is_authoritative_over_a_disagreeing_mask(canonical, tokenizer):
    ids, sid, _ = multi_chain_batch(tokenizer)
    model = load(ESMCModel, canonical)
    wrong = torch.ones_like(ids)
    with pytest.raises(ValueError, match="attention_mask and sequence_id disagree"):
        model(ids, wrong, sequence_id=sid)


def test_results_independent_of_batch_composition(canonical, tokenizer):
    model = load(ESMCForMaskedLM, canonical, attn_implementation="sdpa")
    target = "MKTAYIAKQRQISF"
    batch = tokenizer(["GSHMLDKWCAAVLGRRTEEPQNVLKHIW", target, "ACDE"], padding=True, return_tensors="pt")
    alone = tokenizer([target], return_tensors="pt")
    with torch.no_grad():
        many = model(**batch).logits
        one = model(**alone).logits
    assert rel(many[1, : len(target) + 2], one[0]) <= TOL


def test_output_attentions_respect_chains(canonical, tokenizer):
    ids, sid, na = multi_chain_batch(tokenizer)
    model = load(ESMCModel, canonical, attn_implementation="sdpa")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model(ids, sequence_id=sid, output_attentions=True)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert len(out.attentions) == LAYERS
    probs = out.attentions[0][0]  # (heads, seq, seq) of the two-chain row
    assert probs[:, :na, na:].abs().max() == 0 and probs[:, na:, :na].abs().max() == 0
    assert model.config._attn_implementation == "sdpa"


def _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        seg = [t[start:end].transpose(0, 1)[None].float() for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg, scale=softmax_scale)[0].transpose(0, 1).to(q.dtype)
    return out


class _ReportsCuda(torch.Tensor):
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_flash_takes_bool_sequence_id_and_refuses_integer_ids(monkeypatch, canonical, tokenizer):
    real_check = fastplms.flash.check_flash_inputs
    loads: list[str] = []

    def as_cuda(q, k, v, attention_mask=None):
        q, k, v = (torch.Tensor._make_subclass(_ReportsCuda, t.detach()) for t in (q, k, v))
        return real_check(q, k, v, attention_mask)

    def kernel(implementation, lockfile=None):
        loads.append(implementation)
        return types.SimpleNamespace(flash_attn_varlen_func=_stand_in_varlen)

    monkeypatch.setattr(fastplms.flash, "check_flash_inputs", as_cuda)
    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", kernel)
    ids, sid, _ = multi_chain_batch(tokenizer)
    model = load(ESMCModel, canonical, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="integer sequence_id .* not supported by flash_attention_2"):
        model(ids, sequence_id=sid)
    assert loads == []
    eager = load(ESMCModel, canonical, attn_implementation="eager")
    valid = sid >= 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        flash = model(ids, sequence_id=valid).last_hidden_state
        reference = eager(ids, sequence_id=valid).last_hidden_state
    assert loads == ["flash_attention_2"]  # resolved once per model, not per layer
    assert rel(flash[valid].float(), reference[valid].float()) < 2e-2
    assert flash[~valid].abs().max() == 0


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda ids: torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=torch.long), "shape of input_ids"),
        (lambda ids: torch.zeros(ids.shape), "bool .* or integers"),
        (lambda ids: torch.full(ids.shape, -2), ">= 0 for tokens and -1 for padding"),
        (lambda ids: torch.full(ids.shape, -1), "no valid token"),
        (lambda ids: ids.tolist(), "must be a torch.Tensor"),
    ],
)
def test_bad_sequence_id_is_refused(make, message, canonical, tokenizer):
    ids = tokenizer(["MKTAYIAK"], return_tensors="pt")["input_ids"]
    model = load(ESMCModel, canonical)
    with pytest.raises((ValueError, TypeError), match=message):
        model(ids, sequence_id=make(ids))


def test_bad_ids_residues_and_backends_are_refused(canonical, tokenizer):
    model = load(ESMCForMaskedLM, canonical)
    with pytest.raises(ValueError, match="invalid character 'J'"):
        tokenizer(["MKTJ"])
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 64\)"):
        model(torch.tensor([[0, 64, 2]]))
    with pytest.raises(ValueError, match="Valid names are exactly"):
        model.set_attn_implementation("flex")
    restricted = load(ESMCModel, canonical, allowed_backends=["eager", "sdpa"])
    with pytest.raises(ValueError, match="not supported by ESM\\+\\+"):
        restricted.set_attn_implementation("flex_attention")


def test_dtype_policy(canonical, tokenizer):
    batch = tokenizer(["MKTAYIAKQRQISF", "ACDE"], padding=True, return_tensors="pt")
    model = load(ESMCForMaskedLM, canonical, attn_implementation="sdpa")
    with torch.no_grad():
        reference = model(**batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(**batch).logits
    valid = batch["attention_mask"].bool()
    assert rel(low[valid].float(), reference[valid]) < 5e-2
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="autocast dtype torch.float16"):
        model(**batch)
    with pytest.raises(ValueError, match="keep parameters in float32"):
        load(ESMCForMaskedLM, canonical).to(torch.bfloat16)(**batch)


# ------------------------------------------------------------------ task heads, save/load, embedding


def test_task_heads_and_round_trip(tmp_path, canonical, tokenizer):
    batch = tokenizer(["MKTAYIAKQRQISF", "ACDE"], padding=True, return_tensors="pt")
    mlm = load(ESMCForMaskedLM, canonical)
    mlm.save_pretrained(tmp_path)
    again = ESMCForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert again.config._attn_implementation == "eager"
    with torch.no_grad():
        assert rel(again(**batch).logits, mlm(**batch).logits) <= TOL  # eager against sdpa
    seq = ESMCForSequenceClassification.from_pretrained(tmp_path, num_labels=3).eval()
    tok = ESMCForTokenClassification.from_pretrained(tmp_path, num_labels=5).eval()
    base = ESMCModel.from_pretrained(tmp_path).eval()
    out = seq(**batch, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss is not None
    labels = torch.where(batch["attention_mask"].bool(), 1, -100)
    out = tok(**batch, labels=labels)
    assert out.logits.shape == (*batch["input_ids"].shape, 5) and out.loss is not None
    with torch.no_grad():
        assert torch.equal(base(**batch).last_hidden_state, mlm.esmc(**batch).last_hidden_state)


def test_embed_dataset(canonical, tokenizer):
    model = load(ESMCForMaskedLM, canonical)
    sequences = {"a": "MKTAYIAKQRQISF", "b": "ACDE"}
    result = model.embed_dataset(sequences, pooling=("mean",))
    batch = tokenizer(["MKTAYIAKQRQISF"], return_tensors="pt")
    with torch.no_grad():
        states = model.esmc(**batch).last_hidden_state[0, 1:-1]
    assert result.ids == ["a", "b"]
    assert rel(result.stack("mean")[0], states.mean(0)) <= TOL


# ------------------------------------------------------------------ conversion


def test_both_layouts_convert_to_the_same_canonical_dict(official, canonical):
    assert set(canonical) == set(canonical_spec(LAYERS, HIDDEN))
    from_bio = from_biohub(biohub_state(official))
    assert from_bio.keys() == canonical.keys()
    assert all(torch.equal(from_bio[k], canonical[k]) for k in canonical)
    # Fused tensors are carried as stored: q/k/v and gate/value halves in official order.
    assert torch.equal(
        canonical["esmc.layers.1.qkv.weight"], official["transformer.blocks.1.attn.layernorm_qkv.1.weight"]
    )
    assert torch.equal(canonical["esmc.layers.0.fc1.weight"], official["transformer.blocks.0.ffn.1.weight"])
    half = {k: v.to(torch.bfloat16) for k, v in official.items()}
    assert all(v.dtype == torch.float32 for v in from_esm(half).values())


def test_conversion_is_strict(official):
    missing = dict(official)
    del missing["transformer.blocks.1.attn.q_ln.weight"]
    with pytest.raises(ConversionError, match=r"missing keys: esmc\.layers\.1\.q_norm\.weight"):
        from_esm(missing)
    extra = {**official, "transformer.blocks.0.attn.rotary.inv_freq": torch.ones(8)}
    with pytest.raises(ConversionError, match="unknown keys: transformer.blocks.0.attn.rotary.inv_freq"):
        from_esm(extra)
    beyond = {**official, "transformer.blocks.2.attn.q_ln.weight": torch.ones(HIDDEN)}
    with pytest.raises(ConversionError, match="missing keys: esmc.layers.2"):
        from_esm(beyond)
    wrong = {**official, "transformer.blocks.0.ffn.3.weight": torch.ones(HIDDEN, 128)}
    with pytest.raises(ConversionError, match=r"shapes do not fit .*fc2\.weight \(64, 128\)"):
        from_esm(wrong)
    bio = biohub_state(official)
    with pytest.raises(ConversionError, match="unknown keys: sequence_head"):
        from_biohub({**bio, "sequence_head.0.bias": torch.ones(HIDDEN)})
    with pytest.raises(ConversionError, match="unknown keys: esmc.transformer.blocks.0.attn.q_ln._extra_state"):
        from_biohub({**bio, "esmc.transformer.blocks.0.attn.q_ln._extra_state": torch.zeros(0)})
    with pytest.raises(ConversionError, match="missing keys: esmc.embed.weight"):
        from_biohub({k: v for k, v in bio.items() if k != "esmc.embed.weight"})


# ------------------------------------------------------------------ build and fresh-process load


@pytest.fixture
def tiny_manifest(monkeypatch):
    """`esmc_300m` from the real manifest, shrunk to the tiny dims so the builder's checks apply to them."""
    family, checkpoint = find_checkpoint("esmc_300m")
    tiny = dataclasses.replace(checkpoint, num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS)
    monkeypatch.setattr(build_module, "find_checkpoint", lambda model_id: (family, tiny))
    return family, tiny


def write_esm_snapshot(root: Path, state) -> Path:
    path = root / "data" / "weights" / "esmc_300m_2024_12_v0.pth"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return root


def write_biohub_snapshot(root: Path, state, **config) -> Path:
    root.mkdir(parents=True)
    save_file(state, str(root / "model.safetensors"))
    dims = {"model_type": "esmc", "d_model": HIDDEN, "n_heads": HEADS, "n_layers": LAYERS, "vocab_size": 64}
    (root / "config.json").write_text(json.dumps({**dims, **config}))
    return root


def test_build_from_both_layouts_and_verify(tmp_path, tiny_manifest, official, tokenizer):
    from fastplms.artifact.verify import verify

    esm = write_esm_snapshot(tmp_path / "esm", official)
    bio = write_biohub_snapshot(tmp_path / "bio", biohub_state(official))
    a = build("esmc_300m", esm, tmp_path / "out" / "a", allow_unpinned=True)
    b = build("esmc_300m", bio, tmp_path / "out" / "b", allow_unpinned=True)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    record = json.loads((a / "provenance.json").read_text())
    assert record["source"]["kind"] == "esm" and record["transform"] == "esmc-v1"
    assert record["source"]["license"] == "Cambrian Open License"
    assert json.loads((b / "provenance.json").read_text())["source"]["license"] == "MIT"
    assert (b / "README.md").read_text().startswith("---\nlicense: mit\n")
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "fastplms_esmc" and config["architectures"] == ["ESMCForMaskedLM"]
    assert (a / "vocab.txt").read_text().splitlines() == list(ESMC_VOCAB)
    assert json.loads((a / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    assert set(load_file(str(a / "model.safetensors"))) == set(canonical_spec(LAYERS, HIDDEN))

    problems, report = verify(a)
    assert problems == []
    assert set(report["auto_classes"]) == {
        "AutoModel",
        "AutoModelForMaskedLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
    }
    assert report["auto_classes"]["AutoModelForMaskedLM"]["output_shape"][-1] == 64


def test_build_refuses_wrong_snapshots(tmp_path, tiny_manifest, official):
    bio = biohub_state(official)
    with pytest.raises(BuildError, match="n_heads is 8, expected 4"):
        build("esmc_300m", write_biohub_snapshot(tmp_path / "heads", bio, n_heads=8), tmp_path / "o1")
    with pytest.raises(BuildError, match="num_hidden_layers is 3, expected 2"):
        build("esmc_300m", write_biohub_snapshot(tmp_path / "layers", bio, num_hidden_layers=3), tmp_path / "o2")
    with pytest.raises(BuildError, match="is not an esm snapshot of EvolutionaryScale/esmc-300m-2024-12"):
        (tmp_path / "empty").mkdir()
        build("esmc_300m", tmp_path / "empty", tmp_path / "o3")
    bigger = official_state(n_layers=3)
    with pytest.raises(BuildError, match="3 layers, hidden size 64; esmc_300m has 2 layers"):
        build("esmc_300m", write_esm_snapshot(tmp_path / "deep", bigger), tmp_path / "o4", allow_unpinned=True)


# ------------------------------------------------------------------ manifest

ESMC_TOML = MANIFEST_DIR / "esmc.toml"
# Written down independently of the manifest (esm.pretrained.ESMC_*_202412 constructors, Biohub cards):
# id -> (published, layers, hidden, heads, source kinds)
ESMC_FACTS = {
    "esmc_300m": ("ESMplusplus-300M", 30, 960, 15, ["esm", "biohub"]),
    "esmc_600m": ("ESMplusplus-600M", 36, 1152, 18, ["esm", "biohub"]),
    "esmc_6b": ("ESMplusplus-6B", 80, 2560, 40, ["biohub"]),
}


def test_manifest_records_the_released_checkpoints():
    family = load_manifest(ESMC_TOML)  # also resolves every AutoClass target
    assert family.transform == "esmc-v1" and family.representative == "esmc_300m"
    assert [c.id for c in family.checkpoints] == list(ESMC_FACTS)
    for checkpoint in family.checkpoints:
        published, layers, hidden, heads, kinds = ESMC_FACTS[checkpoint.id]
        assert (checkpoint.published, checkpoint.num_layers, checkpoint.hidden_size, checkpoint.num_heads) == (
            published,
            layers,
            hidden,
            heads,
        )
        assert [s.kind for s in checkpoint.sources] == kinds
        assert checkpoint.source("biohub").license == "MIT"
    for size, license_name in (("300m", "Cambrian Open License"), ("600m", "Cambrian Non-Commercial License")):
        esm = family.checkpoint(f"esmc_{size}").source("esm")
        assert esm.repo == f"EvolutionaryScale/esmc-{size}-2024-12"
        assert esm.file == f"data/weights/esmc_{size}_2024_12_v0.pth"
        assert esm.license == license_name == family.checkpoint(f"esmc_{size}").license


@pytest.mark.parametrize(
    ("old", "new", "key", "message"),
    [
        ('file = "data/weights/esmc_300m_2024_12_v0.pth"\n', "", "sources[0].file", "missing required key"),
        ('"data/weights/esmc_300m', '"../weights/esmc_300m', "sources[0].file", "must be a relative path"),
        ('kind = "biohub"\nrepo = "biohub/ESMC-300M"\n', 'kind = "biohub"\n', "sources[1].repo", "missing required"),
        ('revision = "7d639541', 'revision = "7D639541', "sources[1].revision", "40-character lowercase hex"),
        ('license = "MIT"\n\n[[checkpoints]]', 'url = "https://x/y"\n\n[[checkpoints]]', "sources[1].url", "unknown"),
    ],
)
def test_manifest_source_kinds_are_validated(tmp_path, old, new, key, message):
    text = ESMC_TOML.read_text()
    assert old in text, old
    path = tmp_path / "esmc.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ManifestError, match=rf"checkpoints\[0\]\.{re.escape(key)}: .*{message}"):
        load_manifest(path, resolve=False)
