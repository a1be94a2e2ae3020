"""The dense-activation x sparse-weight kernel family (``compiler.weights``, ``engine.weights``): ``F.linear`` with
a CSR, BSR or n:m weight against dense torch on the masked weight, across token counts (partial tiles, several
tiles, fewer tiles than threads), odd sizes, all-zero rows, fully dense weights, 16-bit values, index widths,
thread counts, values and gradients; and the loop IR itself run by the NumPy interpreter."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_bits, weights_grad as grads
from scorch.compiler.codegen import cpp
from scorch.compiler.target import CPU, Target
from scorch.engine import weights as kernels, weights_grad

F = torch.nn.functional
FORMATS = ("csr", "bsr(2, 2)", "bsr(4, 8)", "bsr(16, 16)", "nm(2, 4)", "nm(1, 2)")


def _weight(fmt: str, out: int, inp: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    if fmt.startswith("bsr"):
        bh, bw = scorch.formats.named.block_size(scorch.formats.named.resolve(fmt))
        keep = torch.rand(out // bh, inp // bw, generator=g) < density
        return w * keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    if fmt.startswith("nm"):
        n, m = (int(v) for v in fmt[3:-1].split(","))
        return w * scorch.nn.NM(n, m).mask(w)
    return w * (torch.rand(out, inp, generator=g) < density)


def _shape(fmt, out, inp):
    """``(out, inp)`` rounded up to what the format's blocks or groups tile."""
    if fmt.startswith("bsr"):
        bh, bw = scorch.formats.named.block_size(scorch.formats.named.resolve(fmt))
        return -(-out // bh) * bh, -(-inp // bw) * bw
    if fmt.startswith("nm"):
        m = int(fmt[3:-1].split(",")[1])
        return out, -(-inp // m) * m
    return out, inp


def _served(monkeypatch):
    """A list that records each call the family serves."""
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), out=st.integers(1, 70), inp=st.integers(1, 70), tokens=st.integers(8, 150),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linear_equals_dense_linear(fmt, out, inp, tokens, density, bias, seed):
    out, inp = _shape(fmt, out, inp)
    w = _weight(fmt, out, inp, density, seed)
    x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(out) if bias else None
    s = scorch.asformat(w, fmt)
    assert kernels.applies(s, x)
    torch.testing.assert_close(F.linear(x, s, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_family_serves_linear_and_writes_row_major(fmt, monkeypatch):
    calls = _served(monkeypatch)
    out, inp = _shape(fmt, 48, 40)
    w = _weight(fmt, out, inp, 0.3, 1)
    x = torch.randn(3, 33, inp)
    y = F.linear(x, scorch.asformat(w, fmt))
    assert calls and y.is_contiguous() and y.shape == (3, 33, out)
    torch.testing.assert_close(y, F.linear(x, w))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_widths(fmt, index_dtype):
    out, inp = _shape(fmt, 32, 24)
    w = _weight(fmt, out, inp, 0.4, 2)
    if fmt.startswith("nm"):
        s = scorch.asformat(w, fmt)  # (n:m offsets have their own narrow type)
    else:
        s = scorch.asformat(w, fmt, index_dtype=index_dtype)
    x = torch.randn(20, inp)
    torch.testing.assert_close(F.linear(x, s), F.linear(x, w))


@pytest.mark.parametrize("fmt", ["csr", "bsr(4, 4)", "nm(2, 4)"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values(fmt, dtype):
    out, inp = _shape(fmt, 64, 96)
    w = _weight(fmt, out, inp, 0.3, 3).to(dtype)
    x, b = torch.randn(40, inp).to(dtype), torch.randn(out).to(dtype)
    y = F.linear(x, scorch.asformat(w, fmt), b)
    assert y.dtype == dtype
    # the family sums in float32 and rounds once: within a 16-bit rounding of the float32 product
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_edges_all_zero_rows_dense_weight_and_empty(fmt):
    out, inp = _shape(fmt, 32, 16)
    x = torch.randn(17, inp)
    for w in (torch.zeros(out, inp), _weight(fmt, out, inp, 1.0, 4)):
        torch.testing.assert_close(F.linear(x, scorch.asformat(w, fmt), torch.ones(out)),
                                   F.linear(x, w, torch.ones(out)))
    w = _weight(fmt, out, inp, 0.5, 5)
    w[: out // 2] = 0  # (whole rows without entries)
    torch.testing.assert_close(F.linear(x, scorch.asformat(w, fmt)), F.linear(x, w))
    assert F.linear(torch.randn(0, inp), scorch.asformat(w, fmt)).shape == (0, out)


@pytest.mark.parametrize("fmt", ["csr", "bsr(16, 16)", "nm(2, 4)"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_and_row_chunks(fmt, threads):
    """Few token tiles split the rows into chunks (more work items than tiles): every thread count gives the
    same values."""
    out, inp = _shape(fmt, 200, 64)
    w = _weight(fmt, out, inp, 0.3, 6)
    s = scorch.asformat(w, fmt)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for tokens in (8, 16, 70, 300):
            x = torch.randn(tokens, inp)
            torch.testing.assert_close(F.linear(x, s), F.linear(x, w))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["csr", "bsr(4, 4)", "bsr(16, 16)", "bsr(2, 32)", "nm(2, 4)"])
def test_gradients_equal_the_masked_dense_layer(fmt, monkeypatch):
    """Values and gradients, by the family's kernels (forward, input gradient, weight gradient)."""
    used = []
    for part in ("input_grad", "weight_grad"):
        real = getattr(weights_grad, part)
        monkeypatch.setattr(weights_grad, part, lambda *a, _real=real, _part=part: used.append(_part) or _real(*a))
    out, inp = _shape(fmt, 40, 36)
    w = _weight(fmt, out, inp, 0.4, 7)
    x = torch.randn(2, 19, inp, requires_grad=True)
    b = torch.randn(out, requires_grad=True)
    s = scorch.asformat(w, fmt).requires_grad_()
    g = torch.randn(2, 19, out)
    F.linear(x, s, b).backward(g)
    xd, bd, wd = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xd, wd, bd).backward(g)
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, bd.grad)
    dense_grad = s.grad.to_dense() if isinstance(s.grad, scorch.SparseTensor) else s.grad
    mask = scorch.asformat(w, fmt).to_dense() != 0
    torch.testing.assert_close(dense_grad * mask, wd.grad * mask, rtol=1e-4, atol=1e-4)
    assert sorted(used) == ["input_grad", "weight_grad"]


@pytest.mark.parametrize("fmt", ["csr", "bsr(16, 16)", "nm(2, 4)"])
def test_16_bit_gradients(fmt):
    out, inp = _shape(fmt, 48, 64)
    w = _weight(fmt, out, inp, 0.4, 9).bfloat16()
    x = torch.randn(37, inp).bfloat16().requires_grad_()
    s = scorch.asformat(w, fmt).requires_grad_()
    g = torch.randn(37, out).bfloat16()
    F.linear(x, s, None).backward(g)
    xd, wd = x.detach().float().requires_grad_(), w.float().requires_grad_()
    F.linear(xd, wd).backward(g.float())
    assert x.grad.dtype == torch.bfloat16 and s.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), xd.grad, rtol=2e-2, atol=5e-2)
    mask = w.float() != 0
    dense_grad = s.grad.to_dense().float() if isinstance(s.grad, scorch.SparseTensor) else s.grad.float()
    torch.testing.assert_close(dense_grad * mask, wd.grad * mask, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("fmt", ["csr", "bsr(2, 2)", "nm(2, 4)"])
@pytest.mark.parametrize("lanes", [1, 4])
def test_the_loop_ir_runs_in_the_interpreter(fmt, lanes):
    """The kernels are loop IR: the NumPy interpreter runs the same program (forward, and the input gradient)
    to the dense product."""
    out, inp = _shape(fmt, 12, 8)
    w = _weight(fmt, out, inp, 0.5, 8)
    s = scorch.asformat(w, fmt)
    kind, block, group = kernels.kind_of(s)
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    target = Target("cpu", vector_bytes=4 * lanes)
    tokens = 7
    x, b = torch.randn(tokens, inp), torch.randn(out)
    for transposed in (False, True) if kind == "bsr" else (False,):  # (CSR / n:m: forward on the transpose)
        plan = family.tiles(target, kind, tokens, "f32", "f32", L.type_of(arrays.get("pos", arrays["crd"]).dtype)
                            if "pos" in arrays else "i64", L.type_of(arrays["crd"].dtype), block, group,
                            bias=not transposed, transposed=transposed)
        kernel = grads.backward_input(plan) if transposed else family.forward(plan)
        src = torch.randn(tokens, out) if transposed else x
        res = np.zeros((tokens, inp if transposed else out), dtype=np.float32)
        args = {"crd": arrays["crd"].numpy(), "vals": s._vals.numpy(), "n": tokens, "n_in": inp, "n_out": out,
                "groups": inp // group[1], "chunks": 1 if transposed else 2, "row_chunk": -(-out // 2 // plan.rows)
                * plan.rows if not transposed else out, "nthreads": 1,
                ("dy" if transposed else "x"): src.reshape(-1).numpy(), ("dx" if transposed else "y"): res.reshape(-1)}
        if "pos" in arrays:
            args["pos"] = arrays["pos"].numpy()
        if not transposed:
            args["bias"] = b.numpy()
        interp.run(kernel, args)
        want = src @ w if transposed else F.linear(x, w, b)
        torch.testing.assert_close(torch.from_numpy(res), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=20), tokens=st.integers(1, 40),
       seed=st.integers(0, 2 ** 16))
def test_csr_rows_read_their_weights_four_at_a_time(lengths, tokens, seed):
    """Where vectors are 8 floats, a CSR row's float32 weights are read a group of 4 at a time (``Tiles.splat``,
    ``loopir.Splat``: one load, each weight to the lanes by shuffles) and the rest one by one: rows of every length
    mod 4 give the dense product in the interpreter, and the C++ reads the groups through ``scorch_splat4``."""
    g = torch.Generator().manual_seed(seed)
    inp, out = 16, len(lengths)
    w = torch.zeros(out, inp)
    for r, k in enumerate(lengths):
        w[r, torch.randperm(inp, generator=g)[:k]] = torch.randn(k, generator=g)
    s = scorch.asformat(w, "csr")
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    plan = family.tiles(Target("cpu", vector_bytes=32), "csr", tokens, "f32", "f32",
                        L.type_of(arrays["pos"].dtype), L.type_of(arrays["crd"].dtype), bias=True)
    assert plan.splat and plan.lanes == 8
    assert not any(family.tiles(Target("cpu", vector_bytes=b), "csr", tokens, "f32", "f32", "i64", "i32").splat
                   for b in (16, 64))
    assert not family.tiles(Target("cpu", vector_bytes=32), "csr", tokens, "bf16", "f32", "i64", "i32").splat
    x, b = torch.randn(tokens, inp, generator=g), torch.randn(out, generator=g)
    res = np.zeros((tokens, out), dtype=np.float32)
    interp.run(family.forward(plan), {
        "pos": arrays["pos"].numpy(), "crd": arrays["crd"].numpy(), "vals": s._vals.numpy(), "x": x.reshape(-1).numpy(),
        "y": res.reshape(-1), "bias": b.numpy(), "n": tokens, "n_in": inp, "n_out": out, "groups": inp, "chunks": 1,
        "row_chunk": out, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(res), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", [0, 5, 8, 13, 20])
def test_a_partial_bsr_tile_multiplies_the_vectors_its_tokens_fill(tail):
    """A BSR tile of 3 vectors of 8 tokens whose last tile holds 1, 2 or 3 vectors' tokens runs that many vectors
    (``_bsr_rows``): the dense product in the interpreter, and the loop IR branches on the tile's tokens."""
    w = _weight("bsr(16, 16)", 32, 48, 0.5, 3)
    s = scorch.asformat(w, "bsr(16, 16)")
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    tokens = 24 + tail
    plan = family.tiles(Target("cpu", vector_bytes=32), "bsr", tokens, "f32", "f32", L.type_of(arrays["pos"].dtype),
                        L.type_of(arrays["crd"].dtype), (16, 16), bias=True)
    assert plan.vectors == 3 and plan.lanes == 8
    x, b = torch.randn(tokens, 48), torch.randn(32)
    res = np.zeros((tokens, 32), dtype=np.float32)
    interp.run(family.forward(plan), {
        "pos": arrays["pos"].numpy(), "crd": arrays["crd"].numpy(), "vals": s._vals.numpy(), "x": x.reshape(-1).numpy(),
        "y": res.reshape(-1), "bias": b.numpy(), "n": tokens, "n_in": 48, "n_out": 32, "groups": 48, "chunks": 1,
        "row_chunk": 32, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(res), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    narrow = [st_.cond.b for st_ in L.walk(family.forward(plan).body) if isinstance(st_, L.If) and
              st_.cond == L.binary("le", L.Var("nt"), st_.cond.b)]
    assert narrow == [L.Const(8), L.Const(16)]


@pytest.mark.skipif(cpp.VECTOR_BYTES != 32, reason="the renderer's vectors are not 8 floats")
def test_csr_weight_groups_render_as_shuffles():
    """The C++ of an 8-lane CSR plan reads each group of 4 weights through ``scorch_splat4`` (its helper included);
    one weight at a time after the last whole group."""
    plan = family.tiles(CPU, "csr", 64, "f32", "f32", "i64", "i16")
    src = cpp.generate(family.forward(plan))
    assert plan.splat and "#define SCORCH_SPLAT4" in src
    assert all(f"scorch_splat4<{u}>(&vals[" in src for u in range(4)) and "vals[p]" in src


def test_the_tile_shape_follows_the_target():
    """Wider vectors, wider tiles; a handful of tokens takes one vector; BSR shares each panel load among the
    block's rows."""
    wide, narrow = Target("cpu", vector_bytes=64), Target("cpu", vector_bytes=32)
    assert family.tiles(wide, "csr", 1024, "f32", "f32", "i32", "i32").T == 16 * family.MAX_VECTORS
    assert family.tiles(narrow, "csr", 1024, "f32", "f32", "i32", "i32").T == family.CSR_TOKENS  # (4 of 8)
    assert family.tiles(narrow, "csr", 1024, "bf16", "bf16", "i32", "i32").T == 8 * family.MAX_VECTORS
    assert family.tiles(narrow, "nm", 1024, "f32", "f32", "i32", "i32", group=(2, 4)).T == 8 * family.GROUP_VECTORS
    assert family.tiles(wide, "csr", 8, "f32", "f32", "i32", "i32").T == 16
    assert family.tiles(wide, "bsr", 1024, "f32", "f32", "i32", "i32", block=(16, 16)).row_pass == 16
    assert not family.serves(wide, "bsr", 1) and family.serves(wide, "csr", 1)


@pytest.mark.parametrize("fmt", ["csr", "nm(2, 4)", "nm(1, 4)"])
@pytest.mark.parametrize("inp", [1, 4, 37, 300])
def test_one_token_runs_row_dots(fmt, inp, monkeypatch):
    """Decode: one token is a dot product per row (``row_dots``), rows of any length (a partial last vector)."""
    monkeypatch.setitem(kernels.BITS_DENSITY, "f32", 2.0)  # (the bitmap's own tests: below)
    out, inp = _shape(fmt, 50, inp)
    w = _weight(fmt, out, inp, 0.5, 10)
    w[3] = 0
    s, x, b = scorch.asformat(w, fmt), torch.randn(1, inp), torch.randn(out)
    assert family.dots(kernels.kind_of(s)[0], "f32", 1, CPU) == (CPU.vector_bytes > 0)
    torch.testing.assert_close(F.linear(x, s, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.linear(x[0], s), F.linear(x[0], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["csr", "nm(2, 4)"])
def test_one_bfloat16_token(fmt):
    """A bfloat16 token (decode in bfloat16) runs the row dots on the token widened, rounded once."""
    out, inp = _shape(fmt, 40, 64)
    w = _weight(fmt, out, inp, 0.5, 15).bfloat16()
    x, b = torch.randn(1, inp).bfloat16(), torch.randn(out).bfloat16()
    y = F.linear(x, scorch.asformat(w, fmt), b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", ["csr", "nm(2, 4)"])
def test_row_dots_in_the_interpreter(fmt):
    out, inp = _shape(fmt, 9, 23)
    w = _weight(fmt, out, inp, 0.5, 11)
    s = scorch.asformat(w, fmt)
    kind, block, group = kernels.kind_of(s)
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    plan = family.tiles(Target("cpu", vector_bytes=16), kind, 1, "f32", "f32",
                        L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64", L.type_of(arrays["crd"].dtype),
                        block, group, bias=True)
    x, b, y = torch.randn(inp), torch.randn(out), np.zeros(out, dtype=np.float32)
    args = {"crd": arrays["crd"].numpy(), "vals": s._vals.numpy(), "bias": b.numpy(), "x": x.numpy(), "y": y,
            "n": 1, "n_in": inp, "n_out": out, "groups": inp // group[1], "chunks": 1, "row_chunk": out, "nthreads": 1}
    if "pos" in arrays:
        args["pos"] = arrays["pos"].numpy()
    interp.run(family.row_dots(plan), args)
    torch.testing.assert_close(torch.from_numpy(y), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_pair_dots_of_a_bfloat16_blocked_weight():
    """bfloat16 BSR weights with blocks of an even width multiply pairs of features (``loopir.PairDot``:
    ``vdpbf16ps`` where the CPU has AVX512-BF16, two multiply-adds otherwise); the interpreter runs the same
    program (values held as float32 arrays of bfloat16-exact numbers)."""
    w = _weight("bsr(4, 4)", 16, 12, 0.5, 12).bfloat16()
    s = scorch.asformat(w, "bsr(4, 4)")
    plan = kernels.plan_for(s, 40, False)
    assert plan.pairs == (CPU.vector_bytes > 0)
    x = torch.randn(40, 12).bfloat16()
    torch.testing.assert_close(F.linear(x, s).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    plan = family.tiles(Target("cpu", vector_bytes=16), "bsr", 5, "bf16", "bf16", "i32", "i32", (4, 4))
    assert plan.pairs
    y = np.zeros(5 * 16, dtype=np.float32)
    interp.run(family.forward(plan), {
        "pos": arrays["pos"].numpy(), "crd": arrays["crd"].numpy(), "vals": s._vals.float().numpy(),
        "x": x[:5].float().reshape(-1).numpy(), "y": y, "n": 5, "n_in": 12, "n_out": 16, "groups": 12,
        "chunks": 1, "row_chunk": 16, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(y).reshape(5, 16), F.linear(x[:5].float(), w.float()),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["csr", "bsr(2, 2)", "nm(2, 4)"])
@pytest.mark.parametrize("lanes", [1, 4])
def test_weight_gradient_loop_ir_in_the_interpreter(fmt, lanes):
    """``weight_grad`` as loop IR, rows longer than a group of ``lanes`` weights (whose dots are summed across
    lanes together) and a remainder, against the dense gradient on the pattern."""
    out, inp = _shape(fmt, 6, 40)
    w = _weight(fmt, out, inp, 0.6, 13)
    s = scorch.asformat(w, fmt)
    kind, block, group = kernels.kind_of(s)
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    plan = family.tiles(Target("cpu", vector_bytes=4 * lanes), kind, 9, "f32", "f32",
                        L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64", L.type_of(arrays["crd"].dtype),
                        block, group)
    x, dy = torch.randn(9, inp), torch.randn(9, out)
    dw = np.zeros(s._vals.numel(), dtype=np.float32)
    args = {"crd": arrays["crd"].numpy(), "x": x.reshape(-1).numpy(), "dy": dy.reshape(-1).numpy(), "dw": dw,
            "n": 9, "n_in": inp, "n_out": out, "groups": inp // group[1], "chunks": 2,
            "row_chunk": -(-out // 2 // plan.rows) * plan.rows, "nthreads": 1}
    if "pos" in arrays:
        args["pos"] = arrays["pos"].numpy()
    interp.run(grads.weight_grad(plan), args)
    got = s.with_values(torch.from_numpy(dw)).to_dense()
    torch.testing.assert_close(got, (dy.T @ x) * (s.to_dense() != 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["csr", "nm(2, 4)", "bsr(16, 16)"])
def test_gradients_of_long_rows(fmt):
    """Rows of many weights (the weight gradient's groups of a vector's lanes), several token tiles."""
    out, inp = _shape(fmt, 48, 200)
    w = _weight(fmt, out, inp, 0.5, 14)
    s = scorch.asformat(w, fmt).requires_grad_()
    x = torch.randn(150, inp)
    g = torch.randn(150, out)
    F.linear(x, s).backward(g)
    mask = scorch.asformat(w, fmt).to_dense() != 0
    torch.testing.assert_close(s.grad.to_dense() * mask, (g.T @ x) * mask, rtol=1e-4, atol=1e-3)


def test_wide_weights_keep_32_bit_coordinates():
    """An input or output width past 16-bit coordinates keeps the weight's own (int32) coordinates, forward and
    backward; the 16-bit copy serves narrower ones."""
    for out, inp in ((3, 40000), (40000, 3)):
        w = torch.zeros(out, inp)
        w[torch.arange(out) % out, (torch.arange(out) * 7919) % inp] = 1.5
        w[out - 1, inp - 1] = -2.0
        s = scorch.asformat(w, "csr").requires_grad_()
        assert kernels._arrays(s)["crd"].dtype == (torch.int32 if inp > kernels.NARROW_EXTENT else torch.int16)
        x = torch.randn(5, inp, requires_grad=True)
        y = F.linear(x, s)
        torch.testing.assert_close(y, F.linear(x.detach(), w))
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(5, out) @ w)
    s = scorch.asformat(torch.eye(8), "csr")
    assert kernels._arrays(s)["crd"].dtype == torch.int16


def _bitmap_calls(monkeypatch):
    """Every density reads the bitmap (n:4 weights too, which take ``weights_picks.decode`` where it serves);
    returns a list recording each product that did."""
    for t in ("f32", "bf16"):
        monkeypatch.setitem(kernels.BITS_DENSITY, t, 0.0)
    monkeypatch.setattr(kernels.picks, "decode_serves", lambda *args: False)
    calls, real = [], kernels._bitmap
    monkeypatch.setattr(kernels, "_bitmap", lambda w: calls.append(real(w)) or calls[-1])
    return calls


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["csr", "nm(2, 4)", "nm(1, 2)"]), out=st.integers(1, 40), inp=st.integers(1, 200),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_one_token_through_the_bitmap(fmt, out, inp, density, dtype, bias, seed):
    """One token read through the weight's bitmap (``row_bits``): rows of any length (past a multiple of 16 and of
    the 64 columns taken at a time), all-zero and full rows, float32 and bfloat16 values, with and without bias."""
    with pytest.MonkeyPatch.context() as mp:
        calls = _bitmap_calls(mp)
        out, inp = _shape(fmt, out, inp)
        w = _weight(fmt, out, inp, density, seed).to(dtype)  # (n:m: every group full, whatever the density)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(1, inp, generator=g).to(dtype)
        b = torch.randn(out, generator=g).to(dtype) if bias else None
        y = F.linear(x, scorch.asformat(w, fmt), b)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert y.dtype == dtype and y.shape == (1, out)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
        assert calls and calls[-1] is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_bitmap_word_expands_to_its_columns(dtype, monkeypatch):
    """Every pattern of 8 columns (both halves of a 16-column word, each lane's value its own integer, exact in
    bfloat16) read through the bitmap: the AVX2 table permute and byte shuffle (and their value-by-value ends: the
    last rows' groups lie less than a vector's values before the values' end), AVX-512's expand, lane by lane
    elsewhere, exactly equal to the dense product."""
    calls = _bitmap_calls(monkeypatch)
    masks = torch.arange(256)
    on = (masks[:, None] >> torch.arange(8)) & 1
    pattern = torch.cat([on, on.flip(0), on.roll(37, 0), on.roll(101, 0)], 1).bool()  # (256 rows x 32 columns)
    w = torch.where(pattern, torch.arange(1, 33).float().repeat(256, 1), torch.zeros(()))
    w = (w * torch.where(torch.arange(256)[:, None] % 2 == 0, 1.0, -1.0)).to(dtype)
    x = (2.0 ** -torch.arange(32).float().remainder(6)).to(dtype)[None]  # (powers of two: every sum exact)
    y = F.linear(x, scorch.asformat(w, "csr"))
    assert calls and calls[-1] is not None
    assert torch.equal(y, F.linear(x.float(), w.float()).to(dtype))  # (the float sums exact, then rounded once)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmap_of_an_n_m_weight_with_padding_keeps_its_kernel(dtype, monkeypatch):
    """A group of an n:m weight holding fewer than n entries is padded by repeating a column: its values are not
    one per set bit, so that weight keeps the n:m kernel (and the right answer)."""
    calls = _bitmap_calls(monkeypatch)
    w = _weight("nm(2, 4)", 6, 32, 1.0, 3)
    w[2, :4] = torch.tensor([0.0, 0.0, 1.5, 0.0])  # (one entry in the group: a padding slot)
    w = w.to(dtype)
    x = torch.randn(1, 32).to(dtype)
    y = F.linear(x, scorch.asformat(w, "nm(2, 4)"))
    assert calls == [None]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_the_bitmap_follows_the_values_once_per_pattern(monkeypatch):
    """The bitmap is made once per pattern: a weight trained in place (new values, same index arrays) reads its
    new values through it."""
    _bitmap_calls(monkeypatch)
    w = _weight("csr", 20, 50, 0.5, 4)
    s = scorch.asformat(w, "csr")
    x = torch.randn(1, 50)
    torch.testing.assert_close(F.linear(x, s), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        s._vals.mul_(-2)
    torch.testing.assert_close(F.linear(x, s), F.linear(x, -2 * w), rtol=1e-5, atol=1e-5)
    assert kernels._BITMAPS.get(("bits", s._format, (20, 50)), s._levels) is not None


@pytest.mark.parametrize("lanes, vtype, pairs", [(4, "f32", False), (8, "f32", False), (8, "bf16", False),
                                                  (16, "f32", False), (16, "bf16", False), (16, "bf16", True)])
def test_row_bits_in_the_interpreter(lanes, vtype, pairs):
    """The bitmap kernel's loop IR (``Expand``, ``PopCount``; bfloat16 pairs: ``ExpandPairDot`` on 32-bit words)
    in the NumPy interpreter, every access checked (bfloat16 held as float32: values it holds exactly): the rows
    that read their groups' values whole (``Expand.whole``) read no value past the values' end, the last rows
    test it."""
    w = _weight("csr", 7, 45, 0.5, 12).bfloat16().float()
    w[4] = 0
    s = scorch.asformat(w, "csr")
    pos, words = kernels._bitmap(s)
    count = kernels._words(45)
    plan = family.tiles(Target("cpu", vector_bytes=4 * lanes), "csr", 1, vtype, vtype if pairs else "f32",
                        L.type_of(pos.dtype), "i16", bias=True)
    plan = replace(plan, pairs=pairs)
    x, b, y = torch.zeros(count * 16), torch.randn(7), np.zeros(7, dtype=np.float32)
    x[:45] = torch.randn(45).bfloat16().float()
    bits = words.view(torch.int32) if pairs else words
    interp.run(weights_bits.row_bits(plan), {"pos": pos.numpy(), "bits": bits.numpy(), "vals": s._vals.numpy(),
                                       "bias": b.numpy(), "x": x.numpy(), "y": y, "n_out": 7, "words": count})
    torch.testing.assert_close(torch.from_numpy(y), F.linear(x[:45], w, b), rtol=1e-5, atol=1e-5)


def _combo_calls(monkeypatch):
    """A list recording each 2:4 bfloat16 product's pair numbers (None where the weight's groups are padded)."""
    calls, real = [], kernels._combos
    monkeypatch.setattr(kernels, "_combos", lambda w, crd: calls.append(real(w, crd)) or calls[-1])
    return calls


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 40), groups=st.integers(1, 40), tokens=st.integers(2, 150), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16), tiles=st.booleans())
def test_a_2_4_bfloat16_weight_through_its_pairs(out, groups, tokens, bias, seed, tiles):
    """A 2:4 bfloat16 weight at more than one token: each group's two values against the panel's pair of their
    columns (``COMBOS``, one ``PairDot``), partial token tiles and row passes, with and without bias; in row
    passes over every group or in column tiles (``weights_tiled``), either forced (the CPU picks one)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "PAIR_TILES", tiles)
        calls = _combo_calls(mp)
        w = _weight("nm(2, 4)", out, 4 * groups, 1.0, seed).bfloat16()
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(tokens, 4 * groups, generator=g).bfloat16()
        b = torch.randn(out, generator=g).bfloat16() if bias else None
        y = F.linear(x, scorch.asformat(w, "nm(2, 4)"), b)
        assert y.dtype == torch.bfloat16 and calls and calls[-1] is not None
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


def test_a_padded_2_4_weight_keeps_its_kernel(monkeypatch):
    """A group holding one entry repeats its offset (padding): no pair number names it, the weight keeps the n:m
    kernel (and the right answer)."""
    calls = _combo_calls(monkeypatch)
    w = _weight("nm(2, 4)", 8, 16, 1.0, 5)
    w[3, 4:8] = torch.tensor([0.0, 0.0, 0.0, 2.0])
    w = w.bfloat16()
    x = torch.randn(20, 16).bfloat16()
    y = F.linear(x, scorch.asformat(w, "nm(2, 4)"))
    assert calls == [None]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lanes", [4, 16])
def test_pairs_of_a_2_4_weight_in_the_interpreter(lanes):
    """The 2:4 bfloat16 kernel's loop IR (the panel of every pair of a group's columns, ``PairDot``) in the NumPy
    interpreter (bfloat16 held as float32: values it holds exactly)."""
    out, inp, tokens = 11, 12, 9
    w = _weight("nm(2, 4)", out, inp, 1.0, 6).bfloat16().float()
    s = scorch.asformat(w, "nm(2, 4)")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    plan = family.tiles(Target("cpu", vector_bytes=4 * lanes), "nm", tokens, "bf16", "bf16", "i64",
                        L.type_of(crd.dtype), (1, 1), (2, 4), bias=True)
    assert plan.combos
    x, b = torch.randn(tokens, inp).bfloat16().float(), torch.randn(out).bfloat16().float()
    y = np.zeros(tokens * out, dtype=np.float32)
    interp.run(family.forward(plan), {
        "combo": kernels._combos(s, crd).numpy(), "vals": s._vals.numpy(), "bias": b.numpy(),
        "x": x.reshape(-1).numpy(), "y": y, "n": tokens, "n_in": inp, "n_out": out, "groups": inp // 4,
        "chunks": 2, "row_chunk": 16, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(y).reshape(tokens, out), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_gradients_through_the_bitmap(index_dtype, dtype, monkeypatch):
    """Training at one token: the forward reads the bitmap (either index width of the weight), the input and
    weight gradients equal the masked dense layer's."""
    calls = _bitmap_calls(monkeypatch)
    w = _weight("csr", 24, 70, 0.5, 21)
    w[5] = 0
    s = scorch.asformat(w.to(dtype), "csr", index_dtype=index_dtype).requires_grad_()
    d = w.to(dtype).clone().requires_grad_()
    x1, x2 = (torch.randn(1, 70).to(dtype).requires_grad_() for _ in range(2))
    with torch.no_grad():
        x2.copy_(x1)
    g = torch.randn(1, 24).to(dtype)
    F.linear(x1, s).backward(g)
    F.linear(x2, d).backward(g)
    assert calls and calls[-1] is not None
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(x1.grad.float(), x2.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(s.grad.to_dense().float() * (w != 0), d.grad.float() * (w != 0), rtol=tol, atol=tol)


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("tokens", [2, 16, 33])
def test_2_4_bfloat16_gradients_through_its_pairs(tokens, tiles, monkeypatch):
    """Training a 2:4 bfloat16 weight: the forward runs the pair panel (in row passes or column tiles, forced),
    the gradients equal the masked dense layer's."""
    monkeypatch.setattr(kernels, "PAIR_TILES", tiles)
    calls = _combo_calls(monkeypatch)
    w = _weight("nm(2, 4)", 20, 36, 1.0, 22).bfloat16()
    s = scorch.asformat(w, "nm(2, 4)").requires_grad_()
    d = w.clone().requires_grad_()
    x1 = torch.randn(tokens, 36).bfloat16().requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(tokens, 20).bfloat16()
    F.linear(x1, s).backward(g)
    F.linear(x2, d).backward(g)
    assert calls and calls[-1] is not None
    torch.testing.assert_close(x1.grad.float(), x2.grad.float(), rtol=3e-2, atol=3e-2)
    on = w != 0
    torch.testing.assert_close(s.grad.to_dense().float() * on, d.grad.float() * on, rtol=3e-2, atol=3e-2)
