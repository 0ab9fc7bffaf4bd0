"""Attention backends, biological mask conversion and the one dispatch facade.

Every model in fastplms calls this module; it is the only place that knows backends. A mask is given
once, as biology describes it: a `(batch, seq)` validity mask and, for rows that hold several
sequences, per-token `sequence_ids` (-1 = padding). Keys may be described separately
(`kv_attention_mask`, `kv_sequence_ids`: a query block against cached context keys, cross-attention,
incremental decoding); omitted, they are the queries'. `semantics` says how tokens see each other,
always between a valid query i and a valid key j:

- ``padding``: i sees every valid key j;
- ``sequence``: i sees j iff they carry the same sequence id;
- ``block_causal``: i sees j iff seq(j) <= seq(i) (own sequence bidirectional, earlier sequences
  visible, later ones not: E1's global layers, the canvas rule);
- ``causal``: i sees j iff j <= i + sk - sq (queries are the last sq positions of the keys:
  FlashAttention's bottom-right convention; with one mask for both, j <= i).

An additive `bias` broadcastable to `(b, hq, sq, sk)` (T5's relative positions) is added to the scaled
scores by eager, sdpa and flex; flash refuses it.

Two entry points compute the same function. `attention(q, k, v, ...)` takes padded `(b, h, s, d)`
tensors. Models use `attention_plan(...)` once per forward, which validates the mask and derives the
one mask form the backend needs, then `attend(q, k, v, plan)` in every layer on their packed valid
tokens `(tokens, heads, head_dim)` (row-major order), so no layer pads and unpads where the backend
takes packed input: flash (varlen), flex (a BlockMask over the packed tokens) and CPU SDPA (one call
per sequence span, no mask at all). Eager, the definition and test oracle, and SDPA where spans do
not apply run on the padded layout with the dense boolean mask. Outputs of a query that sees no key
(padding included) are exact zeros on every backend.

This file ships inside every model artifact: it imports torch only (flash loading lives in .flash,
imported on the first flash call) and does nothing at import time.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
MASK_SEMANTICS = ("padding", "sequence", "block_causal", "causal")
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
FLEX_BLOCK = 128


# --------------------------------------------------------------------------- names


def resolve_backend(name: object) -> str:
    """Return `name` if it is exactly one of ATTENTION_BACKENDS, else raise ValueError."""
    if isinstance(name, str) and name in ATTENTION_BACKENDS:
        return name
    raise ValueError(f"Unknown attention backend {name!r}. Valid names are exactly: {', '.join(ATTENTION_BACKENDS)}.")


def check_backend(
    name: object, allowed: Sequence[str], *, family: str, reasons: Mapping[str, str] | None = None
) -> str:
    """Validate a requested backend against a family's declared list (from its manifest); `reasons` says
    why the family refuses a backend, where its manifest says."""
    backend = resolve_backend(name)
    if backend not in allowed:
        why = f" ({reasons[backend]})" if reasons and backend in reasons else ""
        raise ValueError(
            f"Attention backend {backend!r} is not supported by {family}{why}; its manifest declares: "
            f"{', '.join(allowed)}."
        )
    return backend


def warn_eager_for_attentions(configured: str) -> None:
    """The single warning of the output_attentions=True path (one call runs eager)."""
    warnings.warn(
        f"output_attentions=True needs the full attention-probability matrix, which the configured "
        f"backend {configured!r} does not return; this call runs 'eager'. The configured backend "
        f"stays {configured!r}.",
        RuntimeWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- masks


class MaskState(NamedTuple):
    """Normalized mask: `valid` (b, sq) bool and `ids` (b, sq) int64 (-1 on padding) for the queries;
    `kv_valid`/`kv_ids` (b, sk) for the keys, None when the keys are the queries."""

    valid: torch.Tensor
    ids: torch.Tensor
    semantics: str
    kv_valid: torch.Tensor | None = None
    kv_ids: torch.Tensor | None = None

    @property
    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_valid is None:
            return self.valid, self.ids
        return self.kv_valid, self.kv_ids


class Varlen(NamedTuple):
    """Packed form: flat indices of valid tokens into (b*s), segment offsets and longest segment."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _check_binary_mask(attention_mask: torch.Tensor, shape: tuple[int, int] | None, name: str) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2 or (shape is not None and tuple(attention_mask.shape) != shape):
        expected = f"(batch, seq) = {shape}" if shape is not None else "(batch, seq)"
        raise ValueError(f"{name} must have shape {expected}; received {tuple(attention_mask.shape)}.")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"{name} must be bool or 0/1 integers; received dtype {attention_mask.dtype}. "
            "An additive (0/-inf) mask is not accepted: it would be read inverted."
        )
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        value = attention_mask[bad][0].item()
        raise ValueError(f"{name} must contain only 0 and 1; found {value}.")
    return attention_mask.bool()


def _side(attention_mask, sequence_ids, shape, device, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, ids) of one side (queries or keys) from its mask and/or sequence ids."""
    mask_name, ids_name = f"{prefix}attention_mask", f"{prefix}sequence_ids"
    valid = None if attention_mask is None else _check_binary_mask(attention_mask, shape, mask_name)
    if sequence_ids is not None:
        if not isinstance(sequence_ids, torch.Tensor) or sequence_ids.is_floating_point():
            raise ValueError(f"{ids_name} must be an integer tensor (batch, seq) with -1 for padding.")
        if sequence_ids.dtype == torch.bool:
            raise ValueError(f"{ids_name} must be integers (-1 = padding), not bool.")
        expected = shape if shape is not None else (None if valid is None else tuple(valid.shape))
        if sequence_ids.ndim != 2 or (expected is not None and tuple(sequence_ids.shape) != expected):
            raise ValueError(
                f"{ids_name} must have shape (batch, seq) = {expected}; received {tuple(sequence_ids.shape)}."
            )
        if bool((sequence_ids < -1).any()):
            raise ValueError(f"{ids_name} must be >= 0 for tokens and -1 for padding.")
        from_ids = sequence_ids >= 0
        if valid is not None and not torch.equal(valid.to(from_ids.device), from_ids):
            raise ValueError(f"{mask_name} and {ids_name} disagree on which tokens are padding.")
        valid, ids = from_ids, sequence_ids.long()
    elif valid is not None:
        ids = torch.where(valid, 0, -1)
    elif shape is not None:
        valid = torch.ones(shape, dtype=torch.bool, device=device)
        ids = torch.zeros(shape, dtype=torch.long, device=device)
    else:
        raise ValueError(f"A mask needs {mask_name} or {ids_name}.")
    empty = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        what = "key" if prefix else "valid token"
        raise ValueError(f"Batch row(s) {empty} have no {what}; every row needs at least one.")
    if device is not None:
        valid, ids = valid.to(device), ids.to(device)
    return valid, ids


def mask_state(
    attention_mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
    kv_attention_mask: torch.Tensor | None = None,
    kv_sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
    shape: tuple[int, int] | None = None,
    kv_shape: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> MaskState:
    """Validate and normalize the biological mask once; every mask form is derived from this.

    `shape`/`kv_shape` are the (batch, seq) the masks must have (and the all-valid default when a side
    has no mask). Keys get their own state when any kv argument is given, else they are the queries.
    """
    if semantics not in MASK_SEMANTICS:
        raise ValueError(f"Unknown mask semantics {semantics!r}; valid: {', '.join(MASK_SEMANTICS)}.")
    valid, ids = _side(attention_mask, sequence_ids, shape, device, "")
    if kv_attention_mask is None and kv_sequence_ids is None and kv_shape is None:
        return MaskState(valid, ids, semantics)
    kv_valid, kv_ids = _side(kv_attention_mask, kv_sequence_ids, kv_shape, device or valid.device, "kv_")
    if kv_valid.shape[0] != valid.shape[0]:
        raise ValueError(f"queries have batch {valid.shape[0]} but keys have batch {kv_valid.shape[0]}.")
    return MaskState(valid, ids, semantics, kv_valid.to(valid.device), kv_ids.to(valid.device))


def _visible(semantics: str, q_ok, k_ok, q_id, k_id, q_pos, k_pos, shift: int):
    """The semantics, written once: whether query (ok, id, pos) sees key (ok, id, pos). Works on broadcast
    tensors (the dense oracle) and inside Flex mask functions alike."""
    ok = q_ok & k_ok
    if semantics == "padding":
        return ok
    if semantics == "sequence":
        return ok & (k_id == q_id)
    if semantics == "block_causal":
        return ok & (k_id <= q_id)
    return ok & (k_pos <= q_pos + shift)


def _dense_from_state(state: MaskState) -> torch.Tensor:
    q_ok, q_id = state.valid, state.ids
    k_ok, k_id = state.keys
    sq, sk = q_ok.shape[1], k_ok.shape[1]
    device = q_ok.device
    q_pos = torch.arange(sq, device=device)[None, None, :, None]
    k_pos = torch.arange(sk, device=device)[None, None, None, :]
    return _visible(
        state.semantics,
        q_ok[:, None, :, None],
        k_ok[:, None, None, :],
        q_id[:, None, :, None],
        k_id[:, None, None, :],
        q_pos,
        k_pos,
        sk - sq,
    )


def dense_mask(
    attention_mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
    kv_attention_mask: torch.Tensor | None = None,
    kv_sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
) -> torch.Tensor:
    """Dense boolean mask (b, 1, sq, sk), True = may attend. The oracle for every other form."""
    state = mask_state(
        attention_mask,
        sequence_ids=sequence_ids,
        kv_attention_mask=kv_attention_mask,
        kv_sequence_ids=kv_sequence_ids,
        semantics=semantics,
    )
    return _dense_from_state(state)


def block_mask(attention_mask: torch.Tensor | None = None, **masks):
    """Flex `BlockMask` (b, 1, sq, sk) with the same arguments and semantics as `dense_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    state = mask_state(attention_mask, **masks)
    # Private copies: the caller may refill its tensors in place; the BlockMask keeps its own truth.
    q_ok, q_id = state.valid.clone(), state.ids.clone()
    k_ok, k_id = (t.clone() for t in state.keys)
    b, sq, sk = q_ok.shape[0], q_ok.shape[1], k_ok.shape[1]

    def mask_mod(n, h, q, kv):
        return _visible(state.semantics, q_ok[n, q], k_ok[n, kv], q_id[n, q], k_id[n, kv], q, kv, sk - sq)

    return create_block_mask(mask_mod, b, None, sq, sk, device=q_ok.device)


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(b, s, ...) -> (total_valid, ...) in row-major token order."""
    return x.flatten(0, 1).index_select(0, indices)


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Inverse of `unpad`: scatter packed tokens back; padding positions are exact zeros."""
    out = packed.new_zeros((batch * seq, *packed.shape[1:]))
    out.index_copy_(0, indices, packed)
    return out.view(batch, seq, *packed.shape[1:])


# --------------------------------------------------------------------------- packed segments


def _runs(valid: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per row, the runs of one sequence id over the packed valid tokens: (id, start, stop) in packed
    coordinates. One host transfer."""
    counts = valid.sum(-1).tolist()
    packed_ids = ids[valid].tolist()
    rows, start = [], 0
    for count in counts:
        runs: list[tuple[int, int, int]] = []
        for offset, seq_id in enumerate(packed_ids[start : start + count]):
            if runs and runs[-1][0] == seq_id:
                runs[-1] = (seq_id, runs[-1][1], start + offset + 1)
            else:
                runs.append((seq_id, start + offset, start + offset + 1))
        rows.append(runs)
        start += count
    return rows


def _segment_runs(state: MaskState) -> tuple[list, list]:
    """Query and key runs; a semantics that ignores sequence ids makes each row one run."""
    split = state.semantics in ("sequence", "block_causal")
    q_ids = state.ids if split else torch.where(state.valid, 0, -1)
    q_runs = _runs(state.valid, q_ids)
    if state.kv_valid is None:
        return q_runs, q_runs
    k_valid, k_ids = state.keys
    return q_runs, _runs(k_valid, k_ids if split else torch.where(k_valid, 0, -1))


def _key_span(semantics: str, seq_id: int, key_runs: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """The packed key range a query run of `seq_id` sees, when it is one contiguous range (else None)."""
    if not key_runs:
        return None
    row_start, row_stop = key_runs[0][1], key_runs[-1][2]
    if semantics == "padding":
        return row_start, row_stop
    if semantics == "sequence":
        same = [run for run in key_runs if run[0] == seq_id]
        if len(same) > 1:
            return None
        return (same[0][1], same[0][2]) if same else (row_start, row_start)
    # block_causal: the keys of ids <= seq_id must be a prefix of the row.
    seen = [run[0] <= seq_id for run in key_runs]
    stop = seen.index(False) if False in seen else len(seen)
    if any(seen[stop:]):
        return None
    return row_start, (key_runs[stop - 1][2] if stop else row_start)


def _spans(state: MaskState) -> list[tuple[int, int, int, int]] | None:
    """(q_start, q_stop, k_start, k_stop) per query run in packed coordinates, or None when some run's
    keys are not one contiguous range (or the semantics is causal): then the dense path runs."""
    if state.semantics == "causal":
        return None
    q_rows, k_rows = _segment_runs(state)
    spans = []
    for q_runs, k_runs in zip(q_rows, k_rows, strict=True):
        for seq_id, q_start, q_stop in q_runs:
            keys = _key_span(state.semantics, seq_id, k_runs)
            if keys is None:
                return None
            spans.append((q_start, q_stop, *keys))
    return spans


def _varlen_segments(state: MaskState):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) for flash: one segment per query run, paired with the
    key run of the same row and id."""
    if state.semantics == "block_causal":
        raise ValueError("FlashAttention cannot express block_causal masks; use sdpa or flex_attention.")
    q_rows, k_rows = _segment_runs(state)
    q_lengths, k_lengths = [], []
    for row, (q_runs, k_runs) in enumerate(zip(q_rows, k_rows, strict=True)):
        q_ids, k_ids = [r[0] for r in q_runs], [r[0] for r in k_runs]
        if len(set(q_ids)) != len(q_ids) or len(set(k_ids)) != len(k_ids):
            raise ValueError("The packed (varlen) form needs each sequence id to be one contiguous run within its row.")
        if q_ids != k_ids:
            raise ValueError(
                f"FlashAttention pairs query and key sequences one to one; row {row} has query sequences "
                f"{q_ids} but key sequences {k_ids}."
            )
        q_lengths += [stop - start for _, start, stop in q_runs]
        k_lengths += [stop - start for _, start, stop in k_runs]
    if state.semantics == "causal" and state.kv_valid is not None:
        # Bottom-right causal on packed segments equals the padded rule only without padding.
        if not (bool(state.valid.all()) and bool(state.kv_valid.all())):
            raise ValueError("causal attention with separate keys needs unpadded queries and keys for FlashAttention.")
    device = state.valid.device
    cu_q = torch.tensor([0, *q_lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    if state.kv_valid is None:
        return cu_q, cu_q, max(q_lengths), max(q_lengths)
    cu_k = torch.tensor([0, *k_lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return cu_q, cu_k, max(q_lengths), max(k_lengths)


def varlen(attention_mask: torch.Tensor | None = None, *, sequence_ids: torch.Tensor | None = None) -> Varlen:
    """Packed form for padding-free kernels; with sequence_ids each run of one id is a segment."""
    state = mask_state(attention_mask, sequence_ids=sequence_ids, semantics="sequence")
    cu, _, longest, _ = _varlen_segments(state)
    return Varlen(state.valid.flatten().nonzero().flatten(), cu, longest)


# --------------------------------------------------------------------------- the plan


class AttentionPlan(NamedTuple):
    """Everything a forward's attention calls share, derived once (`attention_plan`).

    `q_index`/`kv_index`: flat indices of the valid tokens into (b*sq)/(b*sk); `form`: the mask form of
    the backend (dense bool, packed BlockMask with its padded lengths, flash segments, or SDPA spans);
    `sees_nothing`: packed query positions that see no key (zeroed), or None when every query sees one.
    """

    backend: str
    state: MaskState
    q_index: torch.Tensor
    kv_index: torch.Tensor
    form: object
    sees_nothing: torch.Tensor | None
    flash_lockfile: object
    # Loaded flash kernels by (backend, lockfile): filled by the first layer, after the device and dtype
    # checks; a model passes its own dict so that a kernel is resolved once per model.
    kernels: dict


def attention_plan(
    backend: str,
    state: MaskState,
    *,
    flash_lockfile=None,
    kernels: dict | None = None,
) -> AttentionPlan:
    """Validate `backend` and derive, once, the mask form it needs for every layer of one forward.

    SDPA on CPU runs one call per sequence span (no padding, no mask) when each query run's keys form
    one contiguous packed range; elsewhere (CUDA, causal, interleaved ids) the dense path runs.
    """
    backend = resolve_backend(backend)
    valid, kv_valid = state.valid, state.keys[0]
    q_index = valid.flatten().nonzero().flatten()
    kv_index = q_index if state.kv_valid is None else kv_valid.flatten().nonzero().flatten()
    sees_nothing = None
    # With one mask for both sides every valid query sees itself; with separate keys it may see none.
    if state.kv_valid is not None and state.semantics != "padding":
        blind = ~_dense_from_state(state).any(-1)[:, 0].flatten().index_select(0, q_index)
        sees_nothing = blind if bool(blind.any()) else None
    if backend == "eager":
        form = _dense_from_state(state)
    elif backend == "sdpa":
        spans = _spans(state) if valid.device.type == "cpu" else None
        form = spans if spans is not None else _dense_from_state(state)
    elif backend == "flex_attention":
        form = _packed_block_mask(state, q_index, kv_index)
    else:
        form = _varlen_segments(state)
    kernels = {} if kernels is None else kernels
    return AttentionPlan(backend, state, q_index, kv_index, form, sees_nothing, flash_lockfile, kernels)


# --------------------------------------------------------------------------- backend adapters
# Module-level functions looked up through `_DISPATCH` at call time, so each can be tested alone and
# replaced in tests. Padded adapters take q (b, hq, sq, d), k/v (b, hkv, sk, d) and return (b, hq, sq, d).


def eager_attention(q, k, v, mask: torch.Tensor, scale: float, bias=None, return_probs: bool = False):
    """The definition: explicit scores, softmax, values. KV heads repeated for GQA (only here)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    # finfo.min instead of -inf keeps rows that see no key finite; they are zeroed below.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # At least float32 (float64 stays float64, so a float64 oracle run is not rounded to float32 here).
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    probs = probs.masked_fill(~mask, 0.0)
    out = torch.matmul(probs, v)
    return (out, probs) if return_probs else out


def sdpa_attention(q, k, v, mask: torch.Tensor, scale: float, bias=None):
    if bias is not None:
        # SDPA takes one mask: the bias with the forbidden entries at the dtype's minimum (finite, so a row
        # that sees nothing stays finite; such rows are zeroed afterwards).
        additive = bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask = additive.masked_fill(~mask, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def sdpa_spans(q, k, v, spans, scale: float):
    """SDPA per span on packed (tokens, heads, d) tensors: each query run against its key range, unmasked."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    gqa = k.shape[1] != q.shape[1]
    for q_start, q_stop, k_start, k_stop in spans:
        if k_stop == k_start:
            continue  # sees no key: stays zero
        qs = q[q_start:q_stop].transpose(0, 1)[None]
        ks, vs = (t[k_start:k_stop].transpose(0, 1)[None] for t in (k, v))
        attended = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=gqa)
        out[q_start:q_stop] = attended[0].transpose(0, 1)
    return out


_flex_compiled: dict[tuple, object] = {}
_block_masks: dict[tuple, tuple] = {}


def flex_attention_forward(q, k, v, block, scale: float, score_mod=None, compiled: bool = True):
    """Flex over (1, h, T, d) inputs already padded to the BlockMask's lengths (multiples of FLEX_BLOCK)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = k.shape[1] != q.shape[1]
    if not compiled:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=gqa)
    key = (q.device, q.dtype, tuple(q.shape), tuple(k.shape), block.mask_mod.__name__, score_mod is not None)
    fn = _flex_compiled.get(key)
    if fn is None:
        # Dynamo counts recompilations per code object (limit 8): one fresh code object per cache key
        # gives every shape its own compiled entry instead of exhausting a shared budget.
        call = types.FunctionType(_flex_call.__code__.replace(), _flex_call.__globals__)
        fn = _flex_compiled[key] = torch.compile(call, dynamic=False, fullgraph=True)
    return fn(q, k, v, block, score_mod, scale, gqa)


def _flex_call(q, k, v, block, score_mod, scale, gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=gqa)


def flex_length(tokens: int) -> int:
    """Packed length Flex runs at: the next power of two, at least FLEX_BLOCK.

    Compiled CPU Flex is wrong on lengths that are not a multiple of its block size (measured, torch 2.13),
    and every new length compiles anew; the extra positions are neither queries nor keys, so their tiles
    are empty and skipped by the kernel, and a whole job compiles for a handful of lengths, never for
    exact row lengths.
    """
    return max(FLEX_BLOCK, 1 << (tokens - 1).bit_length())


class _PackedBlock(NamedTuple):
    block: object
    q_length: int  # padded packed lengths (multiples of FLEX_BLOCK)
    kv_length: int
    meta: tuple  # per packed position: (row, position in row) of queries and of keys


def _packed_meta(valid: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, length: int):
    """Per packed position (padded to `length`): ok, row, id, position in the row."""
    seq = valid.shape[1]
    extra = length - index.numel()
    row = F.pad(index // seq, (0, extra))
    pos = F.pad(index % seq, (0, extra))
    seq_id = F.pad(ids.flatten().index_select(0, index), (0, extra), value=-1)
    ok = F.pad(torch.ones_like(index, dtype=torch.bool), (0, extra), value=False)
    return ok, row, seq_id, pos


def _packed_block_mask(state: MaskState, q_index: torch.Tensor, kv_index: torch.Tensor) -> _PackedBlock:
    """BlockMask over the packed tokens as one row: same row and the semantics. Cached by lengths and
    semantics; reused only when the content is identical."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_length, kv_length = flex_length(q_index.numel()), flex_length(kv_index.numel())
    q_meta = _packed_meta(state.valid, state.ids, q_index, q_length)
    k_valid, k_ids = state.keys
    k_meta = q_meta if state.kv_valid is None else _packed_meta(k_valid, k_ids, kv_index, kv_length)
    sq, sk = state.valid.shape[1], k_valid.shape[1]
    key = (q_index.device, q_length, kv_length, state.semantics, sk - sq, state.kv_valid is None)
    cached = _block_masks.get(key)
    if cached is not None and all(torch.equal(a, b) for a, b in zip(cached[0], (*q_meta, *k_meta), strict=True)):
        return cached[1]
    q_ok, q_row, q_id, q_pos = q_meta
    k_ok, k_row, k_id, k_pos = k_meta
    semantics, shift = state.semantics, sk - sq

    def packed(n, h, q, kv):
        visible = _visible(semantics, q_ok[q], k_ok[kv], q_id[q], k_id[kv], q_pos[q], k_pos[kv], shift)
        return visible & (q_row[q] == k_row[kv])

    packed.__name__ = f"packed_{semantics}"
    block = create_block_mask(packed, 1, None, q_length, kv_length, device=q_index.device)
    result = _PackedBlock(block, q_length, kv_length, (q_row, q_pos, k_row, k_pos))
    _block_masks[key] = ((*q_meta, *k_meta), result)
    return result


def flash_attention_forward(q, k, v, segments, scale: float, causal: bool, kernel):
    """Packed (tokens, heads, d) q, k, v through the pinned varlen kernel, in bfloat16."""
    from .flash import flash_varlen_forward

    cu_q, cu_k, max_q, max_k = segments
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return flash_varlen_forward(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, causal=causal)


_DISPATCH = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flex_attention": flex_attention_forward,
    "flash_attention_2": flash_attention_forward,
    "flash_attention_3": flash_attention_forward,
}


def clear_flex_attention_caches() -> None:
    """Empty our compiled Flex functions and cached BlockMasks; no global torch state is touched."""
    _flex_compiled.clear()
    _block_masks.clear()


# --------------------------------------------------------------------------- facade


def _check_heads(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> None:
    hq, hkv = q.shape[head_dim], k.shape[head_dim]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Query heads ({hq}) must be a multiple of key/value heads ({hkv}).")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    *,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    return_probs: bool = False,
):
    """Attention on packed valid tokens: q (tq, hq, d), k/v (tk, hkv, d) in the plan's token order
    -> (tq, hq, d). `return_probs=True` (eager only) also returns the padded probabilities (b, hq, sq, sk)."""
    backend, state = plan.backend, plan.state
    if return_probs and backend != "eager":
        raise ValueError("Attention probabilities are only materialized by the eager backend.")
    if bias is not None and backend in FLASH_BACKENDS:
        raise ValueError(f"{backend} cannot add an attention bias; use eager, sdpa or flex_attention.")
    _check_heads(q, k, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    adapter = _DISPATCH[backend]
    probs = None
    if backend in FLASH_BACKENDS:
        from .flash import check_flash_inputs, load_flash_kernel

        # Device and dtype are checked before any kernel is downloaded or imported.
        check_flash_inputs(q, k, v)
        key = (backend, plan.flash_lockfile)
        if key not in plan.kernels:
            plan.kernels[key] = load_flash_kernel(backend, plan.flash_lockfile)
        out = adapter(q, k, v, plan.form, scale, state.semantics == "causal", plan.kernels[key])
    elif backend == "flex_attention":
        packed = plan.form
        score_mod = None if bias is None else _bias_score_mod(bias, q.shape[1], state, packed.meta)
        qf = F.pad(q, (0, 0, 0, 0, 0, packed.q_length - q.shape[0])).transpose(0, 1)[None]
        kf, vf = (F.pad(t, (0, 0, 0, 0, 0, packed.kv_length - t.shape[0])).transpose(0, 1)[None] for t in (k, v))
        out = adapter(qf, kf, vf, packed.block, scale, score_mod)[0].transpose(0, 1)[: q.shape[0]]
    elif backend == "sdpa" and isinstance(plan.form, list) and bias is None:
        out = sdpa_spans(q, k, v, plan.form, scale)
    else:
        dense = plan.form if isinstance(plan.form, torch.Tensor) else _dense_from_state(state)
        b, sq, sk = state.valid.shape[0], state.valid.shape[1], state.keys[0].shape[1]
        qp = pad(q, plan.q_index, b, sq).transpose(1, 2)
        kp, vp = (pad(t, plan.kv_index, b, sk).transpose(1, 2) for t in (k, v))
        if backend == "eager":
            out, probs = adapter(qp, kp, vp, dense, scale, bias, return_probs=True)
        else:
            out = adapter(qp, kp, vp, dense, scale, bias)
        out = unpad(out.transpose(1, 2), plan.q_index)
    if plan.sees_nothing is not None:
        out = out.masked_fill(plan.sees_nothing[:, None, None], 0.0)
    return (out, probs) if return_probs else out


def _bias_score_mod(bias: torch.Tensor, heads: int, state: MaskState, meta):
    b, sq, sk = state.valid.shape[0], state.valid.shape[1], state.keys[0].shape[1]
    full = bias.expand(b, heads, sq, sk)
    q_row, q_pos, k_row, k_pos = meta

    def add_bias(score, n, h, q, kv):
        return score + full[q_row[q], h, q_pos[q], k_pos[kv]].to(score.dtype)

    return add_bias


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    attention_mask: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    kv_attention_mask: torch.Tensor | None = None,
    kv_sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    state: MaskState | None = None,
    return_probs: bool = False,
    flash_lockfile=None,
):
    """Attention through one backend on padded tensors: q (b, hq, sq, d), k/v (b, hkv, sk, d) ->
    (b, sq, hq, d). Without kv masks the keys are the queries' positions (sq must equal sk).

    `state` (from `mask_state`) may replace the mask arguments. `return_probs=True` (eager only) also
    returns the attention probabilities (b, hq, sq, sk) for output_attentions. Same function as
    `attention_plan` + `attend`, which models use on packed tokens.
    """
    backend = resolve_backend(backend)
    if return_probs and backend != "eager":
        raise ValueError("Attention probabilities are only materialized by the eager backend.")
    if bias is not None and backend in FLASH_BACKENDS:
        raise ValueError(f"{backend} cannot add an attention bias; use eager, sdpa or flex_attention.")
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    _check_heads(q, k, 1)
    separate = kv_attention_mask is not None or kv_sequence_ids is not None
    separate = separate or (state is not None and state.kv_valid is not None)
    if not separate and sq != sk:
        raise ValueError(
            f"queries have length {sq} but keys {sk}; pass kv_attention_mask or kv_sequence_ids to describe the keys."
        )
    if backend in FLASH_BACKENDS:
        from .flash import check_flash_inputs

        check_flash_inputs(q, k, v, attention_mask)
    if state is None:
        state = mask_state(
            attention_mask,
            sequence_ids=sequence_ids,
            kv_attention_mask=kv_attention_mask,
            kv_sequence_ids=kv_sequence_ids,
            semantics=semantics,
            shape=(b, sq),
            kv_shape=(b, sk) if separate else None,
            device=q.device,
        )
    plan = attention_plan(backend, state, flash_lockfile=flash_lockfile)
    packed_q = unpad(q.transpose(1, 2), plan.q_index)
    packed_k, packed_v = (unpad(t.transpose(1, 2), plan.kv_index) for t in (k, v))
    result = attend(packed_q, packed_k, packed_v, plan, bias=bias, scale=scale, return_probs=return_probs)
    out, probs = result if return_probs else (result, None)
    out = pad(out, plan.q_index, b, sq)
    return (out, probs) if return_probs else out
