"""Interop with torch's sparse layouts: zero-copy views both ways, the torch-signature constructors, their
validation (errors naming the level and position), and the ``check`` / ``check_invariants()`` switches.

Sharing is checked by ``data_ptr()``: a view has the very same index and value arrays as its source.
"""
from __future__ import annotations

import threading

import pytest
import torch

import scorch
from scorch.formats import named
from conftest import assert_matches_dense

pytestmark = [pytest.mark.filterwarnings("ignore:.*Sparse invariant checks are implicitly disabled"),
              pytest.mark.filterwarnings("ignore:.*support is in beta state")]


def _matrix(shape=(6, 8), seed=0, dtype=torch.float32, density=0.4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 10, shape, generator=g).to(dtype)
    x[torch.rand(shape, generator=g) >= density] = 0
    assert bool((x != 0).any()), "the test tensors must have entries, or data_ptr checks mean nothing"
    return x


def _uncoalesced(x):
    """``x`` as a torch COO tensor with every entry split in two, in reversed order (not coalesced)."""
    nz = x.nonzero().T.flip(1)
    v = x[tuple(nz)]
    t = torch.sparse_coo_tensor(torch.cat([nz, nz], 1), torch.cat([v - 1, torch.ones_like(v)]), x.shape)
    assert not t.is_coalesced()
    return t


def _compressed_arrays(t):
    """(compressed indices, plain indices, values) of a torch CSR/CSC/BSR/BSC tensor."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


_MAKE = {torch.sparse_csr: torch.sparse_csr_tensor, torch.sparse_csc: torch.sparse_csc_tensor,
         torch.sparse_bsr: torch.sparse_bsr_tensor, torch.sparse_bsc: torch.sparse_bsc_tensor}


def _torch_compressed(x, layout, index_dtype):
    if layout == torch.sparse_csr:
        t = x.to_sparse_csr()
    elif layout == torch.sparse_csc:
        t = x.to_sparse_csc()
    elif layout == torch.sparse_bsr:
        t = x.to_sparse_bsr((2, 4))
    else:
        t = x.to_sparse_bsc((2, 4))
    if index_dtype == torch.int32:
        c, p, v = _compressed_arrays(t)
        t = _MAKE[layout](c.int(), p.int(), v, x.shape)
    assert _compressed_arrays(t)[0].dtype == index_dtype
    return t


# --- from_torch / to_torch: COO ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6, 8), (3, 4, 5), (2, 3, 2, 3)])
@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_from_torch_coo_shares_indices_and_values(shape, coalesced, dtype):
    x = _matrix(shape, dtype=dtype)
    t = x.to_sparse() if coalesced else _uncoalesced(x)
    S = scorch.from_torch(t)
    assert isinstance(S, scorch.SparseTensor)
    assert S.format == named.coo_nd(len(shape), coalesced=coalesced)
    assert S.shape == t.shape and S.dtype == t.dtype
    idx, vals = t._indices(), t._values()
    for d, st in enumerate(S.levels):
        assert st.crd.data_ptr() == idx[d].data_ptr(), f"level {d} copied the indices"
    assert S.levels[0].pos.tolist() == [0, vals.numel()]
    assert S.values().data_ptr() == vals.data_ptr()
    assert S.nnz == t._nnz()
    assert torch.equal(S.to_dense(), x)
    S.check_invariants()

    T = S.to_torch()
    assert T.layout == torch.sparse_coo
    assert T.is_coalesced() == coalesced
    assert T._indices().data_ptr() == idx.data_ptr()
    assert T._indices().stride() == idx.stride()
    assert T._values().data_ptr() == vals.data_ptr()
    assert torch.equal(T.to_dense(), x)


def test_from_torch_coo_is_a_view_writes_show_through():
    x = _matrix()
    t = x.to_sparse()
    S = scorch.from_torch(t)
    t._values().mul_(2)
    assert torch.equal(S.to_dense(), 2 * x)
    S.values().add_(1)
    assert torch.equal(t.to_dense(), torch.where(x != 0, 2 * x + 1, x))


# --- from_torch / to_torch: CSR, CSC, BSR, BSC --------------------------------------------------------------------
LAYOUTS = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]
LAYOUT_FORMAT = {torch.sparse_csr: named.csr, torch.sparse_csc: named.csc,
                 torch.sparse_bsr: named.bsr(2, 4), torch.sparse_bsc: named.bsc(2, 4)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool], ids=str)
def test_from_torch_compressed_shares_arrays_both_ways(layout, index_dtype, dtype):
    x = _matrix((6, 8), seed=1, dtype=dtype)
    t = _torch_compressed(x, layout, index_dtype)
    cidx, pidx, vals = _compressed_arrays(t)
    S = scorch.from_torch(t)
    assert isinstance(S, scorch.SparseTensor)
    assert S.format == LAYOUT_FORMAT[layout]
    assert S.shape == t.shape and S.dtype == t.dtype and S.index_dtype == index_dtype
    assert S.levels[1].pos.data_ptr() == cidx.data_ptr()
    assert S.levels[1].crd.data_ptr() == pidx.data_ptr()
    assert S.values().data_ptr() == vals.data_ptr()
    assert S.values().dim() == 1 and S.nnz == vals.numel()
    assert all(not st.arrays() for k, st in enumerate(S.levels) if k != 1)
    S.check_invariants()
    assert torch.equal(S.to_dense(), x)

    T = S.to_torch()
    assert T.layout == layout
    c2, p2, v2 = _compressed_arrays(T)
    assert c2.data_ptr() == cidx.data_ptr() and c2.dtype == index_dtype
    assert p2.data_ptr() == pidx.data_ptr() and p2.dtype == index_dtype
    assert v2.data_ptr() == vals.data_ptr()
    assert v2.shape == vals.shape  # blocks come back as (nnz_blocks, bh, bw)
    assert torch.equal(T.to_dense(), x)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_asformat_of_torch_tensor_in_its_own_format_is_a_view(layout):
    x = _matrix()
    t = _torch_compressed(x, layout, torch.int64)
    S = scorch.asformat(t, LAYOUT_FORMAT[layout])
    cidx, pidx, vals = _compressed_arrays(t)
    assert S.levels[1].pos.data_ptr() == cidx.data_ptr()
    assert S.levels[1].crd.data_ptr() == pidx.data_ptr()
    assert S.values().data_ptr() == vals.data_ptr()
    # another index type is a conversion: new arrays, same tensor
    W = scorch.asformat(t, LAYOUT_FORMAT[layout], index_dtype=torch.int32)
    assert W.index_dtype == torch.int32
    assert W.levels[1].pos.data_ptr() != cidx.data_ptr()
    assert torch.equal(W.to_dense(), x)


def test_from_torch_keeps_requires_grad_of_a_leaf():
    t = _matrix().to_sparse_csr().requires_grad_()
    assert scorch.from_torch(t).requires_grad
    assert not scorch.from_torch(_matrix().to_sparse_csr()).requires_grad


def test_from_torch_rejects_dense_and_passes_sparse_tensor_through():
    x = _matrix()
    with pytest.raises(ValueError, match="asformat"):
        scorch.from_torch(x)
    S = scorch.asformat(x, "csr")
    assert scorch.from_torch(S) is S


# --- to_torch of scorch-built tensors -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6, 8), (3, 4, 5), (2, 3, 2, 3)])
def test_scorch_coo_int64_to_torch_shares_indices(shape):
    x = _matrix(shape, seed=2)
    S = scorch.asformat(x, "coo", index_dtype=torch.int64)
    T = S.to_torch()
    assert T.layout == torch.sparse_coo
    assert T.is_coalesced()
    idx = T._indices()
    assert idx.dtype == torch.int64 and idx.shape == (len(shape), S.nnz)
    for d, st in enumerate(S.levels):
        assert idx[d].data_ptr() == st.crd.data_ptr(), f"row {d} of the indices is a copy"
    assert T._values().data_ptr() == S.values().data_ptr()
    assert torch.equal(T.to_dense(), x)
    assert torch.equal(idx, x.to_sparse()._indices())


@pytest.mark.parametrize("shape", [(6, 8), (3, 4, 5)])
def test_scorch_coo_int32_to_torch_converts_indices(shape):
    x = _matrix(shape, seed=3)
    S = scorch.asformat(x, "coo")
    assert S.index_dtype == torch.int32
    T = S.to_torch()
    assert T.layout == torch.sparse_coo and T._indices().dtype == torch.int64
    assert T._values().data_ptr() == S.values().data_ptr()
    assert torch.equal(T.to_dense(), x)


def test_scorch_uncoalesced_coo_to_torch_is_uncoalesced():
    idx = torch.tensor([[1, 0, 1], [2, 0, 2]])
    vals = torch.tensor([1., 2., 3.])
    S = scorch.sparse_coo_tensor(idx, vals, (2, 3))
    T = S.to_torch()
    assert not T.is_coalesced()
    assert T._indices().data_ptr() == idx.data_ptr()
    assert T._values().data_ptr() == vals.data_ptr()
    assert torch.equal(T.to_dense(), torch.tensor([[2., 0., 0.], [0., 0., 4.]]))


@pytest.mark.parametrize("fmt, layout, torch_convert", [
    ("csr", torch.sparse_csr, lambda x: x.to_sparse_csr()),
    ("csc", torch.sparse_csc, lambda x: x.to_sparse_csc()),
    ("bsr(2, 4)", torch.sparse_bsr, lambda x: x.to_sparse_bsr((2, 4))),
    ("bsc(2, 4)", torch.sparse_bsc, lambda x: x.to_sparse_bsc((2, 4))),
    ("bsr(3, 2)", torch.sparse_bsr, lambda x: x.to_sparse_bsr((3, 2))),
], ids=["csr", "csc", "bsr24", "bsc24", "bsr32"])
def test_scorch_storage_matches_torchs_own_layout(fmt, layout, torch_convert):
    """asformat(x, fmt).to_torch() holds exactly the arrays torch's own conversion of x holds."""
    x = _matrix((6, 8), seed=4)
    S = scorch.asformat(x, fmt, index_dtype=torch.int64)
    T = S.to_torch()
    ref = torch_convert(x)
    assert T.layout == layout
    c, p, v = _compressed_arrays(T)
    assert c.data_ptr() == S.levels[1].pos.data_ptr() and p.data_ptr() == S.levels[1].crd.data_ptr()
    assert v.data_ptr() == S.values().data_ptr()
    for got, want in zip((c, p, v), _compressed_arrays(ref)):
        assert torch.equal(got, want)
    assert torch.equal(T.to_dense(), x)


@pytest.mark.parametrize("shape", [(6, 8), (3, 4, 5), (7,)])
def test_dense_format_to_torch_is_a_strided_view_of_values(shape):
    x = _matrix(shape, seed=5)
    S = scorch.asformat(x, "dense")
    T = S.to_torch()
    assert T.layout == torch.strided
    assert not isinstance(T, scorch.SparseTensor)
    assert T.shape == x.shape
    assert T.data_ptr() == S.values().data_ptr()
    assert torch.equal(T, x)
    T.view(-1)[0] = 123
    assert S.values()[0] == 123


@pytest.mark.parametrize("fmt", ["dia", "ell", "dcsr", "dcsc",
                                 "(i, j) -> (i + j : compressed, j : dense)",
                                 "(i, j) -> (j - i : compressed, j : dense)"])
def test_formats_without_torch_layout_raise(fmt):
    S = scorch.asformat(_matrix(), fmt)
    with pytest.raises(ValueError, match="no torch layout"):
        S.to_torch()
    with pytest.raises(ValueError, match="no torch layout"):
        scorch.to_torch(S)


def test_nd_formats_without_torch_layout_raise():
    S = scorch.asformat(_matrix((3, 4, 5)), "csf")
    with pytest.raises(ValueError, match="no torch layout"):
        S.to_torch()


@pytest.mark.parametrize("fmt", ["bsr(4, 3)", "bsc(4, 3)"])
def test_block_formats_with_ragged_shape_raise_in_to_torch(fmt):
    x = _matrix((6, 8))
    S = scorch.asformat(x, fmt)
    assert torch.equal(S.to_dense(), x)  # scorch pads the edge blocks; torch cannot
    with pytest.raises(ValueError, match="multiple of the block"):
        S.to_torch()


# --- the torch-signature constructors ----------------------------------------------------------------------------
CSR = dict(crow=torch.tensor([0, 2, 2, 3]), col=torch.tensor([0, 3, 1]), vals=torch.tensor([1., 2., 3.]))


def _ctor_cases():
    x = _matrix((6, 8), seed=6)
    csr, csc = x.to_sparse_csr(), x.to_sparse_csc()
    bsr, bsc = x.to_sparse_bsr((2, 4)), x.to_sparse_bsc((3, 2))
    coo = x.to_sparse()
    return {
        "coo": (scorch.sparse_coo_tensor, torch.sparse_coo_tensor, (coo._indices(), coo._values())),
        "csr": (scorch.sparse_csr_tensor, torch.sparse_csr_tensor, _compressed_arrays(csr)),
        "csr32": (scorch.sparse_csr_tensor, torch.sparse_csr_tensor,
                  tuple(a.int() if i < 2 else a for i, a in enumerate(_compressed_arrays(csr)))),
        "csc": (scorch.sparse_csc_tensor, torch.sparse_csc_tensor, _compressed_arrays(csc)),
        "bsr": (scorch.sparse_bsr_tensor, torch.sparse_bsr_tensor, _compressed_arrays(bsr)),
        "bsc": (scorch.sparse_bsc_tensor, torch.sparse_bsc_tensor, _compressed_arrays(bsc)),
    }, x


@pytest.mark.parametrize("case", ["coo", "csr", "csr32", "csc", "bsr", "bsc"])
@pytest.mark.parametrize("with_size", [True, False])
def test_constructors_match_torch(case, with_size):
    cases, x = _ctor_cases()
    ours, theirs, arrays = cases[case]
    args = arrays + ((x.shape,) if with_size else ())
    S = ours(*args)
    ref = theirs(*args)
    assert isinstance(S, scorch.SparseTensor)
    assert S.shape == ref.shape and S.dtype == ref.dtype
    S.check_invariants()
    assert torch.equal(S.to_dense(), ref.to_dense())
    if with_size:
        assert torch.equal(S.to_dense(), x)
    # the arrays given are the arrays stored
    if case == "coo":
        assert S.levels[0].crd.data_ptr() == arrays[0][0].data_ptr()
        assert S.levels[1].crd.data_ptr() == arrays[0][1].data_ptr()
    else:
        assert S.levels[1].pos.data_ptr() == arrays[0].data_ptr()
        assert S.levels[1].crd.data_ptr() == arrays[1].data_ptr()
        assert S.index_dtype == arrays[0].dtype
    assert S.values().data_ptr() == arrays[-1].data_ptr()


def test_constructor_keywords():
    S = scorch.sparse_csr_tensor(CSR["crow"], CSR["col"], CSR["vals"], (3, 4), dtype=torch.float64,
                                 requires_grad=True)
    ref = torch.sparse_csr_tensor(CSR["crow"], CSR["col"], CSR["vals"], (3, 4), dtype=torch.float64)
    assert S.dtype == torch.float64 and S.values().dtype == torch.float64
    assert S.requires_grad
    assert torch.equal(S.detach().to_dense(), ref.to_dense())
    C = scorch.sparse_coo_tensor(torch.tensor([[0, 2], [3, 1]]), torch.tensor([1, 2]), (3, 4), dtype=torch.int64,
                                 is_coalesced=True)
    assert C.format == named.coo
    assert torch.equal(C.to_dense(), torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0, 2, 0, 0]]))
    U = scorch.sparse_coo_tensor(torch.tensor([[0, 2], [3, 1]]), torch.tensor([1, 2]), (3, 4))
    assert U.format == named.coo_nd(2, coalesced=False)


def _bad_cases():
    v3 = torch.tensor([1., 2., 3.])
    crow, col = torch.tensor([0, 2, 2, 3]), torch.tensor([0, 3, 1])
    blocks = torch.arange(12.).reshape(3, 2, 2)
    return {
        # CSR (3 x 4): level 1 is the compressed column level
        "csr col out of range": (scorch.sparse_csr_tensor, (crow, torch.tensor([0, 4, 1]), v3, (3, 4)),
                                 r"level 1 .*crd\[1\] = 4 is out of range \[0, 4\)"),
        "csr negative col": (scorch.sparse_csr_tensor, (crow, torch.tensor([0, 3, -1]), v3, (3, 4)),
                             r"level 1 .*crd\[2\] = -1 is out of range"),
        "csr unsorted cols": (scorch.sparse_csr_tensor, (crow, torch.tensor([3, 0, 1]), v3, (3, 4)),
                              r"level 1 .*not strictly increasing at stored entry 1 \(0 after 3\)"),
        "csr repeated col": (scorch.sparse_csr_tensor, (crow, torch.tensor([2, 2, 1]), v3, (3, 4)),
                             r"level 1 .*not strictly increasing at stored entry 1"),
        "csr crow decreasing": (scorch.sparse_csr_tensor, (torch.tensor([0, 2, 1, 3]), col, v3, (3, 4)),
                                r"level 1 .*pos decreases at pos\[2\] \(1 after 2\)"),
        "csr crow not from 0": (scorch.sparse_csr_tensor, (torch.tensor([1, 2, 2, 3]), col, v3, (3, 4)),
                                r"level 1 .*pos\[0\] = 1, expected 0"),
        "csr crow too long": (scorch.sparse_csr_tensor, (torch.tensor([0, 2, 2, 3, 3]), col, v3, (3, 4)),
                              r"level 1 .*pos has 5 entries, expected 4"),
        "csr crow end != nnz": (scorch.sparse_csr_tensor, (torch.tensor([0, 1, 1, 2]), col, v3, (3, 4)),
                                r"level 1 .*pos\[-1\] = 2 but crd has 3 entries"),
        "csr col too short": (scorch.sparse_csr_tensor, (crow, torch.tensor([0, 3]), v3, (3, 4)),
                              r"level 1 .*pos\[-1\] = 3 but crd has 2 entries"),
        # CSC (4 x 3): level 1 is the compressed row level
        "csc row out of range": (scorch.sparse_csc_tensor, (crow, torch.tensor([0, 4, 1]), v3, (4, 3)),
                                 r"level 1 \(i : compressed\).*crd\[1\] = 4"),
        "csc rows unsorted": (scorch.sparse_csc_tensor, (crow, torch.tensor([3, 0, 1]), v3, (4, 3)),
                              r"level 1 \(i : compressed\).*stored entry 1"),
        # BSR (4 x 4, 2 x 2 blocks): level 1 is the compressed block-column level
        "bsr block col out of range": (scorch.sparse_bsr_tensor,
                                       (torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1]), blocks, (4, 4)),
                                       r"level 1 \(j / 2 : compressed\).*crd\[1\] = 2 is out of range \[0, 2\)"),
        "bsr block cols unsorted": (scorch.sparse_bsr_tensor,
                                    (torch.tensor([0, 2, 3]), torch.tensor([1, 0, 1]), blocks, (4, 4)),
                                    r"level 1 .*stored entry 1 \(0 after 1\)"),
        "bsc block row out of range": (scorch.sparse_bsc_tensor,
                                       (torch.tensor([0, 2, 3]), torch.tensor([0, 5, 1]), blocks, (4, 4)),
                                       r"level 1 \(i / 2 : compressed\).*crd\[1\] = 5"),
        # COO (3 x 4), uncoalesced: level 0 rows, level 1 columns
        "coo col out of range": (scorch.sparse_coo_tensor,
                                 (torch.tensor([[0, 1, 2], [0, 4, 1]]), v3, (3, 4)),
                                 r"level 1 .*crd\[1\] = 4 is out of range \[0, 4\)"),
        "coo row out of range": (scorch.sparse_coo_tensor,
                                 (torch.tensor([[0, 3, 2], [0, 1, 1]]), v3, (3, 4)),
                                 r"level 0 .*crd\[1\] = 3 is out of range \[0, 3\)"),
        "coo said coalesced, unsorted": (scorch.sparse_coo_tensor,
                                         (torch.tensor([[1, 0, 2], [0, 1, 1]]), v3, (3, 4)),
                                         r"level 0 .*decreasing at stored entry 1 \(0 after 1\)",
                                         dict(is_coalesced=True)),
        "coo said coalesced, duplicate": (scorch.sparse_coo_tensor,
                                          (torch.tensor([[0, 0, 2], [1, 1, 1]]), v3, (3, 4)),
                                          r"level 1 .*not strictly increasing at stored entry 1",
                                          dict(is_coalesced=True)),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("name", list(BAD))
def test_constructors_reject_bad_arrays_naming_level_and_position(name):
    ctor, args, pattern, *kw = BAD[name]
    with pytest.raises(ValueError, match=pattern):
        ctor(*args, **(kw[0] if kw else {}))


@pytest.mark.parametrize("name", list(BAD))
def test_constructors_skip_validation_when_told(name):
    """check_invariants=False builds the tensor as given: the check above is the constructor's, not torch's."""
    ctor, args, pattern, *kw = BAD[name]
    S = ctor(*args, check_invariants=False, **(kw[0] if kw else {}))
    with pytest.raises(ValueError, match=pattern):
        S.check_invariants()


@pytest.mark.parametrize("ctor, args", [
    (scorch.sparse_csr_tensor, (torch.tensor([0, 2, 2, 3]), torch.tensor([0, 3, 1]), torch.tensor([1., 2.]), (3, 4))),
    (scorch.sparse_csr_tensor, (torch.tensor([0, 2, 2, 3]), torch.tensor([0, 3, 1]), torch.ones(4), (3, 4))),
    (scorch.sparse_csc_tensor, (torch.tensor([0, 2, 2, 3]), torch.tensor([0, 3, 1]), torch.ones(2), (4, 3))),
    (scorch.sparse_bsr_tensor, (torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1]), torch.ones(2, 2, 2), (4, 4))),
], ids=["csr short values", "csr long values", "csc short values", "bsr missing block"])
def test_constructors_reject_wrong_number_of_values(ctor, args):
    with pytest.raises(ValueError, match=r"values has shape .*expected \("):
        ctor(*args)


def test_coo_constructor_rejects_indices_values_length_mismatch_with_value_error():
    """Wrong lengths are bad input like the others: the constructor raises ValueError (torch's own check
    raises RuntimeError)."""
    with pytest.raises(ValueError):
        scorch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [0, 1, 1]]), torch.tensor([1., 2.]), (3, 4))


# --- batched and hybrid torch tensors -------------------------------------------------------------------------------
def _batched_and_hybrid():
    x = _matrix((4, 6), seed=7)
    x3 = torch.stack([x, 2 * x])  # the same pattern in every batch, as torch's batched layouts need
    return {
        "batched csr": x3.to_sparse_csr(),
        "batched csc": x3.to_sparse_csc(),
        "batched bsr": x3.to_sparse_bsr((2, 2)),
        "batched bsc": x3.to_sparse_bsc((2, 2)),
        "hybrid csr": x3.to_sparse_csr(dense_dim=1),
        "hybrid bsr": x3.permute(1, 2, 0).contiguous().to_sparse_bsr((2, 2), dense_dim=1),
        "hybrid coo": x3.to_sparse(sparse_dim=2),
        "hybrid coo 1": x3.to_sparse(sparse_dim=1),
    }


BATCHED_AND_HYBRID = ["batched csr", "batched csc", "batched bsr", "batched bsc", "hybrid csr", "hybrid bsr"]


@pytest.mark.parametrize("name", ["hybrid coo", "hybrid coo 1"])
@pytest.mark.parametrize("coalesced", [True, False])
def test_hybrid_coo_from_torch_and_back(name, coalesced):
    """Hybrid COO (dense trailing dimensions) is COO with dense levels under the sparse ones: from_torch shares the
    indices and values, to_torch gives the same hybrid layout back, ops and conversions see the dense tensor."""
    t = _batched_and_hybrid()[name]
    if not coalesced:
        t = torch.sparse_coo_tensor(t._indices().flip(1), t._values().flip(0), t.shape)
    x = t.to_dense()
    S = scorch.from_torch(t)
    assert S.values().data_ptr() == t._values().data_ptr()
    assert_matches_dense(S, x)
    back = S.to_torch()
    assert back.layout == torch.sparse_coo and back.dense_dim() == t.dense_dim() and back.is_coalesced() == coalesced
    assert torch.equal(back.to_dense(), x)
    for fmt in ("csf", "coo", S.format):
        assert_matches_dense(scorch.asformat(S, fmt), x)
        assert_matches_dense(scorch.asformat(x, S.format, check=True), x)
    assert_matches_dense(scorch.asformat(scorch.asformat(x, "csf"), S.format), x)
    assert_matches_dense(torch.einsum("ijk,k->ij", S, torch.ones(x.shape[2])), x.sum(-1))
    assert_matches_dense(S * 2, 2 * x)


@pytest.mark.parametrize("name", BATCHED_AND_HYBRID)
def test_batched_and_hybrid_torch_tensors_are_not_implemented(name):
    t = _batched_and_hybrid()[name]
    assert t.dense_dim() > 0 or t.dim() > 2 and t.layout != torch.sparse_coo
    with pytest.raises(NotImplementedError):
        scorch.from_torch(t)
    with pytest.raises(NotImplementedError):
        scorch.asformat(t, "dense" if t.dim() != 2 else "csr")


def test_batched_constructor_arrays_are_not_implemented():
    crow = torch.tensor([[0, 1, 2], [0, 1, 2]])
    col = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(NotImplementedError):
        scorch.sparse_csr_tensor(crow, col, torch.ones(2, 2), (2, 2, 2))


# --- check=True and check_invariants() ------------------------------------------------------------------------------
def _bad_csr_arrays():
    """CSR arrays of a 3 x 4 matrix with unsorted columns in row 0 (level 1, stored entry 1)."""
    return [None, {"pos": torch.tensor([0, 2, 2, 3]), "crd": torch.tensor([3, 0, 1])}], torch.tensor([1., 2., 3.])


BAD_CSR = r"level 1 \(j : compressed\).*not strictly increasing at stored entry 1"


def _bad_csr():
    levels, vals = _bad_csr_arrays()
    return scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)


def test_sparse_tensor_validates_by_default():
    levels, vals = _bad_csr_arrays()
    with pytest.raises(ValueError, match=BAD_CSR):
        scorch.SparseTensor("csr", (3, 4), levels, vals)
    good = scorch.SparseTensor("csr", (3, 4), [None, {"pos": torch.tensor([0, 2, 2, 3]),
                                                      "crd": torch.tensor([0, 3, 1])}], vals)
    assert torch.equal(good.to_dense(), torch.tensor([[1., 0, 0, 2], [0, 0, 0, 0], [0, 3, 0, 0]]))


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "dense", "ell"])
def test_asformat_check_true_validates_the_source(fmt):
    S = _bad_csr()  # check=False: built without complaint
    with pytest.raises(ValueError, match=BAD_CSR):
        S.check_invariants()
    with pytest.raises(ValueError, match=BAD_CSR):
        scorch.asformat(S, fmt, check=True)


def test_asformat_without_check_returns_unchecked_source_as_is():
    S = _bad_csr()
    assert scorch.asformat(S, "csr") is S


def test_asformat_check_true_validates_torch_sources():
    t = torch.sparse_csr_tensor(torch.tensor([0, 2, 2, 3]), torch.tensor([3, 0, 1]), torch.tensor([1., 2., 3.]),
                                (3, 4), check_invariants=False)
    assert isinstance(scorch.from_torch(t), scorch.SparseTensor)  # unchecked by default
    with pytest.raises(ValueError, match=BAD_CSR):
        scorch.asformat(t, "csr", check=True)
    with pytest.raises(ValueError, match=BAD_CSR):
        scorch.from_torch(t, check=True)


def test_check_invariants_context_validates_unchecked_construction():
    levels, vals = _bad_csr_arrays()
    scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)  # outside: no check
    with scorch.sparse.check_invariants():
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.sparse_csr_tensor(levels[1]["pos"], levels[1]["crd"], vals, (3, 4), check_invariants=False)
        t = torch.sparse_csr_tensor(levels[1]["pos"], levels[1]["crd"], vals, (3, 4), check_invariants=False)
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.from_torch(t)
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.asformat(t, "coo")
    # and off again afterwards
    S = scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)
    T = scorch.sparse_csr_tensor(levels[1]["pos"], levels[1]["crd"], vals, (3, 4), check_invariants=False)
    assert T.nnz == 3
    assert scorch.asformat(S, "csr") is S


@pytest.mark.parametrize("fmt", ["csr", "coo", "dense"])
def test_check_invariants_context_makes_asformat_validate_its_source(fmt):
    S = _bad_csr()  # built (unchecked) before the context
    with scorch.sparse.check_invariants():
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.asformat(S, fmt)


def test_check_invariants_context_catches_bad_values_length():
    good = scorch.asformat(_matrix(), "csr")
    good.with_values(torch.ones(good.nnz + 1))  # unchecked outside the context
    with scorch.sparse.check_invariants():
        with pytest.raises(ValueError, match="values has shape"):
            good.with_values(torch.ones(good.nnz + 1))
        assert torch.equal(good.with_values(good.values() * 2).to_dense(), 2 * _matrix())


def test_check_invariants_context_nests_and_survives_exceptions():
    levels, vals = _bad_csr_arrays()
    with scorch.sparse.check_invariants():
        with scorch.sparse.check_invariants():
            pass
        # still inside the outer context
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)
    with pytest.raises(RuntimeError, match="boom"):
        with scorch.sparse.check_invariants():
            raise RuntimeError("boom")
    scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)  # the raise left it switched off


def test_check_invariants_context_is_per_thread():
    levels, vals = _bad_csr_arrays()
    errors = []

    def build():
        try:
            scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with scorch.sparse.check_invariants():
        th = threading.Thread(target=build)
        th.start()
        th.join()
        with pytest.raises(ValueError, match=BAD_CSR):
            scorch.SparseTensor("csr", (3, 4), levels, vals, check=False)
    assert errors == []


# --- argument errors ------------------------------------------------------------------------------------------------
def test_asformat_argument_errors():
    with pytest.raises(ValueError, match="0-d"):
        scorch.asformat(torch.tensor(3.), "dense")
    with pytest.raises(ValueError, match="index_dtype"):
        scorch.asformat(_matrix(), "csr", index_dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot hold"):  # int8 only where every position and coordinate fits
        scorch.asformat(torch.ones(20, 20), "csr", index_dtype=torch.int8)
    with pytest.raises(ValueError):
        scorch.asformat(_matrix((3, 4, 5)), "csr")  # a 2-d format for a 3-d tensor


# --- the torch-signature constructors, with every torch argument --------------------------------------------------

_IDX = [[0, 1, 1], [2, 0, 2]]
CONSTRUCTOR_CASES = {
    "coo size only": ("sparse_coo_tensor", (), dict(size=(2, 3))),
    "coo size positional": ("sparse_coo_tensor", ((2, 3),), {}),
    "coo size only float64": ("sparse_coo_tensor", (), dict(size=(2, 3), dtype=torch.float64)),
    "coo lists, size inferred": ("sparse_coo_tensor", (_IDX, [1, 2, 3]), {}),
    "coo int to float64, grad": ("sparse_coo_tensor", (_IDX, [1, 2, 3], (2, 4)),
                                 dict(dtype=torch.float64, requires_grad=True)),
    "coo all keywords": ("sparse_coo_tensor", (torch.tensor(_IDX), torch.tensor([1., 2, 3])),
                         dict(size=(3, 3), dtype=torch.float32, device="cpu", pin_memory=False, requires_grad=False,
                              check_invariants=True, is_coalesced=True)),
    "coo unchecked": ("sparse_coo_tensor", (torch.tensor(_IDX), torch.tensor([1., 2, 3]), (2, 3)),
                      dict(check_invariants=False)),
    "coo empty": ("sparse_coo_tensor", (torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (2, 3)), {}),
    "coo hybrid": ("sparse_coo_tensor", (torch.tensor([[0, 2]]), torch.arange(6.).reshape(2, 3)), {}),
    "coo hybrid 3-d": ("sparse_coo_tensor", (torch.tensor(_IDX), torch.arange(6.).reshape(3, 2), (2, 3, 2)),
                       dict(dtype=torch.float64, is_coalesced=True)),
    "csr size inferred": ("sparse_csr_tensor", ([0, 1, 3], [1, 0, 2], [1., 2, 3]), {}),
    "csr all keywords": ("sparse_csr_tensor", (torch.tensor([0, 1, 3], dtype=torch.int32),
                                               torch.tensor([1, 0, 2], dtype=torch.int32), torch.tensor([1, 2, 3])),
                         dict(size=(2, 4), dtype=torch.float64, device="cpu", pin_memory=False, requires_grad=True,
                              check_invariants=True)),
    "csc": ("sparse_csc_tensor", ([0, 2, 2, 3], [0, 1, 1], [1., 2, 3], (2, 3)), dict(dtype=torch.float64)),
    "bsr": ("sparse_bsr_tensor", ([0, 1, 1], [1], torch.arange(4.).reshape(1, 2, 2), (4, 4)),
            dict(pin_memory=False)),
    "bsc": ("sparse_bsc_tensor", ([0, 1], [1], torch.arange(4.).reshape(1, 2, 2)), dict(requires_grad=True)),
}
for _layout in ("csr", "csc", "bsr", "bsc"):
    _name, _args, _kw = CONSTRUCTOR_CASES["csc" if _layout == "csc" else _layout if _layout != "csr" else
                                          "csr size inferred"]
    CONSTRUCTOR_CASES[f"compressed {_layout}"] = ("sparse_compressed_tensor", _args,
                                                  dict(_kw, layout=getattr(torch, f"sparse_{_layout}")))


@pytest.mark.parametrize("case", list(CONSTRUCTOR_CASES))
def test_constructors_take_every_torch_argument(case):
    """``scorch.sparse_coo_tensor(size=(2, 3))`` raised TypeError, as did pin_memory, hybrid values and
    sparse_compressed_tensor; each now gives what torch gives (shape, dtype, values, requires_grad)."""
    name, args, kwargs = CONSTRUCTOR_CASES[case]
    expected = getattr(torch, name)(*args, **kwargs)
    got = getattr(scorch.interop, name)(*args, **kwargs)
    assert isinstance(got, scorch.SparseTensor)
    assert got.shape == expected.shape and got.requires_grad == expected.requires_grad
    assert_matches_dense(got.detach(), expected.detach().to_dense())
    assert got.layout == expected.layout
    if name == "sparse_coo_tensor" and "size" not in kwargs and len(args) > 1:
        assert got.to_torch().dense_dim() == expected.dense_dim()
    if got.requires_grad:  # gradients reach the stored values
        got.to_dense().sum().backward()
        assert torch.equal(got.grad.values(), torch.ones_like(got.values()))


def test_constructor_errors():
    with pytest.raises(TypeError, match="indices and values, or a size"):
        scorch.sparse_coo_tensor()
    with pytest.raises(ValueError, match="level 1"):
        scorch.sparse_csr_tensor([0, 2, 1], [0, 1], [1., 2], (2, 2))  # pos decreases
    with pytest.raises(NotImplementedError, match="hybrid"):
        scorch.sparse_csr_tensor([0, 1], [0], torch.ones(1, 3), (1, 2))  # hybrid CSR
    with pytest.raises(ValueError):
        scorch.interop.sparse_compressed_tensor([0, 1], [0], [1.], (1, 2))  # no layout


@pytest.mark.parametrize("name,compressed,plain", [("sparse_csr_tensor", "crow_indices", "col_indices"),
                                                   ("sparse_csc_tensor", "ccol_indices", "row_indices")])
def test_compressed_constructors_take_torchs_keyword_names(name, compressed, plain):
    """``scorch.sparse_csr_tensor(crow_indices=..., col_indices=..., values=..., size=...)`` as torch's (PyG
    calls it so; keywords raised TypeError); unknown keywords and missing arrays raise TypeError."""
    ptr, idx, vals = torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.tensor([1., 2.])
    want = getattr(torch, name)(ptr, idx, vals, (2, 2)).to_dense()
    ctor = getattr(scorch, name)
    assert_matches_dense(ctor(**{compressed: ptr, plain: idx, "values": vals, "size": (2, 2)}), want)
    assert_matches_dense(ctor(ptr, idx, values=vals, size=(2, 2)), want)
    assert_matches_dense(ctor(ptr, idx, vals, (2, 2)), want)
    with pytest.raises(TypeError):
        ctor(ptr, idx)
    with pytest.raises(TypeError):
        ctor(ptr, idx, vals, bogus=1)


@pytest.mark.parametrize("case", ["column out of range", "values too short", "crow decreasing", "crow too long"])
def test_from_torch_checks_what_keeps_kernels_in_bounds(case):
    """torch's constructors check nothing by default: an out-of-range column reached a kernel and crashed the
    process (a segfault), short values were read past their end. ``from_torch`` checks lengths, positions and
    coordinate ranges (not order: ``check=True`` for that)."""
    import warnings
    crow, col, vals = torch.tensor([0, 2, 3, 4]), torch.tensor([0, 1, 1, 2]), torch.tensor([1.0, 2, 3, 4])
    if case == "column out of range":
        col = torch.tensor([0, 10 ** 8, 1, 2])
    elif case == "values too short":
        vals = vals[:2]
    elif case == "crow decreasing":
        crow = torch.tensor([0, 3, 1, 4])
    else:
        crow = torch.tensor([0, 2, 3, 4, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t = torch.sparse_csr_tensor(crow, col, vals, (3, 3))
        except RuntimeError:
            pytest.skip("torch refused these arrays itself")
        with pytest.raises(ValueError, match="level 1|values has shape"):
            scorch.from_torch(t) @ torch.ones(3, 2)
        with pytest.raises(ValueError, match="level 1|values has shape"):
            scorch.asformat(t, "csr")


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr"])
def test_from_torch_sorts_and_sums_indices_within_a_row(layout):
    """torch's constructors accept unsorted and repeated column indices in a row (their invariants are checked only
    on request); scorch's kernels assume sorted unique rows: ``S + E`` read an unsorted row wrongly ([[2, 8]] for
    [[7, 8]]) and ``to_dense`` kept one of two repeats where torch sums them. They are sorted and summed, warned."""
    import warnings
    crow, val = torch.tensor([0, 2, 3]), torch.tensor([1.0, 2.0, 3.0])
    e = torch.tensor([[5.0, 7.0], [0.0, 1.0]])
    for col in ([1, 0, 0], [1, 1, 0]):
        if layout == "bsr":
            t = torch.sparse_bsr_tensor(torch.tensor([0, 2]), torch.tensor(col[:2]),
                                        torch.arange(8.0).reshape(2, 2, 2), (2, 4))
        else:
            make = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
            t = make(crow, torch.tensor(col), val, (2, 2))
        with pytest.warns(UserWarning, match="unsorted or repeated"):
            s = scorch.from_torch(t)
        torch.testing.assert_close(s.to_dense(), t.to_dense())
        other = scorch.asformat(torch.ones_like(t.to_dense()) if layout == "bsr" else e, "csr")
        torch.testing.assert_close((s + other).to_dense(), t.to_dense() + other.to_dense())
        torch.testing.assert_close((s * other).to_dense(), t.to_dense() * other.to_dense())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scorch.from_torch(torch.sparse_csr_tensor(torch.tensor([0, 2, 2, 2]), torch.tensor([0, 1]),
                                                  torch.tensor([1.0, 2.0]), (3, 2)))
