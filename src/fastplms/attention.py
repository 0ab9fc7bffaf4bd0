"""Attention backends, biological mask conversion and the one dispatch facade.

Every model in fastplms calls `attention(...)`; it is the only place that knows backends. A mask is
given once, as biology describes it: a `(batch, seq)` validity mask and, for rows that hold several
sequences, per-token `sequence_ids` (-1 = padding). `semantics` says how tokens see each other:

- ``padding``: every query sees every valid key;
- ``sequence``: i sees j iff both are valid and carry the same sequence id;
- ``block_causal``: i sees j iff both are valid and seq(j) <= seq(i) (own sequence bidirectional,
  earlier sequences visible, later ones not: E1's global layers, the canvas rule);
- ``causal``: i sees j iff j <= i and j is valid.

The dense boolean form is the oracle; the Flex BlockMask and the packed varlen form are derived from
the same normalized state and are tested against it. Outputs at padded query positions are zeros on
every backend.

This file ships inside every model artifact: it imports torch only (flash loading lives in .flash,
imported on first flash call) and does nothing at import time.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
MASK_SEMANTICS = ("padding", "sequence", "block_causal", "causal")
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")


# --------------------------------------------------------------------------- names


def resolve_backend(name: object) -> str:
    """Return `name` if it is exactly one of ATTENTION_BACKENDS, else raise ValueError."""
    if isinstance(name, str) and name in ATTENTION_BACKENDS:
        return name
    raise ValueError(f"Unknown attention backend {name!r}. Valid names are exactly: {', '.join(ATTENTION_BACKENDS)}.")


def check_backend(name: object, allowed: Sequence[str], *, family: str) -> str:
    """Validate a requested backend against a family's declared list (from its manifest)."""
    backend = resolve_backend(name)
    if backend not in allowed:
        raise ValueError(
            f"Attention backend {backend!r} is not supported by {family}; its manifest declares: {', '.join(allowed)}."
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
    """Normalized mask: `valid` (b, s) bool and `ids` (b, s) int64 sequence ids, -1 on padding."""

    valid: torch.Tensor
    ids: torch.Tensor
    semantics: str


class Varlen(NamedTuple):
    """Packed form: flat indices of valid tokens into (b*s), segment offsets and longest segment."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _check_binary_mask(attention_mask: torch.Tensor, shape: tuple[int, int] | None) -> torch.Tensor:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2 or (shape is not None and tuple(attention_mask.shape) != shape):
        expected = f"(batch, seq) = {shape}" if shape is not None else "(batch, seq)"
        raise ValueError(f"attention_mask must have shape {expected}; received {tuple(attention_mask.shape)}.")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(
            f"attention_mask must be bool or 0/1 integers; received dtype {attention_mask.dtype}. "
            "An additive (0/-inf) mask is not accepted: it would be read inverted."
        )
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        value = attention_mask[bad][0].item()
        raise ValueError(f"attention_mask must contain only 0 and 1; found {value}.")
    return attention_mask.bool()


def mask_state(
    attention_mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
    shape: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> MaskState:
    """Validate and normalize the biological mask once; every mask form is derived from this."""
    if semantics not in MASK_SEMANTICS:
        raise ValueError(f"Unknown mask semantics {semantics!r}; valid: {', '.join(MASK_SEMANTICS)}.")
    valid = None if attention_mask is None else _check_binary_mask(attention_mask, shape)
    if sequence_ids is not None:
        if not isinstance(sequence_ids, torch.Tensor) or sequence_ids.is_floating_point():
            raise ValueError("sequence_ids must be an integer tensor (batch, seq) with -1 for padding.")
        if sequence_ids.dtype == torch.bool:
            raise ValueError("sequence_ids must be integers (-1 = padding), not bool.")
        expected = shape if shape is not None else (None if valid is None else tuple(valid.shape))
        if sequence_ids.ndim != 2 or (expected is not None and tuple(sequence_ids.shape) != expected):
            raise ValueError(
                f"sequence_ids must have shape (batch, seq) = {expected}; received {tuple(sequence_ids.shape)}."
            )
        if bool((sequence_ids < -1).any()):
            raise ValueError("sequence_ids must be >= 0 for tokens and -1 for padding.")
        from_ids = sequence_ids >= 0
        if valid is not None and not torch.equal(valid.to(from_ids.device), from_ids):
            raise ValueError("attention_mask and sequence_ids disagree on which tokens are padding.")
        valid, ids = from_ids, sequence_ids.long()
    elif valid is not None:
        ids = torch.where(valid, 0, -1)
    elif shape is not None:
        valid = torch.ones(shape, dtype=torch.bool, device=device)
        ids = torch.zeros(shape, dtype=torch.long, device=device)
    else:
        raise ValueError("A mask needs attention_mask or sequence_ids.")
    empty = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"Batch row(s) {empty} have no valid token; every row needs at least one.")
    if device is not None:
        valid, ids = valid.to(device), ids.to(device)
    return MaskState(valid, ids, semantics)


def _dense_from_state(state: MaskState) -> torch.Tensor:
    valid, ids, semantics = state
    b, s = valid.shape
    keys = valid[:, None, None, :]
    if semantics == "padding":
        return keys.expand(b, 1, s, s)
    if semantics == "causal":
        lower = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
        return keys & lower
    both = valid[:, None, :, None] & keys
    q_ids, k_ids = ids[:, None, :, None], ids[:, None, None, :]
    if semantics == "sequence":
        return both & (k_ids == q_ids)
    return both & (k_ids <= q_ids)


def dense_mask(
    attention_mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
) -> torch.Tensor:
    """Dense boolean mask (b, 1, s, s), True = may attend. The oracle for every other form."""
    return _dense_from_state(mask_state(attention_mask, sequence_ids=sequence_ids, semantics=semantics))


def _mask_mod(state: MaskState):
    valid, ids, semantics = state
    if semantics == "padding":

        def padding(b, h, q, kv):
            return valid[b, kv]

        return padding
    if semantics == "causal":

        def causal(b, h, q, kv):
            return valid[b, kv] & (kv <= q)

        return causal
    if semantics == "sequence":

        def sequence(b, h, q, kv):
            return valid[b, q] & valid[b, kv] & (ids[b, kv] == ids[b, q])

        return sequence

    def block_causal(b, h, q, kv):
        return valid[b, q] & valid[b, kv] & (ids[b, kv] <= ids[b, q])

    return block_causal


FLEX_BLOCK = 128
_block_masks: dict[tuple, tuple[torch.Tensor, torch.Tensor, object]] = {}


def _padded_state(state: MaskState, length: int) -> MaskState:
    extra = length - state.valid.shape[1]
    if extra == 0:
        return state
    return MaskState(
        F.pad(state.valid, (0, extra), value=False), F.pad(state.ids, (0, extra), value=-1), state.semantics
    )


def _block_mask_from_state(state: MaskState, length: int | None = None):
    """BlockMask for `state`, optionally over a longer (padded) length whose extra tokens are padding."""
    from torch.nn.attention.flex_attention import create_block_mask

    state = _padded_state(state, length or state.valid.shape[1])
    valid, ids, semantics = state
    b, s = valid.shape
    key = (valid.device, b, s, semantics)
    cached = _block_masks.get(key)
    # Keyed by shape; reused only when the content is identical (all layers of one forward).
    if cached is not None and torch.equal(cached[0], valid) and torch.equal(cached[1], ids):
        return cached[2]
    # Private copies: `valid`/`ids` may alias the caller's tensors, which a caller may refill in place;
    # the cache check above and the block's mask_mod must keep seeing the content it was built from.
    valid, ids = valid.clone(), ids.clone()
    block = create_block_mask(_mask_mod(MaskState(valid, ids, semantics)), b, None, s, s, device=valid.device)
    _block_masks[key] = (valid, ids, block)
    return block


def block_mask(
    attention_mask: torch.Tensor | None = None,
    *,
    sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
):
    """Flex `BlockMask` with the same semantics as `dense_mask`."""
    return _block_mask_from_state(mask_state(attention_mask, sequence_ids=sequence_ids, semantics=semantics))


def _varlen_from_state(state: MaskState) -> Varlen:
    valid, ids, _ = state
    b, s = valid.shape
    indices = valid.flatten().nonzero().flatten()
    row = indices // s
    seg_ids = ids.flatten()[indices]
    # A segment starts at each row start and wherever the sequence id changes along the packed tokens.
    starts = torch.ones_like(indices, dtype=torch.bool)
    starts[1:] = (row[1:] != row[:-1]) | (seg_ids[1:] != seg_ids[:-1])
    first = starts.nonzero().flatten()
    seg_row, seg_id = row[first], seg_ids[first]
    pairs = seg_row * (int(seg_ids.max()) + 1) + seg_id
    if pairs.unique().numel() != pairs.numel():
        raise ValueError("The packed (varlen) form needs each sequence id to be one contiguous run within its row.")
    lengths = torch.diff(torch.cat([first, first.new_tensor([indices.numel()])]))
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=valid.device)
    cu[1:] = lengths.cumsum(0)
    return Varlen(indices, cu, int(lengths.max()))


def varlen(attention_mask: torch.Tensor | None = None, *, sequence_ids: torch.Tensor | None = None) -> Varlen:
    """Packed form for padding-free kernels; with sequence_ids each run of one id is a segment."""
    return _varlen_from_state(mask_state(attention_mask, sequence_ids=sequence_ids, semantics="sequence"))


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(b, s, ...) -> (total_valid, ...) in row-major token order."""
    return x.flatten(0, 1).index_select(0, indices)


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Inverse of `unpad`: scatter packed tokens back; padding positions are exact zeros."""
    out = packed.new_zeros((batch * seq, *packed.shape[1:]))
    out.index_copy_(0, indices, packed)
    return out.view(batch, seq, *packed.shape[1:])


# --------------------------------------------------------------------------- backend adapters
# Module-level functions looked up through `_DISPATCH` at call time, so each can be tested alone
# and replaced in tests. Inputs: q (b, hq, s, d), k/v (b, hkv, s, d); output (b, hq, s, d).


def eager_attention(q, k, v, mask: torch.Tensor, scale: float, return_probs: bool = False):
    """The definition: explicit scores, softmax, values. KV heads repeated for GQA (only here)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    # finfo.min instead of -inf keeps fully masked (padded) query rows finite; they are zeroed later.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = probs.masked_fill(~mask, 0.0)
    out = torch.matmul(probs, v)
    return (out, probs) if return_probs else out


def sdpa_attention(q, k, v, mask: torch.Tensor, scale: float):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


_flex_compiled: dict[tuple, object] = {}


def flex_attention_forward(q, k, v, block, scale: float, compiled: bool = True):
    """Flex over inputs already padded to the BlockMask's length (a multiple of FLEX_BLOCK)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = k.shape[1] != q.shape[1]
    if not compiled:
        return flex_attention(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa)
    key = (q.device, q.dtype, tuple(q.shape), tuple(k.shape), block.mask_mod.__name__)
    fn = _flex_compiled.get(key)
    if fn is None:
        # Dynamo counts recompilations per code object (limit 8): one fresh code object per cache key
        # gives every shape its own compiled entry instead of exhausting a shared budget.
        call = types.FunctionType(_flex_call.__code__.replace(), _flex_call.__globals__)
        fn = _flex_compiled[key] = torch.compile(call, dynamic=False, fullgraph=True)
    return fn(q, k, v, block, scale, gqa)


def _flex_call(q, k, v, block, scale, gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa)


def flash_attention_forward(q, k, v, packing: Varlen, scale: float, causal: bool, implementation: str, lockfile=None):
    from .flash import flash_varlen_forward, load_flash_kernel

    kernel = load_flash_kernel(implementation, lockfile)
    b, _, s, _ = q.shape
    dtype = torch.bfloat16
    q, k, v = (unpad(t.transpose(1, 2), packing.indices).to(dtype) for t in (q, k, v))
    out = flash_varlen_forward(kernel, q, k, v, packing.cu_seqlens, packing.max_seqlen, scale=scale, causal=causal)
    return pad(out, packing.indices, b, s).transpose(1, 2)


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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    attention_mask: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    semantics: str = "padding",
    scale: float | None = None,
    state: MaskState | None = None,
    return_probs: bool = False,
    flash_lockfile=None,
):
    """Attention through one backend. q (b, hq, s, d), k/v (b, hkv, s, d) -> (b, s, hq, d).

    `state` (from `mask_state`) lets a model normalize its mask once per forward and reuse it in
    every layer; otherwise the mask arguments are normalized here. `return_probs=True` (eager only)
    also returns the attention probabilities (b, hq, s, s) for output_attentions.
    """
    backend = resolve_backend(backend)
    if return_probs and backend != "eager":
        raise ValueError("Attention probabilities are only materialized by the eager backend.")
    b, hq, s, d = q.shape
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"Query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]}).")
    scale = d**-0.5 if scale is None else scale
    if backend in FLASH_BACKENDS:
        from .flash import check_flash_inputs

        # Device, dtype and mask shape are checked before any kernel is downloaded or imported.
        check_flash_inputs(q, k, v, attention_mask)
    if state is None:
        state = mask_state(
            attention_mask, sequence_ids=sequence_ids, semantics=semantics, shape=(b, s), device=q.device
        )
    adapter = _DISPATCH[backend]
    probs = None
    if backend == "eager":
        out, probs = adapter(q, k, v, _dense_from_state(state), scale, return_probs=True)
    elif backend == "sdpa":
        out = adapter(q, k, v, _dense_from_state(state), scale)
    elif backend == "flex_attention":
        # Compiled CPU Flex is wrong on lengths that are not a multiple of its block size (measured,
        # torch 2.13), so the sequence is padded up to one; the extra tokens are padding keys.
        padded = -(-s // FLEX_BLOCK) * FLEX_BLOCK
        q, k, v = (F.pad(t, (0, 0, 0, padded - s)) for t in (q, k, v))
        out = adapter(q, k, v, _block_mask_from_state(state, padded), scale)[:, :, :s]
    else:
        if state.semantics == "block_causal":
            raise ValueError(f"{backend} cannot express block_causal masks; use sdpa or flex_attention.")
        # Only `sequence` separates sequence ids; `padding` and `causal` see across them (as the dense
        # oracle does), so they pack one segment per row.
        packed = state if state.semantics == "sequence" else state._replace(ids=torch.where(state.valid, 0, -1))
        out = adapter(q, k, v, _varlen_from_state(packed), scale, state.semantics == "causal", backend, flash_lockfile)
    out = out.transpose(1, 2).masked_fill(~state.valid[:, :, None, None], 0.0)
    return (out, probs) if return_probs else out
