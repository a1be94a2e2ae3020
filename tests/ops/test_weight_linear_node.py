"""``F.linear`` with a sparse weight the family's kernels read, recording a graph: one node (``ops.linalg._WeightLinear``)
whose forward adds the bias in the kernel's store and whose backward runs the family's kernels, against dense torch on
the masked weight: every operand's gradient alone or together (a frozen weight with a trained bias, as BitFit trains),
bias shapes the store does not take, a double backward, 16-bit values, and torch's error for values changed in place
between the forward and the backward."""
import pytest
import torch

import scorch

F = torch.nn.functional


def _weight(fmt, out=48, inp=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(out, inp, generator=g)
    if fmt == "nm(2, 4)":
        keep = dense.abs().view(out, -1, 4).argsort(-1, descending=True).argsort(-1) < 2
        dense = dense * keep.view(out, inp)
    elif fmt.startswith("bsr"):
        dense = dense * (torch.rand(out // 16, inp // 16, generator=g) < 0.5).repeat_interleave(16, 0) \
            .repeat_interleave(16, 1)
    else:
        dense = dense * (torch.rand(out, inp, generator=g) < 0.3)
    dense = dense.to(dtype)
    return dense, scorch.asformat(dense, fmt)


FORMATS = ["csr", "bsr(16, 16)", "nm(2, 4)"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wants", [(True, True, True), (True, False, False), (False, True, False),
                                   (False, False, True), (True, True, False)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_gradients_of_each_operand_match_dense(fmt, wants, tokens):
    dense, S = _weight(fmt)
    w_grad, x_grad, b_grad = wants
    W = torch.nn.Parameter(S, requires_grad=w_grad)
    Wd = dense.clone().requires_grad_(w_grad)
    x = torch.randn(3, tokens, 32)
    xd = x.clone().requires_grad_(x_grad)
    x.requires_grad_(x_grad)
    b = torch.randn(48, requires_grad=b_grad)
    bd = b.detach().clone().requires_grad_(b_grad)
    y, yd = F.linear(x, W, b), F.linear(xd, Wd, bd)
    torch.testing.assert_close(y, yd, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(yd)
    y.backward(g)
    yd.backward(g)
    if x_grad:
        torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-5)
    if b_grad:
        torch.testing.assert_close(b.grad, bd.grad, rtol=1e-4, atol=1e-5)
    if w_grad:
        on = dense != 0
        torch.testing.assert_close(W.grad.to_dense() * on, Wd.grad * on, rtol=1e-4, atol=1e-4)


def test_one_node_with_the_bias_in_the_store():
    _, S = _weight("csr")
    W, b = torch.nn.Parameter(S), torch.nn.Parameter(torch.randn(48))
    y = F.linear(torch.randn(5, 32), W, b)
    assert type(y.grad_fn).__name__ == "_WeightLinearBackward"
    assert y.is_contiguous()


def test_a_frozen_weight_with_a_trained_bias_gets_the_bias_gradient():
    """BitFit: the sparse weight frozen, the input without a graph, the bias trained (also a scalar bias, which is
    added after the product)."""
    dense, S = _weight("csr")
    x = torch.randn(6, 32)
    for b in (torch.randn(48, requires_grad=True), torch.randn((), requires_grad=True)):
        F.linear(x, S, b).square().sum().backward()
        bd = b.detach().clone().requires_grad_()
        F.linear(x, dense, bd).square().sum().backward()
        torch.testing.assert_close(b.grad, bd.grad, rtol=1e-4, atol=1e-4)


def test_double_backward_matches_dense():
    dense, S = _weight("csr")
    W = torch.nn.Parameter(S)
    Wd = dense.clone().requires_grad_()
    x = torch.randn(4, 32, requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    b = torch.randn(48)
    (gx,) = torch.autograd.grad(F.linear(x, W, b).square().sum(), x, create_graph=True)
    (gxd,) = torch.autograd.grad(F.linear(xd, Wd, b).square().sum(), xd, create_graph=True)
    torch.testing.assert_close(gx, gxd, rtol=1e-4, atol=1e-4)
    gx.sum().backward()
    gxd.sum().backward()
    on = dense != 0
    torch.testing.assert_close(W.grad.to_dense() * on, Wd.grad * on, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-4)


def test_bfloat16_values_and_bias():
    dense, S = _weight("csr", dtype=torch.bfloat16)
    W = torch.nn.Parameter(S)
    b = torch.randn(48, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    y = F.linear(x, W, b)
    ref = F.linear(x.detach().float(), dense.float(), b.detach().float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert b.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(b.grad.float(), torch.full((48,), 64.0), rtol=1e-2, atol=1e-2)


def test_values_changed_in_place_before_the_backward_is_torchs_error():
    _, S = _weight("csr")
    W = torch.nn.Parameter(S)
    y = F.linear(torch.randn(5, 32, requires_grad=True), W, torch.randn(48))
    with torch.no_grad():
        W._vals.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
