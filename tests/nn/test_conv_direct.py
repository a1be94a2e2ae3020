"""The direct sparse convolution (``scorch.engine.conv_direct``, the kernel of ``scorch.compiler.conv_direct``), which
serves ``F.conv2d`` with a sparse float32 weight (its backward: ``scorch.engine.conv_grad``): values against dense torch on the
masked weight over odd sizes, strides, padding, dilation, groups, one-pixel outputs, all-zero weight rows, bias,
every format; that it is the path taken; values changed in place; the general path kept where gradients flow."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch.engine import conv_direct, weights as kernels


def _sparse_weight(shape, density, kind, seed):
    """A dense 4-d weight with about ``density`` of its entries kept (output channel 0 all zero), and the same
    weight as a SparseTensor in the 4-d format ``kind``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)
    w[0] = 0.0
    return w, scorch.asformat(w, kind)


@settings(max_examples=60, deadline=None)
@given(og=st.integers(1, 5), cg=st.integers(1, 5), groups=st.sampled_from([1, 2, 3]), kh=st.integers(1, 4),
       kw=st.integers(1, 4), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 6)),
       padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       batch=st.integers(1, 3), extra=st.tuples(st.integers(0, 9), st.integers(0, 9)), bias=st.booleans(),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), kind=st.sampled_from(["coo", "csf"]), seed=st.integers(0, 999))
def test_direct_conv_matches_dense(og, cg, groups, kh, kw, stride, dilation, padding, batch, extra, bias, density,
                                   kind, seed):
    out, cin = og * groups, cg * groups
    w, S = _sparse_weight((out, cg, kh, kw), density, kind, seed)
    # the smallest input the dilated kernel fits in, plus ``extra``: one output pixel up to several rows
    h = max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]) + extra[0]
    wd = max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]) + extra[1]
    x = torch.randn(batch, cin, h, wd, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(out) if bias else None
    direct = conv_direct.conv2d(S, x, b, stride, dilation, [(padding[0],) * 2, (padding[1],) * 2], groups)
    ref = torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups)
    assert direct is not None and direct.shape == ref.shape
    torch.testing.assert_close(direct, ref, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), scorch.strict():
        y = torch.nn.functional.conv2d(x, S, b, stride, padding, dilation, groups)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw, dw", [(3, 2), (3, 5), (4, 3), (5, 6), (2, 17), (3, 9)])
@pytest.mark.parametrize("width", [1, 4, 9, 23])
def test_dilated_taps_farther_apart_than_the_grid_is_wide(kw, dw, width):
    """A dense weight's taps along a row, each a plane shifted by its column (``_geometry``'s shifted planes), read
    from the first plane's row moved left: where the taps lie farther apart than the grid's aligned row is wide (a
    shift past the row's end: 3 taps 6 apart onto rows of 4 or 8), every column of the plane is gathered from the
    input. (Rows of 4 or 8 with AVX2, of 8 or 16 with AVX-512: widths and dilations on either side of both.)"""
    g = torch.Generator().manual_seed(kw * 100 + dw)
    w = torch.randn(3, 2, 3, kw, generator=g)
    x = torch.randn(2, 2, 5, dw * (kw - 1) + width, generator=g)
    for padding in (0, 1):
        ref = torch.nn.functional.conv2d(x, w, None, 1, padding, (1, dw))
        got = conv_direct.conv2d(scorch.asformat(w, "coo"), x, None, (1, 1), (1, dw),
                                 [(padding, padding)] * 2, 1)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["csr", "bsr", "nm"])
def test_scheduled_formats_run_direct_in_inference(fmt, monkeypatch):
    # (2:4 runs with its rows in lanes or in depth blocks where the CPU takes them: ``engine.conv_picks``, tested
    # on its own)
    monkeypatch.setattr(kernels, "CPU", dataclasses.replace(kernels.CPU, lane_picks=False))
    monkeypatch.setattr(kernels, "_depth", lambda plan, tokens: False)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=True)
    s = scorch.schedule(conv)
    if fmt == "csr":
        s["weight"].sparsify(scorch.nn.ScalarFraction(0.9)).set_format("csr")
    elif fmt == "bsr":
        s["weight"].sparsify(scorch.nn.BlockFraction(0.5, block=(4, 4))).block(4, 4)
    else:
        s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    dense_w = conv.weight.detach().to_dense()
    calls = []
    real = conv_direct.conv2d
    monkeypatch.setattr(conv_direct, "conv2d", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(conv_direct, "kept_key", lambda *a: None)  # (every call the long way: tests/nn/test_conv_kept)
    for x in (torch.randn(2, 8, 13, 11), torch.randn(2, 8, 13, 11).to(memory_format=torch.channels_last),
              torch.randn(2, 8, 13, 22)[..., ::2], torch.randn(8, 9, 9)):
        ref = torch.nn.functional.conv2d(x, dense_w, conv.bias, 2, 1)
        with torch.no_grad():
            torch.testing.assert_close(conv(x), ref, rtol=1e-4, atol=1e-5)
        with torch.inference_mode():
            torch.testing.assert_close(conv(x), ref, rtol=1e-4, atol=1e-5)
    assert len(calls) == 8
    # with gradients wanted, the direct kernels too: the forward, and the input gradient's 4 stride phases
    x = torch.randn(1, 8, 7, 7, requires_grad=True)
    conv(x).sum().backward()
    assert len(calls) == 13
    xd, wd = x.detach().clone().requires_grad_(), dense_w.clone().requires_grad_()
    torch.nn.functional.conv2d(xd, wd, conv.bias, 2, 1).sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv.weight.grad.to_dense(), wd.grad * (dense_w != 0), rtol=1e-4, atol=1e-4)


def test_direct_sees_values_changed_in_place_and_new_patterns():
    w, S = _sparse_weight((6, 4, 3, 3), 0.3, "coo", 3)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        y1 = torch.nn.functional.conv2d(x, S, padding=1)
        torch.testing.assert_close(y1, torch.nn.functional.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-5)
        S.values().mul_(3)
        torch.testing.assert_close(torch.nn.functional.conv2d(x, S, padding=1), 3 * y1, rtol=1e-4, atol=1e-5)
        # another input size: the offsets follow the geometry
        x2 = torch.randn(2, 4, 5, 11)
        torch.testing.assert_close(torch.nn.functional.conv2d(x2, S, padding=1),
                                   torch.nn.functional.conv2d(x2, 3 * w, padding=1), rtol=1e-4, atol=1e-5)


def test_direct_declines_what_it_does_not_serve():
    w, S = _sparse_weight((4, 4, 3, 3), 0.5, "coo", 4)
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    assert conv_direct.conv2d(S.double(), x, None, (1, 1), (1, 1), [(0, 0), (0, 0)], 1) is None
    with torch.no_grad():  # (float64 runs on the general path)
        torch.testing.assert_close(torch.nn.functional.conv2d(x, S.double()),
                                   torch.nn.functional.conv2d(x, w.double()))


@pytest.mark.parametrize("chunk_bytes,lanes,rows", [(1 << 30, 1, 1), (1, 16, 1), (1 << 30, 16, 2), (1, 1, 3)])
def test_the_kernels_interpreted_give_the_compiled_result(chunk_bytes, lanes, rows, monkeypatch):
    """The loop IR of the three kernels (the input buffer's pack, the convolution, the result's unpack) run by the
    NumPy interpreter (the reference semantics), each on the previous one's interpreted output, give the compiled
    result; NCHW and channels_last; the entries in one channel chunk, planes unshifted, or in chunks of one
    channel, planes shifted per tap column (some copied from others); one output row at a time or blocks of
    ``rows`` (5 rows: the last block partial)."""
    from scorch.compiler import interp
    monkeypatch.setattr(conv_direct, "ROWS", rows)
    monkeypatch.setattr(conv_direct, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(conv_direct, "_lanes", lambda: lanes)
    monkeypatch.setattr(conv_direct, "SHIFT_SLACK", float("inf"))
    monkeypatch.setattr(conv_direct, "SHIFT_DENSITY", 0.0)
    calls = []
    real = conv_direct.cpp.call
    monkeypatch.setattr(conv_direct.cpp, "call", lambda kernel, loaded, args: calls.append((kernel, dict(args))) or
                        real(kernel, loaded, args))
    w, S = _sparse_weight((5, 3, 3, 2), 0.4, "coo", 7)
    b = torch.randn(5)
    for x in (torch.randn(2, 3, 6, 5), torch.randn(2, 3, 6, 5).to(memory_format=torch.channels_last)):
        calls.clear()
        y = conv_direct.conv2d(S, x, b, (2, 1), (1, 2), [(1, 1), (2, 2)], 1)
        torch.testing.assert_close(y, torch.nn.functional.conv2d(x, w, b, (2, 1), (1, 2), (1, 2)), rtol=1e-4,
                                   atol=1e-5)
        assert [k.name.split("_")[2] for k, _ in calls] == ["pack", "direct", "unpack"]
        # (x's and y's elements as strided in memory: the kernels index them by their strides)
        flat = {"x": x.permute(0, 2, 3, 1) if x.stride(1) == 1 else x}
        out = None
        for kernel, args in calls:
            numpy_args = {}
            for k, v in args.items():
                if not isinstance(v, torch.Tensor):
                    numpy_args[k] = v
                elif kernel.param(k).output:  # (the buffer's slack past the planes: zeros, as the caller makes it)
                    numpy_args[k] = torch.full((v.numel(),), 0.0 if k == "buf" else float("nan")).numpy()
                else:
                    numpy_args[k] = (out if out is not None and k in ("x", "grid") else
                                     flat.get(k, v).detach().reshape(-1).numpy().copy())
            interp.run(kernel, numpy_args)
            out = numpy_args[next(p.name for p in kernel.params if p.output)]
        got = torch.from_numpy(out)
        want = (y.permute(0, 2, 3, 1) if y.stride(1) == 1 else y).reshape(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_large_planes_take_the_wide_tile():
    """A plane of thousands of grid pixels takes the widest tile (a small one pads its grid by less than a vector:
    63 pixels take 4 vectors of 16 lanes with AVX-512, 8 of 8 with AVX2, 4 of 4 (the widest) with SSE)."""
    from scorch.compiler import conv_direct as family
    from scorch.compiler.target import CPU
    assert family.plan(CPU, 50 * 53, "i32", False).vectors >= min(8, family.MAX_VECTORS.get(CPU.vector_bytes, 4))
    small = family.plan(CPU, 63, "i32", False)
    assert small.vectors * small.lanes < 63 + small.lanes
    w, S = _sparse_weight((7, 5, 3, 3), 0.2, "coo", 9)
    for x in (torch.randn(2, 5, 50, 51), torch.randn(1, 5, 101, 99).to(memory_format=torch.channels_last)):
        b = torch.randn(7)
        for stride in (1, 2):
            torch.testing.assert_close(conv_direct.conv2d(S, x, b, (stride, stride), (1, 1), [(1, 1), (1, 1)], 1),
                                       torch.nn.functional.conv2d(x, w, b, stride, 1), rtol=1e-4, atol=1e-5)


_LAYOUT_CASES = [  # (out, in, groups, kernel, stride, dilation, padding, batch, size, bias, channels_last)
    (8, 12, 1, (3, 3), (1, 1), (1, 1), (1, 1), 1, (13, 13), False, True),
    (6, 8, 1, (3, 3), (2, 2), (1, 1), (1, 1), 3, (12, 13), True, False),
    (4, 8, 1, (1, 1), (2, 2), (1, 1), (0, 0), 2, (9, 9), False, True),
    (6, 8, 2, (3, 2), (1, 2), (2, 1), (2, 0), 2, (10, 9), True, True),
    (12, 12, 12, (3, 3), (1, 1), (1, 1), (1, 1), 1, (9, 20), True, False),  # (depthwise)
    (5, 7, 1, (3, 3), (1, 1), (1, 1), (0, 0), 2, (3, 3), False, True),  # (one output pixel)
    (9, 16, 1, (3, 3), (2, 1), (1, 2), (1, 2), 1, (5, 40), True, True)]


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("lanes", [1, 4, 16])
@pytest.mark.parametrize("chunk_bytes", [1, 300, 1 << 30])
def test_planes_and_channel_chunks_match_dense(lanes, chunk_bytes, rows, monkeypatch):
    """The input planes shifted per tap column (rows aligned to ``lanes``, wherever the geometry allows) or not,
    and the entries in channel chunks of one channel, of a few, or all in one: the same convolution (2:4 and 40%
    unstructured weights, all-zero output rows, NCHW and channels_last inputs, bias, groups, depthwise, strides,
    dilation, one output pixel, batch 1 and more, its images packed all at once or one by one), one output row at
    a time or in blocks of 2 or 3 rows sharing their loads (odd row counts: a partial last block), and values
    changed in place are seen."""
    monkeypatch.setattr(conv_direct, "ROWS", rows)
    monkeypatch.setattr(conv_direct, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(conv_direct, "BUFFER_BYTES", 1 if chunk_bytes == 300 else 1 << 30)
    monkeypatch.setattr(conv_direct, "_lanes", lambda: lanes)
    monkeypatch.setattr(conv_direct, "SHIFT_SLACK", float("inf"))
    monkeypatch.setattr(conv_direct, "SHIFT_DENSITY", 0.0)
    for i, (out, cin, groups, kernel, stride, dil, pad, batch, size, bias, cl) in enumerate(_LAYOUT_CASES):
        w, S = _sparse_weight((out, cin // groups) + kernel, 0.4, "coo", i)
        if (cin // groups) % 4 == 0:  # (2:4 along the input channels)
            conv = torch.nn.Conv2d(cin, out, kernel, stride, pad, dil, groups, bias=False)
            s = scorch.schedule(conv)
            s["weight"].sparsify(scorch.nn.NM(2, 4))
            s.apply()
            S = conv.weight
            w = S.detach().to_dense()
        x = torch.randn(batch, cin, *size, generator=torch.Generator().manual_seed(i))
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        b = torch.randn(out) if bias else None
        ref = torch.nn.functional.conv2d(x, w, b, stride, pad, dil, groups)
        got = conv_direct.conv2d(S, x, b, stride, dil, [(p, p) for p in pad], groups)
        assert got is not None and got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # (values changed in place are seen)
            S.values().mul_(-2)
        torch.testing.assert_close(conv_direct.conv2d(S, x, b, stride, dil, [(p, p) for p in pad], groups),
                                   torch.nn.functional.conv2d(x, -2 * w, b, stride, pad, dil, groups), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("rows", [2, 3])
def test_row_blocks_on_2_4_weights_match_dense(rows, monkeypatch):
    """Blocks of output rows sharing their input loads (``conv_direct.ROWS``): 2:4 weights (odd output counts,
    a 2:4 layer with an all-zero weight, an all-zero row block), every subset list of a block filled, with bias,
    strides, padding, dilation, groups, NCHW and channels_last, batch 1 to 5, against dense torch; small planes
    at batch > 1 take tiles of several images (the last tile's partial: zero planes past the batch)."""
    monkeypatch.setattr(conv_direct, "ROWS", rows)
    for i, (out, cin, groups, stride, pad, dil, batch, cl, zero, size) in enumerate([
            (7, 16, 1, (1, 1), (1, 1), (1, 1), 1, True, False, (11, 13)),
            (10, 8, 2, (2, 2), (1, 0), (1, 2), 3, False, False, (11, 13)),
            (5, 12, 1, (1, 2), (2, 2), (2, 1), 2, True, False, (11, 13)),
            (6, 8, 1, (1, 1), (1, 1), (1, 1), 2, False, True, (11, 13)),
            (7, 8, 1, (1, 1), (0, 0), (1, 1), 5, True, False, (5, 5))]):
        conv = torch.nn.Conv2d(cin, out, 3, stride, pad, dil, groups, bias=True)
        with torch.no_grad():
            conv.weight[1:rows + 1] = 0.0  # (a block with no entries)
            if zero:
                conv.weight.zero_()
        s = scorch.schedule(conv)
        s["weight"].sparsify(scorch.nn.NM(2, 4))
        s.apply()
        S, w = conv.weight, conv.weight.detach().to_dense()
        x = torch.randn(batch, cin, *size, generator=torch.Generator().manual_seed(i))
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        b = torch.randn(out)
        got = conv_direct.conv2d(S, x, b, stride, dil, [(p, p) for p in pad], groups)
        torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, b, stride, pad, dil, groups), rtol=1e-4,
                                   atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last) == cl


def test_small_planes_at_batch_share_a_tile():
    """A plane of a few pixels at batch > 1 takes several images a tile where blocks of rows leave room (the
    target's vectors), one image otherwise."""
    from scorch.compiler import conv_direct as family
    from scorch.compiler.target import CPU
    p = family.plan(CPU, 9, "i32", False, 2, 5)
    assert p.images == (1 if not CPU.vectors else min(5, family.MAX_VECTORS.get(CPU.vector_bytes, 8) // 2 // p.vectors))
    assert p.images > 1 or not CPU.vectors or CPU.vector_bytes < 32
    assert family.plan(CPU, 9, "i32", False, 2, 1).images == 1
    assert family.plan(CPU, 9, "i32", False, 1, 5).images == 1


def test_shared_inputs_stay_in_registers():
    """A block's input vector that several rows read is stored into a pinned workspace (``LocalArray.pinned``):
    the generated C++ keeps it in a register (an empty asm on it) instead of a memory operand per row."""
    from scorch.compiler import conv_direct as family
    from scorch.compiler.codegen import cpp
    from scorch.compiler.target import CPU
    if not CPU.vectors:
        pytest.skip("no vector target: the workspace is not held as vectors")
    source = cpp.generate(family.forward(family.plan(CPU, 1000, "i32", True, 2)))
    assert source.count('scorch_pin(xs[') == 1  # (the list of both rows only: one row reads it once)
    assert '__asm__' not in cpp.generate(family.forward(family.plan(CPU, 1000, "i32", True, 1)))


def test_workspaces_reused_across_modes_and_sizes():
    """The buffer and grid kept per thread between calls: a call in inference mode, then a larger one outside
    it, then a smaller one, each against dense torch; ``scorch.clear_caches`` empties them."""
    w, S = _sparse_weight((6, 4, 3, 3), 0.5, "coo", 3)
    for mode, size in ((torch.inference_mode, 6), (torch.no_grad, 12), (torch.no_grad, 5)):
        x = torch.randn(2, 4, size, size + 1)
        with mode():
            got = conv_direct.conv2d(S, x, None, (1, 1), (1, 1), [(1, 1), (1, 1)], 1)
        torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 1, 1), rtol=1e-4, atol=1e-5)
    assert conv_direct._workspace_size() > 0
    scorch.clear_caches()
    assert conv_direct._workspace_size() == 0


@pytest.mark.parametrize("cl", [False, True])
def test_images_side_by_side_match_dense(cl, monkeypatch):
    """Small planes at batch > 1 whose rows alone are too short for aligned planes run joined side by side, the
    row padding's zeros between them (ResNet-18's 7 x 7 layers; dilation, padding on one side, an odd batch: the
    last joint image partial), against dense torch; one image and strided rows run alone."""
    monkeypatch.setattr(conv_direct, "_lanes", lambda: 16)
    for i, (batch, size, pad, dil, stride, joined) in enumerate([
            (8, (7, 7), ((1, 1), (1, 1)), (1, 1), (1, 1), True), (5, (6, 7), ((2, 2), (2, 2)), (2, 2), (1, 1), True),
            (3, (7, 6), ((0, 1), (2, 0)), (1, 1), (2, 1), True), (1, (7, 7), ((1, 1), (1, 1)), (1, 1), (1, 1), False),
            (4, (7, 9), ((1, 1), (1, 1)), (1, 1), (1, 2), False)]):
        conv = torch.nn.Conv2d(8, 6, 3, bias=False)
        s = scorch.schedule(conv)
        s["weight"].sparsify(scorch.nn.NM(2, 4))
        s.apply()
        S, w = conv.weight, conv.weight.detach().to_dense()
        x = torch.randn(batch, 8, *size, generator=torch.Generator().manual_seed(i))
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        b = torch.randn(6)
        shapes = (tuple(S.shape), tuple(x.shape), stride, dil, pad)
        assert (conv_direct._side_by_side_count(*shapes, 16, conv_direct.SHIFT_SLACK) > 1) == joined
        got = conv_direct.conv2d(S, x, b, stride, dil, pad, 1)
        ref = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (*pad[1], *pad[0])), w, b, stride, 0, dil)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last) == cl


@pytest.mark.parametrize("half", [False, True])
def test_half_aligned_rows_match_dense(half, monkeypatch):
    """Rows of the shifted planes a multiple of half the lanes where that pads them less (``HALF_ALIGNED``):
    56 columns of 16 lanes take rows of 56 (not 64), 28 columns rows of 32 either way; 2:4 weights, stride 1 and
    2, channels_last and NCHW, batch 1 and 3, against dense torch."""
    monkeypatch.setattr(conv_direct, "_lanes", lambda: 16)
    monkeypatch.setattr(conv_direct, "HALF_ALIGNED", half)
    conv = torch.nn.Conv2d(8, 6, 3, bias=False)
    s = scorch.schedule(conv)
    s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    S, w = conv.weight, conv.weight.detach().to_dense()
    pads = ((1, 1), (1, 1))
    for i, (batch, size, stride, cl) in enumerate([(1, (9, 56), 1, True), (3, (5, 56), 1, False),
                                                   (3, (6, 28), 1, True), (1, (8, 112), 2, False)]):
        x = torch.randn(batch, 8, *size, generator=torch.Generator().manual_seed(i))
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        shapes = (tuple(S.shape), tuple(x.shape), (stride, stride), (1, 1), pads)
        a = conv_direct._alignment(*shapes, True, 16, conv_direct.SHIFT_SLACK, half)
        # (stride 2: the phases unshifted, ``STRIDED_SHIFT``, rows of 56 outputs and a column shift)
        assert conv_direct._geometry(*shapes, a)[2] == (57 if stride > 1 else 56 if half and size[1] == 56 else
                                                        -(-size[1] // 16) * 16)
        b = torch.randn(6)
        got = conv_direct.conv2d(S, x, b, (stride, stride), (1, 1), pads, 1)
        torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, b, stride, 1), rtol=1e-4, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last) == cl


def test_1x1_convs_on_whole_vector_planes_stay_unshifted(monkeypatch):
    """A 1 x 1 conv whose planes are whole vectors keeps them unshifted (its loads aligned already), one whose
    planes are not takes aligned rows; both against dense torch (2:4, stride 2, channels_last)."""
    monkeypatch.setattr(conv_direct, "_lanes", lambda: 16)
    conv = torch.nn.Conv2d(8, 6, 1, bias=False)
    s = scorch.schedule(conv)
    s["weight"].sparsify(scorch.nn.NM(2, 4))
    s.apply()
    S, w = conv.weight, conv.weight.detach().to_dense()
    for i, (size, lanes) in enumerate([((56, 56), 1), ((28, 28), 16)]):
        x = torch.randn(2, 8, *size, generator=torch.Generator().manual_seed(i)).contiguous(
            memory_format=torch.channels_last)
        shapes = (tuple(S.shape), tuple(x.shape), (2, 2), (1, 1), ((0, 0), (0, 0)))
        assert conv_direct._alignment(*shapes, True, 16, conv_direct.SHIFT_SLACK, True) == lanes
        got = conv_direct.conv2d(S, x, None, (2, 2), (1, 1), [(0, 0), (0, 0)], 1)
        torch.testing.assert_close(got, torch.nn.functional.conv2d(x, w, None, 2), rtol=1e-4, atol=1e-5)
