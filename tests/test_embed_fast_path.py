"""`embed_dataset`'s compiled path (src/fastplms/compiled.py): same numbers as the eager path, compiled
only for large jobs (or when asked), cached on the model, rebuilt when the weights change.

One small seeded ESM2 is shared by the whole module so that it compiles once (tens of seconds on CPU).
"""

from __future__ import annotations

import random

import pytest
import torch

import fastplms.plm_base as plm_base
from fastplms.compiled import CompiledEmbedding
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
    # A job counts as large from this many residues: this one does, so the default settings compile.
    monkeypatch.setattr(plm_base, "COMPILE_MIN_RESIDUES", sum(LENGTHS))
    compiled = model.embed_dataset(
        sequences, per_residue=True, pooling=("mean", "max", "cls"), max_tokens_per_batch=512
    )
    runner = _runner(model)
    assert runner is not None and runner.calls > 0 and runner.compile_seconds is not None
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
