"""`embed_dataset`'s compiled path (src/fastplms/compiled.py): same numbers as the eager path, compiled
only where the measured eager rate says it pays back (or when asked), first batch always eager, dropped when
measured slower, cached on the model, rebuilt when the weights change.

One small seeded ESM2 is shared by the whole module so that it compiles once (tens of seconds on CPU).
"""

from __future__ import annotations

import random

import pytest
import torch

import fastplms.compiled as compiled_module
from fastplms.compiled import CompiledEmbedding, PathChoice
from fastplms.configuration_esm2 import ESM2Config
from fastplms.convert.esm2 import from_transformers
from fastplms.modeling_esm2 import ESM2Model
from fastplms.oracles.esm2 import hf_esm2_state_dict

DIMS = (2, 64, 4)
# Lengths that give batches of one long record, several mixed ones and one-residue records.
LENGTHS = (300, 1, 2, 17, 64, 90, 127, 150, 200, 5, 33, 250)
REL = 1e-5


def seeded_esm2(dims: tuple[int, int, int], backend: str = "sdpa") -> ESM2Model:
    """ESM2 with seeded official-layout weights, converted by the real converter."""
    layers, hidden, heads = dims
    state = from_transformers(hf_esm2_state_dict(layers, hidden, heads, seed=0), heads)
    state = {key.removeprefix("esm."): value for key, value in state.items() if key.startswith("esm.")}
    model = ESM2Model(ESM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads))
    model.load_state_dict(state)
    model.set_attn_implementation(backend)
    return model.eval()


def random_sequences(lengths, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    return {
        f"p{i}_len{n}": "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(n)) for i, n in enumerate(lengths)
    }


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield seeded_esm2(DIMS)
    torch.set_num_threads(threads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _runner(model) -> CompiledEmbedding | None:
    return model.__dict__.get("_fastplms_compiled")


def test_small_job_runs_eager_and_never_compiles(model, monkeypatch):
    def refuse(self, *args):
        raise AssertionError("a small job must not run the compiled path")

    monkeypatch.setattr(CompiledEmbedding, "__call__", refuse)
    result = model.embed_dataset(random_sequences(LENGTHS))
    assert len(result.records) == len(LENGTHS)
    runner = _runner(model)
    assert runner is None or runner.calls == 0


def test_compiled_path_equals_eager_path(model, monkeypatch):
    sequences = random_sequences(LENGTHS, seed=1)
    eager = model.embed_dataset(sequences, compile=False, per_residue=True, pooling=("mean", "max", "cls"))
    # Any projected eager time pays back a compile: the default settings compile after the first batch.
    monkeypatch.setattr(compiled_module, "COMPILE_MIN_SECONDS", 0.0)
    # At these toy dims the compiled path may well time slower than eager; keep it for the comparison.
    monkeypatch.setattr(compiled_module, "SLOWER_MARGIN", float("inf"))
    batches = []
    compiled = model.embed_dataset(
        sequences,
        per_residue=True,
        pooling=("mean", "max", "cls"),
        max_tokens_per_batch=512,
        progress=lambda *_: batches.append(_runner(model).calls),
    )
    runner = _runner(model)
    assert runner is not None and runner.calls > 0 and runner.compile_seconds is not None
    assert batches[0] == 0 and batches[1] == 1  # the first batch ran eager: its result did not wait to compile
    for a, b in zip(compiled.records, eager.records, strict=True):
        assert a.id == b.id
        assert _rel(a.pooled, b.pooled) <= REL
        assert _rel(a.residues, b.residues) <= REL


def test_compiled_path_is_reused_without_recompiling(model):
    runner = _runner(model)
    if runner is None or runner.calls == 0:
        pytest.skip("needs the compiled runner of test_compiled_path_equals_eager_path")
    calls, first = runner.calls, runner.compile_seconds
    compiled = dict(runner.functions)
    # A warm model uses its compiled path even for a small job; a lone record (a one-row batch), new
    # widths and new token counts reuse the same compiled functions without recompiling.
    sequences = random_sequences((411, 3, 77), seed=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        warm = model.embed_dataset(sequences, max_tokens_per_batch=64)
    assert _runner(model) is runner and runner.calls > calls and runner.compile_seconds == first
    assert runner.functions == compiled
    eager = model.embed_dataset(sequences, compile=False)
    for a, b in zip(warm.records, eager.records, strict=True):
        assert _rel(a.pooled, b.pooled) <= REL


def test_changed_weights_get_a_new_compiled_path(model):
    runner = model._compiled_embedding(None)
    with torch.no_grad():
        model.final_norm.bias.add_(0.0)  # an in-place write, even of the same values, bumps the version
    assert model._compiled_embedding(None) is not runner
    assert model._compiled_embedding(False) is None


def test_compile_true_refuses_backends_without_a_compiled_path():
    flex = seeded_esm2(DIMS, backend="flex_attention")
    with pytest.raises(ValueError, match="compile=True needs attention backend"):
        flex.embed_dataset(["ACDE"], compile=True)


def test_compiled_path_under_bf16_autocast_matches_eager_bf16(model):
    sequences = random_sequences((120, 7, 64, 33), seed=3)
    eager = model.embed_dataset(sequences, dtype="bfloat16", compile=False)
    compiled = model.embed_dataset(sequences, dtype="bfloat16", compile=True)
    reference = model.embed_dataset(sequences, compile=False)
    for a, b, ref in zip(compiled.records, eager.records, reference.records, strict=True):
        # Both round to BF16 at the same places; only summation order differs.
        assert _rel(a.pooled, b.pooled) <= 2e-2
        assert _rel(a.pooled, ref.pooled) <= 5e-2


def seeded_esmc(dims: tuple[int, int, int]):
    """ESMC with seeded official-layout weights (`oracles.esmc`), converted by the real converter."""
    from fastplms.configuration_esmc import ESMCConfig
    from fastplms.convert.esmc import from_esm
    from fastplms.modeling_esmc import ESMCModel
    from fastplms.oracles.esmc import esmc_official_state_dict

    layers, hidden, heads = dims
    state = from_esm(esmc_official_state_dict(layers, hidden, heads, seed=0))
    model = ESMCModel(ESMCConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads))
    model.load_state_dict({k.removeprefix("esmc."): v for k, v in state.items() if k.startswith("esmc.")})
    model.set_attn_implementation("sdpa")
    return model.eval()


def test_esmc_compiled_path_equals_eager_path():
    """ESMC takes the same compiled path (its own layer halves; scaled scores instead of a pre-scaled q)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = seeded_esmc((2, 64, 4))
        sequences = random_sequences((150, 1, 40, 97), seed=4)
        eager = model.embed_dataset(sequences, compile=False, per_residue=True)
        compiled = model.embed_dataset(sequences, compile=True, per_residue=True)
        assert _runner(model).calls > 0
        for a, b in zip(compiled.records, eager.records, strict=True):
            assert _rel(a.pooled, b.pooled) <= REL
            assert _rel(a.residues, b.residues) <= REL
        bf16 = model.embed_dataset(sequences, dtype="bfloat16", compile=True)
        for a, b in zip(bf16.records, eager.records, strict=True):
            assert _rel(a.pooled, b.pooled) <= 5e-2
    finally:
        torch.set_num_threads(threads)


def _mask(rows: int, tokens: int) -> torch.Tensor:
    return torch.ones(rows, tokens, dtype=torch.long)


def test_path_choice_compiles_only_where_it_pays_back(model):
    """The decision itself, on given batch times (no clock): first batch eager, then the projection."""
    runner = CompiledEmbedding(model)
    big = PathChoice(runner, None, 1_000_000, 64)
    assert big.next() == "eager"
    big.record("eager", 1.0, _mask(10, 100), False)  # 1,000 tokens/s: 999,000 more residues take ~17 minutes
    assert big.next() == "compiled"
    small = PathChoice(CompiledEmbedding(model), None, 20_000, 64)
    small.next()
    small.record("eager", 1.0, _mask(10, 100), False)  # 19 s more: a compile would not pay back
    assert small.next() == "eager" and small.next() == "eager"
    unknown = PathChoice(CompiledEmbedding(model), None, None, 64)  # a one-shot iterator: size unknown
    unknown.record("eager", 1.0, _mask(10, 100), False)
    assert unknown.next() == "eager"
    assert PathChoice(CompiledEmbedding(model), True, 10, 64).next() == "compiled"
    assert PathChoice(CompiledEmbedding(model), False, 10**9, 64).next() == "eager"
    assert PathChoice(None, None, 10**9, 64).next() == "eager"
    warm = CompiledEmbedding(model)
    warm.calls = 3  # compiled by an earlier job: no first eager batch needed
    assert PathChoice(warm, None, 10, 64).next() == "compiled"


def test_path_choice_drops_a_compiled_path_measured_slower(model):
    runner = CompiledEmbedding(model)
    choice = PathChoice(runner, None, 10**7, 64)
    choice.record("eager", 1.0, _mask(10, 100), False)
    assert choice.next() == "compiled"
    choice.record("compiled", 9.0, _mask(10, 100), True)  # the compiling call: not a rate
    runner.calls = 1
    choice.record("compiled", 0.9, _mask(10, 100), False)  # faster so far, but one batch is not enough
    assert choice.next() == "compiled" and not runner.slower
    choice.record("compiled", 1.5, _mask(10, 100), False)  # 1.2 s per batch on average vs 1.0 eager
    assert runner.slower and choice.next() == "eager"
    # Later jobs of this model keep to eager, even though it has compiled; compile=True still forces it.
    assert PathChoice(runner, None, 10**7, 64).next() == "eager"
    assert PathChoice(runner, True, 10**7, 64).next() == "compiled"
    # A faster compiled path stays (within the margin counts as not slower).
    fast = CompiledEmbedding(model)
    keep = PathChoice(fast, None, 10**7, 64)
    keep.record("eager", 1.0, _mask(10, 100), False)
    keep.record("compiled", 9.0, _mask(10, 100), True)
    fast.calls = 1
    for seconds in (1.02, 1.03, 0.95):
        keep.record("compiled", seconds, _mask(10, 100), False)
    assert not fast.slower and keep.next() == "compiled"


def test_batch_cost_weighs_attention_by_width():
    # Same tokens, wider rows: more attention work, so a higher cost (widths 200 vs 100, hidden 64).
    assert compiled_module.batch_cost(_mask(1, 200), 64) > compiled_module.batch_cost(_mask(2, 100), 64)
    padded = _mask(2, 100)
    padded[1, 50:] = 0
    assert compiled_module.batch_cost(padded, 64) == 100 * (384 + 100) + 50 * (384 + 50)
