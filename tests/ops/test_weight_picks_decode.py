"""One token (decode) through n:4 weights with their rows in a vector's lanes (``compiler.weights_picks.decode``,
``engine.weights._decode_picks``): against dense torch on the masked weight (ragged row blocks, group counts that
are not a whole number of steps, all-zero and padded groups, float32 and bfloat16, bias and activation
epilogues), the kernel taken and not, values changed in place, and the loop IR in the NumPy interpreter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_picks as picks
from scorch.compiler.codegen import cpp
from scorch.compiler.target import CPU, Target
from scorch.engine import weights as kernels

from test_weight_picks import _weight

F = torch.nn.functional
ACTIVATIONS = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), out=st.integers(1, 40), groups=st.integers(1, 140), bias=st.booleans(),
       activation=st.sampled_from(sorted(ACTIVATIONS, key=str)), density=st.sampled_from([0.0, 0.5, 1.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_one_token_equals_the_dense_linear(n, out, groups, bias, activation, density, dtype, seed):
    w = _weight(n, out, 4 * groups, seed, density).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, 4 * groups, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    s = scorch.asformat(w, f"nm({n}, 4)")
    y = kernels.linear(s, x, b, activation)
    want = ACTIVATIONS[activation](F.linear(x.float(), w.float(), None if b is None else b.float()))
    assert y.dtype == dtype and y.shape == (1, out)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), want.to(dtype).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_kernel_taken_and_not(monkeypatch, threads):
    """n:4 float32 and bfloat16 weights take it at one token on a CPU with 8 or 16 float lanes; n:8 and float16
    weights, and two tokens, do not."""
    parts = []
    real = kernels._kernel
    monkeypatch.setattr(kernels, "_kernel", lambda plan, part="forward": parts.append(part) or real(plan, part))
    served = CPU.lanes("f32") in (8, 16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            w = _weight(2, 37, 64, 3).to(dtype)
            x = torch.randn(1, 64).to(dtype)
            parts.clear()
            y = F.linear(x, scorch.asformat(w, "nm(2, 4)"))
            torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)
            assert ("decode" in parts) == served
        parts.clear()
        F.linear(torch.randn(2, 64), scorch.asformat(_weight(2, 37, 64, 3), "nm(2, 4)"))
        w8 = torch.randn(16, 32) * scorch.nn.NM(2, 8).mask(torch.randn(16, 32))
        F.linear(torch.randn(1, 32), scorch.asformat(w8, "nm(2, 8)"))
        w16 = _weight(2, 16, 32, 4).half()
        F.linear(torch.randn(1, 32).half(), scorch.asformat(w16, "nm(2, 4)"))
        assert "decode" not in parts
    finally:
        torch.set_num_threads(old)
    assert picks.decode_serves(Target("cpu", vector_bytes=64), "nm", (3, 4), "bf16", 1)
    assert not picks.decode_serves(Target("cpu", vector_bytes=16), "nm", (2, 4), "f32", 1)
    assert not picks.decode_serves(Target("cpu", vector_bytes=32), "nm", (2, 4), "f32", 2)
    assert not picks.decode_serves(Target("cpu", vector_bytes=32), "nm", (4, 4), "f32", 1)


def test_values_changed_in_place_are_laid_out_again():
    w = _weight(2, 24, 32, 5)
    s = scorch.asformat(w, "nm(2, 4)")
    x = torch.randn(1, 32)
    torch.testing.assert_close(F.linear(x, s), F.linear(x, w), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        s._vals.mul_(-2.0)
    torch.testing.assert_close(F.linear(x, s), F.linear(x, -2.0 * w), rtol=1e-4, atol=1e-4)


def test_a_training_step_at_one_token():
    """Gradients of a one-token step (the forward through this kernel) equal the masked dense layer's."""
    w = _weight(2, 20, 48, 6)
    s = scorch.asformat(w, "nm(2, 4)").requires_grad_()
    d = w.clone().requires_grad_()
    x = torch.randn(1, 48)
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.linear(xs, s).sum().backward()
    F.linear(xd, d).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), d.grad * (w != 0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xs.grad, xd.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("vtype", ["f32", "bf16"])
def test_the_loop_ir_in_the_interpreter(lanes, n, vtype):
    """A ragged last block, groups not a whole number of steps, bias and activation, every access checked."""
    out, groups = 2 * lanes + 3, 4 * picks.decode_chains(n) + 3
    w = _weight(n, out, 4 * groups, 9, 0.7)
    dtype = torch.float32 if vtype == "f32" else torch.bfloat16
    w = w.to(dtype)
    s = scorch.asformat(w, f"nm({n}, 4)")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    target = Target("cpu", vector_bytes=4 * lanes)
    plan = family.tiles(target, "nm", 1, vtype, vtype, "i64", L.type_of(crd.dtype), (1, 1), (n, 4), bias=True,
                        activation="relu")
    plan = picks.planned(plan)
    sel, laid = kernels.lane_fields(s, crd, lanes), kernels._lane_blocks(s._vals.reshape(out, groups, n), out, lanes)
    x, b = torch.randn(4 * groups), torch.randn(out)
    y = np.zeros(out, dtype=np.float32)
    interp.run(picks.decode(plan), {
        "sel": sel.numpy(), "vals": laid.float().numpy(), "bias": kernels.lane_bias(b, out, lanes)["bias"].numpy(),
        "x": x.numpy(), "y": y, "n_out": out, "groups": groups, "nthreads": 1})
    want = F.relu(F.linear(x[None], w.float(), b))[0]
    torch.testing.assert_close(torch.from_numpy(y), want, rtol=1e-5, atol=1e-5)


def test_the_generated_kernel_permutes_a_broadcast_group():
    """The C++: a lane pick per stored value of each of a step's groups, bfloat16 values widened as vectors."""
    plan = picks.planned(family.tiles(Target("cpu", vector_bytes=cpp.VECTOR_BYTES), "nm", 1, "bf16", "bf16",
                                      "i64", "i8", (1, 1), (2, 4)))
    src = cpp.generate(picks.decode(plan))
    steps = picks.decode_chains(2) + 1  # (a step's groups, and the remainder's one)
    assert src.count("scorch_lane_pick<0>(") == steps and src.count("scorch_lane_pick<2>(") == steps
    assert "scorch_widen(" in src
