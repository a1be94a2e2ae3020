"""2-d convolutions of an n:4 weight through the rows-in-lanes kernel (``scorch.engine.conv_picks``, the implicit
product of ``scorch.compiler.weights_picks``) and through depth blocks (``compiler.weights_depth.conv_forward``,
which CPUs with 8-lane vectors take first from 40 output pixels): ``F.conv2d`` with a weight ``scorch.schedule``
pruned 2:4 (its matrix view's groups along the input channels) against dense torch on the masked weight, whatever
CPU runs the tests (each kernel is switched on for them); strides, padding, dilation, rectangular kernels,
batches, NCHW and channels_last, bias; the path taken and where it is not; gradients; the loop IR in the NumPy
interpreter."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import scorch
from conftest import lane_picks_on
from scorch.compiler import interp, weights as family, weights_depth as depth, weights_picks as picks
from scorch.compiler.codegen import cpp
from scorch.compiler.target import Target
from scorch.engine import conv_picks, weights as kernels
from scorch.ops.conv import matrix_view

F = torch.nn.functional
nn = torch.nn


@pytest.fixture
def lane_picks(monkeypatch):
    """The engine's target with the kernel on, and a list recording each convolution it runs."""
    return lane_picks_on(monkeypatch, conv_picks, "conv2d")


def _pruned(conv: nn.Conv2d, n: int = 2) -> nn.Conv2d:
    """A copy of ``conv`` whose weight ``scorch.schedule`` prunes n:4 (groups along the input channels)."""
    sparse = copy.deepcopy(conv)
    s = scorch.schedule(sparse)
    s.regex("weight").sparsify(scorch.nn.NM(n, 4))
    s.apply()
    return sparse


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c4=st.integers(1, 4), out=st.integers(1, 19), kh=st.integers(1, 3), kw=st.integers(1, 3),
       stride=st.tuples(st.integers(1, 2), st.integers(1, 2)), padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)), batch=st.integers(1, 3),
       extra=st.tuples(st.integers(3, 9), st.integers(3, 9)), n=st.integers(1, 3), bias=st.booleans(),
       channels_last=st.booleans(), blocks=st.booleans(), seed=st.integers(0, 999))
def test_conv_equals_the_dense_conv(c4, out, kh, kw, stride, padding, dilation, batch, extra, n, bias,
                                    channels_last, blocks, seed, monkeypatch):
    """(The patched target is the same for every example.) Any n:4, channels a multiple of 4, output channels not a
    whole number of vectors, outputs whose pixels are not a whole number of micro-kernels. ``blocks``: through depth
    blocks (8-lane vectors, store blocks of 6 rows and depth blocks of 2 groups: both ragged; tiles whose pixels
    span output rows and images), else the rows in lanes."""
    blocks = blocks and cpp.VECTOR_BYTES == 32  # (8 float lanes, where the renderer's vectors hold them; fewer
    # pixels then take the rows in lanes at 8 lanes only where the renderer's vectors are 8 floats)
    monkeypatch.setattr(kernels, "CPU", replace(kernels.CPU, lane_picks=not blocks or cpp.VECTOR_BYTES == 32,
                                                vector_bytes=32 if blocks else kernels.CPU.vector_bytes))
    if blocks:
        monkeypatch.setattr(depth, "DEPTH_ROWS", 6)
        monkeypatch.setattr(depth, "DEPTH_PANEL_BYTES", 2 * 4 * 48 * 4)
    else:
        monkeypatch.setattr(kernels, "_depth", lambda plan, tokens: False)
    torch.manual_seed(seed)
    conv = nn.Conv2d(4 * c4, out, (kh, kw), stride, padding, dilation, bias=bias)
    sparse = _pruned(conv, n)
    w = sparse.weight.to_dense()
    x = torch.randn(batch, 4 * c4, dilation[0] * (kh - 1) + extra[0], dilation[1] * (kw - 1) + extra[1])
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y = sparse(x)
        ref = F.conv2d(x, w, conv.bias, stride, padding, dilation)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_the_path_taken_and_where_it_is_not(lane_picks):
    """A 2:4 convolution with enough output pixels runs the kernel; groups, channels not a multiple of 4, too few
    output pixels and CSR weights do not (and give the same values)."""
    cases = [(nn.Conv2d(8, 16, 3, padding=1), (2, 8, 8, 8), True),
             (nn.Conv2d(8, 16, 3, padding=1, groups=2), (2, 8, 8, 8), False),
             (nn.Conv2d(8, 16, 3), (1, 8, 5, 5), False)]  # (9 output pixels)
    for conv, shape, taken in cases:
        lane_picks.clear()
        sparse = _pruned(conv)
        x = torch.randn(shape)
        with torch.no_grad():
            y = sparse(x)
        torch.testing.assert_close(y, F.conv2d(x, sparse.weight.to_dense(), conv.bias, conv.stride, conv.padding,
                                               conv.dilation, conv.groups), rtol=1e-4, atol=1e-4)
        assert bool(lane_picks) == taken, conv
    conv = nn.Conv2d(6, 8, 3, padding=1)  # (a 2:4 view on 6 channels groups across taps: refused)
    assert not conv_picks.serves(scorch.formats.named.resolve("nm(2, 4)", 2), torch.randn(1, 6, 8, 8), 1, 64)


def test_gradients_and_a_training_step(lane_picks):
    """The forward through the kernel, the backward through the direct gradients: the input's, the bias's and the
    stored weights' gradients equal the masked dense convolution's."""
    torch.manual_seed(3)
    conv = nn.Conv2d(8, 12, 3, stride=(1, 2), padding=1)
    sparse = _pruned(conv)
    w = sparse.weight.to_dense().detach().requires_grad_()
    b = conv.bias.detach().clone().requires_grad_()
    x1 = torch.randn(2, 8, 9, 10, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    sparse(x1).square().sum().backward()
    F.conv2d(x2, w, b, (1, 2), 1).square().sum().backward()
    assert lane_picks
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sparse.bias.grad, b.grad, rtol=1e-4, atol=1e-4)
    mask = w.detach() != 0
    torch.testing.assert_close(sparse.weight.grad.to_dense() * mask, w.grad * mask, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", [2, 8])
def test_the_loop_ir_in_the_interpreter(lanes):
    """The convolution's kernel (``forward(conv=True)``) in the NumPy interpreter, every access checked."""
    torch.manual_seed(4)
    conv = nn.Conv2d(8, 5, 3, stride=2, padding=1, bias=True)
    sparse = _pruned(conv)
    view = matrix_view(sparse.weight)
    crd = kernels._arrays(view)["crd"]
    plan = picks.planned(family.tiles(Target("cpu", vector_bytes=4 * lanes, lane_picks=True), "nm", 30, "f32",
                                      "f32", "i64", family.L.type_of(crd.dtype), (1, 1), (2, 4), True))
    x = torch.randn(2, 8, 7, 6)
    buf = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1)).contiguous()
    hp, wp, ho, wo = 9, 8, 4, 3
    taps = np.array([(i * wp + j) * 8 for i in range(3) for j in range(3)], dtype=np.int64)
    sel, vals = kernels.lane_layout(view, crd, plan.lanes)
    y = np.zeros(2 * ho * wo * 5, dtype=np.float32)
    interp.run(picks.forward(plan, conv=True), {
        "sel": sel.numpy(), "vals": vals.numpy(), "taps": taps, "bias": kernels.lane_bias(conv.bias, 5, lanes)[
            "bias"].detach().numpy(), "x": buf.reshape(-1).numpy(), "y": y, "n": 2 * ho * wo, "n_in": 72, "n_out": 5,
        "groups": 18, "chunks": 1, "row_chunk": math.ceil(5 / lanes) * lanes, "nthreads": 1, "cpg": 2,
        "pixels": ho * wo, "wo": wo, "img_stride": hp * wp * 8, "row_stride": 2 * wp * 8, "col_stride": 2 * 8})
    want = F.conv2d(x, sparse.weight.to_dense(), conv.bias, 2, 1).permute(0, 2, 3, 1).reshape(-1)
    torch.testing.assert_close(torch.from_numpy(y), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lanes", [4, 8])
def test_depth_blocks_conv_in_the_interpreter(lanes):
    """The depth blocks' convolution (``weights_depth.conv_forward``: the panel packed from the padded buffer in runs
    along output rows) in the NumPy interpreter, every access checked: a stride-2 conv whose 3-pixel rows split
    each tile into runs, two images in a tile, store and depth blocks ragged."""
    torch.manual_seed(5)
    conv = nn.Conv2d(8, 5, 3, stride=2, padding=1, bias=True)
    sparse = _pruned(conv)
    view = matrix_view(sparse.weight)
    crd = kernels._arrays(view)["crd"]
    plan = family.tiles(Target("cpu", vector_bytes=4 * lanes), "nm", 24, "f32", "f32", "i64",
                        family.L.type_of(crd.dtype), (1, 1), (2, 4), True)
    plan = depth.planned(plan, 24)
    plan = replace(plan, rows=plan.row_pass, depth=5)  # (row chunks: whole store blocks, as ``_split`` makes)
    x = torch.randn(2, 8, 7, 6)
    buf = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1)).contiguous()
    hp, wp, ho, wo = 9, 8, 4, 3
    taps = np.array([(i * wp + j) * 8 for i in range(3) for j in range(3)], dtype=np.int64)
    offsets, vals = kernels._depth_laid(view, crd, plan)
    y = np.zeros(2 * ho * wo * 5, dtype=np.float32)
    interp.run(depth.conv_forward(plan), {
        "crd": offsets.numpy(), "vals": vals.numpy(), "taps": taps, "bias": conv.bias.detach().numpy(),
        "x": buf.reshape(-1).numpy(), "y": y, "n": 2 * ho * wo, "n_in": 72, "n_out": 5, "groups": 18,
        "chunks": -(-5 // plan.rows), "row_chunk": plan.rows, "nthreads": 1, "cpg": 2, "pixels": ho * wo, "wo": wo,
        "img_stride": hp * wp * 8,
        "row_stride": 2 * wp * 8, "col_stride": 2 * 8})
    want = F.conv2d(x, sparse.weight.to_dense(), conv.bias, 2, 1).permute(0, 2, 3, 1).reshape(-1)
    torch.testing.assert_close(torch.from_numpy(y), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pads", [((0, 0), (0, 0)), ((1, 1), (1, 1)), ((2, 0), (0, 3)), ((0, 1), (3, 0))])
@pytest.mark.parametrize("cl", [True, False])
def test_the_padded_buffer_is_torchs_pad_of_the_channels_last_view(pads, cl):
    from scorch.engine.conv_picks import padded_channels_last
    x = torch.randn(2, 5, 4, 6)
    x = x.contiguous(memory_format=torch.channels_last) if cl else x
    (pt, pb), (pl, pr) = pads
    want = torch.nn.functional.pad(x.permute(0, 2, 3, 1), (0, 0, pl, pr, pt, pb))
    got = padded_channels_last(x, pads)
    assert got.is_contiguous() and torch.equal(got, want)


def test_an_eval_layer_keeps_its_kernel_call(monkeypatch):
    """Without gradients the rows-in-lanes convolution's one kernel call is kept (``weights_kept``): later calls
    with the same weight bind only the new buffer and result, see the weight changed in place, and a call that
    needs gradients keeps nothing."""
    from scorch.engine import weights_kept
    lane_picks_on(monkeypatch, conv_picks, "conv2d")
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    s = scorch.schedule(conv)
    s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    weights_kept._KEPT.clear()
    planned, real = [], conv_picks._plan
    monkeypatch.setattr(conv_picks, "_plan", lambda *a: planned.append(1) or real(*a))

    def dense(x):
        return torch.nn.functional.conv2d(x, conv.weight.to_dense(), conv.bias, 1, 1)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 8, 9, 9).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(conv(x), dense(x), rtol=1e-4, atol=1e-5)
        assert [k[0][0] for k in weights_kept._KEPT] == ["conv_picks"] and len(planned) == 1
        conv.weight._vals.mul_(-1.5)
        torch.testing.assert_close(conv(x), dense(x), rtol=1e-4, atol=1e-5)
    weights_kept._KEPT.clear()
    x.requires_grad_()
    conv(x).sum().backward()
    assert not weights_kept._KEPT
