"""torch's conventions for products that a PyTorch user relies on: ``out=`` (written into, resized, refused for
another dtype or a gradient to record) and ``addmm``'s ``beta=0`` (the input's nan and inf not propagated)."""
import pytest
import torch

import scorch


def _case(seed=3):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)
    return d, scorch.asformat(d, "csr"), torch.randn(5, 3, generator=g)


@pytest.mark.parametrize("beta", [0, 0.0])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_addmm_with_beta_zero_ignores_the_input(beta, fill):
    d, s, x = _case()
    inp = torch.full((6, 3), fill)
    for _ in range(2):
        got = torch.addmm(inp, s, x, beta=beta, alpha=2)
        torch.testing.assert_close(got, torch.addmm(inp, d, x, beta=beta, alpha=2))
        assert torch.isfinite(got).all()


def test_addmm_with_beta_zero_gives_the_input_a_zero_gradient():
    d, s, x = _case()
    inp = torch.randn(6, 3, requires_grad=True)
    ref = inp.detach().clone().requires_grad_(True)
    torch.addmm(inp, s, x, beta=0).pow(2).sum().backward()
    torch.addmm(ref, d, x, beta=0).pow(2).sum().backward()
    torch.testing.assert_close(inp.grad, ref.grad)


@pytest.mark.parametrize("op", ["mm", "matmul", "addmm", "mv"])
def test_out_is_written_and_returned(op):
    d, s, x = _case()
    v = x[:, 0].contiguous()
    calls = {"mm": (lambda a, o: torch.mm(a, x, out=o), d @ x),
             "matmul": (lambda a, o: torch.matmul(a, x, out=o), d @ x),
             "addmm": (lambda a, o: torch.addmm(torch.ones(6, 3), a, x, out=o), 1 + d @ x),
             "mv": (lambda a, o: torch.mv(a, v, out=o), d @ v)}
    fn, ref = calls[op]
    for out in (torch.empty(ref.shape), torch.empty(0)):  # the right shape, and one to resize (no warning: empty)
        got = fn(s, out)
        assert got is out
        torch.testing.assert_close(out, ref)
    with pytest.warns(UserWarning, match="resized"):
        fn(s, torch.empty(2, 2))
    with pytest.raises(RuntimeError, match="dtype"):
        fn(s, torch.empty(ref.shape, dtype=torch.float64))


def test_out_refuses_a_product_that_records_a_gradient():
    d, s, x = _case()
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        torch.mm(s, x.clone().requires_grad_(True), out=torch.empty(6, 3))
    with torch.no_grad():
        out = torch.empty(6, 3)
        torch.mm(s, x.clone().requires_grad_(True), out=out)
        torch.testing.assert_close(out, d @ x)


def test_out_takes_a_dense_destination():
    """A sparse destination is refused; a sparse product is written densified into a dense one."""
    d, s, x = _case()
    with pytest.raises(TypeError, match="dense"):
        torch.mm(s, x, out=scorch.asformat(torch.zeros(6, 3), "csr"))
    for other, ref in ((s.t(), d @ d.t()), (scorch.asformat(torch.eye(5), "csr"), d)):
        out = torch.empty(ref.shape)
        torch.mm(s, other, out=out)
        torch.testing.assert_close(out, ref)
