"""Profluent-E1 parity against the official Profluent code, through committed goldens, at real dims.

`tools/goldens/e1.py` ran Profluent-AI/E1's own `E1ForMaskedLM` (FP32 CPU) on the seeded official-layout weights
of `fastplms.oracles.e1` at e1_150m and e1_300m dims, on `e1_panel()` (single-sequence rows, retrieval rows of
two and three sequences, `?` masks, right padding), and committed the outputs. Here the same weights are
regenerated, converted with `convert.e1.from_official`, and ours runs the panel on every declared CPU backend
(flex uncompiled, plus one compiled case). Logits and the stored hidden states (official indices 0, L/2, L,
the last being the final-normed output) are compared over valid tokens, and at the padding positions too,
whose official outputs are defined and which ours reproduces.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import fastplms.attention as A
from fastplms.families.e1_parity import build_e1, compare_e1, e1_golden_models, run_e1
from fastplms.manifest import MANIFEST_DIR, load_manifest
from fastplms.modeling_e1 import prepare_e1_inputs
from fastplms.oracles.e1 import CACHE_ROW, e1_goldens, e1_panel
from fastplms.parity.driver import cpu_backends

pytestmark = pytest.mark.slow

FAMILY = load_manifest(MANIFEST_DIR / "e1.toml", resolve=False)
MODELS = [c.id for c in FAMILY.checkpoints if c.id in e1_golden_models()]
BACKENDS = cpu_backends(FAMILY)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ours():
    built: dict[str, torch.nn.Module] = {}

    def get(name: str):
        if name not in built:
            built.clear()
            gc.collect()
            built[name] = build_e1(name)
        return built[name]

    yield get
    built.clear()
    A.clear_flex_attention_caches()
    gc.collect()


@pytest.fixture
def uncompiled_flex(monkeypatch):
    monkeypatch.setitem(A._DISPATCH, "flex_attention", functools.partial(A.flex_attention_forward, compiled=False))


def test_goldens_cover_150m_and_300m_and_every_cpu_backend_is_declared():
    assert MODELS == ["e1_150m", "e1_300m"]
    assert BACKENDS == ("eager", "sdpa", "flex_attention")


def _check(record: dict, exact: bool) -> None:
    print({k: record[k] for k in ("logits", "hidden_states", "padding")})
    assert record["logits"]["relative_l2"] <= TOLERANCE
    assert record["hidden_states"]["worst_relative_l2"] <= TOLERANCE
    assert record["embeddings"]["relative_l2"] <= TOLERANCE
    assert record["logits"]["top1_agreement_all"] == 1.0
    # Padding positions: their official outputs do not depend on attention, so every backend gives them exactly.
    assert record["padding"]["positions"] > 0
    assert record["padding"]["logits_max_abs"] == 0.0 and record["padding"]["hidden_states_max_abs"] == 0.0
    if exact:  # eager computes what the official code computes, in the same order
        assert record["logits"]["max_abs"] == 0.0 and record["hidden_states"]["worst_max_abs"] == 0.0


@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_float32_matches_the_official_goldens(ours, name: str, backend: str) -> None:
    _recipe, _entry, gold = e1_goldens(name)
    logits, hidden = run_e1(ours(name), backend)
    assert logits.dtype == torch.float32 and len(hidden) == FAMILY.checkpoint(name).num_layers + 1
    _check(compare_e1(logits, hidden, gold), exact=backend == "eager")


def test_compiled_flex_matches_the_official_goldens(ours) -> None:
    _recipe, _entry, gold = e1_goldens("e1_150m")
    logits, hidden = run_e1(ours("e1_150m"), "flex_attention")
    _check(compare_e1(logits, hidden, gold), exact=False)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_bfloat16_error_is_reported_and_small(ours, backend: str) -> None:
    _recipe, _entry, gold = e1_goldens("e1_150m")
    logits, hidden = run_e1(ours("e1_150m"), backend, "bfloat16")
    record = compare_e1(logits, hidden, gold)
    print(f"e1_150m {backend} bf16:", record["logits"], record["hidden_states"])
    assert logits.dtype == torch.float32  # the official head returns float32 logits under autocast
    assert record["logits"]["relative_l2"] < 0.05 and record["hidden_states"]["worst_relative_l2"] < 0.05
    assert record["logits"]["top1_agreement_all"] > 0.9


@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("backend", BACKENDS)
def test_context_cache_reproduces_the_official_cache_goldens(ours, backend: str) -> None:
    """The goldens' cache cases (row CACHE_ROW alone): the query against the cached two-sequence context equals
    the official cached result (which on CPU equals its full forward); the two-sequence "query" against a
    one-sequence context, which the official cached path gets wrong, equals the official full forward."""
    _recipe, _entry, gold = e1_goldens("e1_150m")
    model = ours("e1_150m")
    model.set_attn_implementation(backend)
    *context, query = e1_panel().instances[CACHE_ROW].split(",")
    with torch.no_grad():
        cache = model.encode_context(context)
        assert cache.length == int(gold["cache_context_len"])
        single = model(**prepare_e1_inputs(query), context_cache=cache).logits
        first = model.encode_context(context[:1])
        multi = model(**prepare_e1_inputs(query, context[1:]), context_cache=first).logits
    want_single, want_multi = gold["cache_logits"], gold["cache_full_logits"][:, first.length :]
    for got, want in ((single, want_single), (multi, want_multi)):
        assert got.shape == want.shape
        rel = float((got - want).norm() / want.norm())
        print(f"{backend}: cached query relative L2 {rel:.2e}")
        assert torch.equal(got, want) if backend == "eager" else rel <= TOLERANCE
