"""``to_dense`` by a generated kernel (``scorch.engine.densify``): every format, value and index type, the edge
shapes, duplicates, padding and gradients, against the dense tensor the storage was built from."""
import pytest
import torch

import scorch
from scorch.engine import densify
from scorch.formats import storage

from conftest import assert_matches_dense

FORMATS_2D = ["coo", "csr", "csc", "dcsr", "dcsc", "ell", "dia", "bsr(2, 3)", "bsc(2, 2)", "nm(2, 4)",
              "(i, j) -> (i : compressed, j : dense)", "(i, j) -> (j : dense, i : compressed)",
              "(i, j) -> (i + j : compressed, j : dense)", "(i, j) -> (j - i : compressed, i : dense)"]
FORMATS_3D = ["csf", "coo", "(i, j, k) -> (k : dense, i : compressed, j : compressed)"]
TYPES = [(torch.float32, torch.int32), (torch.float64, torch.int64), (torch.int32, torch.int64),
         (torch.int64, torch.int32)]


def _sample(shape, density, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, shape, generator=g).to(dtype)
    x[x == 0] = 1
    return x * (torch.rand(shape, generator=g) < density)


def _nm(x):
    """Two of every four columns kept (the largest), as nm(2, 4) stores."""
    groups = x.reshape(x.shape[0], x.shape[1] // 4, 4)
    keep = groups.abs().argsort(-1, descending=True)[..., :2]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(x.shape)


def _compiled(s):
    out = densify.to_dense(s.format, s.shape, s.levels, s.values(), min_size=0)
    assert out is not None, "no kernel for this storage"
    return out


@pytest.mark.parametrize("fmt", FORMATS_2D)
@pytest.mark.parametrize("dtype, itype", TYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("shape, density", [((6, 8), 0.3), ((6, 8), 0.0), ((6, 8), 1.0), ((1, 4), 1.0),
                                            ((0, 8), 0.5), ((7, 12), 0.4)])
def test_matrices(fmt, dtype, itype, shape, density):
    if fmt == "nm(2, 4)" and shape[1] % 4:
        pytest.skip("n:m sparsity groups whole columns of 4")
    x = _sample(shape, density, dtype)
    if fmt == "nm(2, 4)":
        x = _nm(x)
    s = scorch.asformat(x, fmt, index_dtype=itype)
    assert_matches_dense(_compiled(s), x)


@pytest.mark.parametrize("fmt", FORMATS_3D)
@pytest.mark.parametrize("dtype, itype", TYPES[:2], ids=lambda t: str(t).replace("torch.", ""))
def test_three_dimensions(fmt, dtype, itype):
    x = _sample((3, 4, 5), 0.3, dtype)
    assert_matches_dense(_compiled(scorch.asformat(x, fmt, index_dtype=itype)), x)


def test_duplicates_are_summed():
    idx = torch.tensor([[0, 2, 0, 1, 0], [1, 0, 1, 3, 1]])
    vals = torch.tensor([1., 2., 3., 4., 5.])
    s = scorch.sparse_coo_tensor(idx, vals, (3, 4))  # not coalesced: (0, 1) three times
    assert s.format.keeps_duplicates
    want = torch.zeros(3, 4).index_put((idx[0], idx[1]), vals, accumulate=True)
    assert_matches_dense(_compiled(s), want)


def test_stored_zeros_and_nan():
    x = torch.tensor([[0., float("nan"), 2.], [float("inf"), 0., -1.]])
    s = scorch.asformat(x, "csr")
    s.values().zero_()[1] = float("nan")  # stored zeros, and a NaN kept where it is stored
    want = storage.to_dense(s.format, s.shape, s.levels, s.values())  # (small: the listing path)
    torch.testing.assert_close(_compiled(s), want, equal_nan=True)


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 3)", "ell"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_is_the_dense_gradient_at_the_stored_positions(fmt, dtype):
    x = _sample((6, 9), 0.4, dtype)
    s = scorch.asformat(x, fmt)
    s.requires_grad_(True)
    d = _compiled(s)
    g = torch.randn(6, 9, dtype=dtype)
    d.backward(g)
    # the same through the listing path (unpack and put, differentiable in the values): torch's gradient
    v = s.values().detach().requires_grad_(True)
    dims, vals = storage.unpack(s.format, s.shape, s.levels, v)
    torch.zeros(6, 9, dtype=dtype).index_put((dims[0], dims[1]), vals, accumulate=True).backward(g)
    torch.testing.assert_close(s.grad.values(), v.grad)
    # a padded level's padding gets no gradient
    stored = torch.zeros(6, 9, dtype=torch.bool)
    stored[dims[0], dims[1]] = True
    torch.testing.assert_close(s.grad.to_dense(), g * stored)


def test_large_storage_takes_the_kernel(monkeypatch):
    """At and above ``MIN_SIZE`` ``SparseTensor.to_dense`` runs the kernel: no listing of the entries."""
    x = _sample((256, 128), 0.5, torch.float32)
    s = scorch.asformat(x, "(i, j) -> (i : compressed, j : dense)")

    def no_listing(*args):
        raise AssertionError("to_dense listed the entries")

    monkeypatch.setattr(storage, "unpack", no_listing)
    assert_matches_dense(s.to_dense(), x)
    assert_matches_dense(scorch.asformat(x, "coo").to_dense(torch.float64), x.double())


def test_other_types_and_small_storage_list_the_entries():
    """bool values (no kernel) and storage below ``MIN_SIZE`` take the listing path, with the same result."""
    x = _sample((5, 6), 0.5, torch.float32)
    b = scorch.asformat(x != 0, "csr")
    assert densify.to_dense(b.format, b.shape, b.levels, b.values(), min_size=0) is None
    assert_matches_dense(b.to_dense(), x != 0)
    s = scorch.asformat(x, "coo")
    assert densify.to_dense(s.format, s.shape, s.levels, s.values()) is None
    assert_matches_dense(s.to_dense(), x)


@pytest.mark.parametrize("itype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("make", [
    lambda it: scorch.asformat(_sample((6, 8), 0.3, torch.float32), "coo", index_dtype=it),
    lambda it: scorch.asformat(_sample((3, 4, 5), 0.3, torch.float64), "coo", index_dtype=it),
    lambda it: scorch.asformat(torch.zeros(4, 5), "coo", index_dtype=it),
    lambda it: scorch.asformat(_sample((1, 1), 1.0, torch.int64), "coo", index_dtype=it),
    lambda it: scorch.sparse_coo_tensor(torch.tensor([[2, 0, 2], [1, 1, 1]], dtype=it), torch.tensor([1., 2., 3.]),
                                        (3, 2)),  # duplicates, not sorted
    lambda it: scorch.asformat(_sample((6, 8), 0.3, torch.float32), "csr", index_dtype=it),
    lambda it: scorch.asformat(_sample((7, 5), 0.5, torch.float64), "csc", index_dtype=it),
    lambda it: scorch.asformat(torch.zeros(0, 3), "csr", index_dtype=it),
    lambda it: scorch.asformat(_sample((4, 6), 1.0, torch.int32), "(i, j) -> (j : dense, i : compressed)",
                               index_dtype=it),
], ids=["coo-2d", "coo-3d", "empty", "one", "uncoalesced", "csr", "csc", "no-rows", "full"])
def test_unpack_of_coordinate_lists(make, itype, monkeypatch):
    """COO, CSR and CSC storage list their entries off their arrays (no walk over the levels): the same entries,
    in the same order, as the walk, a copy of the values, and gradients to the values."""
    s = make(itype)
    s.values().requires_grad_(s.dtype.is_floating_point)
    leaf, want = storage.entries(s.format, s.shape, s.levels, s.values())
    with monkeypatch.context() as m:
        m.setattr(storage, "positions", lambda *a: pytest.fail("unpack walked the levels"))
        dims, vals = storage.unpack(s.format, s.shape, s.levels, s.values())
    assert dims.dtype == torch.int64 and torch.equal(dims, want)
    assert torch.equal(vals, s.values()[leaf])
    assert vals.numel() == 0 or vals.data_ptr() != s.values().data_ptr()
    if vals.requires_grad:
        vals.sum().backward()
        assert torch.equal(s.values().grad, torch.ones_like(s.values()))


@pytest.mark.parametrize("fmt", ["csr", "coo", "dia"])
def test_nothing_stored_keeps_the_graph(fmt):
    """``to_dense`` of a tensor with no stored entries is still differentiable in its (empty) values, as torch's."""
    s = scorch.asformat(torch.zeros(3, 3), fmt).requires_grad_()
    d = s.to_dense()
    assert d.grad_fn is not None and d.requires_grad
    d.sum().backward()
    assert s.grad is not None
