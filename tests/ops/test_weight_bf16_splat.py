"""``scorch_splat_bf16``: a bfloat16 scalar read in a vector loop (a CSR weight's value times a panel vector) as a
16-bit broadcast and a shift, not through a general register (``codegen.bf16``). Its text for each vector width,
the C++ renderer's choice of it, a compiled kernel against NumPy (every bfloat16 bit pattern class: signs, zero,
subnormal, infinity), and bfloat16 CSR Linears below the pair kernel's density (zero rows, dense rows, odd sizes,
one token and many, values and gradients) against dense torch. Forced narrower targets run in
``test_weight_transpose.test_sparse_linears_under_narrower_vectors``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import scorch
from scorch import loopir as L
from scorch.compiler import weights as family
from scorch.compiler.codegen import cpp
from scorch.compiler.codegen.bf16 import splat
from scorch.compiler.codegen.prelude import VECTOR_BYTES
from scorch.compiler.target import Target
from scorch.engine import weights as kernels


def test_the_helper_for_each_width():
    """The AVX-512 broadcast for 64-byte vectors, the AVX2 one for 32, each under its compiler's ISA macro, and the
    scalar conversion for any other width or compiler."""
    for width in (64, 32, 16):
        text = splat(width)
        assert f"#if defined(__AVX512BW__) && {width} == 64" in text
        assert f"#elif defined(__AVX2__) && {width} == 32" in text
        assert "_mm512_slli_epi32(_mm512_set1_epi16(s), 16)" in text
        assert "_mm256_slli_epi32(_mm256_set1_epi16(s), 16)" in text
        assert "return scorch_vf32{} + (float)*p;" in text


#: float32 lanes of this machine's vectors (16 with AVX-512, 8 with AVX2): the compiled kernels' vector loops
LANES = VECTOR_BYTES // 4


def _scale_kernel():
    """``y[i * LANES + v] = (float)w[i] * x[i * LANES + v]`` over a vector loop of ``v``: ``w`` bfloat16."""
    i, v = L.Var("i"), L.Var("v")
    body = L.For(v, L.Const(0), L.Const(LANES), L.block(L.Store(
        "y", L.binary("add", L.binary("mul", i, L.Const(LANES)), v),
        L.binary("mul", L.Cast(L.Load("w", i, "bf16"), "f32"),
                 L.Load("x", L.binary("add", L.binary("mul", i, L.Const(LANES)), v), "f32")))), vector=LANES)
    return L.Kernel("scorch_test_splat_bf16", (
        L.Param("w", "array", "bf16"), L.Param("x", "array", "f32"), L.Param("y", "array", "f32", output=True),
        L.Param("n", "scalar", "i64")), L.block(L.For(i, L.Const(0), L.Var("n"), L.block(body))))


def test_compiled_scalar_times_vector_equals_numpy():
    kernel = _scale_kernel()
    assert "scorch_splat_bf16(&w[i])" in cpp.generate(kernel)
    w = torch.tensor([1.5, -2.0, 0.0, -0.0, 1e-40, float("inf"), 3.0e38, -7.25]).bfloat16()
    x = torch.linspace(-3, 3, w.numel() * LANES)
    y = torch.empty_like(x)
    cpp.call(kernel, cpp.load(kernel), {"w": w, "x": x, "y": y, "n": w.numel()})
    want = (w.float().repeat_interleave(LANES) * x).numpy()
    np.testing.assert_array_equal(y.numpy(), want)


@pytest.mark.parametrize("width", [64, 32])
def test_the_csr_kernel_reads_bfloat16_values_through_it(width, monkeypatch):
    monkeypatch.setattr(cpp, "VECTOR_BYTES", width)  # (the text of either width's kernel, on any machine: not compiled)
    plan = family.tiles(Target("cpu", vector_bytes=width), "csr", 40, "bf16", "bf16", "i32", "i16")
    source = cpp.generate(family.forward(plan))
    assert "scorch_splat_bf16(&vals[" in source and "((float)vals[" not in source
    f32 = family.tiles(Target("cpu", vector_bytes=width), "csr", 40, "f32", "f32", "i32", "i16")
    assert "scorch_splat_bf16" not in cpp.generate(family.forward(f32))


@pytest.mark.parametrize("out, inp, tokens", [(37, 45, 40), (16, 33, 1), (50, 64, 17)])
def test_bfloat16_csr_linears_equal_dense(out, inp, tokens, monkeypatch):
    """Density 10% (the panel kernel: below ``PAIR_TILES_DENSITY``), a zero row and a fully dense row; forward,
    input and weight gradients against the dense layer of the same bfloat16 values, in float32."""
    monkeypatch.setattr(kernels, "PAIR_TILES", False)
    g = torch.Generator().manual_seed(out * 100 + tokens)
    w = torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < 0.1)
    w[1] = 0
    w[2] = torch.randn(inp, generator=g)
    w = w.bfloat16()
    x = torch.randn(tokens, inp, generator=g).bfloat16().requires_grad_()
    s = torch.nn.Parameter(scorch.asformat(w, "csr"))
    y = F.linear(x, s)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)
    xd, wd = x.detach().float().requires_grad_(), w.float().requires_grad_()
    yd = F.linear(xd, wd)
    yd.backward(dy.float())
    tol = dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.float(), yd, **tol)
    torch.testing.assert_close(x.grad.float(), xd.grad, **tol)
    grad = scorch.asformat(s.grad, "csr").to_dense().float() if isinstance(s.grad, scorch.SparseTensor) \
        else s.grad.float()
    torch.testing.assert_close(grad, wd.grad * (w != 0), **tol)


def _fields_kernel():
    """``out[4 * i + u] = (int16) (word[i] >>> 16 u)``: the pair-tile kernel's unpacking of four pair numbers."""
    i = L.Var("i")
    body = [L.Store("out", L.binary("add", L.binary("mul", i, L.Const(4)), L.Const(u)), L.Cast(L.Cast(
        L.binary("shr", L.Load("word", i, "i64"), L.Const(16 * u)), "i16"), "i64")) for u in range(4)]
    return L.Kernel("scorch_test_shr_fields", (L.Param("word", "array", "i64"),
                                               L.Param("out", "array", "i64", output=True),
                                               L.Param("n", "scalar", "i64")),
                    L.block(L.For(i, L.Const(0), L.Var("n"), L.block(*body))))


def test_shr_takes_words_apart_alike_in_cpp_and_the_interpreter():
    """Logical shifts of words with the sign bit set or not, and the 16-bit casts wrapping as C++'s do."""
    from scorch.compiler import interp
    fields = torch.tensor([[0, 1, 2, 3], [-1, 32767, -32768, 5], [255, -2, 0, -1]], dtype=torch.int16)
    word = fields.reshape(-1).view(torch.int64).clone()
    kernel = _fields_kernel()
    out = torch.empty(word.numel() * 4, dtype=torch.int64)
    cpp.call(kernel, cpp.load(kernel), {"word": word, "out": out, "n": word.numel()})
    assert torch.equal(out, fields.reshape(-1).long())
    got = np.zeros(word.numel() * 4, dtype=np.int64)
    interp.run(kernel, {"word": word.numpy(), "out": got, "n": word.numel()})
    np.testing.assert_array_equal(got, fields.reshape(-1).long().numpy())


_PAIR_TILES_FORCED = r"""
import torch, scorch
from scorch.engine import weights as kernels
from scorch.compiler.target import CPU
assert CPU.vector_bytes == int(__import__("os").environ["SCORCH_VECTOR_BYTES"])
kernels.PAIR_TILES = True
F = torch.nn.functional
g = torch.Generator().manual_seed(3)
for out, inp, tokens, density in ((37, 45, 16, 0.5), (20, 64, 5, 0.3), (33, 2 * 2048 + 7, 20, 0.4)):
    w = torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < density)
    w[0] = 0
    w[1] = torch.randn(inp, generator=g)
    w = w.bfloat16()
    x = torch.randn(tokens, inp, generator=g).bfloat16()
    with torch.no_grad():
        y = F.linear(x, scorch.asformat(w, "csr"))
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)
for out, groups, tokens in ((70, 45, 16), (9, 3, 5)):  # (2:4: the panel of every pair of a group's features)
    w = torch.randn(out, 4 * groups, generator=g)
    w = (w * scorch.nn.NM(2, 4).mask(w)).bfloat16()
    x = torch.randn(tokens, 4 * groups, generator=g).bfloat16()
    with torch.no_grad():
        y = F.linear(x, scorch.asformat(w, "nm(2, 4)"))
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)
print("ok")
"""


@pytest.mark.parametrize("width", ["32", "16"])
def test_pair_tiles_under_narrower_vectors(width):
    """The pair kernel forced on AVX2-width vectors (``vdpbf16ps`` on 256 bits where the CPU has AVX512-BF16 and
    VL, else lane by lane) and on no vectors: the grouped pair dots' other branches (a fresh process each)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, SCORCH_VECTOR_BYTES=width)
    done = subprocess.run([sys.executable, "-c", _PAIR_TILES_FORCED], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
