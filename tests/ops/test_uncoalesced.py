"""Uncoalesced COO (entries that repeat a position, summed by every reading of the tensor) in the ops that take
each position's value or gradient: SDDMM's sampled operand, the gradient of the stored values (each duplicate
gets its position's gradient, as torch gives), and torch COO tensors whose values carry a graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch

IDX = torch.tensor([[0, 1, 0, 2, 0], [1, 0, 1, 3, 1]])  # (0, 1) three times


def _values(requires_grad=False):
    return torch.tensor([1., 2., 3., 4., -0.5], requires_grad=requires_grad)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_sampled_addmm_sums_the_duplicates_of_its_input(beta):
    s = scorch.sparse_coo_tensor(IDX, _values(), (3, 4))
    a, b = torch.randn(3, 2), torch.randn(2, 4)
    r = torch.sparse.sampled_addmm(s, a, b, beta=beta, alpha=2.0)
    dense = s.to_dense()
    want = torch.where(dense != 0, beta * dense + 2.0 * (a @ b), torch.zeros(()))
    torch.testing.assert_close(r.to_dense(), want)
    assert r.values().shape[0] == 3  # (one value a position)


@pytest.mark.parametrize("op", ["mm", "rmm", "mul_dense", "einsum", "t_mm", "sum_dim"])
def test_gradients_of_duplicates_are_their_positions_gradient(op):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    w = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    m = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))

    def run(ctor):
        v = _values(requires_grad=True)
        s = ctor(IDX, v, (3, 4))
        y = {"mm": lambda: s @ x, "rmm": lambda: w @ s, "mul_dense": lambda: s * m,
             "einsum": lambda: scorch.einsum("ij,jk->ik", s, x), "t_mm": lambda: s.t() @ w,
             "sum_dim": lambda: torch.sparse.sum(s, 1)}[op]()
        y = y.to_dense() if y.layout != torch.strided or isinstance(y, scorch.SparseTensor) else y
        (y * torch.arange(1., y.numel() + 1).reshape(y.shape)).sum().backward()
        return v.grad

    torch.testing.assert_close(run(scorch.sparse_coo_tensor), run(torch.sparse_coo_tensor))


@pytest.mark.parametrize("entry", ["from_torch", "asformat", "einsum", "mm"])
def test_torch_uncoalesced_coo_with_graph_keeps_it(entry):
    x = torch.randn(4, 3)
    v = _values(requires_grad=True)
    u = torch.sparse_coo_tensor(IDX, v, (3, 4))
    assert not u.is_coalesced()
    y = {"from_torch": lambda: scorch.from_torch(u) @ x, "asformat": lambda: scorch.asformat(u, "csr") @ x,
         "einsum": lambda: scorch.einsum("ij,jk->ik", u, x), "mm": lambda: scorch.mm(u, x)}[entry]()
    assert y.requires_grad
    y.sum().backward()
    v2 = _values(requires_grad=True)
    (torch.sparse_coo_tensor(IDX, v2, (3, 4)).to_dense() @ x).sum().backward()
    torch.testing.assert_close(v.grad, v2.grad)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(0, 12), st.integers(0, 2**31 - 1))
def test_sddmm_and_its_gradients_on_random_duplicates(m, n, nnz, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, m, (nnz,), generator=g), torch.randint(0, n, (nnz,), generator=g)])
    vals = torch.randn(nnz, generator=g)
    a, b = torch.randn(m, 3, generator=g, requires_grad=True), torch.randn(3, n, generator=g, requires_grad=True)
    s = scorch.sparse_coo_tensor(idx, vals, (m, n))
    r = torch.sparse.sampled_addmm(s, a, b)
    dense = torch.sparse_coo_tensor(idx, vals, (m, n)).to_dense()
    mask = torch.sparse_coo_tensor(idx, torch.ones(nnz), (m, n)).to_dense() != 0
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    want = torch.where(mask, dense + a2 @ b2, torch.zeros(()))
    torch.testing.assert_close(r.to_dense(), want.detach())
    r.to_dense().sum().backward()
    want.sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.int8])
def test_integer_and_bool_conversions_sum_duplicates_first(dtype):
    i = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 1]])
    s = scorch.sparse_coo_tensor(i, torch.tensor([0.6, 0.6, 1.0, 1.0, -1.0]), (2, 2))
    want = s.to_dense().to(dtype)
    for r in (s.to(dtype), {torch.int64: s.long, torch.int32: s.int, torch.bool: s.bool,
                            torch.int8: lambda: s.to(torch.int8)}[dtype]()):
        assert r.dtype == dtype
        assert torch.equal(r.to_dense(), want)
        assert torch.equal(r.float().to_dense(), want.float())


@pytest.mark.parametrize("name,args", [("sqrt_", ()), ("abs_", ()), ("relu_", ()), ("tanh_", ()), ("sin_", ()),
                                       ("square_", ()), ("clamp_", (0.0, 2.0)), ("mul_", (2.0,)), ("neg_", ()),
                                       ("sign_", ()), ("div_", (4.0,))])
def test_in_place_maps_sum_the_duplicates_first(name, args):
    """``S.sqrt_()`` on uncoalesced COO mapped each duplicate: sqrt(1) + sqrt(3) - ... at (0, 1), not sqrt of
    their sum. (tanh_, sin_, square_ were not in-place ops of a SparseTensor at all.)"""
    s = scorch.sparse_coo_tensor(IDX, _values().abs(), (3, 4))
    dense = s.to_dense()
    getattr(s, name)(*args)
    torch.testing.assert_close(s.to_dense(), getattr(dense, name)(*args))


def test_to_sparse_bsr_takes_an_int_blocksize():
    d = torch.arange(16.0).reshape(4, 4) * (torch.arange(16).reshape(4, 4) % 3 == 0)
    s = scorch.asformat(d, "csr")
    for blocksize in (2, (2, 2)):
        r = s.to_sparse_bsr(blocksize)
        assert r.format.name == "bsr(2, 2)" and torch.equal(r.to_dense(), d)


def test_an_uncoalesced_coo_leaf_takes_one_gradient_an_entry_as_torch():
    """``requires_grad_()`` / ``nn.Parameter`` on an uncoalesced COO: each duplicate took the entry's whole gradient
    (``S.grad.to_dense()`` twice torch's, an SGD step twice as far) and Adam's step raised on mixed patterns. The
    duplicates are summed first, as ``from_torch`` does for a torch tensor that requires grad."""
    def unc():  # (0, 2) stored twice: 1 + 1
        return torch.sparse_coo_tensor([[0, 0, 1], [2, 2, 2]], [1.0, 1.0, 3.0], (2, 4))
    w = torch.arange(8.0).reshape(2, 4)
    t = unc().requires_grad_()
    (t.to_dense() * w).sum().backward()
    s = scorch.from_torch(unc()).detach().requires_grad_()
    assert s.is_coalesced()
    (s.to_dense() * w).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), t.grad.to_dense())
    for opt in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        p = torch.nn.Parameter(scorch.from_torch(unc()))
        q = torch.nn.Parameter(unc().to_dense())
        for x, o in ((p, opt([p], lr=0.1)), (q, opt([q], lr=0.1))):
            (x @ torch.ones(4)).sum().backward()
            o.step()
        torch.testing.assert_close(p.to_dense(), q.detach() * (unc().to_dense() != 0))
