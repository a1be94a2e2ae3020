"""Dense operands with torch's negative bit (``is_neg()``: a view whose values read negated, as the imaginary
part of a conjugated complex tensor is; contiguous where it has one element, or through ``torch._neg_view``):
every product and elementwise op reads the values the view shows, never its storage's."""
import pytest
import torch

import scorch


def _neg(x):
    y = torch._neg_view(x)
    assert y.is_neg() and y.is_contiguous()
    return y


@pytest.fixture(autouse=True)
def _eager_products():
    with scorch.deferred.deferral("auto"):
        yield


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
def test_products_read_negative_views(fmt):
    g = torch.Generator().manual_seed(4)
    d = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)
    s = scorch.asformat(d, fmt)
    x, w, v = torch.randn(5, 3, generator=g), torch.randn(2, 6, generator=g), torch.randn(5, generator=g)
    for _ in range(3):  # (first calls, then kept calls: each must see the bit)
        torch.testing.assert_close(s @ x, d @ x)
        torch.testing.assert_close(s @ _neg(x), d @ -x)
        torch.testing.assert_close(_neg(w) @ s, -w @ d)
        torch.testing.assert_close(s @ _neg(v), d @ -v)
        torch.testing.assert_close(scorch.einsum("ij,jk->ik", s, _neg(x)), d @ -x)
        torch.testing.assert_close(torch.mm(s, _neg(x)), d @ -x)
        torch.testing.assert_close(torch.sparse.mm(s, _neg(x)), d @ -x)
        torch.testing.assert_close(torch.addmm(_neg(torch.ones(6, 3)), s, _neg(x)), -1 - d @ x)


def test_elementwise_and_sampled_products_read_negative_views():
    g = torch.Generator().manual_seed(5)
    d = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)
    s = scorch.asformat(d, "csr")
    y = torch.randn(6, 5, generator=g)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    for _ in range(3):
        torch.testing.assert_close((s * _neg(y)).to_dense(), d * -y)
        r = s + _neg(y)
        torch.testing.assert_close(r.to_dense() if isinstance(r, scorch.SparseTensor) else r, d - y)
        got = torch.sparse.sampled_addmm(s, _neg(a), _neg(b))
        torch.testing.assert_close(got.to_dense(), d + (a @ b) * (d != 0))


def test_a_one_element_imaginary_part_of_a_conjugate():
    """The public way to a contiguous negative view: the imaginary part of a conjugated 1-element tensor."""
    s = scorch.asformat(torch.tensor([[2.0], [0.0], [-1.5]]), "csr")
    z = torch.tensor([1.0 + 3.0j], dtype=torch.complex64)
    v = z.conj().imag
    assert v.is_neg() and v.is_contiguous()
    for _ in range(3):
        torch.testing.assert_close(s @ v, torch.tensor([-6.0, 0.0, 4.5]))
