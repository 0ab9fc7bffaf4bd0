"""The attention facade and its mask conversions, on CPU.

The dense boolean mask is the oracle. It is itself checked against a brute-force loop over the written
rules; every other form (Flex BlockMask, varlen packing) and every CPU-runnable backend is checked against
it. Compiled Flex cases are few and share cache keys (each new key compiles for seconds on a small CPU).
"""

from __future__ import annotations

import functools
import random
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fastplms.flash
from fastplms import attention as A
from fastplms.validation import relative_l2

SEMANTICS = ("padding", "sequence", "block_causal", "causal")
ODD_LENGTHS = (1, 7, 129, 200)
TOL = 1e-5
UNCOMPILED_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# --------------------------------------------------------------------------- helpers


def _brute_dense(attention_mask, sequence_ids, semantics):
    """The module docstring's rules, one (batch, query, key) triple at a time."""
    if sequence_ids is not None:
        ids = sequence_ids.tolist()
        valid = [[t >= 0 for t in row] for row in ids]
    else:
        valid = [[bool(t) for t in row] for row in attention_mask.tolist()]
        ids = [[0 if t else -1 for t in row] for row in valid]
    out = []
    for vrow, irow in zip(valid, ids, strict=True):
        rows = []
        for i, vi in enumerate(vrow):
            if semantics == "padding":
                rows.append(list(vrow))
            elif semantics == "sequence":
                rows.append([vi and vj and irow[j] == irow[i] for j, vj in enumerate(vrow)])
            elif semantics == "block_causal":
                rows.append([vi and vj and irow[j] <= irow[i] for j, vj in enumerate(vrow)])
            else:
                rows.append([vj and j <= i for j, vj in enumerate(vrow)])
        out.append([rows])
    return torch.tensor(out, dtype=torch.bool)


def _ensure_nonempty(rng, valid, ids):
    for n in range(len(valid)):
        if not any(valid[n]):
            j = rng.randrange(len(valid[n]))
            valid[n][j] = True
            if ids is not None:
                ids[n][j] = 0


def _random_case(rng: random.Random, b: int, s: int, kind: str):
    """(attention_mask, sequence_ids) of one mask form; every batch row has at least one valid token."""
    if kind in ("right", "left", "holes", "single"):
        valid = []
        for _ in range(b):
            if kind == "right":
                n = rng.randint(1, s)
                row = [True] * n + [False] * (s - n)
            elif kind == "left":
                n = rng.randint(1, s)
                row = [False] * (s - n) + [True] * n
            elif kind == "holes":
                row = [rng.random() < 0.6 for _ in range(s)]
            else:
                row = [False] * s
                row[rng.randrange(s)] = True
            valid.append(row)
        _ensure_nonempty(rng, valid, None)
        dtype = rng.choice([torch.bool, torch.int64, torch.int32, torch.uint8])
        return torch.tensor(valid, dtype=dtype), None
    ids = []
    for _ in range(b):
        row, next_id = [], 0
        while len(row) < s:
            run = rng.randint(1, max(1, s // 3))
            if kind == "runs" and rng.random() < 0.25:
                row += [-1] * run
            elif kind == "runs":
                row += [next_id] * run
                next_id += 1
            else:  # "scattered": arbitrary ids, reused non-contiguously (the dense forms allow it)
                row += [rng.choice([-1, 0, 1, 2, 3])] * rng.randint(1, 3)
        ids.append(row[:s])
    valid = [[t >= 0 for t in row] for row in ids]
    _ensure_nonempty(rng, valid, ids)
    sequence_ids = torch.tensor(ids, dtype=rng.choice([torch.int64, torch.int32]))
    if rng.random() < 0.5:
        return (sequence_ids >= 0).to(rng.choice([torch.bool, torch.int64])), sequence_ids
    return None, sequence_ids


def _cases(seed: int, count: int, lengths, batches, kinds):
    """`count` random cases; lengths and batch sizes are cycled so every one of them is covered."""
    rng = random.Random(seed)
    for i in range(count):
        s, b, kind = lengths[i % len(lengths)], batches[i % len(batches)], rng.choice(kinds)
        yield (s, b, kind, *_random_case(rng, b, s, kind))


def _valid(attention_mask, sequence_ids):
    return sequence_ids >= 0 if sequence_ids is not None else attention_mask.bool()


def _qkv(b, hq, hkv, s, d=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen)
    k, v = (torch.randn(b, hkv, s, d, generator=gen) for _ in range(2))
    return tuple(t.to(dtype) for t in (q, k, v))


def _grid_mask(block, b, s):
    """Evaluate a BlockMask's mask_mod on every (batch, query, key) index: the element-level truth."""
    bi = torch.arange(b)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    qi = torch.arange(s)[None, None, :, None]
    ki = torch.arange(s)[None, None, None, :]
    return block.mask_mod(bi, h, qi, ki).expand(b, 1, s, s).bool()


def _tiles(dense, size):
    """Which (query block, key block) tiles hold at least one allowed pair."""
    b, _, s, _ = dense.shape
    n = -(-s // size)
    padded = F.pad(dense, (0, n * size - s, 0, n * size - s))
    return padded.view(b, 1, n, size, n, size).any(dim=(3, 5))


def _check_block_mask(block, dense):
    b, _, s, _ = dense.shape
    assert torch.equal(_grid_mask(block, b, s), dense)
    # The kernel skips tiles the BlockMask marks empty, so the tile map must match the dense mask exactly.
    assert torch.equal(block.to_dense().bool(), _tiles(dense, block.BLOCK_SIZE[0]))


def _assert_matches(out, ref, valid, label=""):
    assert out.shape == ref.shape and out.dtype == ref.dtype, label
    assert torch.isfinite(out).all(), label
    err = relative_l2(out, ref, valid)
    assert err <= TOL, f"{label}: relative_l2 {err:.3g}"
    assert bool((out[~valid] == 0).all()), f"{label}: padded query rows are not exactly zero"


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """Route backend='flex_attention' through the adapter with compiled=False (cheap on CPU)."""
    monkeypatch.setitem(A._DISPATCH, "flex_attention", functools.partial(A.flex_attention_forward, compiled=False))


# --------------------------------------------------------------------------- names and warnings


def test_backend_names_are_exact():
    assert A.ATTENTION_BACKENDS == ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
    for name in A.ATTENTION_BACKENDS:
        assert A.resolve_backend(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "flex",
        "auto",
        "flash_attention_4",
        "kernels-community/flash-attn2",
        "",
        None,
        "EAGER",
        " sdpa",
        "sdpa ",
        "flash_attention",
        "flex-attention",
        2,
        ("eager",),
    ],
)
def test_resolve_backend_rejects_everything_else(name):
    with pytest.raises(ValueError) as info:
        A.resolve_backend(name)
    for valid in A.ATTENTION_BACKENDS:
        assert valid in str(info.value)


def test_check_backend():
    allowed = ("eager", "sdpa", "flash_attention_2")
    assert A.check_backend("sdpa", allowed, family="esm2") == "sdpa"
    with pytest.raises(ValueError, match="esm2") as info:
        A.check_backend("flex_attention", allowed, family="esm2")
    assert "flash_attention_2" in str(info.value)
    with pytest.raises(ValueError) as info:
        A.check_backend("flex", allowed, family="esm2")
    assert all(name in str(info.value) for name in A.ATTENTION_BACKENDS)


def test_warn_eager_for_attentions_warns_once_naming_both_backends():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        A.warn_eager_for_attentions("flex_attention")
    assert len(caught) == 1
    assert caught[0].category is RuntimeWarning
    message = str(caught[0].message)
    assert "'flex_attention'" in message and "'eager'" in message


# --------------------------------------------------------------------------- the dense oracle


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_dense_mask_matches_brute_force_rules(semantics):
    kinds = ("right", "left", "holes", "single", "runs", "scattered")
    for s, b, kind, mask, ids in _cases(
        1000 + SEMANTICS.index(semantics), 120, (1, 2, 3, 5, 8, 9), (1, 2, 3, 4, 5), kinds
    ):
        dense = A.dense_mask(mask, sequence_ids=ids, semantics=semantics)
        assert dense.dtype == torch.bool and dense.shape == (b, 1, s, s)
        expected = _brute_dense(mask, ids, semantics)
        assert torch.equal(dense, expected), (kind, mask, ids)


def test_dense_mask_matches_brute_force_at_odd_lengths():
    for s, _b, kind, mask, ids in _cases(7, 6, (129, 200), (1, 2, 3), ("holes", "runs", "scattered", "left")):
        for semantics in SEMANTICS:
            expected = _brute_dense(mask, ids, semantics)
            assert torch.equal(A.dense_mask(mask, sequence_ids=ids, semantics=semantics), expected), (kind, s)


def test_dense_mask_defaults_to_padding():
    mask = torch.tensor([[1, 1, 0, 1]])
    assert torch.equal(A.dense_mask(mask), A.dense_mask(mask, semantics="padding"))
    assert torch.equal(A.dense_mask(mask)[0, 0], torch.tensor([[1, 1, 0, 1]] * 4, dtype=torch.bool))


# Seed 001 §1, verbatim: seq 8, canvas 4.
SEED_8 = """
1 1 1 1 . . . .
1 1 1 1 . . . .
1 1 1 1 . . . .
1 1 1 1 . . . .
1 1 1 1 1 1 1 1
1 1 1 1 1 1 1 1
1 1 1 1 1 1 1 1
1 1 1 1 1 1 1 1
"""

# Seed 001 §1: seq 16, canvas 4, one line per canvas (every row of a canvas is identical).
SEED_16 = """
1111 | .... | .... | ....
1111 | 1111 | .... | ....
1111 | 1111 | 1111 | ....
1111 | 1111 | 1111 | 1111
"""

# Variable-length blocks, ids [0,0,0,1,1,2,2,2,2,-1], derived by hand from seq(j) <= seq(i).
VARIABLE_BLOCKS = """
1 1 1 . . . . . . .
1 1 1 . . . . . . .
1 1 1 . . . . . . .
1 1 1 1 1 . . . . .
1 1 1 1 1 . . . . .
1 1 1 1 1 1 1 1 1 .
1 1 1 1 1 1 1 1 1 .
1 1 1 1 1 1 1 1 1 .
1 1 1 1 1 1 1 1 1 .
. . . . . . . . . .
"""


def _parse(picture: str, repeat_rows: int = 1) -> torch.Tensor:
    rows = []
    for line in picture.strip().splitlines():
        cells = [c == "1" for c in line if c in "1."]
        rows += [cells] * repeat_rows
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize(
    ("ids", "picture", "repeat"),
    [
        ([0] * 4 + [1] * 4, SEED_8, 1),
        ([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4, SEED_16, 4),
        ([0, 0, 0, 1, 1, 2, 2, 2, 2, -1], VARIABLE_BLOCKS, 1),
    ],
)
def test_block_causal_reproduces_seed_examples(ids, picture, repeat):
    expected = _parse(picture, repeat)
    assert expected.shape == (len(ids), len(ids))
    sequence_ids = torch.tensor([ids])
    dense = A.dense_mask(sequence_ids=sequence_ids, semantics="block_causal")
    assert torch.equal(dense[0, 0], expected)
    _check_block_mask(A.block_mask(sequence_ids=sequence_ids, semantics="block_causal"), dense)
    # The seed's vectorized rule for full canvases, as an independent third opinion.
    if -1 not in ids:
        idx = torch.arange(len(ids))
        q_block = (idx // 4)[:, None]
        assert torch.equal(expected, (idx[None, :] < q_block * 4) | ((idx[None, :] // 4) == q_block))


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
def test_block_causal_seed_outputs_agree_across_backends():
    sequence_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1], [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    q, k, v = _qkv(2, 4, 2, 10)
    valid = sequence_ids >= 0
    ref = A.attention(q, k, v, backend="eager", sequence_ids=sequence_ids, semantics="block_causal")
    for backend in ("sdpa", "flex_attention"):
        out = A.attention(q, k, v, backend=backend, sequence_ids=sequence_ids, semantics="block_causal")
        _assert_matches(out, ref, valid, backend)
    # Token 0 sees only its own canvas: perturbing a later canvas's values must not move it.
    v2 = v.clone()
    v2[:, :, 5:] += 100.0
    out2 = A.attention(q, k, v2, backend="sdpa", sequence_ids=sequence_ids, semantics="block_causal")
    assert torch.allclose(out2[0, :5], ref[0, :5], atol=1e-6)
    assert not torch.allclose(out2[0, 5:9], ref[0, 5:9])


# --------------------------------------------------------------------------- BlockMask


def test_block_mask_matches_dense_oracle():
    kinds = ("right", "left", "holes", "single", "runs", "scattered")
    for s, b, kind, mask, ids in _cases(11, 8, ODD_LENGTHS, (1, 4, 4, 1, 2), kinds):
        for semantics in SEMANTICS:
            dense = A.dense_mask(mask, sequence_ids=ids, semantics=semantics)
            block = A.block_mask(mask, sequence_ids=ids, semantics=semantics)
            assert tuple(block.shape) == (b, 1, s, s)
            _check_block_mask(block, dense)
            # The facade's padded-up BlockMask: same truth on the real tokens, extra tokens are padding keys.
            state = A.mask_state(mask, sequence_ids=ids, semantics=semantics)
            padded = -(-s // A.FLEX_BLOCK) * A.FLEX_BLOCK
            grid = _grid_mask(A._block_mask_from_state(state, padded), b, padded)
            assert torch.equal(grid[:, :, :s, :s], dense), (kind, semantics, s)
            assert not grid[:, :, :, s:].any()


def test_block_mask_does_not_go_stale_when_inputs_change_in_place():
    """The BlockMask cache is keyed by shape and must compare content, even for a mutated input tensor."""
    ids = torch.zeros(1, 256, dtype=torch.long)
    ids[0, 128:] = 1
    first = A.block_mask(sequence_ids=ids, semantics="sequence")
    _check_block_mask(first, A.dense_mask(sequence_ids=ids, semantics="sequence"))
    ids[0, 128:] = 0  # in place: a reused batch buffer
    second = A.block_mask(sequence_ids=ids, semantics="sequence")
    _check_block_mask(second, A.dense_mask(sequence_ids=ids, semantics="sequence"))
    # A BlockMask handed out earlier keeps describing the mask it was built from.
    original = torch.tensor([[0] * 128 + [1] * 128])
    assert torch.equal(_grid_mask(first, 1, 256), A.dense_mask(sequence_ids=original, semantics="sequence"))


# --------------------------------------------------------------------------- backends agree (FP32)


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("hkv", [4, 2])
def test_eager_sdpa_flex_agree(semantics, hkv):
    kinds = ("right", "left", "holes", "single", "runs", "scattered")
    seed = 100 + 10 * SEMANTICS.index(semantics) + hkv
    for s, b, kind, mask, ids in _cases(seed, 4, ODD_LENGTHS, (1, 3, 3, 1), kinds):
        q, k, v = _qkv(b, 4, hkv, s, seed=seed)
        valid = _valid(mask, ids)
        kwargs = dict(attention_mask=mask, sequence_ids=ids, semantics=semantics)
        ref = A.attention(q, k, v, backend="eager", **kwargs)
        assert ref.shape == (b, s, 4, 16)
        # Eager itself against a direct softmax over the oracle mask, one query row at a time.
        dense = A.dense_mask(mask, sequence_ids=ids, semantics=semantics)
        kk, vv = (t.repeat_interleave(4 // hkv, dim=1) for t in (k, v))
        n, i = int(valid.nonzero()[0, 0]), int(valid.nonzero()[0, 1])
        keys = dense[n, 0, i]
        probs = torch.softmax((q[n, :, i, None] @ kk[n, :, keys].transpose(-1, -2)) / 4.0, dim=-1)
        assert torch.allclose(ref[n, i], (probs @ vv[n, :, keys])[:, 0], atol=1e-6)
        assert bool((ref[~valid] == 0).all())
        for backend in ("sdpa", "flex_attention"):
            out = A.attention(q, k, v, backend=backend, **kwargs)
            _assert_matches(out, ref, valid, f"{backend} {semantics} {kind} s={s} b={b} hkv={hkv}")


def test_eager_return_probs():
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 0, 0, 0]])
    q, k, v = _qkv(2, 4, 2, 5)
    out, probs = A.attention(q, k, v, backend="eager", attention_mask=mask, return_probs=True)
    assert probs.shape == (2, 4, 5, 5)
    keys = mask.bool()[:, None, None, :].expand_as(probs)
    assert bool((probs[~keys] == 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 5))
    assert torch.equal(out, A.attention(q, k, v, backend="eager", attention_mask=mask))


def test_no_mask_means_all_valid():
    q, k, v = _qkv(2, 4, 4, 7)
    ref = A.attention(q, k, v, backend="eager")
    expected = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert relative_l2(ref, expected) <= TOL
    assert relative_l2(A.attention(q, k, v, backend="sdpa"), ref) <= TOL
    scaled = A.attention(q, k, v, backend="sdpa", scale=0.5)
    assert relative_l2(scaled, F.scaled_dot_product_attention(q, k, v, scale=0.5).transpose(1, 2)) <= TOL


# Compiled Flex: one compile per (shape, semantics) key, about 5-15 s of CPU each with a cold inductor cache
# (marked slow, not skipped). The shapes below are shared by the tests that follow (compile counting,
# in-place change) so they add no compiles of their own.
COMPILED = [("padding", 3, 4, 200), ("sequence", 2, 2, 200), ("block_causal", 2, 2, 129), ("causal", 3, 4, 150)]


@pytest.mark.slow
@pytest.mark.parametrize(("semantics", "b", "hkv", "s"), COMPILED)
def test_compiled_flex_matches_eager(semantics, b, hkv, s):
    kind = "right" if semantics in ("padding", "causal") else "runs"
    rng = random.Random(s + b)
    mask, ids = _random_case(rng, b, s, kind)
    if semantics == "causal":
        mask = torch.ones(b, s, dtype=torch.bool)
        mask[0, :5] = False  # left padding and a hole
        mask[1, 60:70] = False
    q, k, v = _qkv(b, 4, hkv, s, seed=s)
    kwargs = dict(attention_mask=mask, sequence_ids=ids, semantics=semantics)
    ref = A.attention(q, k, v, backend="eager", **kwargs)
    out = A.attention(q, k, v, backend="flex_attention", **kwargs)
    _assert_matches(out, ref, _valid(mask, ids), f"compiled flex {semantics}")


@pytest.mark.slow
def test_compiled_flex_does_not_recompile_for_new_lengths():
    b, s = 3, 200  # the padding case of COMPILED
    q, k, v = _qkv(b, 4, 4, s, seed=3)
    outputs = []
    masks = [
        torch.arange(s)[None, :] < torch.tensor([[200], [150], [7]]),
        torch.arange(s)[None, :] < torch.tensor([[5], [199], [130]]),
        torch.arange(s)[None, :] < torch.tensor([[1], [1], [64]]),
    ]
    masks[2][2, 100:] = True  # a hole
    for i, mask in enumerate(masks):
        outputs.append(A.attention(q, k, v, backend="flex_attention", attention_mask=mask))
        if i == 0:
            keys, graphs = set(A._flex_compiled), counters["stats"]["unique_graphs"]
    assert set(A._flex_compiled) == keys
    assert counters["stats"]["unique_graphs"] == graphs
    # A different sequence length inside the same 128-block bucket also reuses the compiled function.
    q2, k2, v2 = (t[:, :, :129] for t in (q, k, v))
    A.attention(q2, k2, v2, backend="flex_attention", attention_mask=torch.ones(b, 129, dtype=torch.bool))
    assert set(A._flex_compiled) == keys and counters["stats"]["unique_graphs"] == graphs
    for mask, out in zip(masks, outputs, strict=True):
        ref = A.attention(q, k, v, backend="eager", attention_mask=mask)
        _assert_matches(out, ref, mask, "recompile-free flex")


@pytest.mark.slow
def test_compiled_flex_sees_in_place_changes_of_sequence_ids():
    b, s = 2, 256  # pads like the sequence case of COMPILED (200 -> 256): same compiled function
    q, k, v = _qkv(b, 4, 2, s, seed=5)
    ids = torch.zeros(b, s, dtype=torch.long)
    ids[:, 128:] = 1
    A.attention(q, k, v, backend="flex_attention", sequence_ids=ids, semantics="sequence")
    ids[:, 128:] = 0  # the caller reuses its buffer for the next batch
    out = A.attention(q, k, v, backend="flex_attention", sequence_ids=ids, semantics="sequence")
    ref = A.attention(q, k, v, backend="eager", sequence_ids=ids, semantics="sequence")
    _assert_matches(out, ref, ids >= 0, "flex after in-place change")


def test_clear_flex_attention_caches_only_empties_ours(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("clear_flex_attention_caches must not reset dynamo")

    monkeypatch.setattr(torch._dynamo, "reset", forbidden)
    monkeypatch.setattr(torch.compiler, "reset", forbidden)
    compiled, blocks = {("k",): object()}, {("k",): (None, None, object())}
    monkeypatch.setattr(A, "_flex_compiled", compiled)
    monkeypatch.setattr(A, "_block_masks", blocks)
    graphs = counters["stats"]["unique_graphs"]
    A.clear_flex_attention_caches()
    assert compiled == {} and blocks == {}
    assert A._flex_compiled is compiled and A._block_masks is blocks
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.usefixtures("uncompiled_flex")
@UNCOMPILED_FLEX
def test_clear_flex_attention_caches_real_entries(monkeypatch):
    monkeypatch.setattr(A, "_block_masks", {})
    q, k, v = _qkv(1, 2, 2, 9)
    A.attention(q, k, v, backend="flex_attention", attention_mask=torch.ones(1, 9, dtype=torch.bool))
    assert len(A._block_masks) == 1
    A.clear_flex_attention_caches()
    assert A._block_masks == {}


# --------------------------------------------------------------------------- flash path, kernel faked


def _fake_flash_kernel(calls):
    """flash_attn_varlen_func in plain FP32: attention within each cu_seqlens segment."""

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and max_q == max_k
        bounds = cu_q.tolist()
        lengths = [e - a for a, e in zip(bounds[:-1], bounds[1:], strict=True)]
        assert bounds[0] == 0 and bounds[-1] == q.shape[0] and max(lengths) == max_q
        calls.append((lengths, causal))
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32)
        for a, e in zip(bounds[:-1], bounds[1:], strict=True):
            qs = q[a:e].float().transpose(0, 1)
            ks, vs = (t[a:e].float().transpose(0, 1).repeat_interleave(groups, dim=0) for t in (k, v))
            scores = qs @ ks.transpose(-1, -2) * softmax_scale
            if causal:
                scores = scores.masked_fill(torch.ones(e - a, e - a, dtype=torch.bool).triu(1), float("-inf"))
            out[a:e] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1)
        return out

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.fixture
def fake_flash(monkeypatch):
    calls: list = []
    kernel = _fake_flash_kernel(calls)
    monkeypatch.setattr(fastplms.flash, "check_flash_inputs", lambda *args, **kwargs: torch.bfloat16)
    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", lambda implementation, lockfile=None: kernel)
    return calls


@pytest.mark.parametrize("semantics", ["padding", "sequence", "causal"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_flash_path_semantics_match_eager(fake_flash, semantics, hkv):
    """The facade's packing for flash (varlen, causal flag, unpad/pad) expresses the same semantics."""
    for s, b, kind, mask, ids in _cases(300 + hkv, 10, ODD_LENGTHS, (1, 3, 2), ("right", "left", "holes", "runs")):
        # bf16-representable inputs: the flash path casts to bf16, so the comparison stays FP32-exact.
        q, k, v = (t.bfloat16().float() for t in _qkv(b, 4, hkv, s, seed=s))
        kwargs = dict(attention_mask=mask, sequence_ids=ids, semantics=semantics)
        ref = A.attention(q, k, v, backend="eager", **kwargs)
        for backend in A.FLASH_BACKENDS:
            out = A.attention(q, k, v, backend=backend, **kwargs)
            _assert_matches(out.float(), ref, _valid(mask, ids), f"{backend} {semantics} {kind} s={s}")
    assert fake_flash and all(causal == (semantics == "causal") for _, causal in fake_flash)


def test_block_causal_with_flash_raises_before_any_kernel(monkeypatch):
    ids = torch.tensor([[0, 0, 1, 1]])
    q, k, v = _qkv(1, 2, 2, 4)
    for backend in A.FLASH_BACKENDS:  # real CPU path: the input check refuses CPU tensors first
        with pytest.raises(ValueError):
            A.attention(q, k, v, backend=backend, sequence_ids=ids, semantics="block_causal")

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was requested")

    monkeypatch.setattr(fastplms.flash, "check_flash_inputs", lambda *args, **kwargs: torch.bfloat16)
    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", no_kernel)
    for backend in A.FLASH_BACKENDS:
        with pytest.raises(ValueError, match="block_causal"):
            A.attention(q, k, v, backend=backend, sequence_ids=ids, semantics="block_causal")


# --------------------------------------------------------------------------- varlen


def _brute_segments(valid, ids):
    lengths, previous = [], None
    for n, (vrow, irow) in enumerate(zip(valid.tolist(), ids.tolist(), strict=True)):
        for v, i in zip(vrow, irow, strict=True):
            if not v:
                continue
            if previous == (n, i):
                lengths[-1] += 1
            else:
                lengths.append(1)
                previous = (n, i)
    return lengths


def test_varlen_segments_and_round_trip():
    gen = torch.Generator().manual_seed(0)
    for s, b, kind, mask, ids in _cases(
        21, 40, ODD_LENGTHS + (2, 3), (1, 2, 5, 3, 4), ("right", "left", "holes", "single", "runs")
    ):
        packing = A.varlen(mask, sequence_ids=ids)
        valid = _valid(mask, ids)
        seg_ids = ids if ids is not None else torch.where(valid, 0, -1)
        assert packing.cu_seqlens.dtype == torch.int32 and packing.cu_seqlens.dim() == 1
        assert int(packing.cu_seqlens[0]) == 0 and int(packing.cu_seqlens[-1]) == int(valid.sum())
        lengths = torch.diff(packing.cu_seqlens).tolist()
        assert lengths == _brute_segments(valid, seg_ids), (kind, mask, ids)
        assert isinstance(packing.max_seqlen, int) and packing.max_seqlen == max(lengths)
        assert torch.equal(packing.indices, valid.flatten().nonzero().flatten())
        # Segments are exactly the oracle's "sequence" blocks over the valid tokens.
        segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        dense = A.dense_mask(mask, sequence_ids=ids, semantics="sequence")
        rows, cols = packing.indices // s, packing.indices % s
        over_valid = dense[rows[:, None], 0, cols[:, None], cols[None, :]] & (rows[:, None] == rows[None, :])
        assert torch.equal(over_valid, segment[:, None] == segment[None, :])
        # unpad / pad: row-major valid tokens, exact inverse on valid positions, exact zeros elsewhere.
        x = torch.randn(b, s, 3, 2, generator=gen)
        packed = A.unpad(x, packing.indices)
        assert torch.equal(packed, x[valid])
        back = A.pad(packed, packing.indices, b, s)
        assert torch.equal(back[valid], x[valid]) and bool((back[~valid] == 0).all())


def test_varlen_without_sequence_ids_is_one_segment_per_row():
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]])
    packing = A.varlen(mask)
    assert packing.cu_seqlens.tolist() == [0, 3, 4, 9] and packing.max_seqlen == 5
    assert packing.indices.tolist() == [0, 2, 3, 9, 10, 11, 12, 13, 14]


def test_varlen_with_sequence_ids():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1], [-1, 5, 5, -1, 7, 7, 7, -1, -1, -1]])
    packing = A.varlen(sequence_ids=ids)
    assert packing.cu_seqlens.tolist() == [0, 3, 5, 9, 11, 14]
    assert packing.cu_seqlens.dtype == torch.int32 and packing.max_seqlen == 4


@pytest.mark.parametrize("ids", [[[0, 0, 1, 1, 0]], [[0, 1, 0, -1, -1]], [[2, 2, 1, 1, 2]]])
def test_varlen_rejects_non_contiguous_reuse_of_an_id(ids):
    with pytest.raises(ValueError, match="contiguous"):
        A.varlen(sequence_ids=torch.tensor(ids))


# --------------------------------------------------------------------------- bad input


BAD_MASKS = [
    ("additive", torch.tensor([[0.0, 0.0, float("-inf")]])),
    ("float01", torch.tensor([[1.0, 1.0, 0.0]])),
    ("two", torch.tensor([[1, 2, 0]])),
    ("negative", torch.tensor([[1, -1, 0]])),
    ("rank3", torch.ones(1, 1, 3, dtype=torch.bool)),
    ("rank4", torch.ones(1, 1, 1, 3, dtype=torch.bool)),
    ("rank1", torch.ones(3, dtype=torch.bool)),
    ("all_padding_row", torch.tensor([[1, 1, 0], [0, 0, 0]])),
]


@pytest.mark.parametrize(("label", "mask"), BAD_MASKS, ids=[label for label, _ in BAD_MASKS])
def test_bad_masks_are_rejected_everywhere(label, mask):
    for build in (A.dense_mask, A.block_mask, A.varlen):
        with pytest.raises(ValueError):
            build(mask)
    q, k, v = _qkv(mask.shape[0] if mask.ndim == 2 else 1, 2, 2, 3)
    for backend in ("eager", "sdpa", "flex_attention"):
        with pytest.raises(ValueError):
            A.attention(q, k, v, backend=backend, attention_mask=mask)


def test_bad_mask_messages_are_specific():
    with pytest.raises(ValueError, match="additive"):
        A.dense_mask(torch.tensor([[0.0, float("-inf")]]))
    with pytest.raises(ValueError, match="2"):
        A.dense_mask(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"\[1\]"):
        A.dense_mask(torch.tensor([[1, 0], [0, 0]]))
    q, k, v = _qkv(2, 2, 2, 8)
    with pytest.raises(ValueError) as info:
        A.attention(q, k, v, backend="sdpa", attention_mask=torch.ones(2, 1, 1, 8, dtype=torch.bool))
    assert "(2, 8)" in str(info.value) and "(2, 1, 1, 8)" in str(info.value)
    with pytest.raises(ValueError) as info:  # right rank, wrong length for q
        A.attention(q, k, v, backend="eager", attention_mask=torch.ones(2, 7, dtype=torch.bool))
    assert "(2, 8)" in str(info.value) and "(2, 7)" in str(info.value)
    with pytest.raises(ValueError):  # wrong batch for q
        A.attention(q, k, v, backend="flex_attention", attention_mask=torch.ones(3, 8, dtype=torch.bool))


@pytest.mark.parametrize(
    "sequence_ids",
    [
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[True, True, False]]),
        torch.tensor([0, 0, 1]),
        torch.tensor([[[0, 0, 1]]]),
        torch.tensor([[0, -2, 1]]),
        torch.tensor([[-1, -1, -1]]),
    ],
)
def test_bad_sequence_ids(sequence_ids):
    for semantics in SEMANTICS:
        with pytest.raises(ValueError):
            A.dense_mask(sequence_ids=sequence_ids, semantics=semantics)
    with pytest.raises(ValueError):
        A.varlen(sequence_ids=sequence_ids)


def test_sequence_ids_shape_and_agreement_with_the_mask():
    q, k, v = _qkv(1, 2, 2, 4)
    with pytest.raises(ValueError):  # wrong length for q
        A.attention(q, k, v, backend="sdpa", sequence_ids=torch.tensor([[0, 0, 1]]), semantics="sequence")
    with pytest.raises(ValueError):  # wrong shape vs the attention mask
        A.dense_mask(torch.ones(1, 4, dtype=torch.bool), sequence_ids=torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="disagree"):
        A.dense_mask(torch.tensor([[1, 1, 1, 1]]), sequence_ids=torch.tensor([[0, 0, 1, -1]]))
    with pytest.raises(ValueError):
        A.dense_mask()


def test_other_bad_arguments():
    mask = torch.ones(1, 4, dtype=torch.bool)
    q, _, _ = _qkv(1, 3, 2, 4)
    _, k, v = _qkv(1, 3, 2, 4)
    for backend in ("eager", "sdpa", "flex_attention"):
        with pytest.raises(ValueError, match="multiple"):
            A.attention(q, k, v, backend=backend, attention_mask=mask)
    q, k, v = _qkv(1, 2, 2, 4)
    for semantics in ("bidirectional", "Causal", "", None):
        with pytest.raises(ValueError):
            A.dense_mask(mask, semantics=semantics)
        with pytest.raises(ValueError):
            A.attention(q, k, v, backend="sdpa", attention_mask=mask, semantics=semantics)
    for backend in ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"):
        with pytest.raises(ValueError, match="eager"):
            A.attention(q, k, v, backend=backend, attention_mask=mask, return_probs=True)
    for backend in ("flex", "auto", None):
        with pytest.raises(ValueError):
            A.attention(q, k, v, backend=backend, attention_mask=mask)
