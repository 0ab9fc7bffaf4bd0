"""`fastplms embed` on a real artifact, crash safety with a killed process, the demo, the progress bar.

The artifact is built once per session by the real builder from a seeded, official-layout ESM2-8M
snapshot (random weights, real dimensions). Every stored result is compared with the in-process
`model.embed_dataset` of the same artifact.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fastplms import cli
from fastplms.artifact.build import build
from fastplms.cli import demo
from fastplms.embedding import read_embedding_meta, read_embeddings
from fastplms.manifest import find_checkpoint
from fastplms.oracles.esm2 import write_hf_snapshot

AMINO = "ACDEFGHIKLMNPQRSTVWY"
DIMS = find_checkpoint("esm2_8m")[1].dims
DIM = DIMS[1]
# One intra-op thread in the children too (see one_thread); offline: artifacts are local folders.
SUBPROCESS_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on two shared cores a second one mostly waits for the first (embedding
    measured 2-5x slower with two threads while other jobs ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("esm2_8m")
    snapshot = write_hf_snapshot(root / "esm2_t6_8M_UR50D", *DIMS, seed=0)
    return str(build("esm2_8m", snapshot, root / "ESM2-8M-seeded", allow_unpinned=True))


@pytest.fixture(scope="session")
def model(artifact: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(artifact, trust_remote_code=True).eval()


def random_records(n: int, low: int, high: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    return {f"prot{i}": "".join(rng.choice(AMINO) for _ in range(rng.randint(low, high))) for i in range(n)}


def write_fasta(path: Path, records: dict[str, str]) -> Path:
    path.write_text("".join(f">{rid} test record {i}\n{seq}\n" for i, (rid, seq) in enumerate(records.items())))
    return path


SMALL = random_records(12, 20, 90, seed=0)


@pytest.fixture(scope="module")
def fasta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fasta(tmp_path_factory.mktemp("inputs") / "small.fasta", SMALL)


def embed(*args: object) -> tuple[int, str, str]:
    """Run `fastplms embed` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["embed", *map(str, args)])
    return code, out.getvalue(), err.getvalue()


def assert_same(stored, expected, *, residues: bool = False) -> None:
    assert stored.ids == expected.ids
    assert [r.index for r in stored.records] == [r.index for r in expected.records]
    assert [(r.sequence, r.header) for r in stored.records] == [(r.sequence, r.header) for r in expected.records]
    assert stored.pooling_slices == expected.pooling_slices
    torch.testing.assert_close(stored.stack(), expected.stack(), rtol=1e-5, atol=1e-6)
    if residues:
        for a, b in zip(stored.records, expected.records, strict=True):
            torch.testing.assert_close(a.residues, b.residues, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def outputs(artifact: str, fasta: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """One CLI run per output format: {kind: (output path, stdout)}."""
    root = tmp_path_factory.mktemp("outputs")
    runs = {}
    for kind, out, extra in (
        ("sqlite", root / "small.db", ["--pooling", "mean,max"]),
        ("shards", root / "small_shards", ["--pooling", "mean", "--per-residue"]),
    ):
        code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out, "--max-tokens", 300, *extra)
        assert code == 0, stderr
        runs[kind] = (out, stdout)
    return runs


# ---------------------------------------------------------------- outputs


def test_summary_and_sqlite_output_equal_in_process(outputs, model, fasta: Path, artifact: str) -> None:
    db, stdout = outputs["sqlite"]
    residues = sum(map(len, SMALL.values()))
    assert f"records      {len(SMALL)}\n" in stdout
    assert f"residues     {residues}\n" in stdout
    assert f"model        {artifact} (ESM2, sdpa, float32)\n" in stdout
    assert f"pooling      mean 0:{DIM}, max {DIM}:{2 * DIM}\n" in stdout
    assert f"output       {db}\n" in stdout
    assert re.search(r"^time         \d+\.\d s$", stdout, re.MULTILINE), stdout
    assert re.search(r"^throughput   [\d,]+ residues/s$", stdout, re.MULTILINE), stdout

    stored = read_embeddings(db)
    expected = model.embed_dataset(fasta, pooling=("mean", "max"), max_tokens_per_batch=300)
    assert stored.complete and stored.ids == list(SMALL)
    assert_same(stored, expected)
    # The CLI and the API fingerprint runs alike, so either may resume the other's output (the weights are
    # hashed only for a run with an output: the in-memory `expected` has no model_sha256).
    assert stored.fingerprint == {**expected.fingerprint, **model.model_fingerprint()}

    # The documented layout, read with nothing but sqlite3 and struct.
    conn = sqlite3.connect(db)
    meta = {key: json.loads(value) for key, value in conn.execute("SELECT key, value FROM meta")}
    rows = conn.execute("SELECT id, length, pooled, dtype, dim FROM embeddings ORDER BY idx").fetchall()
    conn.close()
    assert meta["status"] == "complete" and meta["pooling_slices"] == {"mean": [0, DIM], "max": [DIM, 2 * DIM]}
    for (rid, length, blob, dtype, dim), record in zip(rows, expected.records, strict=True):
        assert (rid, length, dtype, dim) == (record.id, len(record.sequence), "float32", DIM)
        vector = torch.tensor(struct.unpack(f"<{len(blob) // 4}f", blob))
        torch.testing.assert_close(vector, record.pooled, rtol=1e-5, atol=1e-6)


def test_shard_directory_output_equal_in_process(outputs, model, fasta: Path) -> None:
    out, stdout = outputs["shards"]
    assert f"output       {out}\n" in stdout
    stored = read_embeddings(out)
    expected = model.embed_dataset(fasta, pooling="mean", per_residue=True, max_tokens_per_batch=300)
    assert_same(stored, expected, residues=True)
    assert all(r.residues.shape == (len(r.sequence), DIM) for r in stored.records)

    index = json.loads((out / "index.json").read_text())
    assert index["status"] == "complete" and index["num_records"] == len(SMALL)
    with safe_open(str(out / index["shards"][0]["file"]), "pt") as shard:
        ids = json.loads(shard.metadata()["ids"])
        offsets = shard.get_tensor("offsets")
        assert shard.get_tensor("residues").shape == (int(offsets[-1]), DIM)
        assert shard.get_tensor("pooled").shape == (len(ids), DIM)
    assert ids == list(SMALL)


@pytest.mark.parametrize("kind", ["sqlite", "shards"])
def test_existing_output_is_kept_without_overwrite(kind, outputs, artifact, fasta, tmp_path: Path) -> None:
    source, _ = outputs[kind]
    out = tmp_path / source.name
    (shutil.copytree if source.is_dir() else shutil.copy2)(source, out)
    before = snapshot_files(out)

    code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out, "--pooling", "max")
    assert code != 0 and stdout == ""
    assert f"fastplms embed: error: {out} exists; pass --overwrite to replace it or --resume to continue it" in stderr
    assert snapshot_files(out) == before

    code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out, "--pooling", "max", "--overwrite")
    assert code == 0, stderr
    replaced = read_embeddings(out)
    assert replaced.pooling_slices == {"max": slice(0, DIM)} and replaced.ids == list(SMALL)


def snapshot_files(path: Path) -> dict[str, tuple[bytes, int]]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}


@pytest.mark.parametrize("kind", ["sqlite", "shards"])
def test_resume_with_other_settings_is_refused(kind, outputs, artifact, fasta, tmp_path: Path) -> None:
    source, _ = outputs[kind]
    out = tmp_path / source.name
    (shutil.copytree if source.is_dir() else shutil.copy2)(source, out)
    before = snapshot_files(out)
    stored_pooling = ["mean", "max"] if kind == "sqlite" else ["mean"]
    per_residue = ["--per-residue"] if kind == "shards" else []

    code, _, stderr = embed(fasta, "--model", artifact, "--out", out, "--pooling", "min", *per_residue, "--resume")
    assert code != 0
    assert f"cannot resume {out}: it was made from different inputs or settings" in stderr
    assert f"pooling (stored {stored_pooling!r}, now ['min'])" in stderr
    assert snapshot_files(out) == before

    # The same settings resume, under another thread count too: a complete output is taken over whole.
    pooling = ",".join(stored_pooling)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code, stdout, stderr = embed(
            fasta, "--model", artifact, "--out", out, "--resume", "--pooling", pooling, *per_residue
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stderr
    assert f"records      {len(SMALL)} ({len(SMALL)} resumed)\n" in stdout
    assert_same(read_embeddings(out), read_embeddings(source), residues=bool(per_residue))


# ---------------------------------------------------------------- bad inputs


BAD = {"ok1": "MKTAYIAKQR", "bad1": "MKTAYJAKQR", "ok2": "GSHMLEDPVA"}  # 'J' at 0-based position 5


def test_bad_residue_names_record_position_and_character(artifact: str, tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "bad.fasta", BAD)
    out = tmp_path / "bad.db"
    code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out)
    assert code != 0 and stdout == ""
    assert "fastplms embed: error: record 'bad1': invalid residue 'J' at position 5" in stderr
    assert "pass --invalid skip to skip such records" in stderr
    assert not out.exists()  # validation runs before any output is created

    code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out, "--invalid", "skip")
    assert code == 0, stderr
    assert "records      2\n" in stdout
    assert "skipped      1: bad1 (invalid residue 'J' at position 5)\n" in stdout
    stored = read_embeddings(out)
    assert stored.ids == ["ok1", "ok2"] and [r.index for r in stored.records] == [0, 2]
    assert stored.skipped == [("bad1", "invalid residue 'J' at position 5")]


def test_too_long_raise_and_truncate(artifact: str, model, tmp_path: Path) -> None:
    records = {"short": "MKTAY", "long": "MKTAYIAKQRQISFVKSHFSRQ", "edge": "GSHMLEDPVA"}
    fasta = write_fasta(tmp_path / "long.fasta", records)
    out = tmp_path / "long.db"
    code, _, stderr = embed(fasta, "--model", artifact, "--out", out, "--max-length", 10)
    assert code != 0
    assert "record 'long': 22 residues exceeds the limit of 10 (max_length)" in stderr
    assert "pass --too-long truncate or --too-long skip" in stderr
    assert not out.exists()

    code, stdout, stderr = embed(fasta, "--model", artifact, "--out", out, "--max-length", 10, "--too-long", "truncate")
    assert code == 0, stderr
    assert "truncated    1: long\n" in stdout
    assert f"residues     {5 + 10 + 10}\n" in stdout
    stored = read_embeddings(out)
    assert [r.sequence for r in stored.records] == ["MKTAY", "MKTAYIAKQR", "GSHMLEDPVA"]
    assert stored.truncated == ["long"]
    expected = model.embed_dataset({rid: seq[:10] for rid, seq in records.items()})
    torch.testing.assert_close(stored.stack(), expected.stack(), rtol=1e-5, atol=1e-6)


def test_undeclared_dtype_is_refused_by_the_cli(artifact: str, fasta: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()) as err:
        cli.main(["embed", str(fasta), "--model", artifact, "--out", str(tmp_path / "x.db"), "--dtype", "float16"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'float16'" in err.getvalue()


# ---------------------------------------------------------------- crash safety with a killed process


def _committed(out: Path) -> int | None:
    """Records committed so far, read without writing anything (None while unreadable)."""
    try:
        if out.suffix == ".db":
            conn = sqlite3.connect(out.absolute().as_uri() + "?mode=ro", uri=True, timeout=0.05)
            try:
                return conn.execute("SELECT count(*) FROM embeddings").fetchone()[0]
            finally:
                conn.close()
        return json.loads((out / "index.json").read_text())["num_records"]
    except (sqlite3.Error, OSError, ValueError, KeyError):
        return None


def _cli_process(args: list[object], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "fastplms.cli", "embed", *map(str, args)]
    with open(log, "wb") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=SUBPROCESS_ENV)


def _kill_midway(args: list[object], out: Path, total: int, log: Path, deadline_s: float = 600) -> int:
    """Start the CLI and SIGKILL it once some, not all, records are committed; return how many were.

    Returns ``total`` when the run finished before it could be killed (the caller retries with more work).
    """
    proc = _cli_process(args, log)
    target, done = max(1, total // 10), 0
    start = time.monotonic()
    try:
        while proc.poll() is None:
            if time.monotonic() - start > deadline_s:
                pytest.fail(f"fewer than {target} records committed within {deadline_s:.0f} s:\n{log.read_text()}")
            done = (_committed(out) if out.exists() else None) or 0
            if target <= done < total:
                proc.kill()
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if proc.returncode == 0:
        return total
    assert proc.returncode == -signal.SIGKILL, log.read_text()
    return done


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, shape",
    [
        # SQLite commits every batch (here 2 to 8 records of 50..120 residues).
        ("killed.db", (300, 50, 120)),
        # A shard holds 1024 records: enough short records for one to land before the end.
        ("killed_shards", (1250, 8, 16)),
    ],
)
def test_sigkill_then_resume_equals_an_uninterrupted_run(name, shape, artifact, model, tmp_path: Path) -> None:
    n, low, high = shape
    for attempt in range(3):  # more records on each retry, if the run outpaced the kill
        records = random_records(n * 2**attempt, low, high, seed=7 + attempt)
        fasta = write_fasta(tmp_path / f"crash{attempt}.fasta", records)
        out = tmp_path / f"attempt{attempt}-{name}"
        args = [fasta, "--model", artifact, "--out", out, "--max-tokens", 512]
        killed_at = _kill_midway(args, out, len(records), tmp_path / f"killed{attempt}.log")
        if killed_at < len(records):
            break
    else:
        pytest.fail(f"`fastplms embed` finished {name} three times before it could be killed mid-run")

    partial = read_embeddings(out, allow_incomplete=True)
    assert not partial.complete and read_embedding_meta(out)["status"] == "running"
    assert killed_at <= len(partial.records) < len(records)
    assert len({r.index for r in partial.records}) == len(partial.records)

    log = tmp_path / "resumed.log"
    resumed = _cli_process([*args, "--resume"], log)
    try:  # the uninterrupted reference, computed in this process while the resumed run works
        uninterrupted = model.embed_dataset(fasta, max_tokens_per_batch=512)
    finally:
        code = resumed.wait(timeout=900)
    assert code == 0, log.read_text()
    assert f"records      {len(records)} ({len(partial.records)} resumed)" in log.read_text()

    final = read_embeddings(out)
    assert final.complete and final.ids == list(records)
    assert [r.index for r in final.records] == list(range(len(records)))  # no duplicate, none missing
    assert_same(final, uninterrupted)


def test_reading_after_a_kill_inside_a_commit(outputs, tmp_path: Path) -> None:
    """A writer killed mid-commit leaves a hot journal; readers still see exactly the committed rows."""
    source, _ = outputs["sqlite"]
    db = tmp_path / "hot.db"
    shutil.copy2(source, db)
    script = (
        "import os, sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1])\n"
        "conn.execute('PRAGMA cache_size=1')\n"  # spill changed pages into the file before commit
        "conn.execute('BEGIN')\n"
        "conn.executemany('INSERT INTO embeddings(idx, id, pooled) VALUES (?, ?, ?)',"
        " [(1000 + i, 'x', bytes(4096)) for i in range(200)])\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(db)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert Path(str(db) + "-journal").exists()
    assert_same(read_embeddings(db), read_embeddings(source))


def test_crash_while_creating_an_sqlite_output_leaves_it_resumable(tmp_path: Path, monkeypatch) -> None:
    """Schema and fingerprint commit together: tables without a fingerprint could never be resumed."""
    from fastplms import embedding_store

    db = tmp_path / "new.db"
    meta = {"fingerprint": {"model": "m"}, "pooling": ["mean"], "per_residue": False}

    def crash(self, values):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(embedding_store.SqliteWriter, "_set_meta", crash)
        with pytest.raises(KeyboardInterrupt):
            embedding_store.open_writer(str(db), meta, resume=False, overwrite=False)
    writer = embedding_store.open_writer(str(db), meta, resume=True, overwrite=False)
    writer.close()
    assert read_embedding_meta(db)["fingerprint"] == {"model": "m"}


# ---------------------------------------------------------------- demo and progress bar


@pytest.mark.slow
def test_demo_writes_plots_and_says_the_weights_are_random(artifact, tmp_path, monkeypatch, capsys) -> None:
    # The default demo model, without building into the checkout's dist/ folder.
    monkeypatch.setattr(demo, "demo_artifact", lambda: Path(artifact))
    records = {**random_records(5, 30, 80, seed=11), "mid150": random_records(1, 150, 150, seed=12)["prot0"]}
    fasta = write_fasta(tmp_path / "demo.fasta", records)
    assert demo.main(["--input", str(fasta), "--out", str(tmp_path / "demo")]) == 0
    stdout = capsys.readouterr().out
    assert "WEIGHTS ARE RANDOM" in stdout
    assert "records      6\n" in stdout
    for name in ("pca.png", "contacts.png"):
        png = tmp_path / "demo" / name
        assert f"plot         {png}" in stdout
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert read_embeddings(tmp_path / "demo" / "embeddings.db").ids == list(records)


def test_demo_artifact_is_rebuilt_only_when_stale(artifact: str, tmp_path: Path, monkeypatch) -> None:
    """The demo reuses its artifact while the runtime modules match this checkout's, else rebuilds it."""
    from fastplms.artifact.build import RUNTIME_DIR

    path = Path(shutil.copytree(artifact, tmp_path / "ESM2-8M-demo"))
    for module in path.glob("*.py"):  # current by construction, whatever was edited since the build
        shutil.copyfile(RUNTIME_DIR / module.name, module)
    builds = []
    monkeypatch.setattr("fastplms.oracles.esm2.write_hf_snapshot", lambda path, *dims, seed: Path(path))
    monkeypatch.setattr("fastplms.artifact.build.build", lambda *args, **kwargs: builds.append((args, kwargs)) or path)
    assert demo.demo_artifact(path) == path and builds == []

    with open(path / "embedding.py", "a") as handle:
        handle.write("# built from an older checkout\n")
    assert demo.demo_artifact(path) == path
    assert [(args[0], args[2], kwargs) for args, kwargs in builds] == [("esm2_8m", path, {"allow_unpinned": True})]


class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli._progress_bar(FakeStream(tty=False)) is None
    stream = FakeStream(tty=True)
    show = cli._progress_bar(stream)
    assert show is not None
    show(5, 1000, 20)
    line = stream.getvalue()
    assert line.startswith("\r[") and "5/20 records" in line and "res/s" in line and "ETA" in line
    assert "#" * 7 + "." * 23 in line  # a quarter of 30 cells
    show(7, 1400, None)  # total unknown (a one-shot iterator): no bar, no ETA
    last = stream.getvalue().rsplit("\r", 1)[-1]
    assert "7 records" in last and "res/s" in last and "ETA" not in last
    # The default stream is the current sys.stderr, not the one present at import.
    terminal = FakeStream(tty=True)
    monkeypatch.setattr(sys, "stderr", terminal)
    cli._progress_bar()(1, 10, 2)
    assert "1/2 records" in terminal.getvalue()


def test_leftover_temp_files_of_a_crashed_first_index_write_do_not_block_a_new_run(tmp_path) -> None:
    """A kill during the very first index.json write leaves only temp files; the folder holds nothing
    committed, so a fresh (or resumed) run must start instead of refusing a 'foreign' directory."""
    from fastplms.embedding_store import ShardWriter

    out = tmp_path / "emb"
    out.mkdir()
    (out / "index.json.tmp").write_bytes(b'{"format": "fastpl')
    writer = ShardWriter(str(out), {"fingerprint": {"x": 1}}, resume=True, overwrite=False)
    assert writer.committed == set()
    assert sorted(p.name for p in out.iterdir()) == ["index.json"]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="without index.json"):
        ShardWriter(str(tmp_path / "foreign"), {"fingerprint": {}}, resume=True, overwrite=True)
