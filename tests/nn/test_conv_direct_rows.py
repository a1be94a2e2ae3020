"""The direct sparse convolution's blocks of 4 output rows (``conv_direct.ROWS``), the narrower blocks it takes where
4 rows would leave a one-vector tile (``_rows``), and its work items handed to the threads as they come free
(``Parallel("dynamic")``): values against dense torch (odd sizes, strides, padding, dilation, groups, bias, batch 1
to 8, NCHW and channels_last), at 1 and 2 threads, under forced AVX2 vectors, and gradients through the same
scheduled layers."""
import os
import subprocess
import sys

import pytest
import torch

import scorch
from scorch import loopir as L
from scorch.compiler import conv_direct as family
from scorch.compiler.codegen import cpp
from scorch.compiler.target import Target
from scorch.engine import conv_direct


def _nm_conv(cin, out, kernel, stride, pad, dil=1, groups=1, bias=False, empty=0):
    """A 2:4 conv layer, its output channels ``0 .. empty`` all zero (a block of rows with no entries)."""
    conv = torch.nn.Conv2d(cin, out, kernel, stride, pad, dil, groups, bias=bias)
    with torch.no_grad():
        conv.weight[:empty] = 0.0
    s = scorch.schedule(conv)
    s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    return conv


#: (out, cin, groups, kernel, stride, pad, dilation, batch, size, channels_last)
_CASES = [(7, 16, 1, 3, 1, 1, 1, 1, (11, 13), True),  # (7 rows: a partial last block of 4)
          (10, 8, 2, 3, 2, 1, 2, 3, (11, 13), False),
          (9, 12, 1, 3, 2, 2, 1, 8, (15, 9), True),
          (6, 8, 1, 1, 2, 0, 1, 5, (14, 14), True),
          (13, 8, 1, 3, 1, 1, 1, 8, (7, 7), True),  # (images side by side: 2 rows a block, ``_rows``)
          (5, 16, 1, 3, 1, 0, 1, 2, (5, 5), False)]


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_of_four_rows_match_dense(threads, monkeypatch):
    """Blocks of 4 rows (wherever the tile is, ``BLOCK_VECTORS`` 1), statically or dynamically split, the batch
    packed at once or image by image (``PARALLEL_BUFFER_BYTES`` at 2 threads), against dense torch on 2:4 weights,
    bias and none, a block of rows with no entries, in-place value changes seen."""
    monkeypatch.setattr(conv_direct, "ROWS", 4)
    monkeypatch.setattr(conv_direct, "BLOCK_VECTORS", 1)
    names = []
    real = conv_direct.cpp.call
    monkeypatch.setattr(conv_direct.cpp, "call", lambda kernel, loaded, args: names.append(kernel.name) or
                        real(kernel, loaded, args))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dynamic in (True, False):
            monkeypatch.setattr(conv_direct, "DYNAMIC", dynamic)
            # (at 2 threads the whole batch packed at once, or image by image)
            monkeypatch.setattr(conv_direct, "PARALLEL_BUFFER_BYTES", 64 << 20 if dynamic else 1)
            for i, (out, cin, groups, k, stride, pad, dil, batch, size, cl) in enumerate(_CASES):
                conv = _nm_conv(cin, out, k, stride, pad, dil, groups, bias=i % 2 == 0, empty=4)
                w = conv.weight.detach().to_dense()
                x = torch.randn(batch, cin, *size, generator=torch.Generator().manual_seed(i))
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                ref = torch.nn.functional.conv2d(x, w, conv.bias, stride, pad, dil, groups)
                with torch.no_grad():
                    got = conv(x)
                    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
                    assert got.is_contiguous(memory_format=torch.channels_last) == cl
                    conv.weight.values().mul_(-1)
                    torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(
                        x, -w, conv.bias, stride, pad, dil, groups), rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(before)
    direct = [n for n in names if n.startswith("scorch_conv_direct")]
    assert direct and all("_r4" in n for n in direct) and any("_dyn" in n for n in direct) and \
        any("_dyn" not in n for n in direct)


def test_gradients_of_the_same_layers_match_dense():
    """With gradients wanted the general path runs (the direct kernel has no backward): input and weight
    gradients of the layers above against dense torch on the masked weight."""
    for i, (out, cin, groups, k, stride, pad, dil, batch, size, cl) in enumerate(_CASES[:3]):
        torch.manual_seed(i)
        conv = _nm_conv(cin, out, k, stride, pad, dil, groups, bias=True)
        w = conv.weight.detach().to_dense().requires_grad_()
        x = torch.randn(batch, cin, *size, generator=torch.Generator().manual_seed(i))
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn_like(torch.nn.functional.conv2d(x, w, None, stride, pad, dil, groups))
        (conv(x1) * g).sum().backward()
        (torch.nn.functional.conv2d(x2, w, conv.bias, stride, pad, dil, groups) * g).sum().backward()
        # (float32 sums over a batch's pixels, in another order than torch's)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-3)
        mask = w.detach() != 0
        torch.testing.assert_close(conv.weight.grad.to_dense(), w.grad * mask, rtol=1e-4, atol=1e-3)


def test_rows_narrow_where_four_rows_leave_a_one_vector_tile(monkeypatch):
    """``_rows`` on AVX-512 vectors (whatever this machine has): ResNet-18's planes take blocks of 4 rows (56 x
    56, 28 x 32 and 14 x 16 grids at batch 8; 7 x 8 at batch 1), its 7 x 7 planes joined side by side (two
    images, a 7 x 16 grid: 112 pixels, one vector at 4 rows) blocks of 2; AVX2's and no vectors' tiles are
    decided by the same rule."""
    for vector_bytes, expect in ((64, [4, 4, 4, 4, 2]), (32, None), (16, None)):
        target = Target("cpu", vector_bytes=vector_bytes)
        monkeypatch.setattr(conv_direct, "_plan", lambda px, pt, bias, rows, batch, dynamic=False:
                            family.plan(target, px, "i32", bias, rows, batch, dynamic))
        shapes = [(56 * 56, 8), (28 * 32, 8), (14 * 16, 8), (7 * 8, 1), (7 * 16, 4)]
        got = [conv_direct._rows(px, b) for px, b in shapes]
        assert got == (expect or [conv_direct.NARROW_ROWS if family.plan(target, px, "i32", False, 4, b).vectors <
                                  conv_direct.BLOCK_VECTORS else 4 for px, b in shapes])
        monkeypatch.setattr(conv_direct, "ROWS", 2)
        assert [conv_direct._rows(px, b) for px, b in shapes] == [2] * len(shapes)
        monkeypatch.setattr(conv_direct, "ROWS", 4)


def test_dynamic_parallel_loop_runs_every_iteration_once():
    """``Parallel("dynamic")``: every iteration runs exactly once, chunks of 3 over a count that is not a multiple
    of 3 and over none, on 1 to 4 threads; the generated C++ hands them out through an atomic counter."""
    i = L.Var("i")
    kernel = L.Kernel("scorch_test_dynamic", (L.Param("y", "array", "f32", output=True), L.Param("n", "scalar", "i64"),
                                              L.Param("nthreads", "scalar", "i64")),
                      L.block(L.For(i, L.Const(0, "i64"), L.Var("n"), L.block(
                          L.Store("y", i, L.Const(1.0, "f32"), "add")), parallel=L.Parallel("dynamic", None, L.block(),
                                                                                           chunk=3))))
    assert "#pragma omp atomic capture" in cpp.generate(kernel)
    loaded = cpp.load(kernel)
    for n in (0, 1, 10, 301):
        for threads in (1, 2, 4):
            y = torch.zeros(n + 1)
            cpp.call(kernel, loaded, {"y": y, "n": n, "nthreads": threads})
            assert torch.equal(y, torch.cat([torch.ones(n), torch.zeros(1)]))


_AVX2 = r"""
import torch, scorch
from scorch.compiler.target import CPU
from scorch.engine import conv_direct
assert CPU.vector_bytes == 32
conv_direct.ROWS = 4
for threads in (1, 2):
    torch.set_num_threads(threads)
    for i, (out, cin, k, stride, pad, batch, size) in enumerate([
            (7, 16, 3, 1, 1, 1, (11, 13)), (9, 12, 3, 2, 2, 8, (15, 9)), (13, 8, 3, 1, 1, 8, (7, 7)),
            (6, 8, 1, 2, 0, 3, (14, 14))]):
        conv = torch.nn.Conv2d(cin, out, k, stride, pad, bias=True)
        s = scorch.schedule(conv)
        s["weight"].sparsify(scorch.nn.NM(2, 4))
        s.apply()
        w = conv.weight.detach().to_dense()
        x = torch.randn(batch, cin, *size).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, w, conv.bias, stride, pad),
                                       rtol=1e-4, atol=1e-5)
print("ok")
"""


def test_blocks_of_four_rows_under_avx2():
    """The same kernels generated for AVX2 vectors (a fresh process: the target is read once)."""
    env = dict(os.environ, SCORCH_VECTOR_BYTES="32")
    done = subprocess.run([sys.executable, "-c", _AVX2], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("strided", [False, True])
def test_strided_convs_keep_their_phases_unshifted(strided, monkeypatch):
    """A 3 x 3 conv strided along the rows keeps its 4 stride phases unshifted (``STRIDED_SHIFT`` False), not 6
    shifted planes; a 1 x 1 strided conv (as many planes either way) and stride 1 along the rows are as before;
    values against dense torch either way (2:4, stride 2 and (1, 2), padding, odd sizes, channels_last)."""
    monkeypatch.setattr(conv_direct, "_lanes", lambda: 16)
    monkeypatch.setattr(conv_direct, "STRIDED_SHIFT", strided)
    for i, (k, stride, size, shifted) in enumerate([(3, (2, 2), (28, 28), strided), (3, (1, 2), (9, 27), strided),
                                                    (1, (2, 2), (28, 28), True), (3, (2, 1), (13, 14), True)]):
        conv = _nm_conv(8, 6, k, stride, k // 2, bias=True)
        S, w = conv.weight, conv.weight.detach().to_dense()
        x = torch.randn(3, 8, *size, generator=torch.Generator().manual_seed(i)).contiguous(
            memory_format=torch.channels_last)
        pads = ((k // 2,) * 2,) * 2
        shapes = (tuple(S.shape), tuple(x.shape), stride, (1, 1), pads)
        a = conv_direct._alignment(*shapes, True, 16, conv_direct.SHIFT_SLACK, True, strided)
        assert (a > 1) == shifted, (i, a)
        with torch.no_grad():
            got = conv(x)
        torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, conv.bias, stride, k // 2), rtol=1e-4,
                                   atol=1e-5)
