"""``loopir.Transpose``, the copy that packs the sparse-weight Linear kernels' input panels and stores their results
(``compiler.weights``): its meaning in the NumPy interpreter, its C++ rendering (vector tiles where both sides are
float32, lane by lane at the edges and for 16-bit values) against NumPy for every edge of a tile, the helper's text
for each vector width, and ``F.linear`` with sparse weights under forced narrower vectors (AVX2, none), whatever
this machine's."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from scorch import loopir as L
from scorch.compiler import interp
from scorch.compiler.codegen import cpp
from scorch.compiler.codegen.transpose import transpose

#: (rows, cols): empty, under one tile, whole AVX2 / AVX-512 tiles, whole tiles with edges on either side
SHAPES = ((0, 5), (3, 0), (1, 1), (5, 7), (8, 8), (16, 16), (17, 9), (9, 33), (32, 48), (37, 21))


def _kernel(stype: str, dtype: str) -> L.Kernel:
    """``dst[at + j * ds + i] = src[sa + i * ss + j]``, ``rows x cols``, every extent a parameter."""
    v = {n: L.Var(n) for n in ("at", "ds", "sa", "ss", "rows", "cols")}
    return L.Kernel(f"scorch_test_transpose_{stype}_{dtype}", (
        L.Param("src", "array", stype), L.Param("dst", "array", dtype, output=True),
        *(L.Param(n, "scalar", "i64") for n in v)), L.block(
        L.Transpose("dst", v["at"], v["ds"], "src", v["sa"], v["ss"], v["rows"], v["cols"], stype, dtype)))


def _case(rows, cols, seed):
    """A source matrix with a row stride past ``cols`` and an offset, a destination with a stride past ``rows``
    and an offset, and what the destination holds after the copy (entries between the strides untouched)."""
    g = np.random.default_rng(seed)
    sa, ss, at, ds = 3, cols + 2, 5, rows + 3
    src = g.standard_normal(sa + rows * ss + 1).astype(np.float32)
    dst = np.full(at + max(cols, 1) * ds + 1, -7.0, dtype=np.float32)
    want = dst.copy()
    for i in range(rows):
        want[at + np.arange(cols) * ds + i] = src[sa + i * ss + np.arange(cols)]
    return src, dst, want, dict(at=at, ds=ds, sa=sa, ss=ss, rows=rows, cols=cols)


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_the_interpreter_runs_its_loops(rows, cols):
    src, dst, want, scalars = _case(rows, cols, rows * 100 + cols)
    interp.run(_kernel("f32", "f32"), dict(src=src, dst=dst, **scalars))
    np.testing.assert_array_equal(dst, want)


def test_compiled_float32_matches_numpy_at_every_tile_edge():
    kernel = _kernel("f32", "f32")
    compiled = cpp.load(kernel)
    for rows, cols in SHAPES:
        src, dst, want, scalars = _case(rows, cols, rows * 100 + cols)
        s, d = torch.from_numpy(src), torch.from_numpy(dst)
        cpp.call(kernel, compiled, dict(src=s, dst=d, **scalars))
        np.testing.assert_array_equal(d.numpy(), want, err_msg=f"{rows} x {cols}")


@pytest.mark.parametrize("stype, dtype", [("bf16", "f32"), ("f32", "bf16"), ("f16", "f32"), ("f32", "f16")])
def test_compiled_16_bit_converts_once(stype, dtype):
    """Widened exactly, or rounded once from float32 (as torch's ``.to``)."""
    kernel = _kernel(stype, dtype)
    compiled = cpp.load(kernel)
    torch_type = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    for rows, cols in ((17, 9), (32, 48)):
        src, dst, _, scalars = _case(rows, cols, rows + cols)
        s = torch.from_numpy(src).to(torch_type[stype])
        d = torch.from_numpy(dst).to(torch_type[dtype])
        want = dst.copy()  # (the source as it is held, then converted once)
        for i in range(rows):
            want[5 + np.arange(cols) * (rows + 3) + i] = s.float().numpy()[3 + i * (cols + 2) + np.arange(cols)]
        cpp.call(kernel, compiled, dict(src=s, dst=d, **scalars))
        assert torch.equal(d, torch.from_numpy(want).to(torch_type[dtype])), (stype, dtype, rows, cols)


def test_the_helper_takes_the_targets_tiles():
    """AVX-512 16 x 16 tiles (an AVX2 8 x 8 one where the compiler has no AVX-512), AVX2 8 x 8 tiles, none for
    narrower vectors: every target keeps the lane-by-lane copy (edges, 16-bit values)."""
    wide, narrow, none = transpose(64), transpose(32), transpose(16)
    assert "_mm512_shuffle_f32x4" in wide and "_mm256_permute2f128_ps" in wide
    assert "_mm512" not in narrow and "_mm256_permute2f128_ps" in narrow
    assert "_mm" not in none and "immintrin" not in none
    for text in (wide, narrow, none):
        assert "d[j * ds + i] = (D)(float)s[i * ss + j]" in text


_LINEARS = r"""
import torch, scorch
from scorch.compiler.target import CPU
assert CPU.vector_bytes == int(__import__("os").environ["SCORCH_VECTOR_BYTES"])
F = torch.nn.functional
g = torch.Generator().manual_seed(0)
for fmt, out, inp, tokens in (("csr", 45, 50, 37), ("bsr(4, 4)", 44, 52, 19), ("csr", 40, 33, 1)):
    w = torch.randn(out, inp, generator=g)
    if fmt == "csr":
        w = w * (torch.rand(out, inp, generator=g) < 0.3)
    else:
        w = w * (torch.rand(out // 4, inp // 4, generator=g) < 0.5).repeat_interleave(4, 0).repeat_interleave(4, 1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, inp, generator=g).to(dtype).requires_grad_()
        s = torch.nn.Parameter(scorch.asformat(w.to(dtype), fmt))
        b = torch.randn(out, generator=g).to(dtype)
        y = F.linear(x, s, b)
        y.backward(torch.ones_like(y))
        xd = x.detach().float().requires_grad_()
        yd = F.linear(xd, w.to(dtype).float(), b.float())
        yd.backward(torch.ones_like(yd))
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(y.float(), yd, **tol)
        torch.testing.assert_close(x.grad.float(), xd.grad, **tol)
print("ok")
"""


@pytest.mark.parametrize("width", ["32", "16"])
def test_sparse_linears_under_narrower_vectors(width):
    """Forward and input gradient, partial tiles, features not a multiple of a tile, one token, float32 and
    bfloat16, with the kernels generated for AVX2 vectors or none (a fresh process: the target is read once)."""
    env = dict(os.environ, SCORCH_VECTOR_BYTES=width)
    done = subprocess.run([sys.executable, "-c", _LINEARS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_cuda_renders_the_plain_loops():
    """CUDA has no helper: it renders the statement's meaning (``Transpose.loops``), the weight kernels as well."""
    from scorch.compiler import weights as family
    from scorch.compiler.codegen import cuda
    from scorch.compiler.mapping import map_to_gpu
    from scorch.compiler.target import Target
    plan = family.tiles(Target("cpu", vector_bytes=64), "csr", 100, "f32", "f32", "i32", "i32")
    for kernel in (_kernel("f32", "bf16"), family.forward(plan)):
        src = cuda.generate(kernel, map_to_gpu(kernel), prelude=False, symbol="k")
        assert "tr_i" in src and "scorch_transpose" not in src
