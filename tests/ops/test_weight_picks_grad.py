"""The value gradient of n:4 weights with their rows in a vector's lanes (``compiler.weights_picks.weight_grad``,
``engine.weights_grad._picks_grad``): through ``F.linear``'s backward against dense torch on the masked weight
(ragged row blocks, groups past a chunk of ``GRAD_GROUP_CHUNK`` and not a whole number of steps, token tiles with a
tail, one token, all-zero and padded groups), the kernel taken, and the loop IR in the NumPy interpreter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_picks as picks
from scorch.compiler.target import CPU, Target
from scorch.engine import weights as kernels

from test_weight_picks import _weight

F = torch.nn.functional


def _grads(n, w, x, dy):
    """The sparse layer's weight gradient on the pattern and input gradient, and the dense layer's."""
    s = scorch.asformat(w, f"nm({n}, 4)").requires_grad_()
    xs, xd, d = x.clone().requires_grad_(), x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xs, s).backward(dy)
    F.linear(xd, d).backward(dy)
    mask = w != 0
    return (s.grad.to_dense() * mask, xs.grad), (d.grad * mask, xd.grad)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), out=st.integers(1, 40), groups=st.integers(1, 140), tokens=st.integers(1, 80),
       density=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2 ** 16))
def test_value_gradients_equal_the_masked_dense_layer(n, out, groups, tokens, density, seed):
    w = _weight(n, out, 4 * groups, seed, density)
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = torch.randn(tokens, 4 * groups, generator=g), torch.randn(tokens, out, generator=g)
    (gw, gx), (rw, rx) = _grads(n, w, x, dy)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-4)


def test_the_kernel_taken(monkeypatch):
    """float32 n:4 weights on a CPU with 8 or 16 float lanes take it, whichever kernel their forward takes;
    bfloat16 ones and n:8 ones keep the per-value dots."""
    parts = []
    real = kernels._run
    monkeypatch.setattr(kernels, "_run", lambda part, *a, **k: parts.append(part) or real(part, *a, **k))
    x, dy = torch.randn(30, 32), torch.randn(30, 16)
    w = _weight(2, 16, 32, 3)
    _grads(2, w, x, dy)
    assert ("picks_dw" in parts) == (CPU.lanes("f32") in (8, 16))
    parts.clear()
    s = scorch.asformat(w.bfloat16(), "nm(2, 4)").requires_grad_()
    F.linear(x.bfloat16(), s).backward(dy.bfloat16())
    w8 = torch.randn(16, 32) * scorch.nn.NM(2, 8).mask(torch.randn(16, 32))
    s8 = scorch.asformat(w8, "nm(2, 8)").requires_grad_()
    F.linear(x, s8).backward(dy)
    assert "picks_dw" not in parts and "weight_grad" in parts
    assert picks.grad_serves(Target("cpu", vector_bytes=32), "nm", (3, 4), "f32", "f32")
    assert not picks.grad_serves(Target("cpu", vector_bytes=16), "nm", (2, 4), "f32", "f32")
    assert not picks.grad_serves(Target("cpu", vector_bytes=32), "nm", (4, 4), "f32", "f32")


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_loop_ir_in_the_interpreter(lanes, n, monkeypatch):
    """Small token tiles and group chunks (so that both have tails and a chunk holds a step's remainder), in the
    NumPy interpreter (every access checked)."""
    monkeypatch.setattr(picks, "GRAD_TILE", 4)
    monkeypatch.setattr(picks, "GRAD_GROUP_CHUNK", 5)
    out, groups, tokens = 2 * lanes, 7, 10
    w = _weight(n, out, 4 * groups, 9, 0.7)
    s = scorch.asformat(w, f"nm({n}, 4)")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    plan = picks.planned(family.tiles(Target("cpu", vector_bytes=4 * lanes), "nm", tokens, "f32", "f32", "i64",
                                      L.type_of(crd.dtype), (1, 1), (n, 4)))
    x, dy = torch.randn(tokens, 4 * groups), torch.randn(tokens, out)
    dw = np.zeros(out * groups * n, dtype=np.float32)
    interp.run(picks.weight_grad(plan), {
        "sel": kernels.lane_fields(s, crd, lanes).numpy(), "x": x.reshape(-1).numpy(), "dy": dy.reshape(-1).numpy(),
        "dw": dw, "n": tokens, "n_in": 4 * groups, "n_out": out, "groups": groups, "chunks": 2, "row_chunk": lanes,
        "nthreads": 1})
    got = kernels.lane_values(torch.from_numpy(dw), out, lanes, groups * n)
    mask = w != 0
    torch.testing.assert_close(s.with_values(got).to_dense() * mask, (dy.T @ x) * mask, rtol=1e-4, atol=1e-4)
