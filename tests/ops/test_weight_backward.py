"""The sparse-weight Linear's backward kernels (``engine.weights_grad.input_grad`` / ``weight_grad``): a CSR weight's
value gradient in longer token tiles (``compiler.weights_grad.grad_tiles``), a BSR weight's value gradient a register
slice of a block at a time over tokens laid out by block strips (``block_weight_grad``, ``block_columns``), and a
BSR weight's input gradient as the forward kernel on its block-transposed pattern (``_block_transposed``): against
dense torch on the masked weight, on random shapes, blocks, token counts (partial tiles, one token) and densities,
compiled and in the NumPy interpreter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_grad as grads
from scorch.compiler.target import Target
from scorch.engine import weights as kernels, weights_grad

from test_weight_kernels import _shape, _weight

F = torch.nn.functional
BLOCKS = ("bsr(2, 2)", "bsr(4, 8)", "bsr(8, 16)", "bsr(16, 16)", "bsr(32, 32)", "bsr(2, 32)", "bsr(16, 4)")


def _masked_grads(fmt, w, x, g):
    """``(x.grad, weight gradient on the pattern, mask)`` of the sparse layer, and the dense layer's."""
    s = scorch.asformat(w, fmt).requires_grad_()
    xs = x.clone().requires_grad_()
    F.linear(xs, s).backward(g)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xd, wd).backward(g)
    mask = scorch.asformat(w, fmt).to_dense() != 0
    dense_grad = s.grad.to_dense() if isinstance(s.grad, scorch.SparseTensor) else s.grad
    return (xs.grad, dense_grad * mask), (xd.grad, wd.grad * mask)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(BLOCKS + ("csr",)), out=st.integers(1, 80), inp=st.integers(1, 80),
       tokens=st.integers(1, 90), density=st.sampled_from([0.0, 0.2, 0.6, 1.0]), seed=st.integers(0, 2 ** 16))
def test_gradients_equal_the_masked_dense_layer(fmt, out, inp, tokens, density, seed):
    out, inp = _shape(fmt, out, inp)
    w = _weight(fmt, out, inp, density, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = torch.randn(tokens, inp, generator=g), torch.randn(tokens, out, generator=g)
    (gx, gw), (rx, rw) = _masked_grads(fmt, w, x, dy)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bsr(16, 16)", "bsr(32, 32)", "bsr(4, 8)"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_block_gradients(fmt, dtype):
    out, inp = _shape(fmt, 64, 96)
    w = _weight(fmt, out, inp, 0.5, 3).to(dtype)
    x, dy = torch.randn(45, inp).to(dtype), torch.randn(45, out).to(dtype)
    s = scorch.asformat(w, fmt).requires_grad_()
    xs = x.clone().requires_grad_()
    F.linear(xs, s).backward(dy)
    assert xs.grad.dtype == dtype and s.grad.dtype == dtype
    mask = w.float() != 0
    torch.testing.assert_close(xs.grad.float(), dy.float() @ w.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(s.grad.to_dense().float() * mask, (dy.float().T @ x.float()) * mask, rtol=2e-2,
                               atol=5e-2)


def test_the_backward_kernels_taken(monkeypatch):
    """A BSR weight's input gradient runs the forward kernel (on the transposed blocks) from half a vector of tokens,
    the scatter kernel below; its value gradient runs ``block_weight_grad`` where a block's row is whole vectors."""
    parts = []
    real = kernels._run
    monkeypatch.setattr(kernels, "_run", lambda part, plan, *a, **k: parts.append((part, plan.block)) or
                        real(part, plan, *a, **k))
    w = _weight("bsr(16, 8)", 64, 48, 0.5, 5)
    s = scorch.asformat(w, "bsr(16, 8)")
    lanes = kernels.CPU.lanes("f32")
    weights_grad.input_grad(s, torch.randn(40, 64))
    assert parts[-1] == ("forward", (8, 16))
    if lanes > 2:
        weights_grad.input_grad(s, torch.randn(1, 64))
        assert parts[-1] == ("input_grad", (16, 8))
    weights_grad.weight_grad(s, torch.randn(40, 48), torch.randn(40, 64))
    assert parts[-1][0] == "weight_grad"
    plan = kernels.plan_for(s, 40, False)
    assert grads.blocks_by_columns(plan) == (lanes > 1 and 8 % lanes == 0)


def test_block_slices_fit_the_registers():
    avx2, avx512 = Target("cpu", vector_bytes=32), Target("cpu", vector_bytes=64)

    def slices(target, block):
        return grads.block_slices(family.tiles(target, "bsr", 1024, "f32", "f32", "i32", "i16", block=block))
    assert slices(avx2, (16, 16)) == (4, 2)
    assert slices(avx512, (16, 16)) == (16, 1)
    assert slices(avx2, (32, 32)) == (2, 4)
    assert slices(avx512, (32, 32)) == (8, 2)
    assert slices(avx2, (8, 64)) == (2, 4)  # (8 vectors a row: slices of 4)
    for target in (avx2, avx512):
        for block in ((16, 16), (32, 32), (4, 32), (2, 16)):
            rs, cv = slices(target, block)
            assert block[0] % rs == 0 and (block[1] // target.lanes("f32")) % cv == 0 and rs * cv <= 16


def test_csr_gradient_tiles():
    avx2, avx512, scalar = Target("cpu", vector_bytes=32), Target("cpu", vector_bytes=64), Target("cpu")

    def grad_T(target, kind, tokens):
        plan = family.tiles(target, kind, tokens, "f32", "f32", "i32", "i16",
                            block=(16, 16) if kind == "bsr" else (1, 1), group=(2, 4) if kind == "nm" else (1, 1))
        return grads.grad_tiles(plan, tokens).T
    assert grad_T(avx2, "csr", 1024) == 32 and grad_T(avx512, "csr", 1024) == 32
    assert grad_T(avx2, "csr", 20) == 24 and grad_T(avx2, "csr", 3) == 8
    assert grad_T(avx2, "bsr", 1024) == family.tiles(avx2, "bsr", 1024, "f32", "f32", "i32", "i16", (16, 16)).T
    assert grad_T(scalar, "csr", 1024) == family.tiles(scalar, "csr", 1024, "f32", "f32", "i32", "i16").T


@pytest.mark.parametrize("fmt", ["bsr(4, 8)", "bsr(16, 16)", "bsr(4, 32)", "bsr(6, 8)"])
@pytest.mark.parametrize("lanes", [4, 8])
def test_block_weight_grad_in_the_interpreter(fmt, lanes):
    """``block_weight_grad`` as loop IR (slices of rows and of column vectors) over ``block_columns``' layout."""
    out, inp = _shape(fmt, 24, 64)
    w = _weight(fmt, out, inp, 0.6, 21)
    s = scorch.asformat(w, fmt)
    kind, block, _ = kernels.kind_of(s)
    arrays = kernels._arrays(s)
    plan = family.tiles(Target("cpu", vector_bytes=4 * lanes), kind, 11, "f32", "f32", L.type_of(arrays["pos"].dtype),
                        L.type_of(arrays["crd"].dtype), block)
    assert grads.blocks_by_columns(plan)
    x, dy = torch.randn(11, inp), torch.randn(11, out)
    dw = np.zeros(s._vals.numel(), dtype=np.float32)
    chunks = 2
    row_chunk = -(-out // chunks // block[0]) * block[0]
    interp.run(grads.block_weight_grad(plan), {
        "pos": arrays["pos"].numpy(), "crd": arrays["crd"].numpy(),
        "x": weights_grad.block_columns(x, block[1]).reshape(-1).numpy(),
        "dy": weights_grad.block_columns(dy, block[0]).reshape(-1).numpy(), "dw": dw, "n": 11, "n_in": inp, "n_out": out,
        "groups": inp, "chunks": -(-out // row_chunk), "row_chunk": row_chunk, "nthreads": 1})
    got = s.with_values(torch.from_numpy(dw)).to_dense()
    torch.testing.assert_close(got, (dy.T @ x) * (s.to_dense() != 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_gradients_over_thread_counts(threads):
    fmt = "bsr(16, 16)"
    w = _weight(fmt, 96, 64, 0.5, 8)
    x, dy = torch.randn(70, 64), torch.randn(70, 96)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (gx, gw), (rx, rw) = _masked_grads(fmt, w, x, dy)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["csr", "nm(2, 4)"])
def test_large_weights_input_gradient_through_the_parallel_gather(monkeypatch, fmt):
    """A weight of at least 2**14 stored values gathers them into its transpose's order by the parallel loop
    (``compiler.relayout.gather``), not ``index_select``: the input gradient equals the dense layer's."""
    from scorch.compiler import relayout
    gathered = []
    monkeypatch.setattr(weights_grad, "gather", lambda v, p: gathered.append(p.numel()) or relayout.gather(v, p))
    w = _weight(fmt, 256, 192, 0.6, 11)
    x, dy = torch.randn(37, 192), torch.randn(37, 256)
    (gx, gw), (rx, rw) = _masked_grads(fmt, w, x, dy)
    assert gathered and gathered[-1] >= 2 ** 14
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)
