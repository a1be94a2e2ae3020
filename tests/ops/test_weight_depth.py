"""n:m weights in depth blocks (``compiler.weights_depth``, ``engine.weights_depth``): ``F.linear`` against dense
torch on the masked weight, whatever CPU runs the tests (the engine's target is given 8-lane vectors, which the
kernel serves), with store blocks and depth blocks made small so that both come out ragged; the weight's layout
against its formula; the loop IR in the NumPy interpreter; the generated C++'s addressing."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import scorch
from conftest import chains_take_two_calls, takes_from, trains_like_dense, values_laid_out_again
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_depth as depth
from scorch.compiler.codegen import cpp
from scorch.compiler.target import Target
from scorch.engine import weights as kernels, weights_depth as laid_out

F = torch.nn.functional
#: the tests that compile the kernel at 8 float lanes: only where the renderer's vectors are 8 floats (other
#: kernels a product takes, the n:4 gradient's, render at the engine's lanes); the interpreter's and the layout's
#: run everywhere
renders_8_lanes = pytest.mark.skipif(cpp.VECTOR_BYTES != 32, reason="the renderer's vectors are not 8 floats")


@pytest.fixture
def depth_on(monkeypatch):
    """The engine's target with 8-lane vectors (the kernel on, whatever the CPU), small store blocks (12 rows)
    and depth blocks (3 groups of 4 at 48 tokens), and a list recording the plans of the depth kernel's calls."""
    # (rows in lanes, which fewer tokens take, render at 8 lanes only where the renderer's vectors are 8 floats)
    monkeypatch.setattr(kernels, "CPU", replace(kernels.CPU, vector_bytes=32,
                                                lane_picks=kernels.CPU.lane_picks and cpp.VECTOR_BYTES == 32))
    monkeypatch.setattr(depth, "DEPTH_ROWS", 12)
    monkeypatch.setattr(depth, "DEPTH_PANEL_BYTES", 3 * 4 * 48 * 4)
    calls, real = [], kernels._forward
    monkeypatch.setattr(kernels, "_forward", lambda plan, *a, **k: (calls.append(plan) if plan.depth else None) or
                        real(plan, *a, **k))
    return calls


def _weight(n: int, m: int, out: int, inp: int, seed: int, density: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < density)
    return w * scorch.nn.NM(n, m).mask(w)


def _activated(y, activation):
    return {None: y, "relu": F.relu(y), "gelu": F.gelu(y), "silu": F.silu(y)}[activation]


@renders_8_lanes
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nm=st.sampled_from([(1, 4), (2, 4), (3, 4), (2, 8), (4, 8)]), out=st.integers(1, 40),
       groups=st.integers(1, 14), tokens=st.integers(depth.DEPTH_MIN_TOKENS, 110), bias=st.booleans(),
       activation=st.sampled_from([None, "relu", "gelu", "silu"]), density=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 2 ** 16))
def test_depth_blocks_equal_the_dense_linear(depth_on, nm, out, groups, tokens, bias, activation, density, seed):
    """Any n:4 and n:8 (n:8 in tiles of 4 vectors, whose offsets fit a byte), rows not a whole number of passes
    or store blocks, groups not a whole number of depth blocks, tokens not a whole number of tiles (the last tile's
    extra lanes zeros), all-zero and padded groups (density 0 and 0.5), bias and activation epilogues."""
    n, m = nm
    inp = m * groups
    w = _weight(n, m, out, inp, seed, density)
    x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(out) if bias else None
    y = kernels.linear(scorch.asformat(w, f"nm({n}, {m})"), x, b, activation)
    assert depth_on and (m == 4 or depth_on[-1].T == 32)
    torch.testing.assert_close(y, _activated(F.linear(x, w, b), activation), rtol=1e-4, atol=1e-4)


@renders_8_lanes
@pytest.mark.parametrize("threads", [1, 3])
def test_the_engine_takes_the_kernel_and_splits_rows(depth_on, threads):
    """F.linear on a 2:4 weight runs the kernel from ``DEPTH_MIN_TOKENS`` tokens (fewer: another kernel), with
    fewer token tiles than threads (the rows in chunks of whole store blocks) and more."""
    least = depth.DEPTH_MIN_TOKENS
    takes_from(depth_on, _weight(2, 4, 200, 96, 3), "nm(2, 4)", least, (least - 1, least, 97, 400), threads)


@renders_8_lanes
def test_values_changed_in_place_are_laid_out_again(depth_on):
    """The values' copy in the kernel's order is remade when the weight's values change (an optimizer step); the
    offsets, made once per pattern, are kept."""
    def offsets(s):
        plan = depth_on[-1]
        return laid_out._OFFSETS.get(("depth", plan.row_pass, plan.depth, plan.rows, 16, 8, plan.T), s._levels)
    values_laid_out_again(_weight(2, 4, 16, 32, 4), 50, offsets)


@renders_8_lanes
def test_gradients_and_a_training_step(depth_on):
    """The forward through the kernel, the gradients through the family's: equal to the masked dense layer's, and
    an SGD step's values reach the next forward."""
    trains_like_dense(depth_on, _weight(2, 4, 24, 40, 5), 50)


@renders_8_lanes
def test_other_weights_and_products_keep_their_kernels(depth_on):
    """bfloat16 values, CSR, n:16 (offsets past a byte) and one token do not take the kernel."""
    x = torch.randn(48, 32)
    for w, fmt in ((_weight(2, 4, 16, 32, 6).bfloat16(), "nm(2, 4)"), (torch.randn(16, 32), "csr"),
                   (_weight(2, 16, 16, 32, 7), "nm(2, 16)")):
        xx = x.to(w.dtype)
        torch.testing.assert_close(F.linear(xx, scorch.asformat(w, fmt)).float(), F.linear(xx, w).float(),
                                   rtol=3e-2, atol=3e-2)
    w = _weight(2, 4, 16, 32, 8)
    torch.testing.assert_close(F.linear(x[:1], scorch.asformat(w, "nm(2, 4)")), F.linear(x[:1], w), rtol=1e-4,
                               atol=1e-4)
    assert depth_on == []


def _reference_order(t: torch.Tensor, n_out: int, groups: int, plan) -> torch.Tensor:
    """The layout's formula, value by value (the module's text of ``compiler.weights_depth``)."""
    n, R, D, RC = plan.group[0], plan.row_pass, plan.depth, plan.rows
    rows = -(-n_out // R) * R
    out = torch.zeros(rows * groups * n, dtype=t.dtype)
    t = t.reshape(n_out, groups, n)
    for rb in range(0, rows, RC):
        passes = (min(rows, rb + RC) - rb) // R
        for g0 in range(0, groups, D):
            gk = min(D, groups - g0)
            for p in range(passes):
                for g in range(gk):
                    for r in range(R):
                        if rb + p * R + r < n_out:
                            for k in range(n):
                                out[rb * groups * n + ((g0 * passes + p * gk + g) * R + r) * n + k] = \
                                    t[rb + p * R + r, g0 + g, k]
    return out


@pytest.mark.parametrize("shape", [(7, 5, 2, 2, 4, 2), (10, 6, 3, 4, 6, 1), (12, 8, 2, 3, 4, 3), (5, 3, 2, 5, 4, 2),
                                   (9, 7, 3, 7, 3, 2), (1, 1, 2, 1, 2, 1)])
def test_the_layout_follows_its_formula(shape):
    """``engine.weights_depth.ordered`` (whole store blocks at once, the last one apart; whole depth blocks, the
    last one apart; padding rows) against the formula, value by value."""
    n_out, groups, R, D, RC, n = shape
    plan = replace(family.tiles(Target("cpu", vector_bytes=32), "nm", 64, "f32", "f32", "i64", "i8",
                                group=(n, 4)), row_pass=R, depth=D, rows=RC)
    t = torch.randn(n_out * groups * n)
    assert torch.equal(laid_out.ordered(t, n_out, groups, plan), _reference_order(t, n_out, groups, plan))


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("nm", [(1, 4), (2, 4), (3, 4), (2, 8)])
def test_the_loop_ir_in_the_interpreter(lanes, nm):
    """The kernel's loop IR in the NumPy interpreter (every access checked), the weight laid out by the engine:
    two store blocks (the second ragged), ragged depth blocks, two token tiles (the second partial), two row
    chunks."""
    n, m = nm
    out, inp, tokens = 11, 5 * m, 19
    w = _weight(n, m, out, inp, 7, 0.7)
    s = scorch.asformat(w, f"nm({n}, {m})")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    target = Target("cpu", vector_bytes=4 * lanes)
    plan = family.tiles(target, "nm", tokens, "f32", "f32", "i64", L.type_of(crd.dtype), (1, 1), (n, m), bias=True)
    plan = replace(depth.planned(plan, tokens), rows=6, depth=2)
    offsets, vals = laid_out.laid(s, crd, plan)
    x, b = torch.randn(tokens, inp), torch.randn(out)
    y = np.zeros(tokens * out, dtype=np.float32)
    interp.run(depth.forward(plan), {
        "crd": offsets.numpy(), "vals": vals.numpy(), "bias": b.numpy(), "x": x.reshape(-1).numpy(), "y": y,
        "n": tokens, "n_in": inp, "n_out": out, "groups": inp // m, "chunks": 2, "row_chunk": 6, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(y).reshape(tokens, out), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@renders_8_lanes
def test_the_generated_kernel_adds_a_stored_offset():
    """The C++ of the micro-kernel: per stored value one broadcast weight and the panel's row at its stored offset
    (a load and an add: no multiplication of the in-group column by the tile's tokens)."""
    plan = depth.planned(family.tiles(Target("cpu", vector_bytes=32), "nm", 1024, "f32", "f32", "i64", "i8",
                                      (1, 1), (2, 4)), 1024)
    assert (plan.T, plan.row_pass) == (48, 2)
    src = cpp.generate(depth.forward(plan))
    assert src.count("(int64_t)crd[") == plan.row_pass * 2
    assert "crd[(wat + INT64_C(1))]) * " not in src and "crd[wat]) * " not in src
    assert f"INT64_C({depth.offset_bias(plan)})" in src


def test_the_planner_refuses_what_the_kernel_does_not_serve():
    t = Target("cpu", vector_bytes=32)
    assert depth.serves(t, "nm", (2, 4), "f32", "f32", 64)
    assert depth.serves(t, "nm", (4, 8), "f32", "f32", 64)
    assert depth.fitting(8, 8) == (4,) and depth.fitting(4, 8) == depth.DEPTH_VECTORS
    assert not depth.serves(t, "nm", (2, 16), "f32", "f32", 64)
    assert not depth.serves(replace(t, vector_bytes=64), "nm", (2, 4), "f32", "f32", 64)
    assert not depth.serves(replace(t, vector_bytes=16), "nm", (2, 4), "f32", "f32", 64)
    assert not depth.serves(t, "nm", (2, 4), "bf16", "bf16", 64)
    assert not depth.serves(t, "csr", (1, 1), "f32", "f32", 64)
    assert not depth.serves(t, "nm", (2, 4), "f32", "f32", 64, transposed=True)
    assert not depth.serves(t, "nm", (2, 4), "f32", "f32", depth.DEPTH_MIN_TOKENS - 1)
    with pytest.raises(ValueError, match="n:m forward"):
        depth.planned(family.tiles(t, "csr", 64, "f32", "f32", "i32", "i32"), 64)
    with pytest.raises(ValueError, match="planned"):
        depth.forward(family.tiles(t, "nm", 64, "f32", "f32", "i64", "i8", group=(2, 4)))


@renders_8_lanes
def test_chains_and_stacks_take_two_calls(depth_on):
    """A chain or a stack of products with an n:m weight the kernel serves runs as separate calls (their one kernel
    holds the weight in its own layout): the same values."""
    chains_take_two_calls(depth_on, _weight(2, 4, 32, 16, 8), _weight(2, 4, 16, 32, 9), 48)
