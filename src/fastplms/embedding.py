"""Model-independent dataset embedding: read, validate, batch by length, pool, store.

This is a runtime module: it ships flat inside every Hub artifact, so it imports only the stdlib,
torch, safetensors and its sibling ``embedding_store``. A model supplies ``forward`` (token ids and
attention mask to last hidden states) and a ``ResidueEncoder``; everything else lives here.

Inputs: a FASTA path (``.fa .fasta .faa .fas``, optionally ``.gz``, or any file whose first
non-empty line starts with ``>``), a ``.txt`` path with one sequence per line (ids ``seq{n}``, n
counting non-empty lines from 0, the same ids a list of those strings gets), a mapping id ->
sequence, a list/tuple of sequences (ids ``seq0``, ``seq1``, ...) or any iterable of (id, sequence)
pairs. FASTA ids are the header up to the first whitespace; the full header is kept. Output order
is input order; duplicate ids are kept and reported.
"""

from __future__ import annotations

import ctypes
import functools
import gzip
import hashlib
import itertools
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .embedding_store import (
    EmbeddingRecord,
    EmbeddingResult,
    iter_sqlite_embeddings,
    open_sqlite_embeddings,
    open_writer,
    pooling_slices,
    read_embedding_meta,
    read_embeddings,
)

__all__ = [
    "POOLERS",
    "EmbeddingRecord",
    "EmbeddingResult",
    "ResidueEncoder",
    "embed_dataset",
    "iter_sqlite_embeddings",
    "open_sqlite_embeddings",
    "read_embedding_meta",
    "read_embeddings",
]

POOLERS = ("mean", "max", "min", "std", "sum", "cls", "last")
FASTA_SUFFIXES = (".fa", ".fasta", ".faa", ".fas")
# Records sorted together by length. Larger windows pad less; the window is all that is held
# besides the output, so it bounds memory on huge FASTA files.
WINDOW_RECORDS = 4096
# The first batch of a job holds at most 1/FIRST_BATCH_SHARE of the token budget (see `_batches`).
FIRST_BATCH_SHARE = 4

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Progress = Callable[[int, int, "int | None"], None]


@dataclass(frozen=True)
class ResidueEncoder:
    alphabet: frozenset[str]  # allowed residue characters
    to_id: Mapping[str, int]  # residue char -> token id
    prefix: tuple[int, ...]  # special ids before residues, e.g. (cls,)
    suffix: tuple[int, ...]  # special ids after residues, e.g. (eos,)
    pad_id: int
    max_residues: int | None  # model limit on residues per sequence (None = none)


class _Item(NamedTuple):
    index: int  # position in the input stream, skipped records included
    id: str
    header: str
    sequence: str


@dataclass(frozen=True)
class _Rules:
    alphabet: frozenset[str]
    limit: int | None
    limit_name: str
    invalid: str
    too_long: str


@dataclass
class _Report:
    skipped: list[tuple[str, str]] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    kept: int = 0
    residues: int = 0
    seen: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)

    def as_json(self) -> dict[str, object]:
        return {"skipped": self.skipped, "truncated": self.truncated, "duplicate_ids": self.duplicate_ids}


# ---------------------------------------------------------------- reading


def _numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    # Binary lines decoded one by one: a text-mode reader decodes whole blocks ahead and would
    # report a bad byte on the wrong line.
    opener = gzip.open if path.lower().endswith(".gz") else open
    lineno = 0
    with opener(path, "rb") as handle:  # type: ignore[operator]
        try:
            for lineno, raw in enumerate(handle, 1):
                yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: line {lineno}: not UTF-8 text ({error.reason})") from error
        except OSError as error:  # e.g. a corrupt .gz: the raw message names no file
            raise OSError(f"{path}: line {lineno + 1}: {error}") from error


def _read_fasta(path: str, lines: Iterable[tuple[int, str]]) -> Iterator[tuple[str, str, str]]:
    header: str | None = None
    chunks: list[str] = []

    def record() -> tuple[str, str, str]:
        sequence = "".join(chunks)
        if sequence.endswith("*"):  # a translated stop codon, not a residue
            sequence = sequence[:-1]
        return header.split(maxsplit=1)[0], header, sequence  # type: ignore[union-attr]

    for lineno, line in lines:
        if line.startswith(">"):
            if header is not None:
                yield record()
            header, chunks = line[1:].strip(), []
            if not header:
                raise ValueError(f"{path}: line {lineno}: FASTA header without an id")
        elif line.strip():
            if header is None:
                raise ValueError(f"{path}: line {lineno}: sequence data before the first '>' header")
            chunks.append("".join(line.split()))
    if header is not None:
        yield record()


def _read_path(path: str) -> Iterator[tuple[str, str, str]]:
    base = path[:-3] if path.lower().endswith(".gz") else path
    suffix = os.path.splitext(base)[1].lower()
    lines = _numbered_lines(path)
    first = next(((n, line) for n, line in lines if line.strip()), None)
    if first is None:
        if suffix in FASTA_SUFFIXES or suffix == ".txt":
            return
        raise ValueError(f"{path}: line 1: empty file is neither FASTA nor a .txt file of sequences")
    rest = itertools.chain([(first[0], first[1].lstrip())], lines)
    if first[1].lstrip().startswith(">"):
        yield from _read_fasta(path, rest)
    elif suffix in FASTA_SUFFIXES:
        raise ValueError(f"{path}: line {first[0]}: sequence data before the first '>' header")
    elif suffix == ".txt":
        n = 0
        for _, line in rest:
            if line.strip():
                yield f"seq{n}", f"seq{n}", line.strip()
                n += 1
    else:
        raise ValueError(
            f"{path}: line {first[0]}: neither FASTA (first line starting with '>') "
            "nor a .txt file of one sequence per line"
        )


def _read_objects(inputs: object) -> Iterator[tuple[str, str, str]]:
    if isinstance(inputs, Mapping):
        for rid, sequence in inputs.items():
            if not isinstance(rid, str) or not isinstance(sequence, str):
                raise TypeError(f"mapping input: ids and sequences must be str, got {rid!r}: {type(sequence).__name__}")
            yield rid, rid, sequence
        return
    if not isinstance(inputs, Iterable):
        raise TypeError(f"cannot read sequences from {type(inputs).__name__}")
    for n, item in enumerate(inputs):
        if isinstance(item, str):
            yield f"seq{n}", f"seq{n}", item
            continue
        pair = tuple(item) if isinstance(item, (tuple, list)) else ()
        if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise TypeError(f"input item {n}: expected a sequence string or an (id, sequence) pair, got {item!r:.60}")
        yield pair[0], pair[0], pair[1]


def _source(inputs: object, *, replay: bool) -> tuple[Callable[[], Iterator[tuple[str, str, str]]], bool]:
    """A factory of fresh (id, header, sequence) streams, and whether calling it twice is allowed."""
    if isinstance(inputs, (str, os.PathLike)):
        path = os.fspath(inputs)
        return (lambda: _read_path(path)), True
    if isinstance(inputs, (Mapping, list, tuple)):
        return (lambda: _read_objects(inputs)), True
    if replay:  # a one-shot iterator; sequences are small next to their embeddings
        items = list(_read_objects(inputs))
        return (lambda: iter(items)), True
    return (lambda: _read_objects(inputs)), False


def _prepare(stream: Iterable[tuple[str, str, str]], rules: _Rules, report: _Report) -> Iterator[_Item]:
    """Validate records in order, applying the invalid/too_long policies and filling ``report``."""
    seen: set[str] = set()
    duplicates: set[str] = set()
    for index, (rid, header, sequence) in enumerate(stream):
        report.seen += 1
        for part in (rid, header, sequence):  # length-prefixed, so no separator can be forged
            data = part.encode("utf-8", "surrogatepass")
            report.digest.update(len(data).to_bytes(8, "little") + data)
        if rid in seen and rid not in duplicates:
            duplicates.add(rid)
            report.duplicate_ids.append(rid)
        seen.add(rid)
        problem = None
        if not sequence:
            problem = "empty sequence"
        elif not rules.alphabet.issuperset(sequence):
            position, char = next((i, c) for i, c in enumerate(sequence) if c not in rules.alphabet)
            problem = f"invalid residue {char!r} at position {position}"
        if problem is not None:
            if rules.invalid == "raise":
                hint = "" if problem == "empty sequence" else f" (allowed: {''.join(sorted(rules.alphabet))})"
                raise ValueError(f"record {rid!r}: {problem}{hint}; pass invalid='skip' to skip such records")
            report.skipped.append((rid, problem))
            continue
        if rules.limit is not None and len(sequence) > rules.limit:
            if rules.too_long == "raise":
                raise ValueError(
                    f"record {rid!r}: {len(sequence)} residues exceeds the limit of {rules.limit} "
                    f"({rules.limit_name}); pass too_long='truncate' or too_long='skip'"
                )
            if rules.too_long == "skip":
                report.skipped.append((rid, f"too long: {len(sequence)} > {rules.limit} residues"))
                continue
            sequence = sequence[: rules.limit]
            report.truncated.append(rid)
        report.kept += 1
        report.residues += len(sequence)
        yield _Item(index, rid, header, sequence)


# ---------------------------------------------------------------- batching and pooling


def _batches(
    window: list[_Item], budget: int, n_special: int, batch_size: int | None, first: bool = False
) -> Iterator[list[_Item]]:
    """Longest first, so each batch's first record sets its padded width. With `first` (the job's first
    window) the first batch gets a quarter of the budget: the first result arrives in a quarter of a
    batch's time, at no measurable cost to the rate."""
    batch: list[_Item] = []
    width = 0
    limit = max(1, budget // FIRST_BATCH_SHARE) if first else budget
    for item in sorted(window, key=lambda item: -len(item.sequence)):
        if batch and ((len(batch) + 1) * width > limit or (batch_size is not None and len(batch) >= batch_size)):
            yield batch
            batch, limit = [], budget
        if not batch:
            width = len(item.sequence) + n_special
        batch.append(item)
    if batch:
        yield batch


def _encode(batch: list[_Item], encoder: ResidueEncoder) -> tuple[torch.Tensor, torch.Tensor]:
    width = len(encoder.prefix) + max(len(item.sequence) for item in batch) + len(encoder.suffix)
    input_ids = torch.full((len(batch), width), encoder.pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        tokens = [*encoder.prefix, *(encoder.to_id[c] for c in item.sequence), *encoder.suffix]
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
    return input_ids, attention_mask


def _pool(hidden: torch.Tensor, lengths: torch.Tensor, start: int, names: Sequence[str]) -> torch.Tensor:
    """(b, s, d) float32 -> (b, len(names) * d), over each row's residues [start, start + length).

    Everything outside a row's residues is masked with a neutral value via masked_fill, not
    multiplied by zero: padding states may hold anything, even NaN, and must never leak in.
    """
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    keep = ((positions >= start) & (positions < start + lengths[:, None])).unsqueeze(-1)
    count = lengths.to(hidden.dtype)[:, None]
    total = hidden.masked_fill(~keep, 0.0).sum(1)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    parts = []
    for name in names:
        if name == "mean":
            parts.append(total / count)
        elif name == "sum":
            parts.append(total)
        elif name == "max":
            parts.append(hidden.masked_fill(~keep, float("-inf")).amax(1))
        elif name == "min":
            parts.append(hidden.masked_fill(~keep, float("inf")).amin(1))
        elif name == "std":  # population std, from centred values for accuracy
            centred = (hidden - (total / count)[:, None]).masked_fill(~keep, 0.0)
            parts.append((centred.square().sum(1) / count).sqrt())
        elif name == "cls":
            parts.append(hidden[:, 0])
        elif name == "last":
            parts.append(hidden[rows, start + lengths - 1])
    return torch.cat(parts, dim=-1)


def _check_pooling(pooling: str | Sequence[str], encoder: ResidueEncoder) -> tuple[str, ...]:
    names = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    unknown = [name for name in names if name not in POOLERS]
    if unknown:
        raise ValueError(f"unknown pooling {unknown}; valid names are {list(POOLERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"pooling {list(names)} names a pooler twice")
    if "cls" in names and not encoder.prefix:
        raise ValueError("pooling 'cls' needs a prefix token, and this model adds none before the residues")
    return names


# ---------------------------------------------------------------- driver

# glibc mallopt parameters and the values embed_dataset sets: activation buffers up to 32 MiB (glibc's
# largest mmap threshold) come from the heap, and up to 256 MiB of freed memory at its top is kept. A 1 GiB
# trim threshold was as fast but let fragmentation grow the peak: 1,002 vs 787 MB on a 250-record job.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 256 << 20


@functools.cache
def reuse_freed_memory() -> bool:
    """Once per process, on glibc: keep freed activation buffers for reuse; True if set.

    Every batch allocates the same few large activations (tens of MB each). glibc serves blocks of that
    size with fresh mmap()s and returns freed memory to the kernel, so each batch page-faults its activations
    in anew: 0.5-1.7 million faults and 5-12% of the wall time of an ESM2-35M job on 2 cores (measured,
    docs/embedding.md). With these values the peak is lower, not higher (787 vs 823 MB on a 250-record job):
    the next batch reuses the same memory. Other C libraries are left alone.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # not glibc (e.g. musl without mallopt)
        return False


def embed_dataset(
    forward: Forward,
    encoder: ResidueEncoder,
    inputs: object,
    *,
    max_tokens_per_batch: int = 4096,
    batch_size: int | None = None,
    max_length: int | None = None,
    pooling: str | Sequence[str] = ("mean",),
    per_residue: bool = False,
    output: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    invalid: str = "raise",
    too_long: str = "raise",
    fingerprint: Mapping[str, object] | None = None,
    progress: Progress | None = None,
    device: torch.device | str | None = None,
    plan: Callable[[int | None], None] | None = None,
    group: Callable[[str, str], Hashable] | None = None,
    group_digest: Callable[[str], bytes] | None = None,
) -> EmbeddingResult:
    """Embed every record of ``inputs`` with ``forward``; see the module docstring for inputs.

    ``forward(input_ids, attention_mask)`` returns last hidden states (b, s, d). Pooled vectors
    (float32, CPU) cover biological residues only. With ``output`` (``.db``/``.sqlite``/
    ``.sqlite3`` for SQLite, else a shard directory) records are written as batches finish and
    ``result.records`` stays empty; ``resume=True`` continues an output made with the same
    fingerprint, ``overwrite=True`` replaces one.

    ``plan``, if given, is called once before any batch with the number of residues the job holds
    (None when the input can be read only once), so a caller can pick an execution strategy.

    ``group(id, sequence)``, if given, keys each kept record (e.g. by its retrieval context): a
    batch holds records of one key only, and ``forward`` is called as
    ``forward(input_ids, attention_mask, key)``. ``group_digest(id)`` (bytes) of every kept record
    is hashed in the first pass into the fingerprint's ``group_sha256``, so a resume is refused on
    an output made with other groups; it is also the place to refuse a record early.
    """
    started = time.perf_counter()
    reuse_freed_memory()
    names = _check_pooling(pooling, encoder)
    if not names and not per_residue:
        raise ValueError("nothing to compute: give at least one pooling or per_residue=True")
    if invalid not in ("raise", "skip"):
        raise ValueError(f"invalid={invalid!r}; use 'raise' or 'skip'")
    if too_long not in ("raise", "truncate", "skip"):
        raise ValueError(f"too_long={too_long!r}; use 'raise', 'truncate' or 'skip'")
    if max_tokens_per_batch < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError("max_tokens_per_batch and batch_size must be positive")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length} must be positive")
    if resume and overwrite:
        raise ValueError("pass resume=True or overwrite=True, not both")
    limits = [
        (n, name) for n, name in ((max_length, "max_length"), (encoder.max_residues, "model maximum")) if n is not None
    ]
    limit, limit_name = min(limits) if limits else (None, "")
    rules = _Rules(frozenset(encoder.alphabet), limit, limit_name, invalid, too_long)

    # A first pass validates everything before any compute is spent, counts the records for
    # progress, and hashes the input for the output fingerprint.
    open_stream, replayable = _source(inputs, replay=output is not None)
    report = _Report()
    groups = hashlib.sha256()
    if replayable:
        for item in _prepare(open_stream(), rules, report):
            if group_digest is not None:
                data = group_digest(item.id)
                groups.update(len(data).to_bytes(8, "little") + data)

    settings = {
        "input_sha256": report.digest.hexdigest(),
        "input_records": report.seen,
        "pooling": list(names),
        "per_residue": per_residue,
        "max_length": limit,
        "too_long": too_long,
        "invalid": invalid,
    }
    if group_digest is not None:
        settings["group_sha256"] = groups.hexdigest()
    merged = {**(fingerprint or {}), **settings} if replayable else None
    writer = None
    if output is not None:
        output = os.fspath(output)
        meta = {"fingerprint": merged, "pooling": list(names), "per_residue": per_residue}
        writer = open_writer(output, meta, resume=resume, overwrite=overwrite)
    committed = writer.committed if writer is not None else set()
    dim = writer.dim if writer is not None else None

    done: dict[int, EmbeddingRecord] = {}
    records_done = residues_done = resumed = 0
    total = report.kept if replayable else None
    start = len(encoder.prefix)
    n_special = len(encoder.prefix) + len(encoder.suffix)

    def grouped(window: list[_Item]) -> Iterator[tuple[tuple[Hashable, ...], list[_Item]]]:
        if group is None:
            yield (), window
            return
        parts: dict[Hashable, list[_Item]] = {}  # keys in first-seen order
        for item in window:
            parts.setdefault(group(item.id, item.sequence), []).append(item)
        for key, part in parts.items():
            yield (key,), part

    def run(window: list[_Item]) -> None:
        for key, part in grouped(window):
            for batch in _batches(part, max_tokens_per_batch, n_special, batch_size, first=not records_done):
                run_batch(batch, key)

    def run_batch(batch: list[_Item], key: tuple[Hashable, ...]) -> None:
        nonlocal dim, records_done, residues_done
        input_ids, attention_mask = _encode(batch, encoder)
        with torch.inference_mode():
            hidden = forward(input_ids.to(device), attention_mask.to(device), *key)
            if hidden.ndim != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape):
                raise ValueError(
                    f"forward returned shape {tuple(hidden.shape)} for input {tuple(input_ids.shape)};"
                    " expected (batch, tokens, hidden)"
                )
            hidden = hidden.float()
            lengths = torch.tensor([len(item.sequence) for item in batch], device=hidden.device)
            pooled = _pool(hidden, lengths, start, names) if names else None
            states = hidden.cpu() if per_residue else None
        # Copies made outside inference mode are ordinary tensors, which callers may modify
        # in place; inference tensors would refuse that.
        pooled = None if pooled is None else pooled.to("cpu", copy=True)
        dim = hidden.shape[-1]
        records = [
            EmbeddingRecord(
                id=item.id,
                sequence=item.sequence,
                header=item.header,
                pooled=None if pooled is None else pooled[row],
                # clone: a view would keep the whole padded batch alive
                residues=None if states is None else states[row, start : start + len(item.sequence)].clone(),
                index=item.index,
            )
            for row, item in enumerate(batch)
        ]
        if writer is not None:
            writer.add(records, dim, names)
        else:
            done.update((record.index, record) for record in records)
        records_done += len(batch)
        residues_done += sum(len(item.sequence) for item in batch)
        if progress is not None:
            progress(records_done, residues_done, total)

    main_report = _Report() if replayable else report
    if plan is not None:
        plan(report.residues if replayable else None)
    try:
        window: list[_Item] = []
        for item in _prepare(open_stream(), rules, main_report):
            if item.index in committed:
                resumed += 1
                records_done += 1
                residues_done += len(item.sequence)
                continue
            window.append(item)
            if len(window) >= WINDOW_RECORDS:
                run(window)
                window = []
        if window:
            run(window)
        if writer is not None:
            writer.finish(report.as_json())
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if writer is not None:
            writer.close()

    return EmbeddingResult(
        records=[done[index] for index in sorted(done)],
        pooling_slices=pooling_slices(names, dim),
        num_records=report.kept,
        num_residues=report.residues,
        seconds=time.perf_counter() - started,
        skipped=report.skipped,
        truncated=report.truncated,
        duplicate_ids=report.duplicate_ids,
        output=output,
        fingerprint=merged,
        num_resumed=resumed,
    )
