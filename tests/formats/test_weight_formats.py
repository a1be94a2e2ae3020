"""Formats that pay off for weights (n:m, block, diagonal, ELL, blocked ELL): the generated kernels against dense
torch for what a layer does with its weight: ``F.linear`` forward and backward, ``W @ X``, ``X @ W.t()``,
``torch.sparse.sampled_addmm`` on the weight's pattern, and conversions there and back.

Values are multiples of 1/4 (``quarters``) and the sums are short, so float32 and float64 results are exact and
every comparison is a real one. Each format is tried on a random weight, an all-zero one, one block (one group of
``m`` columns for n:m) and a fully dense one.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch import SparseTensor

from conftest import assert_matches_dense, compile_ahead, plain_test_job, quarters, is_dense_result

BLOCKED_ELL = "(i, j) -> (i / 8 : dense, j / 8 : fixed, i % 8 : dense, j % 8 : dense)"

# format -> (kind of pattern, block or group size, shape of the random weight)
WEIGHT_FORMATS = {
    "nm(2, 4)": ("nm", (2, 4), (8, 16)),
    "nm(1, 4)": ("nm", (1, 4), (8, 16)),
    "nm(4, 8)": ("nm", (4, 8), (6, 32)),
    **{f"bsr({b}, {b})": ("bsr", (b, b), (2 * b, 3 * b)) for b in (4, 8, 16, 32, 64)},
    "bsc(8, 8)": ("bsc", (8, 8), (16, 24)),
    "dia": ("dia", None, (7, 9)),
    "ell": ("ell", None, (7, 9)),
    BLOCKED_ELL: ("bell", (8, 8), (16, 32)),
}
CASES = ("random", "random, seed 1", "zero", "one block", "full")
DTYPES = (torch.float32, torch.float64)


def weight(fmt, case, dtype):
    """A dense weight that ``fmt`` stores (n:m weights are pruned to at most n of every m columns)."""
    kind, size, shape = WEIGHT_FORMATS[fmt]
    seed = int(case[-1]) if case.startswith("random, seed") else 0
    case = "random" if case.startswith("random") else case
    if case == "one block":
        shape = (1, size[1]) if kind == "nm" else size if size else (1, 1)
    g = torch.Generator().manual_seed(1000 + seed)
    w = quarters(shape, seed, 1.0, torch.float64)
    if case == "zero":
        return torch.zeros(shape, dtype=dtype)
    if kind == "nm":
        n, m = size
        groups = w.reshape(shape[0], shape[1] // m, m)
        # random: 0..n entries in each group (padding where fewer); full: exactly n in every group
        keep = torch.randint(0, n + 1, groups.shape[:2], generator=g) if case == "random" else \
            torch.full(groups.shape[:2], n)
        order = torch.rand(groups.shape, generator=g).argsort(-1).argsort(-1)  # a random rank per column
        w = (groups * (order < keep[..., None])).reshape(shape)
    elif kind in ("bsr", "bsc", "bell") and case == "random":
        bh, bw = size
        blocks = torch.rand(shape[0] // bh, shape[1] // bw, generator=g) < 0.5
        inside = torch.rand(shape, generator=g) < 0.8  # zeros inside stored blocks too
        w = w * blocks.repeat_interleave(bh, 0).repeat_interleave(bw, 1) * inside
    elif kind == "dia" and case == "random":
        offsets = torch.arange(shape[1])[None, :] - torch.arange(shape[0])[:, None]
        w = w * torch.isin(offsets, torch.tensor([-3, 0, 1, 5])) * (torch.rand(shape, generator=g) < 0.8)
    elif case == "random":
        w = w * (torch.rand(shape, generator=g) < 0.4)
    return w.to(dtype)


def pattern(fmt, w):
    """Where ``fmt`` holds entries of ``w`` (worked out from the format's idea, not from scorch's storage):
    the positions a gradient or an SDDMM may fill. Block formats store their blocks whole, DIA its diagonals
    whole (inside the shape); formats with a padded (fixed) level cannot tell a stored zero from padding, so only
    the nonzeros are entries there."""
    kind, size, _ = WEIGHT_FORMATS[fmt]
    if kind in ("bsr", "bsc"):
        bh, bw = size
        r, c = w.shape
        blocks = (w.reshape(r // bh, bh, c // bw, bw) != 0).any(3).any(1)
        return blocks.repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    if kind == "dia":
        offsets = torch.arange(w.shape[1])[None, :] - torch.arange(w.shape[0])[:, None]
        return torch.isin(offsets, offsets[w != 0])
    return w != 0


def params():
    return [pytest.param(fmt, case, dtype, id=f"{fmt}-{case}-{str(dtype)[6:]}")
            for fmt in WEIGHT_FORMATS for case in CASES for dtype in DTYPES]


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead(request):
    compile_ahead(request, plain_test_job)


# --- conversions -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, case, dtype", params())
def test_to_dense_roundtrip(fmt, case, dtype):
    w = weight(fmt, case, dtype)
    s = scorch.asformat(w, fmt, check=True)
    assert isinstance(s, SparseTensor) and s.format == scorch.formats.resolve(fmt) and s.dtype == dtype
    assert_matches_dense(s, w)
    assert_matches_dense(scorch.asformat(s, "csr", check=True), w)  # out of the format
    assert_matches_dense(scorch.asformat(scorch.asformat(w, "csr"), fmt, check=True), w)  # in from another one
    assert_matches_dense(s.to_dense(), w)


@pytest.mark.parametrize("fmt", [f for f in WEIGHT_FORMATS if f.startswith("nm")])
@pytest.mark.parametrize("case", CASES)
def test_nm_storage_is_the_standard_layout(fmt, case):
    """n values and n column offsets for every group of m, however many entries a group has."""
    (n, m), w = WEIGHT_FORMATS[fmt][1], weight(fmt, case, torch.float32)
    s = scorch.asformat(w, fmt)
    groups = w.shape[0] * (w.shape[1] // m)
    assert s.levels[2].crd.numel() == s.values().numel() == groups * n
    assert s.index_dtype == torch.int8  # an offset in a group of m < 128: one byte per kept entry
    assert s.format.name == fmt and scorch.formats.resolve(fmt.replace(" ", "")) == s.format



@settings(max_examples=12, deadline=None)
@given(nm=st.sampled_from([(2, 4), (1, 4), (4, 8), (3, 128), (5, 200)]), rows=st.integers(0, 5),
       groups=st.integers(1, 3), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_nm_offsets_take_the_narrowest_index_dtype(nm, rows, groups, seed, dtype):
    """An n:m weight stores one offset in its group of m per kept entry: int8 where m <= 128, else int16, unless
    asked otherwise; every product and conversion on it (a kernel reading 1- or 2-byte offsets, a merge with a
    CSR operand that converts it first) gives what the int32 storage of the same weight gives."""
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    w = quarters((rows, groups * m), seed, 1.0, torch.float64)
    order = torch.rand(rows, groups, m, generator=g).argsort(-1).argsort(-1)
    w = (w.reshape(rows, groups, m) * (order < n)).reshape(rows, groups * m).to(dtype)
    narrow = scorch.asformat(w, f"nm({n}, {m})")
    wide = scorch.asformat(w, f"nm({n}, {m})", index_dtype=torch.int32)
    assert narrow.index_dtype == (torch.int8 if m <= 128 else torch.int16) and wide.index_dtype == torch.int32
    assert narrow.levels[2].crd.dtype == narrow.index_dtype
    assert scorch.asformat(w, f"nm({n}, {m})", index_dtype=torch.int64).index_dtype == torch.int64
    assert torch.equal(narrow.to_dense(), w)
    x = quarters((3, w.shape[1]), seed + 1, 1.0, dtype)
    c = scorch.asformat(quarters(w.shape, seed + 2, 1.0, dtype) * (torch.rand(w.shape, generator=g) < 0.3), "csr")
    for op in (lambda s: F.linear(x, s), lambda s: s + c, lambda s: s * c, lambda s: scorch.asformat(s, "csr"),
               lambda s: s.t().to_dense(), lambda s: s.sum(1)):
        a, b = op(narrow), op(wide)
        a, b = (t.to_dense() if isinstance(t, SparseTensor) else t for t in (a, b))
        assert torch.equal(a, b)
    assert_matches_dense(F.linear(x.double(), narrow.double()), F.linear(x.double(), w.double()))
    # the gradient lands on the narrow pattern
    p = narrow.clone().requires_grad_()
    F.linear(x, p).sum().backward()
    grad = p.grad.to_dense() if isinstance(p.grad, SparseTensor) else p.grad
    assert torch.equal(grad, x.sum(0).expand_as(w) * (w != 0))


def test_narrow_index_dtype_refused_where_it_cannot_hold_the_arrays():
    w = torch.ones(20, 300)
    with pytest.raises(ValueError, match="cannot hold"):
        scorch.asformat(w, "csr", index_dtype=torch.int8)
    assert scorch.asformat(torch.eye(5), "csr", index_dtype=torch.int8).index_dtype == torch.int8
    assert scorch.asformat(torch.eye(5), "csr").index_dtype == torch.int32  # the default stays int32

# --- products ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, case, dtype", params())
def test_linear_forward_and_backward(fmt, case, dtype):
    """``F.linear(x, W)`` as dense torch; the gradient of x as dense torch's, and W's gradient is dense autograd's
    on ``W * mask``, restricted to W's pattern and stored on it."""
    w = weight(fmt, case, dtype)
    x = quarters((5, w.shape[1]), 1, dtype=dtype)
    g = quarters((5, w.shape[0]), 2, dtype=dtype)
    mask = pattern(fmt, w)
    W = scorch.asformat(w, fmt).requires_grad_()
    xs = x.clone().requires_grad_()
    out = F.linear(xs, W)
    assert is_dense_result(out)
    assert_matches_dense(out, F.linear(x, w))
    (out * g).sum().backward()
    wd, xd = w.clone().requires_grad_(), x.clone().requires_grad_()
    (F.linear(xd, wd * mask) * g).sum().backward()
    assert_matches_dense(xs.grad, xd.grad)
    grad = W.grad
    assert isinstance(grad, SparseTensor) and grad.format == W.format and grad.shape == W.shape
    assert_matches_dense(grad, wd.grad * mask)
    if W.format.padded:  # padding stays padding: no gradient there
        assert not bool(grad.values()[W.values() == 0].any())


@pytest.mark.parametrize("batch", [1, 129, 200])
@pytest.mark.parametrize("fmt", ["csr", "bsr(4, 4)", "coo"])
def test_linear_in_batch_tiles(monkeypatch, fmt, batch):
    """A large batch runs in tiles of rows (``linalg._batch_tiles``; its size thresholds lowered here): the same
    result as dense torch, a partial last tile included. With a gradient to record the tiles are one node of the
    graph: x's and W's gradients are the whole batch's (W's one SDDMM, not one per tile). (float64: float32 and
    16-bit CSR / BSR / n:m weights run the weight family, ``engine.weights``, which tiles the batch itself.)"""
    from scorch.ops import linalg
    monkeypatch.setattr(linalg, "TILE_MIN_BYTES", 0)
    monkeypatch.setattr(linalg, "TILE_MIN_ROWS", 0)
    w = quarters((12, 16), 5, dtype=torch.float64) * (torch.arange(16) % 3 == 0)
    x = quarters((batch, 16), 6, dtype=torch.float64)
    g = quarters((batch, 12), 7, dtype=torch.float64)
    W = scorch.asformat(w, fmt)
    calls = []
    real = linalg.engine.einsum
    monkeypatch.setattr(linalg.engine, "einsum", lambda *a, **k: calls.append((a[0], a[2].shape[0])) or real(*a, **k))
    rows = linalg.BATCH_TILE if fmt.startswith("bsr") else linalg.BATCH_TILE // 2
    tiles = [("oi,bi->ob", batch)] if batch <= 2 * rows else [("oi,bi->ob", len(t)) for t in x.split(rows)]
    with torch.no_grad():
        assert_matches_dense(F.linear(x, W), F.linear(x, w))
    assert calls == tiles
    calls.clear()
    Wg, xs = scorch.asformat(w, fmt).requires_grad_(), x.clone().requires_grad_()
    out = F.linear(xs, Wg)
    # (the same products; a product of the whole batch is called twice: the autograd einsum calls the inner one)
    assert set(c for c in calls if c[0] == "oi,bi->ob") == set(tiles)
    assert_matches_dense(out, F.linear(x, w))
    calls.clear()
    (out * g).sum().backward()
    assert len([c for c in calls if c[0].endswith("->oi")]) == 1  # (W's gradient: one product)
    wd, xd = w.clone().requires_grad_(), x.clone().requires_grad_()
    (F.linear(xd, wd) * g).sum().backward()
    assert_matches_dense(xs.grad, xd.grad)
    stored = Wg.detach()
    mask = stored.with_values(torch.ones_like(stored.values())).to_dense() != 0  # (blocks keep their zeros)
    assert_matches_dense(Wg.grad, wd.grad * mask)


@pytest.mark.parametrize("fmt, case, dtype", params())
def test_products_with_dense(fmt, case, dtype):
    """``W @ X`` and ``X @ W.t()``: dense results, as torch's."""
    w = weight(fmt, case, dtype)
    W = scorch.asformat(w, fmt)
    x = quarters((w.shape[1], 3), 3, dtype=dtype)
    y = quarters((4, w.shape[1]), 4, dtype=dtype)
    r = W @ x
    assert is_dense_result(r)
    assert_matches_dense(r, w @ x)
    assert_matches_dense(y @ W.t(), y @ w.t())
    assert_matches_dense(torch.mm(W, x), w @ x)


@pytest.mark.parametrize("fmt, case, dtype", params())
def test_sampled_addmm_on_the_pattern(fmt, case, dtype):
    w = weight(fmt, case, dtype)
    W = scorch.asformat(w, fmt)
    m1 = quarters((w.shape[0], 3), 5, dtype=dtype)
    m2 = quarters((3, w.shape[1]), 6, dtype=dtype)
    mask = pattern(fmt, w)
    r = torch.sparse.sampled_addmm(W, m1, m2, beta=0.5, alpha=2.0)
    assert isinstance(r, SparseTensor) and r.format == W.format
    r.check_invariants()
    assert_matches_dense(r, 0.5 * w + 2.0 * (m1 @ m2) * mask)


# --- n:m conversion: what it accepts and what it refuses ----------------------------------------------------------

@settings(max_examples=60)
@given(st.integers(1, 4), st.integers(0, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**16),
       st.floats(0.0, 1.0))
def test_nm_conversion_accepts_exactly_the_nm_tensors(n, extra, rows, groups, seed, density):
    m = n + extra
    w = quarters((rows, groups * m), seed, density)
    per_group = (w.reshape(rows, groups, m) != 0).sum(-1)
    over = (per_group > n).nonzero()
    fmt = f"nm({n}, {m})"
    if over.numel():
        r, grp = over[0].tolist()
        with pytest.raises(ValueError, match=rf"row {r}, column group {grp} \(columns {grp * m}\.\.{grp * m + m - 1}\)"
                                             rf" has {int(per_group[r, grp])} nonzeros.*Prune first"):
            scorch.asformat(w, fmt)
        return
    s = scorch.asformat(w, fmt, check=True)
    assert s.values().numel() == rows * groups * n
    assert torch.equal(s.to_dense(), w)
    assert torch.equal(scorch.asformat(scorch.asformat(s, "coo"), fmt).to_dense(), w)


def test_nm_refuses_columns_not_in_whole_groups():
    with pytest.raises(ValueError, match=r"nm\(2, 4\) needs the number of columns to be a multiple of 4"):
        scorch.asformat(torch.zeros(3, 6), "nm(2, 4)")


def test_nm_from_a_sparse_source_names_the_first_full_group():
    w = torch.zeros(4, 8)
    w[2, 4:7] = 1.0  # row 2, group 1: 3 of 4
    w[3, 0:4] = 1.0
    with pytest.raises(ValueError, match=r"row 2, column group 1 \(columns 4\.\.7\) has 3 nonzeros"):
        scorch.asformat(scorch.asformat(w, "csr"), "nm(2, 4)")


def test_nm_storage_is_validated():
    s = scorch.asformat(weight("nm(2, 4)", "random", torch.float32), "nm(2, 4)")
    lv = list(s.levels)
    lv[2] = scorch.formats.LevelStorage(crd=lv[2].crd[:32])  # one slot per group (ELL would take that)
    with pytest.raises(ValueError, match=r"j % 4 : fixed\(2\)\): crd has 32 entries, expected 2 for each of the 32"):
        SparseTensor(s.format, s.shape, lv, s.values()[:32], check=True)
