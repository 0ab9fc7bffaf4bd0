"""Embedding records, and the two on-disk formats ``embed_dataset`` writes and reads back.

This is a runtime module: it ships flat inside every Hub artifact, so it imports only the stdlib,
torch and safetensors.

Every record carries ``idx``, its 0-based position in the input stream (skipped records leave
gaps). Batches finish in length order, not input order, so readers order by ``idx``. Vectors are
float32. ``dim`` is the model's hidden size d; a pooled vector is ``len(pooling) * dim`` wide, one
d-wide block per pooler in request order (``pooling_slices`` gives each block's [start, stop)).

SQLite (``*.db``, ``*.sqlite``, ``*.sqlite3``), readable with plain ``sqlite3`` + numpy/struct::

    embeddings(idx INTEGER PRIMARY KEY, id TEXT, header TEXT, sequence TEXT, length INTEGER,
               pooled BLOB, residues BLOB, dtype TEXT, dim INTEGER)
    meta(key TEXT PRIMARY KEY, value TEXT)

  ``pooled`` is raw little-endian float32 bytes (``len(pooling) * dim`` values, NULL when no
  pooling was asked); ``residues`` is ``length * dim`` row-major float32 values, NULL unless
  per-residue output was asked; ``dtype`` is ``'float32'``. ``meta`` values are JSON text:
  ``format``, ``status`` (``"running"`` until the run completes, then ``"complete"``),
  ``fingerprint`` (what produced the file), ``pooling`` (names), ``per_residue``, ``dim`` and
  ``pooling_slices`` (``{name: [start, stop]}``, once the first batch is stored), and ``report``
  (``skipped``, ``truncated``, ``duplicate_ids``, at completion). Each batch is one transaction.
  Example: ``numpy.frombuffer(row_pooled, "<f4")`` or ``struct.unpack(f"<{len(b) // 4}f", b)``.

Shards (any other path, a directory)::

    index.json               {"format", "status", "fingerprint", "pooling", "per_residue", "dim",
                              "pooling_slices", "shards": [{"file", "records"}], "num_records",
                              "report"}
    shard-00000.safetensors  idx (n,) int64 sorted; pooled (n, D) float32 if pooling was asked;
                             residues (sum of lengths, dim) float32 and offsets (n + 1,) int64
                             (record i is residues[offsets[i]:offsets[i + 1]]) if per-residue;
                             metadata "ids", "headers", "sequences": JSON lists in row order.

  A shard is written to a temporary name and renamed into place, then ``index.json`` is rewritten
  the same way, so the index only ever names whole shards. A shard not named by the index (left
  by a crash between the two renames) is ignored and its records are computed again on resume.
"""

from __future__ import annotations

import ctypes
import json
import os
import sqlite3
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "fastplms-embeddings/1"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
INDEX_FILE = "index.json"
# A shard is flushed at whichever comes first; the byte cap keeps per-residue runs from holding
# gigabytes of finished states in memory before anything reaches the disk.
SHARD_RECORDS = 1024
SHARD_BYTES = 256 << 20


@dataclass(frozen=True)
class EmbeddingRecord:
    id: str
    sequence: str  # the residues embedded (after truncation, if the record was truncated)
    header: str
    pooled: torch.Tensor | None  # (D,) float32, poolers concatenated in request order
    residues: torch.Tensor | None  # (length, d) float32, special tokens removed
    index: int = -1  # 0-based position in the input stream


@dataclass
class EmbeddingResult:
    records: list[EmbeddingRecord]  # input order; empty when written to an output
    pooling_slices: dict[str, slice]
    num_records: int = 0
    num_residues: int = 0
    seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (id, reason)
    truncated: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    output: str | None = None
    fingerprint: dict[str, object] | None = None
    num_resumed: int = 0  # records taken over from an existing output
    complete: bool = True

    @property
    def ids(self) -> list[str]:
        return [record.id for record in self.records]

    def stack(self, pooling: str | None = None) -> torch.Tensor:
        """Pooled vectors as (N, D), or only the block of one pooler as (N, d)."""
        if not self.records:
            if self.output is not None:
                raise ValueError(f"embeddings were written to {self.output}; load them with read_embeddings")
            return torch.empty(0, 0)
        if self.records[0].pooled is None:
            raise ValueError("no pooled vectors: embed_dataset was called without pooling")
        stacked = torch.stack([record.pooled for record in self.records])  # type: ignore[misc]
        if pooling is None:
            return stacked
        if pooling not in self.pooling_slices:
            raise ValueError(f"pooling {pooling!r} was not computed; have {sorted(self.pooling_slices)}")
        return stacked[:, self.pooling_slices[pooling]]


def pooling_slices(names: Sequence[str], dim: int | None) -> dict[str, slice]:
    if dim is None:  # nothing embedded yet, so the width is unknown
        return {}
    return {name: slice(i * dim, (i + 1) * dim) for i, name in enumerate(names)}


def canonical(value: object) -> object:
    """JSON round trip, so tuples and lists (or a stored and a fresh value) compare equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_fingerprint(path: str, stored: object, current: Mapping[str, object]) -> None:
    stored = stored if isinstance(stored, dict) else {}
    now = canonical(dict(current))
    assert isinstance(now, dict)
    differing = sorted(key for key in stored.keys() | now.keys() if stored.get(key) != now.get(key))
    if differing:
        parts = [f"{key} (stored {_short(stored.get(key))}, now {_short(now.get(key))})" for key in differing]
        raise ValueError(f"cannot resume {path}: it was made from different inputs or settings: " + "; ".join(parts))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _float32_bytes(tensor: torch.Tensor) -> bytes:
    # bytes(storage) copies element by element (about a minute for 5 MB); ctypes reads the
    # contiguous CPU buffer directly and needs no numpy.
    flat = tensor.detach().to("cpu", torch.float32).contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.nbytes)


def _float32_tensor(blob: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer warns on read-only buffers, and the copy owns its memory.
    return torch.frombuffer(bytearray(blob), dtype=torch.float32) if blob else torch.empty(0)


def is_sqlite_path(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).lower().endswith(SQLITE_SUFFIXES)


class SqliteWriter:
    """Appends finished batches to an SQLite file, one transaction each."""

    def __init__(self, path: str, meta: Mapping[str, object], *, resume: bool, overwrite: bool) -> None:
        self.path = path
        self.dim: int | None = None
        self.committed: set[int] = set()
        if os.path.exists(path):
            if overwrite:
                for leftover in (path, path + "-journal", path + "-wal", path + "-shm"):
                    if os.path.exists(leftover):
                        os.remove(leftover)
            elif not resume:
                raise FileExistsError(f"{path} exists; pass overwrite=True to replace it or resume=True to continue it")
        self.conn = sqlite3.connect(path)
        try:
            self._open(meta)
        except BaseException:
            self.conn.close()
            raise

    def _open(self, meta: Mapping[str, object]) -> None:
        path = self.path
        # Default rollback journal: a killed process leaves at worst a hot journal that the next
        # open rolls back, so exactly the committed batches survive. One fsync per batch is cheap
        # next to a forward pass.
        try:
            tables = {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as error:
            raise ValueError(f"{path} is not a fastplms embeddings database: {error}") from error
        if "meta" in tables:
            stored = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
            check_fingerprint(path, json.loads(stored.get("fingerprint", "null")), meta["fingerprint"])  # type: ignore[arg-type]
            self.dim = json.loads(stored.get("dim", "null"))
            self.committed = {row[0] for row in self.conn.execute("SELECT idx FROM embeddings")}
        elif tables:
            raise ValueError(f"{path} is an SQLite file but not a fastplms embeddings database")
        else:
            # An empty file (a crash before the schema committed) starts fresh like a missing one.
            # Schema and meta commit together: a crash in between would leave tables without a
            # fingerprint, which no resume could ever match.
            self.conn.executescript(
                "BEGIN;"
                "CREATE TABLE embeddings(idx INTEGER PRIMARY KEY, id TEXT, header TEXT, sequence TEXT,"
                " length INTEGER, pooled BLOB, residues BLOB, dtype TEXT, dim INTEGER);"
                "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);"
            )
            with self.conn:  # commits the transaction the script began (rolls it back on error)
                self._set_meta({"format": FORMAT, "status": "running", **meta})

    def _set_meta(self, values: Mapping[str, object]) -> None:
        self.conn.executemany(
            "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
            [(key, json.dumps(canonical(value))) for key, value in values.items()],
        )

    def add(self, records: Sequence[EmbeddingRecord], dim: int, names: Sequence[str]) -> None:
        rows = [
            (
                r.index,
                r.id,
                r.header,
                r.sequence,
                len(r.sequence),
                None if r.pooled is None else _float32_bytes(r.pooled),
                None if r.residues is None else _float32_bytes(r.residues),
                "float32",
                dim,
            )
            for r in records
        ]
        with self.conn:
            if self.dim is None:
                self._set_meta({"dim": dim, "pooling_slices": _slices_json(names, dim)})
                self.dim = dim
            elif dim != self.dim:
                raise ValueError(f"{self.path}: hidden size {dim} differs from the stored dim {self.dim}")
            self.conn.executemany("INSERT INTO embeddings VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def finish(self, report: Mapping[str, object]) -> None:
        with self.conn:
            self._set_meta({"report": report, "status": "complete"})

    def abort(self) -> None:
        pass  # every finished batch is already committed

    def close(self) -> None:
        self.conn.close()


class ShardWriter:
    """Buffers finished records and commits them as whole safetensors shards."""

    def __init__(self, path: str, meta: Mapping[str, object], *, resume: bool, overwrite: bool) -> None:
        self.path = path
        self.committed: set[int] = set()
        self._buffer: list[EmbeddingRecord] = []
        self._buffer_bytes = 0
        index_path = os.path.join(path, INDEX_FILE)
        if os.path.exists(path) and not os.path.isdir(path):
            raise FileExistsError(f"{path} exists and is not a directory (SQLite outputs end in .db/.sqlite)")
        ours = os.path.exists(index_path)
        if os.path.isdir(path) and not ours:
            # A crash during the very first index write leaves only our temp files: nothing committed.
            for name in os.listdir(path):
                if name == INDEX_FILE + ".tmp" or (name.startswith("shard-") and name.endswith(".tmp")):
                    os.remove(os.path.join(path, name))
        if os.path.isdir(path) and os.listdir(path) and not ours:
            # Overwrite must never delete a directory of someone else's files.
            raise FileExistsError(f"{path} is a non-empty directory without {INDEX_FILE}; refusing to use it")
        if ours and overwrite:
            for name in os.listdir(path):
                if name == INDEX_FILE or name.startswith("shard-") or name.endswith(".tmp"):
                    os.remove(os.path.join(path, name))
            ours = False
        elif ours and not resume:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it or resume=True to continue it")
        if ours:
            self.index = _read_index(path)
            check_fingerprint(path, self.index.get("fingerprint"), meta["fingerprint"])  # type: ignore[arg-type]
            for shard in self.index["shards"]:
                with safe_open(os.path.join(path, shard["file"]), "pt") as handle:
                    self.committed.update(handle.get_tensor("idx").tolist())
        else:
            os.makedirs(path, exist_ok=True)
            self.index = {
                "format": FORMAT,
                "status": "running",
                **canonical(dict(meta)),  # type: ignore[dict-item]
                "dim": None,
                "pooling_slices": {},
                "shards": [],
                "num_records": 0,
            }
            self._write_index()

    @property
    def dim(self) -> int | None:
        return self.index["dim"]

    def _write_index(self) -> None:
        _atomic_write(os.path.join(self.path, INDEX_FILE), json.dumps(self.index, indent=1).encode())

    def add(self, records: Sequence[EmbeddingRecord], dim: int, names: Sequence[str]) -> None:
        if self.index["dim"] is None:
            self.index["dim"] = dim
            self.index["pooling_slices"] = _slices_json(names, dim)
        elif dim != self.index["dim"]:
            raise ValueError(f"{self.path}: hidden size {dim} differs from the stored dim {self.index['dim']}")
        for record in records:
            self._buffer.append(record)
            self._buffer_bytes += sum(t.nbytes for t in (record.pooled, record.residues) if t is not None)
        if len(self._buffer) >= SHARD_RECORDS or self._buffer_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        # Detach the buffer first: if this flush is interrupted, a later abort() cannot write the
        # same records into a second shard (they are recomputed on resume instead).
        records, self._buffer, self._buffer_bytes = sorted(self._buffer, key=lambda r: r.index), [], 0
        if not records:
            return
        tensors = {"idx": torch.tensor([r.index for r in records], dtype=torch.int64)}
        if records[0].pooled is not None:
            tensors["pooled"] = torch.stack([r.pooled for r in records]).float().contiguous()  # type: ignore[misc]
        if records[0].residues is not None:
            lengths = torch.tensor([0] + [len(r.sequence) for r in records], dtype=torch.int64)
            tensors["offsets"] = lengths.cumsum(0)
            tensors["residues"] = torch.cat([r.residues for r in records]).float().contiguous()  # type: ignore[misc]
        metadata = {
            "format": FORMAT,
            "ids": json.dumps([r.id for r in records]),
            "headers": json.dumps([r.header for r in records]),
            "sequences": json.dumps([r.sequence for r in records]),
        }
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        final = os.path.join(self.path, name)
        save_file(tensors, final + ".tmp", metadata=metadata)
        _fsync_file(final + ".tmp")
        os.replace(final + ".tmp", final)
        self.index["shards"].append({"file": name, "records": len(records)})
        self.index["num_records"] += len(records)
        self._write_index()
        self.committed.update(r.index for r in records)

    def finish(self, report: Mapping[str, object]) -> None:
        self._flush()
        self.index["report"] = canonical(dict(report))
        self.index["status"] = "complete"
        self._write_index()

    def abort(self) -> None:
        # Best effort on an error that is already propagating (KeyboardInterrupt, a failing
        # forward): keep the finished records so a resume need not recompute them. A failure here
        # must not replace the original exception, and resume recovers either way.
        try:
            self._flush()
        except Exception:
            pass

    def close(self) -> None:
        self._buffer, self._buffer_bytes = [], 0


def _slices_json(names: Sequence[str], dim: int) -> dict[str, list[int]]:
    return {name: [s.start, s.stop] for name, s in pooling_slices(names, dim).items()}


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def _read_index(path: str) -> dict:
    index_path = os.path.join(path, INDEX_FILE)
    with open(index_path, encoding="utf-8") as handle:
        index = json.load(handle)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{index_path} is not a fastplms embeddings index (format {FORMAT!r})")
    return index


def open_writer(path: str, meta: Mapping[str, object], *, resume: bool, overwrite: bool) -> SqliteWriter | ShardWriter:
    """``meta`` holds ``fingerprint``, ``pooling`` and ``per_residue``; resume compares fingerprints."""
    if sys.byteorder != "little":  # raw buffers are written as-is; both layouts define little-endian
        raise RuntimeError("writing embeddings needs a little-endian host")
    writer = SqliteWriter if is_sqlite_path(path) else ShardWriter
    return writer(path, meta, resume=resume, overwrite=overwrite)


def read_embedding_meta(path: str | os.PathLike[str]) -> dict:
    """Format, status, fingerprint, pooling, dim, pooling_slices and report of an output."""
    path = os.fspath(path)
    if is_sqlite_path(path):
        conn = _connect_ro(path)
        try:
            rows = conn.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as error:
            raise ValueError(f"{path} is not a fastplms embeddings database: {error}") from error
        finally:
            conn.close()
        return {key: json.loads(value) for key, value in rows}
    index = _read_index(path)
    return {key: value for key, value in index.items() if key != "shards"}


def _connect_ro(path: str) -> sqlite3.Connection:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such embeddings database")
    if os.path.exists(path + "-journal"):
        # A writer killed inside a commit leaves a hot journal, which a read-only connection may not
        # roll back ("attempt to write a readonly database"). Any read through an ordinary connection
        # rolls it back, restoring the last committed batch; a live writer's journal is left alone.
        recovery = sqlite3.connect(path)
        try:
            recovery.execute("SELECT count(*) FROM sqlite_master").fetchall()
        finally:
            recovery.close()
    return sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True)


def _require_complete(path: str, meta: Mapping[str, object], allow_incomplete: bool) -> None:
    if meta.get("status") != "complete" and not allow_incomplete:
        raise ValueError(
            f"{path} is incomplete (status {meta.get('status')!r}); finish it with resume=True "
            "or read it anyway with allow_incomplete=True"
        )


def open_sqlite_embeddings(path: str | os.PathLike[str], *, allow_incomplete: bool = False) -> sqlite3.Connection:
    """A read-only connection to an SQLite output, for streaming queries (``ORDER BY idx``)."""
    path = os.fspath(path)
    _require_complete(path, read_embedding_meta(path), allow_incomplete)
    return _connect_ro(path)


def iter_sqlite_embeddings(
    path: str | os.PathLike[str], *, allow_incomplete: bool = False
) -> Iterator[EmbeddingRecord]:
    """Records of an SQLite output in input order, one at a time."""
    conn = open_sqlite_embeddings(path, allow_incomplete=allow_incomplete)
    try:
        query = "SELECT idx, id, header, sequence, length, pooled, residues, dim FROM embeddings ORDER BY idx"
        for idx, rid, header, sequence, length, pooled, residues, dim in conn.execute(query):
            yield EmbeddingRecord(
                id=rid,
                sequence=sequence,
                header=header,
                pooled=None if pooled is None else _float32_tensor(pooled),
                residues=None if residues is None else _float32_tensor(residues).view(length, dim),
                index=idx,
            )
    finally:
        conn.close()


def _shard_records(path: str, name: str) -> list[EmbeddingRecord]:
    with safe_open(os.path.join(path, name), "pt") as handle:
        meta = handle.metadata()
        keys = set(handle.keys())
        tensors = {key: handle.get_tensor(key) for key in keys}
    ids, headers, sequences = (json.loads(meta[key]) for key in ("ids", "headers", "sequences"))
    offsets = tensors["offsets"].tolist() if "offsets" in tensors else None
    return [
        EmbeddingRecord(
            id=ids[row],
            sequence=sequences[row],
            header=headers[row],
            pooled=tensors["pooled"][row] if "pooled" in tensors else None,
            residues=tensors["residues"][offsets[row] : offsets[row + 1]] if offsets is not None else None,
            index=idx,
        )
        for row, idx in enumerate(tensors["idx"].tolist())
    ]


def read_embeddings(path: str | os.PathLike[str], *, allow_incomplete: bool = False) -> EmbeddingResult:
    """Load a whole SQLite or shard output into memory, records in input order."""
    path = os.fspath(path)
    meta = read_embedding_meta(path)
    _require_complete(path, meta, allow_incomplete)
    if is_sqlite_path(path):
        records = list(iter_sqlite_embeddings(path, allow_incomplete=True))
    else:
        records = [r for shard in _read_index(path)["shards"] for r in _shard_records(path, shard["file"])]
        records.sort(key=lambda r: r.index)
    report = meta.get("report") or {}
    return EmbeddingResult(
        records=records,
        pooling_slices={name: slice(a, b) for name, (a, b) in (meta.get("pooling_slices") or {}).items()},
        num_records=len(records),
        num_residues=sum(len(r.sequence) for r in records),
        skipped=[(rid, reason) for rid, reason in report.get("skipped", [])],
        truncated=list(report.get("truncated", [])),
        duplicate_ids=list(report.get("duplicate_ids", [])),
        output=path,
        fingerprint=meta.get("fingerprint"),
        complete=meta.get("status") == "complete",
    )
