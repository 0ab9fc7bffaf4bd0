"""`model.embed_dataset` on the real ESM2 model: inputs, pooling math, batch independence, BF16, dtypes.

tests/test_embedding_pipeline.py covers the model-independent pipeline with a toy forward; here every
embedding comes from ESM2 itself (seeded official-layout weights converted by the real converter), and
every expected value is computed by calling the model directly on one sequence at a time.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fastplms.configuration_esm2 import ESM2Config
from fastplms.convert.esm2 import from_transformers
from fastplms.manifest import find_checkpoint
from fastplms.modeling_esm2 import ESM2ForMaskedLM, ESM2Model
from fastplms.oracles.esm2 import ESM2_VOCAB, hf_esm2_state_dict

AMINO = "ACDEFGHIKLMNPQRSTVWY"
TINY = (2, 64, 4)  # layers, hidden, heads
CLS, EOS = ESM2_VOCAB.index("<cls>"), ESM2_VOCAB.index("<eos>")
# Lengths chosen so that every token budget below mixes records of very different lengths.
PANEL_LENGTHS = (1, 2, 5, 9, 17, 30, 44, 63, 64, 65, 90, 127, 150, 200)
BUDGETS = (64, 512, 4096)
REL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on two shared cores a second one mostly waits for the first (embedding
    measured 2-5x slower with two threads while other jobs ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded_esm2(dims: tuple[int, int, int], cls: type = ESM2Model, backend: str = "sdpa"):
    """ESM2 with seeded official-layout weights (the same numbers the seeded snapshots hold)."""
    layers, hidden, heads = dims
    state = from_transformers(hf_esm2_state_dict(layers, hidden, heads, seed=0), heads)
    if cls is ESM2Model:
        state = {key.removeprefix("esm."): value for key, value in state.items() if key.startswith("esm.")}
    model = cls(ESM2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads))
    model.load_state_dict(state)
    model.set_attn_implementation(backend)
    return model.eval()


def random_sequences(lengths, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    return {f"p{i}_len{n}": "".join(rng.choice(AMINO) for _ in range(n)) for i, n in enumerate(lengths)}


def alone(model: ESM2Model, sequence: str) -> torch.Tensor:
    """Last hidden states (L + 2, d) of one unpadded sequence, tokenized from the official vocabulary."""
    ids = torch.tensor([[CLS, *(ESM2_VOCAB.index(c) for c in sequence), EOS]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def tiny() -> ESM2Model:
    return seeded_esm2(TINY)


@pytest.fixture(scope="module")
def panel() -> dict[str, str]:
    return random_sequences(PANEL_LENGTHS)


@pytest.fixture(scope="module")
def references(tiny: ESM2Model, panel: dict[str, str]) -> dict[str, torch.Tensor]:
    return {rid: alone(tiny, sequence) for rid, sequence in panel.items()}


# ---------------------------------------------------------------- inputs and pooling math


def test_every_input_kind_on_esm2(tmp_path: Path, tiny: ESM2Model, panel, references) -> None:
    fasta = tmp_path / "panel.fasta"
    # 60-column FASTA with descriptions: ids are the header up to the first whitespace.
    fasta.write_text(
        "".join(
            f">{rid} some description\n" + "".join(seq[i : i + 60] + "\n" for i in range(0, len(seq), 60))
            for rid, seq in panel.items()
        )
    )
    ids = list(panel)
    sequences = list(panel.values())
    kinds = {
        "fasta": (fasta, ids),
        "mapping": (panel, ids),
        "pairs": (iter(panel.items()), ids),
        "list": (sequences, [f"seq{i}" for i in range(len(sequences))]),
    }
    results = {}
    for kind, (inputs, expected_ids) in kinds.items():
        result = tiny.embed_dataset(inputs, max_tokens_per_batch=512)
        assert result.ids == expected_ids, kind
        assert [r.sequence for r in result.records] == sequences, kind
        assert result.num_records == len(panel) and result.num_residues == sum(PANEL_LENGTHS)
        assert result.pooling_slices == {"mean": slice(0, TINY[1])}
        results[kind] = result.stack()
    for kind, pooled in results.items():  # same records, same batches: bit-identical
        assert torch.equal(pooled, results["mapping"]), kind
    assert results["fasta"].shape == (len(panel), TINY[1]) and results["fasta"].dtype == torch.float32
    for row, rid in enumerate(ids):
        # Mean over the residue positions only: <cls> (row 0) and <eos> (row L + 1) excluded.
        expected = references[rid][1:-1].mean(0)
        assert rel_err(results["mapping"][row], expected) < REL, rid
        with_specials = references[rid].mean(0)
        assert rel_err(results["mapping"][row], with_specials) > 1e-3, "specials would have been noticed"


def test_poolers_concatenate_in_request_order(tiny: ESM2Model, panel, references) -> None:
    names = ("max", "mean", "std", "sum", "min", "cls", "last")
    result = tiny.embed_dataset(panel, pooling=names, max_tokens_per_batch=512)
    d = TINY[1]
    assert result.pooling_slices == {name: slice(i * d, (i + 1) * d) for i, name in enumerate(names)}
    stacked = result.stack()
    assert stacked.shape == (len(panel), len(names) * d)
    for row, (rid, sequence) in enumerate(panel.items()):
        h = references[rid]
        residues = h[1 : len(sequence) + 1]
        expected = {
            "max": residues.amax(0),
            "mean": residues.mean(0),
            "std": residues.std(0, correction=0),
            "sum": residues.sum(0),
            "min": residues.amin(0),
            "cls": h[0],
            "last": h[len(sequence)],
        }
        for name in names:
            got = result.stack(name)[row]
            assert torch.equal(got, stacked[row, result.pooling_slices[name]])
            if name == "std" and len(sequence) == 1:
                assert torch.allclose(got, torch.zeros(d), atol=1e-6)
            else:
                assert rel_err(got, expected[name]) < REL, (rid, name)


def test_per_residue_shape_and_values(tiny: ESM2Model, panel, references) -> None:
    result = tiny.embed_dataset(panel, pooling=(), per_residue=True, max_tokens_per_batch=512)
    for record in result.records:
        length = len(record.sequence)
        assert record.pooled is None
        assert record.residues.shape == (length, TINY[1]) and record.residues.dtype == torch.float32
        assert rel_err(record.residues, references[record.id][1 : length + 1]) < REL, record.id
    with pytest.raises(ValueError, match="without pooling"):
        result.stack()


def test_masked_lm_embeds_with_its_encoder(tiny: ESM2Model, panel) -> None:
    """ESM2ForMaskedLM embeds through its base model: same vectors as the bare encoder."""
    masked_lm = seeded_esm2(TINY, cls=ESM2ForMaskedLM)
    assert masked_lm.training is False
    masked_lm.train()  # embed_dataset runs in eval mode and restores the caller's mode
    a = masked_lm.embed_dataset(panel, max_tokens_per_batch=512)
    assert masked_lm.training is True
    b = tiny.embed_dataset(panel, max_tokens_per_batch=512)
    assert a.ids == b.ids and torch.equal(a.stack(), b.stack())
    # The LM head is part of the identity (hashed only for runs with an output, so asked for directly here).
    assert masked_lm.model_fingerprint()["model_sha256"] != tiny.model_fingerprint()["model_sha256"]


# ---------------------------------------------------------------- batch composition


def _recording(model: ESM2Model, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    forward = model.embedding_forward

    def spy(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, attention_mask)

    monkeypatch.setattr(model, "embedding_forward", spy)
    return shapes


def _check_batch_independence(model: ESM2Model, panel, references, budgets, monkeypatch) -> None:
    shapes = _recording(model, monkeypatch)
    widths = {}
    for budget in budgets:
        shapes.clear()
        result = model.embed_dataset(panel, pooling=("mean", "max"), per_residue=True, max_tokens_per_batch=budget)
        assert result.ids == list(panel)
        assert all(b * s <= budget or b == 1 for b, s in shapes), (budget, shapes)
        widths[budget] = shapes[:]
        for record in result.records:
            h = references[record.id][1:-1]
            assert rel_err(record.residues, h) < REL, (budget, record.id)
            assert rel_err(result.stack("mean")[result.ids.index(record.id)], h.mean(0)) < REL, (budget, record.id)
            assert rel_err(result.stack("max")[result.ids.index(record.id)], h.amax(0)) < REL, (budget, record.id)
    # The compositions really differ: many small batches at the smallest budget, and at the largest one
    # records share a batch padded to a much longer partner.
    assert len(widths[min(budgets)]) > len(widths[max(budgets)])
    assert any(b > 1 and s > 100 for b, s in widths[max(budgets)])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_batch_composition_does_not_change_results(backend, panel, references, monkeypatch) -> None:
    model = seeded_esm2(TINY, backend=backend)
    assert model.attention_backend() == backend
    _check_batch_independence(model, panel, references, BUDGETS, monkeypatch)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_batch_composition_compiled_flex(monkeypatch) -> None:
    """Once for compiled Flex: every new (batch, padded length) shape costs a compile on CPU."""
    model = seeded_esm2(TINY, backend="flex_attention")
    # All under one Flex block (128 tokens), so alone and batched each compile one shape only.
    panel = random_sequences((3, 40, 100), seed=1)
    references = {rid: alone(seeded_esm2(TINY), sequence) for rid, sequence in panel.items()}
    shapes = _recording(model, monkeypatch)
    batched = model.embed_dataset(panel, pooling=("mean", "max"), per_residue=True, max_tokens_per_batch=4096)
    assert shapes == [(3, 102)]
    single = [model.embed_dataset([sequence], per_residue=True).records[0] for sequence in panel.values()]
    for record, lone in zip(batched.records, single, strict=True):
        h = references[record.id][1:-1]
        assert rel_err(record.residues, lone.residues) < REL, record.id
        assert rel_err(record.residues, h) < REL, record.id  # and Flex agrees with SDPA
        assert rel_err(batched.stack("mean")[batched.ids.index(record.id)], h.mean(0)) < REL


# ---------------------------------------------------------------- dtypes


@pytest.fixture(scope="module")
def esm2_8m() -> ESM2Model:
    return seeded_esm2(find_checkpoint("esm2_8m")[1].dims)


def test_bf16_autocast_stays_close_to_fp32(esm2_8m: ESM2Model) -> None:
    inputs = random_sequences((12, 33, 57, 101, 180), seed=3)
    fp32 = esm2_8m.embed_dataset(inputs, pooling=("mean", "max"), max_tokens_per_batch=1024)
    bf16 = esm2_8m.embed_dataset(inputs, pooling=("mean", "max"), max_tokens_per_batch=1024, dtype="bfloat16")
    assert next(esm2_8m.parameters()).dtype == torch.float32  # autocast: storage stays float32
    assert bf16.fingerprint["dtype"] == "bfloat16" and fp32.fingerprint["dtype"] == "float32"
    assert bf16.ids == fp32.ids
    a, b = bf16.stack("mean"), fp32.stack("mean")
    assert a.dtype == torch.float32  # outputs are float32 whatever the compute dtype
    assert not torch.equal(a, b), "bfloat16 made no difference: autocast did not run"
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cosine.min()) > 0.99, cosine
    assert rel_err(a, b) < 0.1


def test_undeclared_dtype_is_refused(tiny: ESM2Model) -> None:
    for dtype in ("float16", "fp32", "int8"):
        with pytest.raises(ValueError, match=rf"dtype '{dtype}' is not declared for ESM2: \['float32', 'bfloat16'\]"):
            tiny.embed_dataset(["MKV"], dtype=dtype)
    fp32_only = seeded_esm2(TINY)
    fp32_only.config.allowed_dtypes = ["float32"]
    with pytest.raises(ValueError, match="dtype 'bfloat16' is not declared"):
        fp32_only.embed_dataset(["MKV"], dtype="bfloat16")


def test_weights_fingerprint_is_exact_and_thread_independent(esm2_8m: ESM2Model) -> None:
    """Resume compares this fingerprint: equal weights must match under any thread count (a float sum
    of the weights did not), and a one-ulp change must not."""
    threads = torch.get_num_threads()
    try:
        prints = []
        for n in (1, 2):
            torch.set_num_threads(n)
            prints.append(esm2_8m.model_fingerprint())
    finally:
        torch.set_num_threads(threads)
    assert prints[0] == prints[1]
    model = seeded_esm2(TINY)
    before = model.model_fingerprint()
    with torch.no_grad():
        weight = model.layers[0].fc1.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert model.model_fingerprint()["model_sha256"] != before["model_sha256"]
