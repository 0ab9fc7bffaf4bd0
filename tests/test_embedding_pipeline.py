"""The model-independent embedding pipeline: inputs, validation, batching, pooling, storage, resume."""

from __future__ import annotations

import gzip
import json
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fastplms import embedding, embedding_store
from fastplms.embedding import (
    POOLERS,
    ResidueEncoder,
    embed_dataset,
    open_sqlite_embeddings,
    read_embedding_meta,
    read_embeddings,
)

AMINO = "ACDEFGHIKLMNPQRSTVWY"
CLS, PAD, EOS = 0, 1, 2
ENCODER = ResidueEncoder(
    alphabet=frozenset(AMINO),
    to_id={c: 4 + i for i, c in enumerate(AMINO)},
    prefix=(CLS,),
    suffix=(EOS,),
    pad_id=PAD,
    max_residues=None,
)
DIM = 8


class ToyModel(nn.Module):
    """Per-token projection plus a masked sequence mean, so a record's states depend on its own
    tokens only; padded positions are NaN so any pooling that touches them shows up."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(4 + len(AMINO), DIM)
        self.token = nn.Linear(DIM, DIM)
        self.mix = nn.Linear(DIM, DIM)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator)
        self.calls: list[tuple[int, int]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(input_ids.shape))
        assert not torch.is_grad_enabled() and torch.is_inference_mode_enabled()
        x = self.embed(input_ids)
        mask = attention_mask.unsqueeze(-1).bool()
        context = x.masked_fill(~mask, 0).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        hidden = torch.tanh(self.token(x) + self.mix(context))
        return hidden.masked_fill(~mask, float("nan"))


class Crash(RuntimeError):
    pass


def crashing(model: ToyModel, after: int):
    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if len(model.calls) >= after:
            raise Crash(f"simulated crash after {after} batches")
        return model(input_ids, attention_mask)

    return forward


def residue_states(model: ToyModel, sequence: str) -> torch.Tensor:
    """The record alone, unpadded: (L, d) states of its residues."""
    ids = torch.tensor([[CLS, *(ENCODER.to_id[c] for c in sequence), EOS]])
    with torch.inference_mode():
        return model(ids, torch.ones_like(ids))[0].float()


def random_sequences(n: int, seed: int = 1, lo: int = 1, hi: int = 60) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(AMINO) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def assert_same_records(a, b, *, exact: bool = True) -> None:
    """Bit-equal for a stored copy of one run; within float noise across different batchings
    (CPU kernels may round a row differently in a differently shaped batch)."""
    assert [(r.id, r.header, r.sequence, r.index) for r in a] == [(r.id, r.header, r.sequence, r.index) for r in b]
    for x, y in zip(a, b, strict=True):
        for t, u in ((x.pooled, y.pooled), (x.residues, y.residues)):
            assert (t is None) == (u is None)
            if t is not None:
                assert t.dtype == u.dtype == torch.float32
                if exact:
                    assert torch.equal(t, u)
                else:
                    torch.testing.assert_close(t, u, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- inputs


def test_every_input_kind_gives_the_same_records(tmp_path: Path) -> None:
    model = ToyModel()
    seqs = random_sequences(5)
    ids = [f"seq{i}" for i in range(5)]
    fasta = tmp_path / "x.fasta"
    fasta.write_text("".join(f">{i} desc\n{s}\n" for i, s in zip(ids, seqs, strict=True)))
    txt = tmp_path / "x.txt"
    txt.write_text("\n".join(seqs) + "\n")
    noext = tmp_path / "x.data"  # FASTA by content, whatever the suffix
    noext.write_text(fasta.read_text())
    kinds = {
        "list": seqs,
        "tuple": tuple(seqs),
        "mapping": dict(zip(ids, seqs, strict=True)),
        "pairs": ((i, s) for i, s in zip(ids, seqs, strict=True)),
        "fasta-str": str(fasta),
        "fasta-path": fasta,
        "fasta-by-content": noext,
        "txt": txt,
    }
    reference = embed_dataset(model, ENCODER, seqs)
    assert reference.ids == ids and [r.index for r in reference.records] == list(range(5))
    for kind, inputs in kinds.items():
        result = embed_dataset(model, ENCODER, inputs)
        assert result.ids == ids, kind
        assert [r.sequence for r in result.records] == seqs, kind
        assert torch.equal(result.stack(), reference.stack()), kind
        expected_headers = [f"{i} desc" for i in ids] if "fasta" in kind else ids
        assert [r.header for r in result.records] == expected_headers, kind


def test_txt_ids_count_non_empty_lines(tmp_path: Path) -> None:
    txt = tmp_path / "s.txt"
    txt.write_text("\nMKV\n\n  ACD  \n\n")
    result = embed_dataset(ToyModel(), ENCODER, txt)
    assert [(r.id, r.sequence) for r in result.records] == [("seq0", "MKV"), ("seq1", "ACD")]


def test_fasta_multiline_headers_blank_lines_stop_codon_whitespace(tmp_path: Path) -> None:
    text = "\n\n>sp|P1|A first protein\r\nMKV LL\r\n\nACD*\n>p2\n  GG\tH  \nKK*\n>p3 empty-looking but fine\nW\n"
    path = tmp_path / "a.fa"
    path.write_text(text)
    gz = tmp_path / "a.faa.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    for source in (path, gz):
        records = embed_dataset(ToyModel(), ENCODER, source).records
        assert [(r.id, r.header, r.sequence) for r in records] == [
            ("sp|P1|A", "sp|P1|A first protein", "MKVLLACD"),
            ("p2", "p2", "GGHKK"),
            ("p3", "p3 empty-looking but fine", "W"),
        ]


def test_fasta_is_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the window at 3 records, a forward runs long before the last record is parsed.
    monkeypatch.setattr("fastplms.embedding.WINDOW_RECORDS", 3)
    seqs = random_sequences(10)
    path = tmp_path / "a.fasta"
    path.write_text("".join(f">r{i}\n{s}\n" for i, s in enumerate(seqs)))
    parsed: list[str] = []

    original = embedding._read_fasta

    def spy(p, lines):
        for record in original(p, lines):
            parsed.append(record[0])
            yield record

    monkeypatch.setattr(embedding, "_read_fasta", spy)
    model = ToyModel()
    parsed_at_call: list[int] = []

    def forward(ids, mask):
        parsed_at_call.append(len(parsed))
        return model(ids, mask)

    result = embed_dataset(forward, ENCODER, path, max_tokens_per_batch=10**6)
    assert result.ids == [f"r{i}" for i in range(10)]
    # the validation pre-pass parses all 10; the embedding pass then parses one window at a time
    assert parsed_at_call[0] == 10 + 3


def test_duplicate_ids_kept_and_reported() -> None:
    result = embed_dataset(ToyModel(), ENCODER, [("a", "MK"), ("b", "AC"), ("a", "W"), ("b", "K"), ("a", "G")])
    assert result.ids == ["a", "b", "a", "b", "a"]
    assert result.duplicate_ids == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.fasta", "MKV\n>a\nMK\n", r"bad\.fasta: line 1: sequence data before the first '>' header"),
        ("bad2.fa", "\n\nMKV\n", r"bad2\.fa: line 3: sequence data before the first '>' header"),
        ("weird.csv", "id,seq\n", r"weird\.csv: line 1: neither FASTA"),
        ("empty.bin", "", r"empty\.bin: line 1: empty file"),
        ("nohead.fasta", ">a\nMK\n>  \nAC\n", r"nohead\.fasta: line 3: FASTA header without an id"),
    ],
)
def test_bad_files_name_path_and_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        embed_dataset(ToyModel(), ENCODER, path)


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.fasta"
    with pytest.raises(OSError, match="missing.fasta"):
        embed_dataset(ToyModel(), ENCODER, missing)
    binary = tmp_path / "bin.fasta"
    binary.write_bytes(b">a\nMK\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bin\.fasta: line 3: not UTF-8"):
        embed_dataset(ToyModel(), ENCODER, binary)
    with pytest.raises(TypeError, match="input item 1"):
        embed_dataset(ToyModel(), ENCODER, ["MK", 5])


def test_validation_errors_name_record_position_length_limit() -> None:
    model = ToyModel()
    with pytest.raises(ValueError, match=r"record 'b': invalid residue 'X' at position 2"):
        embed_dataset(model, ENCODER, {"a": "MK", "b": "MKXA"})
    with pytest.raises(ValueError, match=r"record 'e': empty sequence"):
        embed_dataset(model, ENCODER, {"a": "MK", "e": ""})
    with pytest.raises(ValueError, match=r"record 'l': 6 residues exceeds the limit of 5 \(max_length\)"):
        embed_dataset(model, ENCODER, {"a": "MK", "l": "MKVLLA"}, max_length=5)
    capped = ResidueEncoder(**{**ENCODER.__dict__, "max_residues": 4})
    with pytest.raises(ValueError, match=r"record 'l': 6 residues exceeds the limit of 4 \(model maximum\)"):
        embed_dataset(model, capped, {"a": "MK", "l": "MKVLLA"}, max_length=5)
    assert not model.calls  # validation runs before any compute


def test_skip_and_truncate_policies_are_reported() -> None:
    model = ToyModel()
    inputs = {"ok": "MKV", "bad": "MK?V", "empty": "", "long": "ACDEFGHIK", "ok2": "W"}
    result = embed_dataset(model, ENCODER, inputs, invalid="skip", too_long="truncate", max_length=4)
    assert result.ids == ["ok", "long", "ok2"]
    assert result.skipped == [("bad", "invalid residue '?' at position 2"), ("empty", "empty sequence")]
    assert result.truncated == ["long"]
    assert result.records[1].sequence == "ACDE"
    assert [r.index for r in result.records] == [0, 3, 4]
    assert result.num_records == 3 and result.num_residues == 3 + 4 + 1
    skipped = embed_dataset(model, ENCODER, inputs, invalid="skip", too_long="skip", max_length=4)
    assert skipped.ids == ["ok", "ok2"]
    assert skipped.skipped[-1] == ("long", "too long: 9 > 4 residues")


def test_bad_arguments() -> None:
    model = ToyModel()
    with pytest.raises(ValueError, match=r"unknown pooling \['avg'\]; valid names are \['mean', 'max'"):
        embed_dataset(model, ENCODER, ["MK"], pooling=("mean", "avg"))
    no_prefix = ResidueEncoder(**{**ENCODER.__dict__, "prefix": ()})
    with pytest.raises(ValueError, match="'cls' needs a prefix"):
        embed_dataset(model, no_prefix, ["MK"], pooling=("cls",))
    with pytest.raises(ValueError, match="too_long"):
        embed_dataset(model, ENCODER, ["MK"], too_long="cut")


# ---------------------------------------------------------------- pooling and batching


def test_pooling_math_excludes_specials_and_padding() -> None:
    model = ToyModel()
    seqs = random_sequences(12, seed=3)
    result = embed_dataset(model, ENCODER, seqs, pooling=POOLERS, per_residue=True, max_tokens_per_batch=200)
    assert list(result.pooling_slices) == list(POOLERS)
    assert result.pooling_slices["mean"] == slice(0, DIM) and result.pooling_slices["last"] == slice(6 * DIM, 7 * DIM)
    assert result.stack().shape == (12, 7 * DIM)
    for record, seq in zip(result.records, seqs, strict=True):
        full = residue_states(model, seq)  # includes cls at 0 and eos at the end
        states = full[1:-1]
        expected = {
            "mean": states.mean(0),
            "max": states.max(0).values,
            "min": states.min(0).values,
            "std": states.std(0, unbiased=False),
            "sum": states.sum(0),
            "cls": full[0],
            "last": states[-1],
        }
        assert record.pooled is not None and record.pooled.dtype == torch.float32
        assert not record.pooled.is_inference() and not record.residues.is_inference()
        assert not torch.isnan(record.pooled).any()
        for name, value in expected.items():
            torch.testing.assert_close(record.pooled[result.pooling_slices[name]], value, atol=1e-5, rtol=1e-5)
        assert record.residues is not None and record.residues.shape == (len(seq), DIM)
        torch.testing.assert_close(record.residues, states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.stack("std"), result.stack()[:, 3 * DIM : 4 * DIM])


def test_concatenation_follows_request_order() -> None:
    model = ToyModel()
    seqs = random_sequences(4)
    both = embed_dataset(model, ENCODER, seqs, pooling=("max", "mean"))
    assert both.pooling_slices == {"max": slice(0, DIM), "mean": slice(DIM, 2 * DIM)}
    torch.testing.assert_close(both.stack("max"), embed_dataset(model, ENCODER, seqs, pooling="max").stack())
    torch.testing.assert_close(both.stack("mean"), embed_dataset(model, ENCODER, seqs).stack())
    residues_only = embed_dataset(model, ENCODER, seqs, pooling=(), per_residue=True)
    assert residues_only.records[0].pooled is None and residues_only.records[0].residues is not None


def test_token_budget_and_input_order() -> None:
    model = ToyModel()
    seqs = random_sequences(80, seed=7, lo=1, hi=120)
    seqs.append("A" * 300)  # longer than the budget on its own: goes alone
    random.Random(0).shuffle(seqs)
    seen: list[tuple[int, int]] = []
    budget = 512
    result = embed_dataset(model, ENCODER, seqs, max_tokens_per_batch=budget, progress=lambda *a: seen.append(a))
    batches = list(model.calls)
    assert all(b * s <= budget or b == 1 for b, s in batches)
    assert (1, 302) in model.calls
    assert [r.sequence for r in result.records] == seqs
    assert result.ids == [f"seq{i}" for i in range(len(seqs))]
    # batch composition does not change a record's vector
    for record, seq in zip(result.records, seqs, strict=True):
        torch.testing.assert_close(record.pooled, residue_states(model, seq)[1:-1].mean(0), atol=1e-5, rtol=1e-5)
    # progress: after each batch, cumulative, with a known total
    assert len(seen) == len(batches)
    assert seen[-1] == (len(seqs), sum(map(len, seqs)), len(seqs))
    assert [s[0] for s in seen] == sorted(s[0] for s in seen)
    capped = ToyModel()
    embed_dataset(capped, ENCODER, seqs, max_tokens_per_batch=10**6, batch_size=7)
    assert max(b for b, _ in capped.calls) == 7


def test_first_batch_is_a_quarter_budget_so_the_first_result_comes_early() -> None:
    model = ToyModel()
    seqs = ["ACDEFGHIKL" * 4] * 200  # 42 tokens each: 97 rows fill a 4,096-token batch
    embed_dataset(model, ENCODER, seqs, max_tokens_per_batch=4096)
    (first_rows, width), *rest = model.calls
    assert width == 42 and first_rows == 4096 // 4 // 42
    assert [rows for rows, _ in rest] == [97, 200 - first_rows - 97]


# ---------------------------------------------------------------- storage


def make_inputs(n: int = 23) -> dict[str, str]:
    seqs = random_sequences(n, seed=11, lo=1, hi=40)
    return {f"p{i}": s for i, s in enumerate(seqs)}


OUTPUTS = ["out.db", "out.sqlite3", "shards"]


@pytest.mark.parametrize("name", OUTPUTS)
def test_output_round_trip_equals_memory(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding_store, "SHARD_RECORDS", 5)
    model = ToyModel()
    inputs = {**make_inputs(), "bad": "MKB", "long": "A" * 45}
    options = dict(pooling=("mean", "max"), per_residue=True, invalid="skip", too_long="truncate", max_length=40)
    memory = embed_dataset(model, ENCODER, inputs, max_tokens_per_batch=128, **options)
    out = tmp_path / name
    written = embed_dataset(model, ENCODER, inputs, max_tokens_per_batch=128, output=out, **options)
    assert written.records == [] and written.output == str(out) and written.num_records == memory.num_records
    back = read_embeddings(out)
    assert_same_records(back.records, memory.records)
    assert back.pooling_slices == memory.pooling_slices
    assert (
        (back.skipped, back.truncated)
        == (memory.skipped, memory.truncated)
        == ([("bad", "invalid residue 'B' at position 2")], ["long"])
    )
    assert torch.equal(back.stack(), memory.stack())
    meta = read_embedding_meta(out)
    assert meta["status"] == "complete" and meta["fingerprint"]["pooling"] == ["mean", "max"]
    if name == "shards":
        shards = json.loads((out / "index.json").read_text())["shards"]
        assert len(shards) > 1 and sum(shard["records"] for shard in shards) == 24
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_sqlite_is_readable_with_plain_sqlite3_and_struct(tmp_path: Path) -> None:
    model = ToyModel()
    inputs = make_inputs(6)
    db = tmp_path / "e.sqlite"
    embed_dataset(model, ENCODER, inputs, pooling=("mean", "cls"), per_residue=True, output=db)
    memory = embed_dataset(model, ENCODER, inputs, pooling=("mean", "cls"), per_residue=True)
    conn = sqlite3.connect(db)
    columns = [row[1] for row in conn.execute("PRAGMA table_info(embeddings)")]
    assert columns == ["idx", "id", "header", "sequence", "length", "pooled", "residues", "dtype", "dim"]
    meta = {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    assert meta["status"] == "complete" and meta["pooling_slices"] == {
        "mean": [0, DIM],
        "cls": [DIM, 2 * DIM],
    }
    rows = conn.execute("SELECT idx, id, length, pooled, residues, dtype, dim FROM embeddings ORDER BY idx").fetchall()
    conn.close()
    assert [r[1] for r in rows] == list(inputs)
    for (idx, rid, length, pooled, residues, dtype, dim), record in zip(rows, memory.records, strict=True):
        assert (idx, rid, dtype, dim, length) == (
            record.index,
            record.id,
            "float32",
            DIM,
            len(record.sequence),
        )
        assert list(struct.unpack(f"<{len(pooled) // 4}f", pooled)) == record.pooled.tolist()
        assert list(struct.unpack(f"<{length * dim}f", residues)) == record.residues.flatten().tolist()
    with open_sqlite_embeddings(db) as ro, pytest.raises(sqlite3.OperationalError):
        ro.execute("DELETE FROM embeddings")


@pytest.mark.parametrize("name", ["x.db", "x_shards"])
def test_existing_output_is_not_overwritten(tmp_path: Path, name: str) -> None:
    model = ToyModel()
    out = tmp_path / name
    embed_dataset(model, ENCODER, ["MK", "AC"], output=out)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        embed_dataset(model, ENCODER, ["W"], output=out)
    with pytest.raises(ValueError, match="not both"):
        embed_dataset(model, ENCODER, ["W"], output=out, resume=True, overwrite=True)
    embed_dataset(model, ENCODER, ["W"], output=out, overwrite=True)
    assert [r.sequence for r in read_embeddings(out).records] == ["W"]


def test_foreign_directory_is_never_touched(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="without index.json"):
        embed_dataset(ToyModel(), ENCODER, ["MK"], output=tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", OUTPUTS)
def test_resume_after_crash_matches_uninterrupted_run(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedding_store, "SHARD_RECORDS", 4)
    monkeypatch.setattr("fastplms.embedding.WINDOW_RECORDS", 8)
    inputs = make_inputs(30)
    options = dict(pooling=("mean", "std"), per_residue=True, max_tokens_per_batch=96, fingerprint={"model": "toy"})
    clean = embed_dataset(ToyModel(), ENCODER, inputs, output=tmp_path / ("clean-" + name), **options)
    uninterrupted = read_embeddings(clean.output)

    out = tmp_path / name
    crashed = ToyModel()
    with pytest.raises(Crash):
        embed_dataset(crashing(crashed, after=5), ENCODER, inputs, output=out, **options)
    with pytest.raises(ValueError, match="incomplete"):
        read_embeddings(out)
    partial = read_embeddings(out, allow_incomplete=True)
    assert 0 < len(partial.records) < 30 and not partial.complete

    resumed_model = ToyModel()
    result = embed_dataset(resumed_model, ENCODER, inputs, output=out, resume=True, **options)
    assert result.num_resumed == len(partial.records) and result.num_records == 30
    assert sum(b for b, _ in resumed_model.calls) == 30 - len(partial.records)
    final = read_embeddings(out)
    indices = [r.index for r in final.records]
    assert indices == list(range(30))  # no duplicates, no gaps
    assert_same_records(final.records, uninterrupted.records, exact=False)

    # resuming a complete output computes nothing and changes nothing
    idle = ToyModel()
    embed_dataset(idle, ENCODER, inputs, output=out, resume=True, **options)
    assert idle.calls == []
    assert_same_records(read_embeddings(out).records, final.records)


@pytest.mark.parametrize("name", ["r.db", "r_shards"])
def test_resume_refuses_other_settings_or_inputs(tmp_path: Path, name: str) -> None:
    model = ToyModel()
    inputs = make_inputs(6)
    out = tmp_path / name
    with pytest.raises(Crash):
        embed_dataset(
            crashing(model, after=1),
            ENCODER,
            inputs,
            output=out,
            max_tokens_per_batch=64,
            fingerprint={"model": "a"},
        )
    cases = [
        ({"pooling": ("max",)}, r"pooling \(stored \['mean'\], now \['max'\]\)"),
        ({"per_residue": True}, "per_residue"),
        ({"max_length": 100}, "max_length"),
        ({"fingerprint": {"model": "b"}}, r"model \(stored 'a', now 'b'\)"),
        ({"inputs": {**inputs, "p0": "MKV"}}, "input_sha256"),
    ]
    for change, message in cases:
        args = {"inputs": inputs, "fingerprint": {"model": "a"}, **change}
        with pytest.raises(ValueError, match=message):
            embed_dataset(ToyModel(), ENCODER, output=out, resume=True, **args)
    assert read_embedding_meta(out)["status"] == "running"


def test_resume_without_output_starts_fresh(tmp_path: Path) -> None:
    out = tmp_path / "fresh.db"
    embed_dataset(ToyModel(), ENCODER, ["MK"], output=out, resume=True)
    assert read_embeddings(out).ids == ["seq0"]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import test_embedding_pipeline as t
    from fastplms import embedding, embedding_store
    embedding_store.SHARD_RECORDS = 4
    embedding.WINDOW_RECORDS = 8
    model = t.ToyModel()
    def forward(ids, mask):
        if len(model.calls) == {after}:
            os.kill(os.getpid(), signal.SIGKILL)
        return model(ids, mask)
    embedding.embed_dataset(forward, t.ENCODER, t.make_inputs(30), output={out!r}, max_tokens_per_batch=96)
    """
)


@pytest.mark.parametrize("name", ["k.db", "k_shards"])
def test_resume_after_sigkill(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / name
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), after=6, out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = read_embeddings(out, allow_incomplete=True)
    assert 0 < len(partial.records) < 30
    monkeypatch.setattr(embedding_store, "SHARD_RECORDS", 4)
    model = ToyModel()
    embed_dataset(model, ENCODER, make_inputs(30), output=out, resume=True, max_tokens_per_batch=96)
    final = read_embeddings(out)
    assert [r.index for r in final.records] == list(range(30))
    assert_same_records(final.records, embed_dataset(ToyModel(), ENCODER, make_inputs(30)).records, exact=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activation_memory_is_kept_for_reuse_on_glibc() -> None:
    from fastplms.embedding import reuse_freed_memory

    assert reuse_freed_memory() is True  # set once per process; a second call is the cached answer
    assert reuse_freed_memory() is True
