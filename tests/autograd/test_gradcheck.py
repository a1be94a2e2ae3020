"""Gradients of every op family, in every format, by torch.autograd.gradcheck and gradgradcheck (float64).

A sparse operand's gradient is taken through its values. Only real entries are perturbed: padding (ELL's
repeated last coordinate, DIA's positions outside the matrix, blocks past the edge) is not an entry, and its
gradient is zero by design.
"""
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import scorch
from scorch.formats import storage

FORMATS = ["csr", "csc", "coo", "dcsr", "bsr(2, 1)", "bsc(1, 2)", "ell", "dia",
           "(i, j) -> (j - i : compressed, j : dense)"]
F64 = torch.float64


def _dense(r):
    return r.to_dense() if isinstance(r, scorch.SparseTensor) else r


def _entries(x):
    leaf, _, inside = storage.coordinates(x.format, x.shape, x.levels)
    return leaf[inside & (x.values()[leaf] != 0)]


class Sparse:
    """A sparse operand whose real entries' values are gradcheck's input."""

    def __init__(self, dense, fmt):
        self.x = scorch.asformat(dense, fmt)
        self.leaf = _entries(self.x)
        self.v = self.x.values()[self.leaf].detach().clone().requires_grad_()

    def __call__(self, v):
        vals = torch.zeros(self.x.values().shape, dtype=v.dtype).index_put((self.leaf,), v)
        return self.x.with_values(vals)


def _matrix(shape, seed, density=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g) < density)


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64, requires_grad=True)


def _cases(fmt):
    a, b = Sparse(_matrix((5, 4), 1), fmt), Sparse(_matrix((5, 4), 2), fmt)
    return {
        "S @ X": (lambda v, x: a(v) @ x, (a.v, _rand(4, 3))),
        "S.T @ G (einsum ij,ik->jk)": (lambda v, g: _dense(scorch.einsum("ij,ik->jk", a(v), g)), (a.v, _rand(5, 2))),
        "S @ v": (lambda v, x: a(v) @ x, (a.v, _rand(4))),
        "3 operands ij,jk,kl->il": (lambda v, x, y: _dense(scorch.einsum("ij,jk,kl->il", a(v), x, y)),
                                    (a.v, _rand(4, 3), _rand(3, 2, seed=1))),
        "S + S": (lambda v, w: _dense(a(v) + b(w)), (a.v, b.v)),
        "S - 2.5 S": (lambda v, w: _dense(torch.sub(a(v), b(w), alpha=2.5)), (a.v, b.v)),
        "S * S": (lambda v, w: _dense(a(v) * b(w)), (a.v, b.v)),
        "S * D": (lambda v, x: _dense(a(v) * x), (a.v, _rand(5, 4))),
        "S + D": (lambda v, x: a(v) + x, (a.v, _rand(5, 4))),
        "sum(0)": (lambda v: _dense(a(v).sum(0)), (a.v,)),
        "sum()": (lambda v: _dense(a(v).sum()), (a.v,)),
        "mean(1)": (lambda v: _dense(a(v).mean(1)), (a.v,)),
        "amax(1)": (lambda v: _dense(a(v).amax(1)), (a.v,)),
        "amin(0)": (lambda v: _dense(a(v).amin(0)), (a.v,)),
        "t()": (lambda v: _dense(a(v).t()), (a.v,)),
        "relu, tanh, neg": (lambda v: _dense(-torch.tanh(torch.relu(a(v)))), (a.v,)),
        "S * 3, S / 2": (lambda v: _dense(a(v) * 3 / 2), (a.v,)),
        "asformat('csr')": (lambda v: _dense(a(v).asformat("csr")), (a.v,)),
        "asformat('coo')": (lambda v: _dense(a(v).asformat("coo")), (a.v,)),
        "sampled_addmm": (lambda v, m1, m2: _dense(torch.sparse.sampled_addmm(a(v), m1, m2, beta=0.5, alpha=2.0)),
                          (a.v, _rand(5, 3), _rand(3, 4, seed=2))),
        "to_dense": (lambda v: a(v).to_dense(), (a.v,)),
    }


CASE_NAMES = list(_cases("csr"))
# the default run: every op in these formats, and these ops in every format; the rest of the cross is slow
CORE_FORMATS = ("csr", "coo", "bsr(2, 1)", "dia")
CORE_OPS = ("S @ X", "S + S", "S * S", "sum(0)", "amax(1)", "asformat('csr')", "sampled_addmm")


def _params():
    for fmt in FORMATS:
        for name in CASE_NAMES:
            core = fmt in CORE_FORMATS or name in CORE_OPS
            yield pytest.param(fmt, name, marks=() if core else pytest.mark.slow, id=f"{fmt}-{name}")


@pytest.mark.parametrize("fmt, name", list(_params()))
def test_gradcheck(fmt, name):
    fn, args = _cases(fmt)[name]
    assert gradcheck(fn, args)
    if fmt in ("csr", "coo") or name in CORE_OPS:  # second derivatives: the same einsums once more
        assert gradgradcheck(fn, args)


def test_dense_to_sparse_conversion_is_differentiable():
    x = _rand(4, 5)
    assert gradcheck(lambda x: scorch.asformat(x, "csr").to_dense(), (x,))


def test_repeated_and_broadcast_indices():
    s = Sparse(_matrix((5, 5), 3, 0.6), "csr")
    assert gradcheck(lambda v: _dense(scorch.einsum("ii->i", s(v))), (s.v,))
    assert gradcheck(lambda v, x: _dense(scorch.einsum("ii,i->", s(v), x)), (s.v, _rand(5)))
    d = _rand(5, 5)
    t = scorch.asformat(_matrix((5, 3), 4), "csr")
    assert gradcheck(lambda d: _dense(scorch.einsum("ii,ij->ij", d, t)), (d,))  # a diagonal gradient
    b = _rand(1, 3)
    assert gradcheck(lambda b: _dense(scorch.einsum("ij,ij->ij", t, b)), (b,))  # broadcast, summed


def test_index_only_in_the_dense_operand():
    t = scorch.asformat(_matrix((5, 3), 5), "csr")
    x = _rand(4, 7)  # 'k' and 'l' appear nowhere else: its gradient is constant along them
    assert gradcheck(lambda x: _dense(scorch.einsum("ij,kl->ij", t, x)), (x,))


def test_sparse_gradient_stays_on_the_pattern_and_shares_index_arrays():
    s = scorch.asformat(_matrix((50, 40), 6, 0.1), "csr").requires_grad_()
    x = _rand(40, 8)
    (s @ x).pow(2).sum().backward()
    assert isinstance(s.grad, scorch.SparseTensor) and s.grad.format == s.format
    assert all(a is b for a, b in zip(s.grad.levels, s.levels))  # the SDDMM wrote on s's own positions
    dense = s.detach().to_dense().requires_grad_()
    (dense @ x.detach()).pow(2).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), dense.grad * (s.detach().to_dense() != 0))


def test_no_graph_without_requires_grad_or_under_no_grad():
    s = scorch.asformat(_matrix((5, 4), 7), "csr")
    assert not (s @ torch.randn(4, 2, dtype=F64)).requires_grad
    s.requires_grad_()
    with torch.no_grad():
        assert not (s @ torch.randn(4, 2, dtype=F64)).requires_grad
    assert (s @ torch.randn(4, 2, dtype=F64)).requires_grad


def test_grad_accumulates_over_backward_calls():
    s = scorch.asformat(_matrix((5, 4), 8), "csr").requires_grad_()
    x = torch.randn(4, 2, dtype=F64)
    (s @ x).sum().backward()
    first = s.grad.values().clone()
    (s @ x).sum().backward()
    torch.testing.assert_close(s.grad.values(), 2 * first)
    s.grad = None
    assert s.grad is None and s.values().grad is None


def test_sparse_values_from_a_graph_flow_into_the_constructor():
    w = _rand(4)
    idx = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
    x = torch.randn(4, 3, dtype=F64)
    assert gradcheck(lambda w: scorch.sparse_coo_tensor(idx, w, (4, 4)) @ x, (w,))
