"""The torch API around sparse operands: layout and is_sparse, F.linear with a sparse weight or input,
torch.sparse's functions on torch's own sparse tensors, dtype promotion."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import scorch

F64 = torch.float64


def _matrix(shape, seed, density=0.5, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g) < density)).to(dtype)


@pytest.mark.parametrize("fmt, layout", [("csr", torch.sparse_csr), ("csc", torch.sparse_csc),
                                         ("coo", torch.sparse_coo), ("bsr(2, 2)", torch.sparse_bsr),
                                         ("bsc(2, 1)", torch.sparse_bsc), ("dia", torch.sparse_coo),
                                         ("dense", torch.strided)])
def test_layout_and_is_sparse(fmt, layout):
    s = scorch.asformat(_matrix((4, 4), 0), fmt)
    assert s.layout == layout
    assert s.is_sparse == (layout == torch.sparse_coo)
    assert s.is_sparse_csr == (layout == torch.sparse_csr)
    if fmt != "dia":  # DIA has no torch layout of its own
        assert s.to_torch().layout == layout


def test_a_gradient_is_not_sparse_in_torchs_sense():
    s = scorch.asformat(_matrix((4, 3), 1), "coo").requires_grad_()
    (s @ torch.ones(3, 2, dtype=F64)).sum().backward()
    assert s.is_sparse and not s.grad.is_sparse  # optimizers apply it like a dense gradient


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 1)"])
def test_linear_with_a_sparse_weight(fmt):
    w = _matrix((6, 5), 2)
    s = scorch.asformat(w, fmt)
    x = torch.randn(3, 4, 5, dtype=F64)
    b = torch.randn(6, dtype=F64)
    torch.testing.assert_close(F.linear(x, s, b), F.linear(x, w, b))
    torch.testing.assert_close(F.linear(x, s), F.linear(x, w))
    v = s.values().detach().clone().requires_grad_()
    xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
    assert gradcheck(lambda v, x, b: F.linear(x, s.with_values(v), b), (v, xg, bg))
    lin = torch.nn.Linear(5, 6).double()
    lin.weight = torch.nn.Parameter(s.clone())
    torch.testing.assert_close(lin(x), F.linear(x, w, lin.bias))


def test_linear_with_a_sparse_input():
    x = _matrix((4, 5), 3)
    s = scorch.asformat(x, "csr")
    w = torch.randn(6, 5, dtype=F64, requires_grad=True)
    torch.testing.assert_close(F.linear(s, w), F.linear(x, w))
    assert gradcheck(lambda w: F.linear(s, w), (w,))
    with pytest.raises(ValueError, match="cannot be multiplied"):
        F.linear(s, torch.randn(6, 4, dtype=F64))


def test_torch_sparse_functions_take_torchs_own_sparse_tensors():
    a = _matrix((5, 4), 4)
    x = torch.randn(4, 3, dtype=F64)
    for t in (a.to_sparse(), a.to_sparse_csr()):
        torch.testing.assert_close(scorch.sparse.mm(t, x), a @ x)
        torch.testing.assert_close(scorch.spmm(t, x), a @ x)
        r = scorch.sparse.softmax(a.to_sparse(), 1)
        assert isinstance(r, scorch.SparseTensor)
        torch.testing.assert_close(r.to_dense(), torch.sparse.softmax(a.to_sparse(), 1).to_dense())
    t = a.to_sparse().requires_grad_()  # its gradient is torch's: left to torch
    scorch.sparse.mm(t, x).sum().backward()
    assert t.grad is not None


def test_dtype_promotion_with_an_integer_one_hot():
    x = torch.randn(6, 4)
    gates = F.one_hot(torch.tensor([0, 2, 1, 2, 0, 1]), 3).to_sparse()  # int64
    s = scorch.from_torch(gates)
    y = scorch.einsum("bd,bn->bnd", x, s)
    assert y.dtype == torch.float32
    dense = torch.einsum("bd,bn->bnd", x, gates.to_dense().float())
    torch.testing.assert_close(y.to_dense() if isinstance(y, scorch.SparseTensor) else y, dense)
    torch.testing.assert_close((s * 2.5).to_dense(), gates.to_dense() * 2.5)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_lookup_as_spmm(mode):
    """A bag of indices per row is a multi-hot sparse matrix (COO: a bag may repeat an index): ``bags @ table``
    is F.embedding_bag, gradients too."""
    g = torch.Generator().manual_seed(9)
    table = torch.randn(20, 6, dtype=F64, generator=g, requires_grad=True)
    idx = torch.randint(0, 20, (15,), generator=g)
    offsets = torch.tensor([0, 3, 3, 7, 12])  # the second bag is empty
    counts = torch.diff(torch.cat([offsets, torch.tensor([15])]))
    vals = torch.ones(15, dtype=F64)
    if mode == "mean":
        vals = vals / counts.repeat_interleave(counts).to(F64)
    rows = torch.arange(5).repeat_interleave(counts)
    bags = scorch.sparse_coo_tensor(torch.stack([rows, idx]), vals, (5, 20))
    y = bags @ table
    ref_table = table.detach().clone().requires_grad_()
    ref = F.embedding_bag(idx, ref_table, offsets, mode=mode)
    torch.testing.assert_close(y, ref)
    y.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(table.grad, ref_table.grad)
