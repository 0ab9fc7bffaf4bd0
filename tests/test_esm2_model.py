"""ESM2 model contract on CPU: Transformers parity, backend selection, padding-free execution, dtype policy,
bad input, save/load and the task heads.

Tiny dims (2 layers, 64 wide, 4 heads) with seeded official-layout weights keep every test fast; only the
Flex test compiles (two shapes).
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import EsmForMaskedLM

import fastplms.flash
import fastplms.plm_base as plm_base
from fastplms.attention import ATTENTION_BACKENDS, attention_plan, clear_flex_attention_caches
from fastplms.configuration_esm2 import ESM2Config
from fastplms.convert.esm2 import from_transformers
from fastplms.modeling_esm2 import (
    ESM2ForMaskedLM,
    ESM2ForSequenceClassification,
    ESM2ForTokenClassification,
    ESM2Model,
)
from fastplms.oracles.esm2 import hf_esm2_config, hf_esm2_state_dict
from fastplms.rotary import inverse_frequencies
from fastplms.tokenization_esm import ESM2_VOCAB, ESMTokenizer, write_vocab

DIMS = (2, 64, 4)  # layers, hidden, heads
LAYERS, HIDDEN, HEADS = DIMS
SEED = 5
TARGET = "MKTAYIAKQRQISF"
OTHERS = ("GSHMLDKWCAAVLGRRTEEPQNVLKHIW", "ACDE")  # one longer, one shorter than TARGET
CPU_BACKENDS = ("eager", "sdpa")


def tiny_config(**overrides) -> ESM2Config:
    return ESM2Config(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, **overrides)


@pytest.fixture(scope="module")
def official() -> dict[str, torch.Tensor]:
    return hf_esm2_state_dict(*DIMS, seed=SEED)


@pytest.fixture(scope="module")
def canonical(official) -> dict[str, torch.Tensor]:
    return from_transformers(official, HEADS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ESMTokenizer:
    return ESMTokenizer(write_vocab(tmp_path_factory.mktemp("tok") / "vocab.txt", ESM2_VOCAB))


def build(cls, canonical: dict[str, torch.Tensor], **config):
    """`cls` with the seeded encoder (and LM head where it has one) loaded strictly; heads stay seeded."""
    torch.manual_seed(0)
    model = cls(tiny_config(**config))
    base = model if isinstance(model, ESM2Model) else model.esm
    base.load_state_dict({k.removeprefix("esm."): v for k, v in canonical.items() if k.startswith("esm.")})
    if isinstance(model, ESM2ForMaskedLM):
        head = {k.removeprefix("lm_head."): v for k, v in canonical.items() if k.startswith("lm_head.")}
        model.lm_head.load_state_dict(head)
    return model.eval()


def encode(tokenizer: ESMTokenizer, *sequences: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch = tokenizer(list(sequences), padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


@pytest.fixture
def backend_calls(monkeypatch) -> list[str]:
    """Backend every layer's attention call receives; the call itself runs for real."""
    calls: list[str] = []
    real = plm_base.attend

    def spy(q, k, v, plan, **kwargs):
        calls.append(plan.backend)
        return real(q, k, v, plan, **kwargs)

    monkeypatch.setattr(plm_base, "attend", spy)
    return calls


@pytest.fixture
def routed_calls(monkeypatch) -> list[str]:
    """Like backend_calls, but each call computes with eager, so any backend can be routed on CPU cheaply."""
    calls: list[str] = []
    real = plm_base.attend

    def spy(q, k, v, plan, **kwargs):
        calls.append(plan.backend)
        return real(q, k, v, attention_plan("eager", plan.state), **kwargs)

    monkeypatch.setattr(plm_base, "attend", spy)
    return calls


@pytest.fixture
def flash_loads(monkeypatch) -> list[str]:
    """Records attempts to load a flash kernel and fails them, so nothing is ever fetched."""
    loads: list[str] = []

    def load(implementation, lockfile=None):
        loads.append(implementation)
        raise AssertionError("flash kernel load attempted")

    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", load)
    return loads


@pytest.fixture(scope="module")
def saved_mlm(tmp_path_factory, canonical) -> Path:
    directory = tmp_path_factory.mktemp("mlm")
    build(ESM2ForMaskedLM, canonical).save_pretrained(directory)
    return directory


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------ parity with the Transformers oracle


@pytest.fixture(scope="module")
def oracle(official) -> EsmForMaskedLM:
    model = EsmForMaskedLM(hf_esm2_config(*DIMS, attn_implementation="eager")).eval()
    result = model.load_state_dict(official, strict=False)
    assert not result.missing_keys
    return model


def test_masked_lm_with_mask_tokens_matches_transformers_oracle(canonical, oracle, tokenizer):
    # Different mask ratios per row exercise the per-sequence token-dropout rescaling; row 2 is padded.
    ids, mask = encode(tokenizer, "MKT<mask>YIAK<mask>RQISF", "GS<mask>ML", "ACDEFGHIKLMNPQRSTVWY")
    model = build(ESM2ForMaskedLM, canonical)
    with torch.no_grad():
        ours = model(ids, mask, output_hidden_states=True)
        ref = oracle(ids, attention_mask=mask, output_hidden_states=True)
    valid = mask.bool()
    assert ours.logits.shape == (3, ids.shape[1], len(ESM2_VOCAB))
    assert rel_err(ours.logits[valid], ref.logits[valid]) < 1e-5
    assert len(ours.hidden_states) == len(ref.hidden_states) == LAYERS + 1
    for mine, theirs in zip(ours.hidden_states, ref.hidden_states, strict=True):
        assert rel_err(mine[valid], theirs[valid]) < 1e-5


def test_token_dropout_off_matches_oracle_without_rescaling(canonical, official, tokenizer):
    ids, mask = encode(tokenizer, "MKT<mask>YIAK<mask>RQ")
    ref = EsmForMaskedLM(hf_esm2_config(*DIMS, token_dropout=False)).eval()
    ref.load_state_dict(official, strict=False)
    model = build(ESM2ForMaskedLM, canonical, token_dropout=False)
    with torch.no_grad():
        assert rel_err(model(ids, mask).logits, ref(ids, attention_mask=mask).logits) < 1e-5


def test_predict_contacts_matches_oracle_and_runs_eager_silently(canonical, oracle, tokenizer, backend_calls):
    ids, mask = encode(tokenizer, "MKTAYIAKQRQISFVK", "GSHMLDKW")
    model = build(ESM2ForMaskedLM, canonical)  # configured sdpa
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # contacts need attention maps; the eager switch is not news
            contacts = model.predict_contacts(ids, mask)
            base_contacts = model.esm.predict_contacts(ids, mask)
        ref = oracle.predict_contacts(ids, mask)
    assert contacts.shape == (2, ids.shape[1] - 2, ids.shape[1] - 2)
    assert set(backend_calls) == {"eager"}
    assert torch.equal(contacts, base_contacts)
    assert torch.allclose(contacts[0], ref[0], atol=1e-6)
    assert torch.allclose(contacts[1, :8, :8], ref[1, :8, :8], atol=1e-6)
    assert model.config._attn_implementation == "sdpa"


def test_base_model_outputs(canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2Model, canonical)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="runs 'eager'"):
        plain = model(ids, mask)
        full = model(ids, mask, output_hidden_states=True, output_attentions=True)
    assert plain.last_hidden_state.shape == (2, ids.shape[1], HIDDEN)
    assert plain.hidden_states is None and plain.attentions is None
    assert len(full.hidden_states) == LAYERS + 1
    assert torch.equal(full.hidden_states[-1], full.last_hidden_state)
    assert len(full.attentions) == LAYERS
    valid = mask.bool()
    for probs in full.attentions:
        assert probs.shape == (2, HEADS, ids.shape[1], ids.shape[1])
        sums = probs.sum(-1)
        assert torch.allclose(sums[valid[:, None, :].expand_as(sums)], torch.tensor(1.0), atol=1e-5)
        assert probs[1, :, :, 6:].abs().max() == 0  # padded keys get no weight


# ------------------------------------------------------------------ backend selection


def test_from_pretrained_backend_ends_in_config_and_every_layer(saved_mlm, tokenizer, routed_calls):
    ids, mask = encode(tokenizer, TARGET)
    for backend in ATTENTION_BACKENDS:
        model = ESM2ForMaskedLM.from_pretrained(saved_mlm, attn_implementation=backend)
        assert model.config._attn_implementation == backend
        assert model.esm.config._attn_implementation == backend
        routed_calls.clear()
        with torch.no_grad():
            model(ids, mask)
        assert routed_calls == [backend] * LAYERS
    assert ESM2ForMaskedLM.from_pretrained(saved_mlm).config._attn_implementation == "sdpa"


def test_set_attn_implementation_at_runtime_reaches_every_layer(canonical, tokenizer, routed_calls):
    ids, mask = encode(tokenizer, TARGET)
    model = build(ESM2ForSequenceClassification, canonical, num_labels=2)
    for backend in (*ATTENTION_BACKENDS, "eager"):
        model.set_attn_implementation(backend)
        assert model.config._attn_implementation == model.esm.config._attn_implementation == backend
        routed_calls.clear()
        with torch.no_grad():
            model(ids, mask)
        assert routed_calls == [backend] * LAYERS


@pytest.mark.parametrize("name", ["bogus", "Eager", "sdpa ", "paged|sdpa", "flash_attention", "flex"])
def test_undeclared_backend_name_raises_listing_valid_names(name, saved_mlm, canonical):
    with pytest.raises(ValueError, match="Valid names are exactly: eager, sdpa, flex_attention"):
        ESM2ForMaskedLM.from_pretrained(saved_mlm, attn_implementation=name)
    model = build(ESM2ForMaskedLM, canonical)
    with pytest.raises(ValueError, match="Valid names are exactly"):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == "sdpa"


def test_backend_outside_family_declaration_raises_naming_family(tmp_path, canonical):
    model = build(ESM2Model, canonical, allowed_backends=["eager", "sdpa"])
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'flex_attention' is not supported by ESM2; .*declares: eager, sdpa"):
        ESM2Model.from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="not supported by ESM2"):
        model.set_attn_implementation("flash_attention_2")
    with pytest.raises(ValueError, match="not supported by ESM2"):
        ESM2Model(tiny_config(allowed_backends=["eager"], attn_implementation="sdpa"))
    assert model.config._attn_implementation == "sdpa"
    # Unspecified falls back to the first declared backend when sdpa is not declared.
    assert ESM2Model(tiny_config(allowed_backends=["eager"])).config._attn_implementation == "eager"


def test_hub_kernel_names_never_reach_kernels(monkeypatch, saved_mlm, canonical, flash_loads):
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.modeling_utils as modeling_utils

    reached: list[str] = []

    def record(name):
        def hook(*args, **kwargs):
            reached.append(name)
            raise AssertionError(f"{name} reached")

        return hook

    for module, name in [
        (modeling_utils, "lazy_import_flash_attention"),
        (modeling_utils, "lazy_import_paged_flash_attention"),
        (hub_kernels, "load_and_register_attn_kernel"),
        (hub_kernels, "get_kernel"),
        (hub_kernels, "lazy_load_kernel"),
    ]:
        monkeypatch.setattr(module, name, record(name))
    kernels = sys.modules.get("kernels")
    if kernels is not None:
        for name in ("get_kernel", "install_kernel", "get_local_kernel", "load_kernel"):
            if hasattr(kernels, name):
                monkeypatch.setattr(kernels, name, record(f"kernels.{name}"))
    before = {name for name in sys.modules if name == "kernels" or name.startswith("kernels.")}

    model = build(ESM2ForMaskedLM, canonical)
    for name in ("kernels-community/flash-attn2", "kernels-community/flash-attn2:flash_attention"):
        with pytest.raises(ValueError, match="Unknown attention backend"):
            ESM2ForMaskedLM.from_pretrained(saved_mlm, attn_implementation=name)
        with pytest.raises(ValueError, match="Unknown attention backend"):
            model.set_attn_implementation(name)
    after = {name for name in sys.modules if name == "kernels" or name.startswith("kernels.")}
    assert reached == [] and flash_loads == []
    assert after == before
    assert model.config._attn_implementation == "sdpa"


def test_output_attentions_runs_eager_for_one_call_with_one_warning(canonical, tokenizer, backend_calls):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForMaskedLM, canonical)  # configured sdpa
    eager = build(ESM2ForMaskedLM, canonical, attn_implementation="eager")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(ids, mask, output_attentions=True)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1
    assert "'sdpa'" in str(runtime[0].message) and "'eager'" in str(runtime[0].message)
    assert backend_calls == ["eager"] * LAYERS
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = eager(ids, mask, output_attentions=True)
        backend_calls.clear()
        model(ids, mask)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]  # eager needs no switch
    assert backend_calls == ["sdpa"] * LAYERS
    for mine, theirs in zip(out.attentions, reference.attentions, strict=True):
        assert torch.equal(mine, theirs)


# ------------------------------------------------------------------ flash on a machine without it


def test_flash_is_declared_but_loads_only_on_forward(saved_mlm, canonical, tokenizer, flash_loads):
    ids, mask = encode(tokenizer, TARGET)
    loaded = ESM2ForMaskedLM.from_pretrained(saved_mlm, attn_implementation="flash_attention_2")
    model = build(ESM2ForMaskedLM, canonical)
    model.set_attn_implementation("flash_attention_3")
    assert flash_loads == []
    for m in (loaded, model):
        # The documented CUDA error, raised by the input check that precedes any kernel load.
        with pytest.raises(ValueError, match="FlashAttention needs CUDA tensors"):
            m(ids, mask)
    assert flash_loads == []
    assert loaded.config._attn_implementation == "flash_attention_2"


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device, so the checks behind the device check are reachable."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@pytest.fixture
def flash_checks_as_cuda(monkeypatch) -> list[tuple[torch.dtype, ...]]:
    """The real flash input check, shown q/k/v as CUDA tensors; records the dtypes it was given."""
    real = fastplms.flash.check_flash_inputs
    seen: list[tuple[torch.dtype, ...]] = []

    def as_cuda(q, k, v, attention_mask=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        q, k, v = (torch.Tensor._make_subclass(_ReportsCuda, t.detach()) for t in (q, k, v))
        return real(q, k, v, attention_mask)

    monkeypatch.setattr(fastplms.flash, "check_flash_inputs", as_cuda)
    return seen


def test_flash_in_float32_is_refused_before_loading(canonical, tokenizer, flash_loads, flash_checks_as_cuda):
    ids, mask = encode(tokenizer, TARGET)
    model = build(ESM2ForMaskedLM, canonical, attn_implementation="flash_attention_2")
    with torch.no_grad(), pytest.raises(ValueError, match="FlashAttention runs in bfloat16; got torch.float32"):
        model(ids, mask)
    assert flash_loads == []


def _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """Reference varlen attention: each packed segment attends only to itself."""
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        seg = [t[start:end].transpose(0, 1)[None].float() for t in (q, k, v)]
        res = F.scaled_dot_product_attention(*seg, scale=softmax_scale, is_causal=causal)
        out[start:end] = res[0].transpose(0, 1).to(q.dtype)
    return out


def test_flash_path_under_bf16_autocast_with_a_stand_in_kernel(monkeypatch, canonical, tokenizer, flash_checks_as_cuda):
    # The one dtype route flash has (float32 parameters, bf16 autocast) passes the real input check, and
    # the packed segments give what eager gives.
    loads: list[str] = []

    def load(implementation, lockfile=None):
        loads.append(implementation)
        return types.SimpleNamespace(flash_attn_varlen_func=_stand_in_varlen)

    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", load)
    model = build(ESM2Model, canonical, attn_implementation="flash_attention_2")
    eager = build(ESM2Model, canonical, attn_implementation="eager")
    ids, mask = encode(tokenizer, OTHERS[0], TARGET, OTHERS[1])
    assert loads == []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        batched = model(ids, mask).last_hidden_state
        alone = model(*encode(tokenizer, TARGET)).last_hidden_state
        reference = eager(ids, mask).last_hidden_state
    assert set(flash_checks_as_cuda) == {(torch.bfloat16,) * 3}
    assert loads == ["flash_attention_2"]  # resolved once per model, not per layer or call
    n = len(TARGET) + 2
    valid = mask.bool()
    assert rel_err(batched[1, :n].float(), alone[0].float()) < 2e-2
    assert rel_err(batched[valid].float(), reference[valid].float()) < 2e-2
    assert batched[~valid].abs().max() == 0


# ------------------------------------------------------------------ padding-free execution


def _check_batch_independence(model, tokenizer) -> torch.Tensor:
    n = len(TARGET) + 2
    ids, mask = encode(tokenizer, OTHERS[0], TARGET, OTHERS[1])
    with torch.no_grad():
        alone = model(*encode(tokenizer, TARGET), output_hidden_states=True)
        batched = model(ids, mask, output_hidden_states=True)
    for one, many in zip(alone.hidden_states, batched.hidden_states, strict=True):
        assert rel_err(many[1, :n], one[0]) <= 1e-5
    padded = ~mask.bool()
    assert batched.last_hidden_state[padded].abs().max() == 0
    assert all(h[padded].abs().max() == 0 for h in batched.hidden_states)
    return batched.last_hidden_state


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_results_independent_of_batch_composition(backend, canonical, tokenizer):
    model = build(ESM2Model, canonical, attn_implementation=backend)
    _check_batch_independence(model, tokenizer)
    # Where padding goes does not matter either: a left-padded row gives the same states.
    ids, mask = encode(tokenizer, TARGET)
    pad = torch.full((1, 3), ESM2_VOCAB.index("<pad>"))
    with torch.no_grad():
        right = model(ids, mask).last_hidden_state
        left = model(torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1)).last_hidden_state
    assert rel_err(left[0, 3:], right[0]) <= 1e-5


@pytest.mark.slow
def test_flex_results_independent_of_batch_composition(canonical, tokenizer):
    # Two compiled shapes (batch of one, batch of three): the costliest test in this file.
    model = build(ESM2Model, canonical, attn_implementation="flex_attention")
    eager = build(ESM2Model, canonical, attn_implementation="eager")
    try:
        batched = _check_batch_independence(model, tokenizer)
    finally:
        clear_flex_attention_caches()
    ids, mask = encode(tokenizer, OTHERS[0], TARGET, OTHERS[1])
    with torch.no_grad():
        reference = eager(ids, mask).last_hidden_state
    assert rel_err(batched[mask.bool()], reference[mask.bool()]) <= 1e-5


# ------------------------------------------------------------------ dtype policy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameter_storage_is_refused(dtype, canonical, tokenizer):
    model = build(ESM2ForMaskedLM, canonical).to(dtype)
    with pytest.raises(ValueError, match=r"keep parameters in float32 and run under torch\.autocast"):
        model(*encode(tokenizer, TARGET))


def test_autocast_float16_is_refused(canonical, tokenizer):
    model = build(ESM2ForMaskedLM, canonical)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="autocast dtype torch.float16"):
        model(*encode(tokenizer, TARGET))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_autocast_bfloat16_on_cpu_works(backend, canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForMaskedLM, canonical, attn_implementation=backend)
    with torch.no_grad():
        reference = model(ids, mask).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids, mask).logits
    assert torch.isfinite(low).all()
    valid = mask.bool()
    assert rel_err(low[valid].float(), reference[valid]) < 0.1
    assert next(model.parameters()).dtype == torch.float32


# ------------------------------------------------------------------ bad input


def test_tokenizer_refuses_unknown_residue_and_empty_sequence(tokenizer):
    with pytest.raises(ValueError, match=r"invalid character 'J' at position 3"):
        tokenizer(["MKTA", "MKTJA"])
    with pytest.raises(ValueError, match="empty sequence"):
        tokenizer("")


def test_model_refuses_empty_sequence(canonical, tokenizer):
    model = build(ESM2Model, canonical)
    with pytest.raises(ValueError, match="no valid token"):
        model(torch.zeros((1, 0), dtype=torch.long))
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Batch row\(s\) \[1\] have no valid token"):
        model(ids, mask)


def test_over_length_sequence_without_truncation_is_refused(canonical, tokenizer):
    model = build(ESM2ForMaskedLM, canonical)
    sequence = "A" * 1030
    ids = tokenizer(sequence, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == 1032
    with pytest.raises(ValueError, match=r"1032 tokens; ESM2 supports at most 1026 .*truncation=True"):
        model(ids)
    truncated = tokenizer(sequence, truncation=True, return_tensors="pt")
    assert truncated["input_ids"].shape[1] == 1026
    with torch.no_grad():
        assert model(**truncated).logits.shape == (1, 1026, len(ESM2_VOCAB))


def test_out_of_vocabulary_ids_are_refused(canonical):
    model = build(ESM2Model, canonical)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 33\)"):
        model(torch.tensor([[0, 5, 33, 2]]))
    with pytest.raises(ValueError, match="shape"):
        model(torch.tensor([0, 5, 2]))


@pytest.mark.parametrize(
    ("make_mask", "message"),
    [
        (lambda m: m[:, :-1], r"attention_mask must have shape \(batch, seq\)"),
        (lambda m: m[None], r"attention_mask must have shape"),
        (lambda m: torch.zeros(m.shape).masked_fill(m == 0, float("-inf")), "additive"),
        (lambda m: m.float(), "must be bool or 0/1 integers"),
        (lambda m: m * 2, "only 0 and 1; found 2"),
    ],
    ids=["short", "3d", "additive", "float-binary", "two"],
)
def test_bad_attention_mask_is_refused(make_mask, message, canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForMaskedLM, canonical)
    with pytest.raises(ValueError, match=message):
        model(ids, make_mask(mask))


def test_bool_and_integer_masks_agree(canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForMaskedLM, canonical)
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, model(ids, mask.bool()).logits)


# ------------------------------------------------------------------ save / load


def test_save_pretrained_round_trip(tmp_path, canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    for cls, extra in [(ESM2ForMaskedLM, {}), (ESM2ForSequenceClassification, {"num_labels": 3})]:
        model = build(cls, canonical, **extra)
        model.save_pretrained(tmp_path / cls.__name__)
        loaded, info = cls.from_pretrained(tmp_path / cls.__name__, output_loading_info=True)
        assert type(loaded) is cls
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
        state, loaded_state = model.state_dict(), loaded.state_dict()
        assert state.keys() == loaded_state.keys()
        assert all(torch.equal(state[k], loaded_state[k]) for k in state)
        assert loaded.config.allowed_backends == model.config.allowed_backends
        with torch.no_grad():
            assert torch.equal(model(ids, mask).logits, loaded.eval()(ids, mask).logits)


def test_rotary_frequencies_are_a_formula_not_state(saved_mlm, canonical, tokenizer):
    # No rotary buffer that from_pretrained could leave uninitialized: the tables are computed per call.
    loaded = ESM2ForMaskedLM.from_pretrained(saved_mlm).eval()
    assert not [name for name, _ in loaded.named_buffers() if "inv_freq" in name]
    head_dim = HIDDEN // HEADS
    expected = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.equal(inverse_frequencies(head_dim, 10000.0), expected)
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask).logits, build(ESM2ForMaskedLM, canonical)(ids, mask).logits)


def test_partial_checkpoint_keeps_every_loaded_tensor(tmp_path, canonical):
    from safetensors.torch import load_file, save_file

    model = build(ESM2ForMaskedLM, canonical)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    del state["esm.layers.0.fc1.bias"]
    save_file(state, weights, metadata={"format": "pt"})
    loaded, info = ESM2ForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"esm.layers.0.fc1.bias"}
    # Only the missing tensor is initialized; its loaded sibling weight is not re-drawn.
    assert torch.equal(loaded.esm.layers[0].fc1.weight, model.esm.layers[0].fc1.weight)
    assert loaded.esm.layers[0].fc1.bias.abs().max() == 0


@pytest.mark.parametrize(
    ("cls", "extra"),
    [(ESM2ForMaskedLM, {}), (ESM2ForSequenceClassification, {"num_labels": 2}), (ESM2ForTokenClassification, {})],
)
def test_base_checkpoint_loads_into_task_classes(cls, extra, tmp_path, canonical):
    base = build(ESM2Model, canonical)
    base.save_pretrained(tmp_path)
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True, **extra)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not any(k.startswith("esm.") for k in info["missing_keys"])
    loaded = model.esm.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in base.state_dict().items())


def test_task_checkpoint_loads_into_base_model(saved_mlm, canonical):
    model, info = ESM2Model.from_pretrained(saved_mlm, output_loading_info=True)
    assert not info["missing_keys"]
    expected = build(ESM2Model, canonical).state_dict()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in expected.items())


# ------------------------------------------------------------------ task heads


@pytest.mark.parametrize(
    ("num_labels", "problem_type", "make_labels", "loss_fn"),
    [
        (1, None, lambda: torch.tensor([0.5, -1.0]), lambda logits, y: F.mse_loss(logits.squeeze(-1), y)),
        (3, "regression", lambda: torch.randn(2, 3), F.mse_loss),
        (3, None, lambda: torch.tensor([2, 0]), F.cross_entropy),
        (3, None, lambda: torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]), F.binary_cross_entropy_with_logits),
    ],
    ids=["regression", "multi-target-regression", "single-label", "multi-label"],
)
def test_sequence_classification_shapes_and_losses(
    num_labels, problem_type, make_labels, loss_fn, canonical, tokenizer
):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForSequenceClassification, canonical, num_labels=num_labels, problem_type=problem_type)
    torch.manual_seed(1)
    labels = make_labels()
    out = model(ids, mask, labels=labels)
    assert out.logits.shape == (2, num_labels)
    assert torch.allclose(out.loss, loss_fn(out.logits, labels))
    out.loss.backward()
    assert model.out_proj.weight.grad is not None and model.esm.layers[0].qkv.weight.grad is not None
    # The head is dense -> tanh -> projection on the <cls> state (dropout is 0).
    with torch.no_grad():
        base = model.esm(ids, mask).last_hidden_state[:, 0]
        manual = model.out_proj(torch.tanh(model.dense(base)))
    assert torch.allclose(out.logits, manual, atol=1e-6)


def test_token_classification_shapes_and_loss(canonical, tokenizer):
    ids, mask = encode(tokenizer, TARGET, "ACDE")
    model = build(ESM2ForTokenClassification, canonical, num_labels=4)
    labels = torch.randint(0, 4, ids.shape, generator=torch.Generator().manual_seed(2))
    labels[mask == 0] = -100
    labels[:, 0] = -100
    out = model(ids, mask, labels=labels)
    assert out.logits.shape == (2, ids.shape[1], 4)
    keep = labels != -100
    assert torch.allclose(out.loss, F.cross_entropy(out.logits[keep], labels[keep]))
    with torch.no_grad():
        assert model(ids, mask).loss is None
