"""Round trips through every storage format, checked against the dense tensor they came from.

dense -> ``scorch.asformat(x, fmt)`` -> ``.to_dense()`` must give back ``x`` exactly, for every named format,
for hand-written format texts (blocked, diagonal, anti-diagonal), for any shape (empty ones included), for
all-zero / fully dense / random patterns, for float32, float64, int64 and bool, and for both index widths.
Conversions between any two formats, from torch's sparse layouts, and of uncoalesced COO (duplicates summed)
must agree with the same dense tensor.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scorch
from scorch.formats import resolve

pytestmark = [pytest.mark.filterwarnings("ignore:.*Sparse invariant checks are implicitly disabled"),
              pytest.mark.filterwarnings("ignore:.*support is in beta state")]

# --- the formats under test -----------------------------------------------------------------------------------
NAMED_2D = ["dense", "coo", "csr", "csc", "dcsr", "dcsc", "ell", "dia",
            "bsr(2, 3)", "bsc(2, 3)", "bsr(1, 1)", "bsr(4, 4)"]
DSL_2D = [
    "(i, j) -> (i / 2 : dense, j / 3 : compressed, i % 2 : dense, j % 3 : dense)",
    "(i, j) -> (j - i : compressed, i : dense)",
    "(i, j) -> (j - i : compressed, j : dense)",
    "(i, j) -> (i + j : compressed, i : dense)",
    "(i, j) -> (i + j : compressed, j : dense)",
]
ALL_2D = NAMED_2D + DSL_2D

ND_FORMATS = {
    1: ["dense", "coo", "csf", "(i) -> (i : compressed)", "(i) -> (i / 3 : compressed, i % 3 : dense)"],
    3: ["dense", "coo", "csf",
        "(i, j, k) -> (k : dense, i : compressed, j : compressed)",
        "(i, j, k) -> (i : dense, j : dense, k : compressed)",
        "(i, j, k) -> (i : dense, j / 2 : compressed, k : compressed, j % 2 : dense)"],
    4: ["dense", "coo", "csf",
        "(i, j, k, l) -> (l : dense, j : compressed, i : compressed, k : compressed)",
        "(i, j, k, l) -> (i : dense, k : compressed(nonunique), j : singleton(nonunique), l : singleton)"],
}

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]
INDEX_DTYPES = [None, torch.int32, torch.int64]

# formats whose every stored value is an entry of the tensor (no padding, no dense blocks)
UNPADDED = {"coo", "csr", "csc", "dcsr", "dcsc", "csf", "bsr(1, 1)",
            "(i) -> (i : compressed)", "(i, j, k) -> (k : dense, i : compressed, j : compressed)",
            "(i, j, k, l) -> (l : dense, j : compressed, i : compressed, k : compressed)",
            "(i, j, k, l) -> (i : dense, k : compressed(nonunique), j : singleton(nonunique), l : singleton)"}


def fast(max_examples):
    """Example counts sized so that this file runs in well under a minute on two cores."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- strategies -------------------------------------------------------------------------------------------------
def _nonzero_values(dtype):
    if dtype == torch.bool:
        return st.just(True)
    if dtype == torch.int64:
        return st.one_of(st.integers(-100, 100), st.integers(-2**62, 2**62)).filter(lambda v: v != 0)
    width = 32 if dtype == torch.float32 else 64
    return st.one_of(st.integers(-100, 100).map(float),
                     st.floats(-2.0**100, 2.0**100, allow_nan=False, allow_infinity=False, width=width)
                     ).filter(lambda v: v != 0)


@st.composite
def tensors_of(draw, shape, dtype):
    """A tensor of ``shape``: all zero, fully dense, or random with a drawn density."""
    n = math.prod(shape)
    kind = draw(st.sampled_from(["zero", "full", "random", "random"]))
    if kind == "zero":
        return torch.zeros(shape, dtype=dtype)
    vals = draw(st.lists(_nonzero_values(dtype), min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=dtype).reshape(shape) if n else torch.zeros(shape, dtype=dtype)
    if kind == "random" and n:
        density = draw(st.sampled_from([1, 3, 5, 8]))  # in tenths
        keep = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
        x = torch.where(torch.tensor(keep).reshape(shape) < density, x, torch.zeros((), dtype=dtype))
    return x


@st.composite
def matrices(draw, max_side=9, dtypes=DTYPES):
    shape = (draw(st.integers(0, max_side)), draw(st.integers(0, max_side)))
    return draw(tensors_of(shape, draw(st.sampled_from(dtypes))))


@st.composite
def nd_tensors(draw, ndim, dtypes=DTYPES):
    max_side = {1: 12, 3: 4, 4: 3}[ndim]
    shape = tuple(draw(st.integers(0, max_side)) for _ in range(ndim))
    return draw(tensors_of(shape, draw(st.sampled_from(dtypes))))


# --- expectations computed from the dense tensor ----------------------------------------------------------------
def _distinct(values) -> int:
    return int(torch.unique(values).numel())


def expected_nnz(fmt: str, pattern: torch.Tensor) -> int | None:
    """The number of values ``fmt`` must store for the entries where ``pattern`` is True (None where this
    file does not pin it down)."""
    nz = pattern.nonzero().T
    if fmt == "dense":
        return pattern.numel()
    if fmt in UNPADDED:
        return int(nz.shape[1])
    rows, cols = pattern.shape if pattern.dim() == 2 else (None, None)
    if fmt == "ell":
        return rows * int(pattern.sum(1).max()) if rows else 0
    if fmt in ("dia", DSL_2D[1]):
        return _distinct(nz[1] - nz[0]) * rows
    if fmt == DSL_2D[2]:
        return _distinct(nz[1] - nz[0]) * cols
    if fmt == DSL_2D[3]:
        return _distinct(nz[0] + nz[1]) * rows
    if fmt == DSL_2D[4]:
        return _distinct(nz[0] + nz[1]) * cols
    block = {"bsr(2, 3)": (2, 3), "bsc(2, 3)": (2, 3), "bsr(4, 4)": (4, 4), DSL_2D[0]: (2, 3)}.get(fmt)
    if block is not None:
        bh, bw = block
        blocks = torch.stack([nz[0] // bh, nz[1] // bw], 1)
        return int(torch.unique(blocks, dim=0).shape[0]) * bh * bw if blocks.numel() else 0
    return None


def stored_pattern(S) -> torch.Tensor:
    """Where ``S`` stores an entry (explicit zeros included, padding excluded): its dense form with every
    stored value replaced by one. A format with a padded (fixed) level cannot tell its padding from stored
    zeros, and lists neither, so its stored pattern is its nonzeros."""
    if any(lvl.padded for lvl in S.format.level_types):
        return S.to_dense() != 0
    return S.with_values(torch.ones_like(S.values())).to_dense() != 0


def check_storage(S, x, fmt, index_dtype, pattern=None):
    """Everything a freshly converted SparseTensor must satisfy, as seen from the dense tensor ``x``.

    ``pattern``: the entries the source stored (default: the nonzeros of ``x``, for a dense source). A
    conversion keeps explicitly stored zeros, so converting a padded format stores more than ``x != 0``.
    """
    from_dense = pattern is None
    pattern = (x != 0) if from_dense else pattern
    assert isinstance(S, scorch.SparseTensor)
    assert S.shape == x.shape
    assert S.dtype == x.dtype
    assert S.device == x.device
    assert S.format == resolve(fmt, x.dim())
    S.check_invariants()
    vals = S.values()
    assert vals.dim() == 1
    assert vals.numel() == S.nnz
    assert vals.dtype == x.dtype
    want_nnz = expected_nnz(fmt, pattern)
    if want_nnz is not None:
        assert S.nnz == want_nnz, (fmt, S.nnz, want_nnz)
    if fmt in UNPADDED and from_dense:
        assert bool((vals != 0).all()), "a format without padding stored a zero from a dense source"
    want_idx = torch.int32 if index_dtype is None else index_dtype
    for k, st_ in enumerate(S.levels):
        for name, a in st_.arrays().items():
            assert a.dtype == want_idx, (fmt, k, name, a.dtype)
            assert a.dim() == 1, (fmt, k, name, a.shape)
    dense = S.to_dense()
    assert dense.dtype == x.dtype
    assert torch.equal(dense, x), (fmt, S)


# --- dense -> format -> dense ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL_2D)
@fast(30)
@given(x=matrices(), index_dtype=st.sampled_from(INDEX_DTYPES))
def test_dense_roundtrip_2d(fmt, x, index_dtype):
    S = scorch.asformat(x, fmt, index_dtype=index_dtype)
    check_storage(S, x, fmt, index_dtype)


@pytest.mark.parametrize("fmt", ALL_2D)
@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (5, 0), (1, 1), (1, 7), (7, 1), (5, 7), (4, 6), (8, 8)])
@pytest.mark.parametrize("pattern", ["zero", "full", "random"])
def test_dense_roundtrip_fixed_shapes(fmt, shape, pattern):
    """The edge shapes and patterns, each guaranteed to run (hypothesis might not draw them all)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((fmt, shape, pattern)).encode()))
    x = torch.randint(1, 10, shape, generator=g).double()
    if pattern == "zero":
        x.zero_()
    elif pattern == "random":
        x[torch.rand(shape, generator=g) < 0.6] = 0
    for index_dtype in INDEX_DTYPES:
        check_storage(scorch.asformat(x, fmt, index_dtype=index_dtype), x, fmt, index_dtype)


@pytest.mark.parametrize("fmt", ALL_2D)
def test_dense_roundtrip_non_contiguous_source(fmt):
    x = torch.arange(1., 43.).reshape(6, 7)
    x[::2, 1::3] = 0
    xt = x.t()  # a transposed view: strides (1, 7)
    assert not xt.is_contiguous()
    check_storage(scorch.asformat(xt, fmt), xt, fmt, None)
    xs = x[:, ::2]
    check_storage(scorch.asformat(xs, fmt), xs, fmt, None)


def test_dsl_text_equals_the_named_block_format():
    """The block DSL text is the same format as bsr(2, 3): same storage for the same tensor."""
    x = torch.arange(35.).reshape(5, 7) * (torch.arange(35).reshape(5, 7) % 4 == 0)
    a, b = scorch.asformat(x, DSL_2D[0]), scorch.asformat(x, "bsr(2, 3)")
    assert a.format == b.format
    assert torch.equal(a.values(), b.values())
    for la, lb in zip(a.levels, b.levels):
        for name in la.arrays():
            assert torch.equal(la.arrays()[name], lb.arrays()[name])


# --- any format -> any format ------------------------------------------------------------------------------------
def _fixed_matrix(shape=(5, 7), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-9, 10, shape, generator=g).to(dtype)
    x[torch.rand(shape, generator=g) < 0.55] = 0
    return x


@pytest.mark.parametrize("src", ALL_2D)
@pytest.mark.parametrize("dst", ALL_2D)
def test_any_to_any_fixed(src, dst):
    x = _fixed_matrix()
    S = scorch.asformat(x, src)
    D = scorch.asformat(S, dst, index_dtype=torch.int64)
    check_storage(D, x, dst, torch.int64, pattern=stored_pattern(S))
    back = scorch.asformat(D, src)
    assert back.format == resolve(src, 2)
    assert torch.equal(back.to_dense(), x)
    # the source is untouched by the conversions
    assert torch.equal(S.to_dense(), x)


@fast(150)
@given(x=matrices(), src=st.sampled_from(ALL_2D), dst=st.sampled_from(ALL_2D),
       src_index=st.sampled_from(INDEX_DTYPES), dst_index=st.sampled_from(INDEX_DTYPES))
def test_any_to_any(x, src, dst, src_index, dst_index):
    S = scorch.asformat(x, src, index_dtype=src_index)
    D = scorch.asformat(S, dst, index_dtype=dst_index, check=True)
    if resolve(src, 2) == resolve(dst, 2) and dst_index in (None, S.index_dtype):
        assert D is S  # "Returns x itself when it already has that format and index type"
        return
    check_storage(D, x, dst, dst_index, pattern=stored_pattern(S))


@pytest.mark.parametrize("fmt", ALL_2D)
def test_same_format_returns_itself_unless_index_dtype_changes(fmt):
    x = _fixed_matrix()
    S = scorch.asformat(x, fmt, index_dtype=torch.int32)
    assert scorch.asformat(S, fmt) is S
    if not any(st_.arrays() for st_ in S.levels):
        return  # no index arrays: nothing has an index type
    assert scorch.asformat(S, fmt, index_dtype=torch.int32) is S
    W = scorch.asformat(S, fmt, index_dtype=torch.int64)
    assert W is not S
    check_storage(W, x, fmt, torch.int64)
    assert S.index_dtype == torch.int32  # the source is left as it was


# --- N-d tensors -------------------------------------------------------------------------------------------------
ND_CASES = [(n, f) for n, fs in ND_FORMATS.items() for f in fs]


@pytest.mark.parametrize("ndim, fmt", ND_CASES)
@fast(25)
@given(data=st.data(), index_dtype=st.sampled_from(INDEX_DTYPES))
def test_dense_roundtrip_nd(ndim, fmt, data, index_dtype):
    x = data.draw(nd_tensors(ndim))
    S = scorch.asformat(x, fmt, index_dtype=index_dtype)
    check_storage(S, x, fmt, index_dtype)


@pytest.mark.parametrize("ndim", sorted(ND_FORMATS))
@fast(40)
@given(data=st.data())
def test_any_to_any_nd(ndim, data):
    x = data.draw(nd_tensors(ndim))
    src = data.draw(st.sampled_from(ND_FORMATS[ndim]))
    dst = data.draw(st.sampled_from(ND_FORMATS[ndim]))
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    S = scorch.asformat(x, src)
    D = scorch.asformat(S, dst, index_dtype=index_dtype)
    check_storage(D, x, dst, index_dtype, pattern=stored_pattern(S))


@pytest.mark.parametrize("shape", [(0,), (1,), (13,), (2, 0, 3), (1, 1, 1), (3, 4, 5), (2, 3, 2, 3), (0, 2, 2, 2)])
def test_nd_fixed_shapes(shape):
    g = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    x = torch.randint(1, 10, shape, generator=g).float()
    x[torch.rand(shape, generator=g) < 0.5] = 0
    for fmt in ND_FORMATS[len(shape)]:
        for index_dtype in INDEX_DTYPES:
            check_storage(scorch.asformat(x, fmt, index_dtype=index_dtype), x, fmt, index_dtype)


# --- torch sparse layouts as the source ----------------------------------------------------------------------------
def _torch_sparse(x, kind):
    if kind == "coo":
        return x.to_sparse()
    if kind == "coo_uncoalesced":
        # the same entries, each split in two halves that sum to it, in reversed order: not coalesced
        nz = x.nonzero().T.flip(1)
        v = x[tuple(nz)]
        if x.dtype == torch.bool:
            halves = (v, v)
        else:
            first = v // 2 if not x.dtype.is_floating_point else v / 2
            halves = (first, v - first)
        idx = torch.cat([nz, nz], 1)
        t = torch.sparse_coo_tensor(idx, torch.cat(halves), x.shape)
        assert not t.is_coalesced() or t._nnz() == 0
        return t
    if kind == "csr":
        return x.to_sparse_csr()
    if kind == "csc":
        return x.to_sparse_csc()
    if kind == "csr_int32":
        c = x.to_sparse_csr()
        return torch.sparse_csr_tensor(c.crow_indices().int(), c.col_indices().int(), c.values(), x.shape)
    if kind == "bsr":
        return x.to_sparse_bsr((2, 2))
    if kind == "bsc":
        return x.to_sparse_bsc((2, 2))
    raise AssertionError(kind)


TORCH_KINDS = ["coo", "coo_uncoalesced", "csr", "csc", "csr_int32", "bsr", "bsc"]


@pytest.mark.parametrize("kind", TORCH_KINDS)
@fast(40)
@given(x=matrices(dtypes=[torch.float64, torch.int64, torch.bool]), fmt=st.sampled_from(ALL_2D),
       index_dtype=st.sampled_from(INDEX_DTYPES))
def test_torch_sparse_source(kind, x, fmt, index_dtype):
    if kind in ("bsr", "bsc"):
        x = x[: x.shape[0] // 2 * 2, : x.shape[1] // 2 * 2]  # torch's BSR needs multiples of the block
    t = _torch_sparse(x, kind)
    assert torch.equal(t.to_dense(), x)
    view = scorch.from_torch(t)
    S = scorch.asformat(t, fmt, index_dtype=index_dtype, check=True)
    if S.format == view.format and index_dtype in (None, view.index_dtype):
        # no conversion: the storage is torch's own, duplicates included
        assert torch.equal(S.to_dense(), x)
        S.check_invariants()
        return
    # blocks store their zeros explicitly, and a conversion keeps explicit zeros
    check_storage(S, x, fmt, index_dtype, pattern=stored_pattern(view))


@pytest.mark.parametrize("fmt", ND_FORMATS[3])
def test_torch_sparse_source_3d(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-5, 6, (3, 4, 5), generator=g).float()
    x[torch.rand(x.shape, generator=g) < 0.5] = 0
    for t in (x.to_sparse(), torch.sparse_coo_tensor(x.nonzero().T.flip(1), x[tuple(x.nonzero().T.flip(1))], x.shape)):
        for index_dtype in (torch.int32, torch.int64):
            check_storage(scorch.asformat(t, fmt, index_dtype=index_dtype), x, fmt, index_dtype)


# --- duplicates in uncoalesced COO ---------------------------------------------------------------------------------
@st.composite
def coo_with_duplicates(draw):
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool]))
    n = draw(st.integers(0, 3 * rows * cols))
    entries = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, cols - 1)), min_size=n, max_size=n))
    if dtype == torch.bool:
        vals = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    else:
        vals = draw(st.lists(st.integers(-20, 20), min_size=n, max_size=n))  # exact sums in any order
    return (rows, cols), dtype, entries, vals


def _summed_reference(shape, dtype, entries, vals):
    """The dense tensor with duplicates summed (or-ed for bool), by a plain Python loop."""
    out = [[False if dtype == torch.bool else 0] * shape[1] for _ in range(shape[0])]
    for (i, j), v in zip(entries, vals):
        out[i][j] = (out[i][j] or v) if dtype == torch.bool else out[i][j] + v
    return torch.tensor(out, dtype=dtype).reshape(shape)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "ell", "bsr(2, 2)", "dia", "dense"])
@fast(30)
@given(case=coo_with_duplicates(), index_dtype=st.sampled_from(INDEX_DTYPES))
def test_uncoalesced_coo_duplicates_are_summed(fmt, case, index_dtype):
    shape, dtype, entries, vals = case
    idx = torch.tensor(entries, dtype=torch.int64).reshape(-1, 2).T
    S = scorch.sparse_coo_tensor(idx, torch.tensor(vals, dtype=dtype), shape)
    expected = _summed_reference(shape, dtype, entries, vals)
    assert S.nnz == len(entries)  # the uncoalesced input keeps every entry
    assert torch.equal(S.to_dense(), expected)
    D = scorch.asformat(S, fmt, index_dtype=index_dtype)
    D.check_invariants()
    assert D.format == resolve(fmt, 2)
    assert torch.equal(D.to_dense(), expected)
    if fmt in ("csr", "csc", "coo", "dcsr"):
        assert D.nnz == len(set(entries)), "duplicates must be merged into one stored entry"
    if D.format == S.format and index_dtype in (None, S.index_dtype):
        assert D is S  # torch marks a COO tensor of at most one entry coalesced: nothing to convert
        return
    want_idx = torch.int32 if index_dtype is None else index_dtype
    for st_ in D.levels:
        for a in st_.arrays().values():
            assert a.dtype == want_idx


def test_duplicates_summed_in_csr_example():
    idx = torch.tensor([[1, 0, 1, 1, 0], [2, 1, 2, 0, 1]])
    vals = torch.tensor([1., 10., 100., 1000., 10000.])
    S = scorch.sparse_coo_tensor(idx, vals, (2, 3))
    C = scorch.asformat(S, "csr")
    assert torch.equal(C.levels[1].pos, torch.tensor([0, 1, 3], dtype=C.levels[1].pos.dtype))
    assert C.levels[1].crd.tolist() == [1, 0, 2]
    assert C.values().tolist() == [10010., 1000., 101.]
    assert torch.equal(C.to_dense(), torch.tensor([[0., 10010., 0.], [1000., 0., 101.]]))


# --- index widths beyond int32 --------------------------------------------------------------------------------------
def test_default_index_dtype_widens_to_int64_for_huge_shapes():
    """A shape past 2**31 - 1 cannot be addressed by int32: the default is int64, and forcing int32 fails."""
    idx = torch.tensor([[0, 2**31 + 5], [1, 3]])
    S = scorch.sparse_coo_tensor(idx, torch.tensor([1., 2.]), (2**32, 4))
    D = scorch.asformat(S, "dcsr")
    D.check_invariants()
    assert D.index_dtype == torch.int64
    assert all(a.dtype == torch.int64 for st_ in D.levels for a in st_.arrays().values())
    assert D.levels[0].crd.tolist() == [0, 2**31 + 5]
    assert D.levels[1].crd.tolist() == [1, 3]
    assert D.values().tolist() == [1., 2.]
    back = scorch.asformat(D, "dcsc")
    assert back.levels[1].crd.tolist() == [0, 2**31 + 5]
    with pytest.raises(ValueError, match="int32"):
        scorch.asformat(S, "dcsr", index_dtype=torch.int32)


# --- padding is not an entry ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dst", ["csr", "coo", "dcsr"])
def test_ell_padding_of_empty_rows_is_not_converted_into_entries(dst):
    """ELL pads short rows with value-0 slots; unpack promises that padding is dropped, so converting ELL
    (built from a dense tensor, so without explicit zeros) stores exactly the tensor's nonzeros."""
    x = torch.tensor([[0., 0., 0.], [1., 2., 0.], [0., 0., 0.], [0., 0., 3.]])
    E = scorch.asformat(x, "ell")
    assert E.nnz == 4 * 2
    D = scorch.asformat(E, dst)
    assert torch.equal(D.to_dense(), x)
    assert D.nnz == 3, f"padding of the empty rows became stored entries: {D.levels}, {D.values()}"
