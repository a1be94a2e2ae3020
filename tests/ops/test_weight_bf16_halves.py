"""bfloat16 CSR Linears at two vectors of tokens read a bfloat16 panel a pair of tokens at a time
(``loopir.PairHalf``, ``Tiles.halves``): the even tokens into an accumulator vector by a shift, the odd ones into the
next by a mask, the store putting them back in order. The plan's choice, the helper's text, ``PairHalf`` compiled
(vector and scalar) and interpreted against NumPy over every bfloat16 bit-pattern class, and Linears against dense
torch (odd sizes, partial tiles, zero and fully dense rows, values and gradients), under this CPU's vectors and
forced AVX2 ones or none (a fresh process: the target is read once)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from scorch import loopir as L
from scorch.compiler import interp
from scorch.compiler import weights as family, weights_grad as grads
from scorch.compiler.codegen import cpp
from scorch.compiler.codegen.bf16 import PAIR_HALF
from scorch.compiler.codegen.prelude import VECTOR_BYTES
from scorch.compiler.target import Target


@pytest.mark.parametrize("width", [64, 32])
def test_the_plan_takes_halves_for_bfloat16_csr_at_two_vectors(width, monkeypatch):
    monkeypatch.setattr(cpp, "VECTOR_BYTES", width)  # (the text of either width's kernel, on any machine: not compiled)
    target = Target("cpu", vector_bytes=width)
    lanes = width // 4
    plan = family.tiles(target, "csr", 4 * lanes, "bf16", "bf16", "i32", "i16")
    assert plan.halves and plan.vectors == 2
    source = cpp.generate(family.forward(plan))
    assert "scorch_pair_half<0>(&panel[" in source and "scorch_pair_half<1>(&panel[" in source
    assert "float* __restrict__ panel" not in source and "float* panel" not in source
    # (float32, one vector of tokens, the input gradient, the weight gradient: float32 panels as before)
    assert not family.tiles(target, "csr", 4 * lanes, "f32", "f32", "i32", "i16").halves
    assert not family.tiles(target, "csr", lanes, "bf16", "bf16", "i32", "i16").halves
    assert not family.tiles(target, "csr", 4 * lanes, "bf16", "bf16", "i32", "i16", transposed=True).halves
    assert "PairHalf" not in repr(grads.weight_grad(plan)) and "PairHalf" in repr(family.forward(plan))
    assert not family.tiles(Target("cpu", vector_bytes=0), "csr", 64, "bf16", "bf16", "i32", "i16").halves


def test_the_helper_is_a_shift_and_a_mask():
    assert "(H ? (v & 0xffff0000u) : (v << 16))" in PAIR_HALF and "vector_size(sizeof(scorch_vf32))" in PAIR_HALF


#: float32 lanes of this machine's vectors (16 with AVX-512, 8 with AVX2): the compiled kernels' vector loops
LANES = VECTOR_BYTES // 4


def _halves_kernel(vector: bool):
    """``y[2 LANES i + LANES h + v] = x[2 (LANES i + v) + h]`` for ``h`` 0 and 1: the even elements of ``LANES``
    pairs, then the odd ones; ``vector``: the ``v`` loop in ``LANES`` lanes (else plain)."""
    i, v = L.Var("i"), L.Var("v")
    pair = L.binary("add", L.binary("mul", i, L.Const(LANES)), v)
    loops = [L.For(v, L.Const(0), L.Const(LANES), L.block(L.Store(
        "y", L.binary("add", L.binary("mul", i, L.Const(2 * LANES)), L.binary("add", L.Const(LANES * h), v)),
        L.PairHalf("x", pair, h))), vector=LANES if vector else 0) for h in (0, 1)]
    return L.Kernel(f"scorch_test_pair_half_{int(vector)}", (
        L.Param("x", "array", "bf16"), L.Param("y", "array", "f32", output=True), L.Param("n", "scalar", "i64")),
        L.block(L.For(i, L.Const(0), L.Var("n"), L.block(*loops))))


@pytest.mark.parametrize("vector", [True, False])
def test_pair_half_equals_numpy(vector):
    kernel = _halves_kernel(vector)
    assert ("scorch_pair_half<1>" in cpp.generate(kernel)) == vector
    special = [1.5, -2.0, 0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), 3.0e38, -7.25]
    x = torch.cat([torch.tensor(special), torch.randn(4 * LANES - len(special))]).bfloat16()
    want = x.float().reshape(-1, LANES, 2).transpose(1, 2).reshape(-1).numpy()
    y = torch.full((4 * LANES,), -1.0)
    cpp.call(kernel, cpp.load(kernel), {"x": x, "y": y, "n": 2})
    np.testing.assert_array_equal(y.numpy(), want)
    got = np.full(4 * LANES, -1.0, dtype=np.float32)
    interp.run(kernel, {"x": x.float().numpy(), "y": got, "n": 2})
    np.testing.assert_array_equal(got, want)


_LINEARS = r"""
import os, torch, scorch
from scorch.engine import weights as kernels
from scorch.compiler.target import CPU
width = os.environ.get("SCORCH_VECTOR_BYTES")
assert width is None or CPU.vector_bytes == int(width)
kernels.PAIR_TILES = False  # (the panel kernel at every density)
F = torch.nn.functional
g = torch.Generator().manual_seed(5)
lanes = CPU.lanes("f32")
for out, inp, tokens, bias in ((37, 45, 2 * lanes + 1, True), (50, 64, 4 * lanes - 3, False), (33, 17, 2 * lanes, True),
                               (20, 31, 100, True), (19, 40, lanes + 1, False), (16, 33, 1, True)):
    w = torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < 0.1)
    w[1] = 0
    w[2] = torch.randn(inp, generator=g)
    w = w.bfloat16()
    x = torch.randn(tokens, inp, generator=g).bfloat16().requires_grad_()
    s = torch.nn.Parameter(scorch.asformat(w, "csr"))
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    y = F.linear(x, s, b)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)
    xd, wd = x.detach().float().requires_grad_(), w.float().requires_grad_()
    yd = F.linear(xd, wd, None if b is None else b.float())
    yd.backward(dy.float())
    # (the float32 sum of the bfloat16 products in another order, rounded; a bias added to the rounded sum when
    #  the weight is trained: within a bfloat16 step of the terms' magnitude)
    scale = F.linear(xd.detach().abs(), wd.detach().abs(), None if b is None else b.float().abs())
    err = ((y.float() - yd).abs() - scale * 2.0 ** -7).max().item()
    assert err <= 1e-5, (out, inp, tokens, err)
    tol = dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(x.grad.float(), xd.grad, **tol)
    grad = scorch.asformat(s.grad, "csr").to_dense().float() if isinstance(s.grad, scorch.SparseTensor) \
        else s.grad.float()
    torch.testing.assert_close(grad, wd.grad * (w != 0), **tol)
print("ok")
"""


@pytest.mark.parametrize("width", [None, "32", "16"])
def test_bfloat16_csr_linears_equal_dense(width):
    env = dict(os.environ)
    if width is not None:
        env["SCORCH_VECTOR_BYTES"] = width
    else:
        env.pop("SCORCH_VECTOR_BYTES", None)
    done = subprocess.run([sys.executable, "-c", _LINEARS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_cuda_renders_the_halves_as_loads():
    """CUDA has no helper: a ``PairHalf`` outside vector loops is the cast load of its element."""
    from scorch.compiler.codegen import cuda
    from scorch.compiler.mapping import map_to_gpu
    plan = family.tiles(Target("cpu", vector_bytes=64), "csr", 100, "bf16", "bf16", "i32", "i32")
    kernel = family.forward(plan)
    src = cuda.generate(kernel, map_to_gpu(kernel), prelude=False, symbol="k")
    assert "scorch_pair_half" not in src and "scorch_f32(panel[(INT64_C(2) * (" in src
