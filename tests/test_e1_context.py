"""E1 `embed_dataset` with per-record retrieval contexts and context sampling, on a small seeded model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fastplms.configuration_e1 import E1Config
from fastplms.convert.e1 import from_official
from fastplms.modeling_e1 import E1ForMaskedLM, E1Model, prepare_e1_inputs, query_identity, read_context, sample_context
from fastplms.oracles.e1 import e1_config_kwargs, e1_dims, e1_official_state_dict

DIMS = e1_dims("e1_150m")._replace(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
E1_ENCODE = E1ForMaskedLM.encode_context
RECORDS = [("a", "MKTAYIAKQRQISFV"), ("b", "GSHMSEQ"), ("c", "MKTAYIAKQ"), ("d", "PLVKRW")]
CTX_A = ["MKSAYIAKQRQLSF", "MRTAYLAKQQISW"]
CTX_B = ["GSHMSEQNDRFIL", "GAHM", "WWKR"]


@pytest.fixture(scope="module")
def model() -> E1ForMaskedLM:
    m = E1ForMaskedLM(E1Config(**e1_config_kwargs(DIMS)))
    m.load_state_dict(from_official(e1_official_state_dict(DIMS), DIMS.num_heads), strict=True)
    return m.eval()


def _alone(model, query: str, context: list[str]) -> torch.Tensor:
    """The query's residue states when it runs after `context` in one single-shot forward."""
    with torch.no_grad():
        hidden = model.e1(**prepare_e1_inputs(query, context)).last_hidden_state[0]
    start = sum(len(s) + 4 for s in context) + 2
    return hidden[start : start + len(query)]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-6) -> bool:
    return float((got.double() - want.double()).norm() / want.double().norm()) <= rtol


def _check_per_record(model, result, contexts: dict[str, list[str]], rtol: float) -> None:
    assert [r.id for r in result.records] == [rid for rid, _ in RECORDS]
    for record in result.records:
        want = _alone(model, record.sequence, contexts[record.id])
        assert _close(record.residues, want.float(), rtol), record.id  # the pipeline stores float32
        torch.testing.assert_close(record.pooled, want.float().mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("backend", "dtype"), [("eager", torch.float64), ("eager", torch.float32), ("sdpa", torch.float32)]
)
def test_a_mapping_of_contexts_equals_each_record_alone(model, tmp_path: Path, monkeypatch, backend, dtype) -> None:
    """As the context cache itself: in float64 on eager equal up to float64 round-off (bit-exact at most shapes;
    CPU BLAS blocking differs between the chained and the single-shot row at some), so the stored float32 states
    agree to 1e-7 relative; within 1e-6 relative in float32."""
    a3m = tmp_path / "b.a3m"
    a3m.write_text(">b\nGSHMSEQNDRFIL\n>hit\nGaHM--\n>hit2\nWW.KR\n")
    assert read_context(a3m) == CTX_B
    # a and c share one context (encoded once), b's comes from a file, d's is its own list
    mapping = {"a": CTX_A, "b": str(a3m), "c": list(CTX_A), "d": ["MKV"]}
    if dtype == torch.float64:
        monkeypatch.setattr(E1Model, "check_dtypes", lambda self, device_type: None)  # not a declared dtype
        model = copy.deepcopy(model).double()
    model.set_attn_implementation(backend)
    try:
        result = model.embed_dataset(RECORDS, context=mapping, per_residue=True, batch_size=2)
        contexts = {"a": CTX_A, "b": CTX_B, "c": CTX_A, "d": ["MKV"]}
        _check_per_record(model, result, contexts, 1e-7 if dtype == torch.float64 else 1e-6)
    finally:
        model.set_attn_implementation("eager")


def test_a_directory_of_contexts_and_a_missing_id(model, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "contexts"
    folder.mkdir()
    (folder / "a.a3m").write_text(">q\n" + "\n>h\n".join(CTX_A) + "\n")
    (folder / "b.fasta").write_text(">x\n" + "\n>y\n".join(CTX_B) + "\n")
    (folder / "c.a3m").write_text(">q\n" + "\n>h\n".join(CTX_A) + "\n")
    records = RECORDS[:3]
    encoded = []
    monkeypatch.setattr(type(model), "encode_context", lambda self, c: encoded.append(c) or E1_ENCODE(self, c))
    result = model.embed_dataset(records, context=str(folder), per_residue=True, batch_size=1)
    assert sorted(encoded) == sorted([tuple(CTX_A), tuple(CTX_B)])  # a and c share one encoded context
    monkeypatch.undo()
    for record, context in zip(result.records, [CTX_A, CTX_B, CTX_A], strict=True):
        assert _close(record.residues, _alone(model, record.sequence, context))
    with pytest.raises(ValueError, match=r"record 'd' has no context.*d\.a3m or d\.fasta"):
        model.embed_dataset(RECORDS, context=folder)
    with pytest.raises(ValueError, match="record 'd' has no context"):
        model.embed_dataset(RECORDS, context={"a": CTX_A, "b": CTX_B, "c": CTX_A})
    # an explicit policy: d runs without a context
    alone = model.embed_dataset(RECORDS, context=folder, missing_context="none", per_residue=True)
    assert torch.equal(
        alone.records[3].residues, model.embed_dataset([RECORDS[3]], per_residue=True).records[0].residues
    )
    (folder / "a.fasta").write_text(">x\nMKV\n")
    with pytest.raises(ValueError, match="both"):
        model.embed_dataset(records, context=folder)
    with pytest.raises(ValueError, match="missing_context"):
        model.embed_dataset(records, context=folder, missing_context="skip")


def test_sampling_is_seeded_budgeted_and_identity_filtered() -> None:
    query = "MKTAYIAKQRQISFV"
    pool = ["MKTAYIAKQRQISFV", "MKTAYIAKQRQISFA"] + [f"{'ACDEFGHIKL'[i % 10] * (5 + i)}" for i in range(40)]
    assert query_identity(query, query) == 1.0
    assert query_identity("MKTA", "MK") == 0.5
    assert query_identity("MKTA", "MKTV") == 0.75
    # under the budget and without a filter: everything, in order
    assert sample_context(pool[:3], query) == pool[:3]
    samples = {seed: sample_context(pool, query, context_tokens=120, seed=seed) for seed in range(6)}
    for seed, kept in samples.items():
        assert kept == sample_context(pool, query, context_tokens=120, seed=seed)  # deterministic
        assert sum(len(s) + 4 for s in kept) <= 120
        assert kept == [s for s in pool if s in kept]  # file order
        assert len(kept) >= 2
    assert len({tuple(kept) for kept in samples.values()}) > 1  # seeds differ
    filtered = sample_context(pool, query, context_tokens=None, max_identity=0.9)
    assert pool[0] not in filtered and pool[1] not in filtered and filtered == pool[2:]
    assert all(query_identity(query, s) <= 0.9 for s in filtered)
    assert len(sample_context(pool, query, context_tokens=None, max_sequences=5)) == 5


def test_sampling_in_embed_dataset_equals_the_sampled_context_alone(model) -> None:
    pool = CTX_A + CTX_B + ["MKTAYIAKQRQISFV"]
    query = RECORDS[0][1]
    result = model.embed_dataset(
        RECORDS[:1], context=pool, context_tokens=40, max_identity=0.95, seed=3, per_residue=True
    )
    kept = sample_context(pool, query, context_tokens=40, max_identity=0.95, seed=3)
    assert kept and query not in kept and sum(len(s) + 4 for s in kept) <= 40
    assert _close(result.records[0].residues, _alone(model, query, kept))
    with pytest.raises(ValueError, match="context_tokens"):
        model.embed_dataset(RECORDS[:1], context=pool, context_tokens=0)
    with pytest.raises(ValueError, match="max_identity"):
        model.embed_dataset(RECORDS[:1], context=pool, max_identity=1.5)


def test_resume_refuses_other_contexts(model, tmp_path: Path) -> None:
    folder = tmp_path / "ctx"
    folder.mkdir()
    for rid, _ in RECORDS:
        (folder / f"{rid}.fasta").write_text(">h\n" + CTX_A[0] + "\n")
    out = tmp_path / "emb.db"
    model.embed_dataset(RECORDS, context=folder, output=out)
    model.embed_dataset(RECORDS, context=folder, output=out, resume=True)  # same contexts: fine
    with pytest.raises(ValueError):
        model.embed_dataset(RECORDS, context=folder, output=out, resume=True, seed=1)
    (folder / "c.fasta").write_text(">h\n" + CTX_A[1] + "\n")
    with pytest.raises(ValueError):
        model.embed_dataset(RECORDS, context=folder, output=out, resume=True)
