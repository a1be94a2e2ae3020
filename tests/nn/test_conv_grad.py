"""The backward of a sparse-weight ``F.conv2d`` by the direct kernels (``scorch.engine.conv_grad``): the input gradient
(a direct convolution with the transposed, flipped weight, per stride phase) and the weight gradient (a dot product
per stored weight over the packed input), against dense torch on the masked weight, over strides, padding,
dilation, groups, batch sizes, NCHW and channels_last, CSR, 2:4 and all-zero weights; that no im2col product runs;
a double backward through the general path. (Training steps against the masked dense model: test_sparse_conv.)"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from conftest import conv_input
from scorch.engine import conv_grad
from scorch.ops import conv as conv_ops


def _weight(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)
    if shape[0] > 1:
        w[0] = 0.0  # (a row with no entries)
    return w


def _no_im2col(monkeypatch):
    """Fail where the general (im2col) path runs."""
    def refuse(*a, **k):
        raise AssertionError("the general (im2col) path ran")
    monkeypatch.setattr(conv_ops, "_general", refuse)


def _check(w, S, x, bias, stride, padding, dilation, groups, atol=1e-4):
    vals = S.values().detach().clone().requires_grad_()
    Sg = S.with_values(vals)
    xs = x.detach().clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    out = torch.nn.functional.conv2d(xs, Sg, b, stride, padding, dilation, groups)
    xd, wd = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
    bd = None if bias is None else bias.clone().requires_grad_()
    ref = torch.nn.functional.conv2d(xd, wd, bd, stride, padding, dilation, groups)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xs.grad, xd.grad, rtol=1e-4, atol=atol)
    assert xs.grad.is_contiguous(memory_format=torch.channels_last) == \
        x.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(S.with_values(vals.grad).to_dense(), wd.grad * (w != 0), rtol=1e-4, atol=atol)
    if bias is not None:
        torch.testing.assert_close(b.grad, bd.grad, rtol=1e-4, atol=atol)


@settings(max_examples=40, deadline=None)
@given(og=st.integers(1, 4), cg=st.integers(1, 4), groups=st.sampled_from([1, 2, 3]), kh=st.integers(1, 4),
       kw=st.integers(1, 4), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.integers(0, 3), st.integers(0, 3)), batch=st.integers(1, 3),
       extra=st.tuples(st.integers(0, 9), st.integers(0, 9)), bias=st.booleans(), cl=st.booleans(),
       density=st.sampled_from([0.0, 0.2, 0.6, 1.0]), seed=st.integers(0, 999))
def test_gradients_match_dense(og, cg, groups, kh, kw, stride, dilation, padding, batch, extra, bias, cl, density,
                               seed):
    out, cin = og * groups, cg * groups
    w = _weight((out, cg, kh, kw), density, seed)
    x = conv_input(batch, cin, (kh, kw), dilation, padding, extra, cl, seed + 1)
    with pytest.MonkeyPatch.context() as mp:
        _no_im2col(mp)
        _check(w, scorch.asformat(w, "coo"), x, torch.randn(out) if bias else None, stride, padding, dilation, groups)


@pytest.mark.parametrize("fmt", ["csr", "nm", "zero"])
@pytest.mark.parametrize("batch,cl", [(1, False), (8, True), (3, False)])
@pytest.mark.parametrize("stride,k,padding", [(1, 3, 1), (2, 3, 1), (2, 1, 0), (2, 7, 3)])
def test_resnet_shapes_scheduled_formats(fmt, batch, cl, stride, k, padding, monkeypatch):
    """ResNet-18's convolution shapes (at a smaller width and plane), weights scheduled as its benchmark prunes them:
    rows long enough for the weight gradient's groups of a vector's entries."""
    torch.manual_seed(stride * 10 + k)
    conv = torch.nn.Conv2d(32, 48, k, stride, padding, bias=False)
    s = scorch.schedule(conv)
    if fmt == "csr":
        s["weight"].sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr")
    elif fmt == "nm":
        s["weight"].sparsify(scorch.nn.NM(2, 4))
    else:
        s["weight"].sparsify(scorch.nn.ScalarFraction(1.0)).set_format("csr")
    s.apply()
    x = torch.randn(batch, 32, 15, 14)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    w = conv.weight.detach().to_dense()
    _no_im2col(monkeypatch)
    _check(w, conv.weight.detach(), x, None, stride, padding, 1, 1, atol=1e-3)


def test_double_backward_takes_the_general_path():
    w = _weight((6, 4, 3, 3), 0.4, 1)
    vals = scorch.asformat(w, "coo").values().clone().requires_grad_()
    S = scorch.asformat(w, "coo").with_values(vals)
    x = torch.randn(2, 4, 7, 7, requires_grad=True)
    gx, = torch.autograd.grad(torch.nn.functional.conv2d(x, S, None, 2, 1).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    wd, xd = w.clone().requires_grad_(), x.detach().clone().requires_grad_()
    gxd, = torch.autograd.grad(torch.nn.functional.conv2d(xd, wd, None, 2, 1).square().sum(), xd, create_graph=True)
    gxd.square().sum().backward()
    torch.testing.assert_close(gx, gxd, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S.with_values(vals.grad).to_dense(), wd.grad * (w != 0), rtol=1e-4, atol=1e-3)


def test_phase_weights_made_once_per_pattern_and_see_new_values():
    w = _weight((8, 4, 3, 3), 0.5, 2)
    S = scorch.asformat(w, "coo")
    vals = S.values().clone().requires_grad_()
    x = torch.randn(1, 4, 9, 9, requires_grad=True)
    conv_grad._PHASES.clear()
    for step in range(3):
        x.grad = vals.grad = None
        torch.nn.functional.conv2d(x, S.with_values(vals), None, 2, 1).sum().backward()
        xd, wd = x.detach().clone().requires_grad_(), S.with_values(vals.detach()).to_dense()
        torch.nn.functional.conv2d(xd, wd, None, 2, 1).sum().backward()
        torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            vals.mul_(-1.5)  # (an optimizer's step: the same tensor, new values)
    assert len(conv_grad._PHASES) == 1



@pytest.mark.parametrize("density", [0.1, 0.5])
def test_weight_gradient_over_several_tiles_and_channel_chunks(density):
    from scorch.compiler import conv_grad as family
    from scorch.engine import conv_direct
    w = _weight((20, 40, 3, 3), density, 5)
    x = torch.randn(2, 40, 37, 35)
    tp, tiles = family.tile(37 * 37, conv_direct._lanes())
    assert tiles > 1 and conv_direct.CHUNK_BYTES // (4 * (tp + 3 * 37)) < 40  # (several tiles and chunks)
    dy = torch.randn(2, 20, 37, 35)
    got = conv_grad.weight_grad(scorch.asformat(w, "coo"), x, dy, (1, 1), (1, 1), ((1, 1), (1, 1)), 1)
    wd = w.clone().requires_grad_()
    torch.nn.functional.conv2d(x, wd, None, 1, 1).backward(dy)
    torch.testing.assert_close(scorch.asformat(w, "coo").with_values(got).to_dense(), wd.grad * (w != 0),
                               rtol=1e-4, atol=1e-3)
