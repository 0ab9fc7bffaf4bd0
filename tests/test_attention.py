"""The attention facade and its mask conversions, on CPU.

The dense boolean mask is the oracle. It is itself checked against a brute-force loop over the written
rules; every other form (Flex BlockMask, varlen packing) and every CPU-runnable backend is checked against
it. Compiled Flex cases are few and share cache keys (each new key compiles for seconds on a small CPU).
"""

from __future__ import annotations

import functools
import itertools
import random
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fastplms.flash
from fastplms import attention as A
from fastplms.parity.metrics import relative_l2

SEMANTICS = ("padding", "sequence", "block_causal", "causal")
ODD_LENGTHS = (1, 7, 129, 200)
TOL = 1e-5
UNCOMPILED_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# --------------------------------------------------------------------------- helpers


def _side(attention_mask, sequence_ids):
    if sequence_ids is not None:
        ids = sequence_ids.tolist()
        return [[t >= 0 for t in row] for row in ids], ids
    valid = [[bool(t) for t in row] for row in attention_mask.tolist()]
    return valid, [[0 if t else -1 for t in row] for row in valid]


def _brute_dense(attention_mask, sequence_ids, semantics, kv_mask=None, kv_ids=None):
    """The module docstring's rules, one (batch, query, key) triple at a time."""
    valid, ids = _side(attention_mask, sequence_ids)
    k_valid, k_ids = (valid, ids) if kv_mask is None and kv_ids is None else _side(kv_mask, kv_ids)
    sq, sk = len(valid[0]), len(k_valid[0])
    out = []
    for vrow, irow, kvrow, kirow in zip(valid, ids, k_valid, k_ids, strict=True):
        rows = []
        for i, vi in enumerate(vrow):
            row = []
            for j, vj in enumerate(kvrow):
                if semantics == "padding":
                    rule = True
                elif semantics == "sequence":
                    rule = kirow[j] == irow[i]
                elif semantics == "block_causal":
                    rule = kirow[j] <= irow[i]
                else:
                    rule = j <= i + sk - sq
                row.append(vi and vj and rule)
            rows.append(row)
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


def _packed_truth(state, dense):
    """The dense oracle over packed tokens (row-major valid tokens): same row and allowed there."""
    k_valid = state.keys[0]
    q_index, k_index = state.valid.flatten().nonzero().flatten(), k_valid.flatten().nonzero().flatten()
    sq, sk = state.valid.shape[1], k_valid.shape[1]
    q_row, q_pos, k_row, k_pos = q_index // sq, q_index % sq, k_index // sk, k_index % sk
    same_row = q_row[:, None] == k_row[None, :]
    return same_row & dense[q_row[:, None], 0, q_pos[:, None], k_pos[None, :]]


def _check_packed_block_mask(state, dense):
    """The facade's packed BlockMask: the oracle on the packed tokens, nothing on the padded-up positions."""
    q_index, k_index = (v.flatten().nonzero().flatten() for v in (state.valid, state.keys[0]))
    packed = A._packed_block_mask(state, q_index, k_index)
    assert packed.q_length == A.flex_length(q_index.numel()) and packed.q_length % A.FLEX_BLOCK == 0
    qi = torch.arange(packed.q_length)[None, None, :, None]
    ki = torch.arange(packed.kv_length)[None, None, None, :]
    grid = packed.block.mask_mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), 0, qi, ki)[0, 0]
    tq, tk = q_index.numel(), k_index.numel()
    assert torch.equal(grid[:tq, :tk], _packed_truth(state, dense))
    assert not grid[tq:].any() and not grid[:, tk:].any()


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
    row = [1, 1, 0, 1]
    expected = torch.tensor([row, row, [0, 0, 0, 0], row], dtype=torch.bool)  # a padded query sees nothing
    assert torch.equal(A.dense_mask(mask)[0, 0], expected)


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
    for s, b, _kind, mask, ids in _cases(11, 8, ODD_LENGTHS, (1, 4, 4, 1, 2), kinds):
        for semantics in SEMANTICS:
            dense = A.dense_mask(mask, sequence_ids=ids, semantics=semantics)
            block = A.block_mask(mask, sequence_ids=ids, semantics=semantics)
            assert tuple(block.shape) == (b, 1, s, s)
            _check_block_mask(block, dense)
            _check_packed_block_mask(A.mask_state(mask, sequence_ids=ids, semantics=semantics), dense)


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
    # Valid queries' rows sum to one; a padded query sees no key, so its row is zero.
    assert torch.allclose(probs.sum(-1), mask[:, None, :].float().expand(2, 4, 5))
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
        torch.arange(s)[None, :] < torch.tensor([[130], [1], [64]]),
    ]
    masks[2][2, 100:] = True  # a hole
    for i, mask in enumerate(masks):
        outputs.append(A.attention(q, k, v, backend="flex_attention", attention_mask=mask))
        if i == 0:
            keys, graphs = set(A._flex_compiled), counters["stats"]["unique_graphs"]
    assert set(A._flex_compiled) == keys
    assert counters["stats"]["unique_graphs"] == graphs
    # Packed lengths are bucketed to powers of two (here 512 tokens), so another sequence length with a
    # total in the same bucket reuses the compiled function too.
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
    """flash_attn_varlen_func in plain FP32: attention within each pair of cu_seqlens segments, causal
    bottom-right aligned as FlashAttention defines it."""

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
        q_lengths = [e - a for a, e in itertools.pairwise(q_bounds)]
        k_lengths = [e - a for a, e in itertools.pairwise(k_bounds)]
        assert q_bounds[0] == 0 and q_bounds[-1] == q.shape[0] and max(q_lengths) == max_q
        assert k_bounds[0] == 0 and k_bounds[-1] == k.shape[0] and max(k_lengths) == max_k
        calls.append((q_lengths, causal))
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32)
        for (a, e), (c, f) in zip(itertools.pairwise(q_bounds), itertools.pairwise(k_bounds), strict=True):
            qs = q[a:e].float().transpose(0, 1)
            ks, vs = (t[c:f].float().transpose(0, 1).repeat_interleave(groups, dim=0) for t in (k, v))
            scores = qs @ ks.transpose(-1, -2) * softmax_scale
            if causal:
                hidden = torch.ones(e - a, f - c, dtype=torch.bool).triu((f - c) - (e - a) + 1)
                scores = scores.masked_fill(hidden, float("-inf"))
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


# --------------------------------------------------------------------------- separate keys, bias, plans


def _kv_cases(seed: int, count: int, kinds=("right", "left", "holes", "runs", "scattered")):
    """(sq, sk, b, q mask, q ids, kv mask, kv ids): queries and keys of different lengths and masks."""
    rng = random.Random(seed)
    shapes = [(1, 9), (7, 7), (5, 130), (130, 3), (12, 40)]
    for i in range(count):
        sq, sk = shapes[i % len(shapes)]
        b, kind = rng.choice((1, 2, 3)), rng.choice(kinds)
        yield (sq, sk, b, *_random_case(rng, b, sq, kind), *_random_case(rng, b, sk, kind))


def _grid(block, b, sq, sk):
    bi = torch.arange(b)[:, None, None, None]
    qi, ki = torch.arange(sq)[None, None, :, None], torch.arange(sk)[None, None, None, :]
    return block.mask_mod(bi, torch.zeros(1, 1, 1, 1, dtype=torch.long), qi, ki).expand(b, 1, sq, sk).bool()


def _qkv_lengths(b, hq, hkv, sq, sk, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, sq, d, generator=gen), *(torch.randn(b, hkv, sk, d, generator=gen) for _ in range(2))


def _sees_something(dense):
    return dense.any(-1)[:, 0]


def test_separate_keys_dense_and_block_mask_match_brute_force():
    for sq, sk, b, mask, ids, kv_mask, kv_ids in _kv_cases(31, 25):
        for semantics in SEMANTICS:
            kwargs = dict(sequence_ids=ids, kv_attention_mask=kv_mask, kv_sequence_ids=kv_ids, semantics=semantics)
            dense = A.dense_mask(mask, **kwargs)
            assert dense.shape == (b, 1, sq, sk)
            assert torch.equal(dense, _brute_dense(mask, ids, semantics, kv_mask, kv_ids)), (semantics, sq, sk)
            assert torch.equal(_grid(A.block_mask(mask, **kwargs), b, sq, sk), dense)
            _check_packed_block_mask(A.mask_state(mask, **kwargs), dense)


def test_causal_with_separate_keys_is_bottom_right():
    """Queries are the last sq positions: the rows of a full causal attention over the keys."""
    q, k, v = _qkv(2, 4, 2, 11, seed=4)
    full = A.attention(q, k, v, backend="eager", semantics="causal")
    ones_q, ones_k = torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 11, dtype=torch.bool)
    for backend in ("eager", "sdpa"):
        last = A.attention(
            q[:, :, -4:], k, v, backend=backend, attention_mask=ones_q, kv_attention_mask=ones_k, semantics="causal"
        )
        assert torch.allclose(last, full[:, -4:], atol=1e-6), backend
    # More queries than keys: the first sq - sk queries see no key and come out exactly zero.
    q, k, v = _qkv_lengths(1, 2, 2, 6, 4, seed=5)
    out = A.attention(q, k, v, backend="sdpa", kv_attention_mask=torch.ones(1, 4, dtype=torch.bool), semantics="causal")
    assert bool((out[:, :2] == 0).all()) and bool((out[:, 2:] != 0).any())


def test_block_causal_query_against_cached_context_equals_the_full_row():
    """E1's cache contract: a query sequence against context + own keys is the full forward's query rows."""
    ids = torch.tensor([[0] * 5 + [1] * 3 + [2] * 4 + [-1] * 2, [0] * 2 + [1] * 10 + [2] * 2])
    q, k, v = _qkv(2, 4, 2, 14, seed=6)
    full = A.attention(q, k, v, backend="eager", sequence_ids=ids, semantics="block_causal")
    query_ids = ids[:, -6:]
    for backend in ("eager", "sdpa"):
        out = A.attention(
            q[:, :, -6:], k, v, backend=backend, sequence_ids=query_ids, kv_sequence_ids=ids, semantics="block_causal"
        )
        valid = query_ids >= 0
        assert torch.allclose(out[valid], full[:, -6:][valid], atol=1e-6), backend


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
def test_separate_keys_backends_agree_with_eager():
    for sq, sk, b, mask, ids, kv_mask, kv_ids in _kv_cases(41, 15):
        q, k, v = _qkv_lengths(b, 4, 2, sq, sk, seed=sq + sk)
        for semantics in SEMANTICS:
            kwargs = dict(
                attention_mask=mask, sequence_ids=ids, kv_attention_mask=kv_mask, kv_sequence_ids=kv_ids,
                semantics=semantics,
            )  # fmt: skip
            dense = A.dense_mask(**kwargs)
            ref = A.attention(q, k, v, backend="eager", **kwargs)
            assert ref.shape == (b, sq, 4, 16)
            seen = _sees_something(dense)
            assert bool((ref[~seen] == 0).all()), "a query that sees no key must be exactly zero"
            for backend in ("sdpa", "flex_attention"):
                out = A.attention(q, k, v, backend=backend, **kwargs)
                if not seen.any():  # no query sees any key: everything is zero
                    assert bool((out == 0).all()), f"{backend} {semantics}"
                    continue
                _assert_matches(out, ref, seen, f"{backend} {semantics} sq={sq} sk={sk}")


def test_flash_path_with_separate_keys(fake_flash):
    mask_q = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    mask_k = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    q, k, v = (t.bfloat16().float() for t in _qkv_lengths(2, 4, 2, 4, 7, seed=8))
    kwargs = dict(attention_mask=mask_q, kv_attention_mask=mask_k, semantics="padding")
    ref = A.attention(q, k, v, backend="eager", **kwargs)
    out = A.attention(q, k, v, backend="flash_attention_2", **kwargs)
    _assert_matches(out.float(), ref, mask_q.bool(), "flash padding sq != sk")
    q, k, v = (t.bfloat16().float() for t in _qkv_lengths(2, 4, 2, 3, 8, seed=9))
    kwargs = dict(attention_mask=torch.ones(2, 3), kv_attention_mask=torch.ones(2, 8), semantics="causal")
    kwargs = {key: (val.long() if isinstance(val, torch.Tensor) else val) for key, val in kwargs.items()}
    ref = A.attention(q, k, v, backend="eager", **kwargs)
    out = A.attention(q, k, v, backend="flash_attention_3", **kwargs)
    _assert_matches(out.float(), ref, torch.ones(2, 3, dtype=torch.bool), "flash causal bottom-right")
    with pytest.raises(ValueError, match="unpadded"):
        A.attention(q, k, v, backend="flash_attention_2", attention_mask=torch.tensor([[1, 1, 0]] * 2),
                    kv_attention_mask=torch.ones(2, 8, dtype=torch.long), semantics="causal")  # fmt: skip


def _bias(b, h, sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, sq, sk, generator=gen) * 2


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("shape", [(2, 4, 9, 9), (1, 4, 9, 9), (1, 1, 9, 9), (2, 1, 1, 9)])
def test_bias_is_added_to_the_scaled_scores(shape):
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    q, k, v = _qkv(2, 4, 2, 9, seed=10)
    bias = _bias(*shape)
    ref = A.attention(q, k, v, backend="eager", attention_mask=mask, bias=bias, scale=1.0)
    # By hand: unscaled scores plus the bias, softmax over the valid keys only (T5's formula).
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2) + bias).masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    expected = (scores.softmax(-1) @ vv).transpose(1, 2) * mask[:, :, None, None]
    assert torch.allclose(ref, expected, atol=1e-5)
    assert not torch.allclose(ref, A.attention(q, k, v, backend="eager", attention_mask=mask, scale=1.0))
    for backend in ("sdpa", "flex_attention"):
        out = A.attention(q, k, v, backend=backend, attention_mask=mask, bias=bias, scale=1.0)
        _assert_matches(out, ref, mask.bool(), f"{backend} bias {shape}")


def test_bias_with_separate_keys():
    q, k, v = _qkv_lengths(2, 4, 4, 3, 10, seed=11)
    kv_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    bias = _bias(1, 4, 3, 10, seed=2)
    kwargs = dict(kv_attention_mask=kv_mask, bias=bias)
    ref = A.attention(q, k, v, backend="eager", **kwargs)
    _assert_matches(A.attention(q, k, v, backend="sdpa", **kwargs), ref, torch.ones(2, 3, dtype=torch.bool))


def test_flash_with_a_bias_raises_before_any_kernel(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("nothing may be checked or loaded before the bias is refused")

    monkeypatch.setattr(fastplms.flash, "check_flash_inputs", forbidden)
    monkeypatch.setattr(fastplms.flash, "load_flash_kernel", forbidden)
    q, k, v = _qkv(1, 2, 2, 4)
    for backend in A.FLASH_BACKENDS:
        with pytest.raises(ValueError, match="bias"):
            A.attention(q, k, v, backend=backend, bias=torch.zeros(1, 1, 4, 4))


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
def test_plan_and_attend_on_packed_tokens_equal_the_padded_facade():
    """Models call attention_plan once per forward and attend per layer on packed tokens."""
    for s, b, _kind, mask, ids in _cases(51, 12, ODD_LENGTHS, (1, 3, 2), ("right", "holes", "runs", "scattered")):
        q, k, v = _qkv(b, 4, 2, s, seed=s)
        for semantics in SEMANTICS:
            state = A.mask_state(mask, sequence_ids=ids, semantics=semantics)
            ref = A.attention(q, k, v, backend="eager", state=state)
            for backend in ("eager", "sdpa", "flex_attention"):
                plan = A.attention_plan(backend, state)
                packed = [A.unpad(t.transpose(1, 2), plan.q_index) for t in (q, k, v)]
                out = A.attend(*packed, plan)
                assert out.shape == (int(state.valid.sum()), 4, 16)
                _assert_matches(A.pad(out, plan.q_index, b, s), ref, state.valid, f"attend {backend} {semantics}")


def test_sdpa_plan_on_cpu_runs_spans_without_a_mask_where_it_can():
    ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 2, 2]])
    spans = A.attention_plan("sdpa", A.mask_state(sequence_ids=ids, semantics="sequence")).form
    assert spans == [(0, 3, 0, 3), (3, 5, 3, 5), (5, 6, 5, 6), (6, 9, 6, 9), (9, 11, 9, 11)]
    spans = A.attention_plan("sdpa", A.mask_state(sequence_ids=ids, semantics="block_causal")).form
    assert spans == [(0, 3, 0, 3), (3, 5, 0, 5), (5, 6, 5, 6), (6, 9, 5, 9), (9, 11, 5, 11)]
    spans = A.attention_plan("sdpa", A.mask_state(sequence_ids=ids, semantics="padding")).form
    assert spans == [(0, 5, 0, 5), (5, 11, 5, 11)]
    # Interleaved ids (keys not one range) and causal run the dense path.
    scattered = torch.tensor([[0, 1, 0, 1]])
    assert isinstance(A.attention_plan("sdpa", A.mask_state(sequence_ids=scattered, semantics="sequence")).form,
                      torch.Tensor)  # fmt: skip
    assert isinstance(A.attention_plan("sdpa", A.mask_state(sequence_ids=ids, semantics="causal")).form, torch.Tensor)
    assert isinstance(A.attention_plan("eager", A.mask_state(sequence_ids=ids, semantics="sequence")).form,
                      torch.Tensor)  # fmt: skip


def test_flex_packed_lengths_are_power_of_two_buckets():
    assert [A.flex_length(n) for n in (1, 127, 128, 129, 300, 4096, 4097)] == [128, 128, 128, 256, 512, 4096, 8192]


@UNCOMPILED_FLEX
@pytest.mark.usefixtures("uncompiled_flex")
def test_attend_makes_no_host_synchronisation(monkeypatch):
    """Everything that needs the host (indices, spans, segments, masks) is in the plan; a layer's call to
    `attend` reads no tensor value on the host, so it never waits for a device."""
    ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 2, 2]])
    q, k, v = _qkv(2, 4, 2, 6)
    for backend in ("eager", "sdpa"):
        for semantics in SEMANTICS:
            plan = A.attention_plan(backend, A.mask_state(sequence_ids=ids, semantics=semantics))
            packed = [A.unpad(t.transpose(1, 2), plan.q_index) for t in (q, k, v)]
            with monkeypatch.context() as patch:
                for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero"):
                    patch.setattr(torch.Tensor, name, _forbidden(name))
                A.attend(*packed, plan)


def _forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"attend called Tensor.{name}: a host synchronisation per layer")

    return call


def test_eager_keeps_float64_in_the_softmax():
    """A float64 oracle run is not rounded to float32 anywhere in eager attention."""
    q, k, v = (t.double() for t in _qkv(1, 2, 2, 5, seed=12))
    out, probs = A.attention(q, k, v, backend="eager", return_probs=True)
    exact = torch.softmax((q @ k.transpose(-1, -2)) / 4.0, dim=-1)
    assert probs.dtype == torch.float64 and torch.allclose(probs, exact, rtol=0, atol=1e-15)
    assert torch.allclose(out, (exact @ v).transpose(1, 2), rtol=0, atol=1e-14)
