"""n:4 weights with their rows in a vector's lanes (``compiler.weights_picks``, ``engine.weights._by_picks``):
``F.linear`` against dense torch on the masked weight, whatever CPU runs the tests (the kernel is switched on for
them: ``Target.lane_picks``), at every vector width the renderer has; the loop IR in the NumPy interpreter; the
generated C++'s permute."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import scorch
from conftest import chains_take_two_calls, lane_picks_on, takes_from, trains_like_dense, values_laid_out_again
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_picks as picks
from scorch.compiler.codegen import cpp
from scorch.compiler.target import Target
from scorch.engine import weights as kernels

F = torch.nn.functional


@pytest.fixture
def lane_picks(monkeypatch):
    """The engine's target with the kernel on, and a list recording the plans it runs."""
    return lane_picks_on(monkeypatch, kernels, "_by_picks")


def _weight(n: int, out: int, inp: int, seed: int, density: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < density)
    return w * scorch.nn.NM(n, 4).mask(w)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), out=st.integers(1, 40), groups=st.integers(1, 12),
       tokens=st.integers(picks.PICK_MIN_TOKENS, 90), bias=st.booleans(),
       activation=st.sampled_from([None, "relu", "gelu", "silu"]), density=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 2 ** 16))
def test_rows_in_lanes_equal_the_dense_linear(n, out, groups, tokens, bias, activation, density, seed, monkeypatch):
    """(The patched target is the same for every example.) Any n:4 (1 to 3 kept a group), rows not a whole number
    of vectors (the last block stored row by row), tokens not a whole number of micro-kernels (the last one's extra
    lanes repeat a token), all-zero and padded groups (density 0 and 0.5: groups keeping fewer than ``n`` repeat an
    offset with a zero value), bias and activation epilogues."""
    monkeypatch.setattr(kernels, "CPU", replace(kernels.CPU, lane_picks=True))
    inp = 4 * groups
    w = _weight(n, out, inp, seed, density)
    x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(out) if bias else None
    s = scorch.asformat(w, f"nm({n}, 4)")
    y = kernels.linear(s, x, b, activation)
    want = F.linear(x, w, b)
    want = {None: want, "relu": F.relu(want), "gelu": F.gelu(want), "silu": F.silu(want)}[activation]
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_engine_takes_the_kernel_and_splits_rows(lane_picks, threads):
    """F.linear on a 2:4 weight runs the kernel from ``PICK_MIN_TOKENS`` tokens (fewer: the panel kernel), at
    BERT-like widths, with fewer token tiles than threads (the rows in chunks) and more."""
    least = picks.PICK_MIN_TOKENS
    takes_from(lane_picks, _weight(2, 200, 96, 3), "nm(2, 4)", least, (least - 1, least, 33, 130), threads)


def test_values_changed_in_place_are_laid_out_again(lane_picks):
    """The values' lane layout is remade when the weight's values change (an optimizer step); the fields, made once
    per pattern, are kept."""
    values_laid_out_again(_weight(2, 16, 32, 4), 40, lambda s: kernels._PICK_FIELDS.get(
        ("lanes", lane_picks[-1].lanes, (16, 32)), s._levels))


def test_gradients_and_a_training_step(lane_picks):
    """The forward through the kernel, the gradients through the family's transposed product: equal to the masked
    dense layer's; an SGD step's values reach the next forward."""
    trains_like_dense(lane_picks, _weight(2, 24, 40, 5), 50)


def test_other_weights_keep_their_kernels(lane_picks):
    """bfloat16 values, n:8 groups and CSR do not take the kernel."""
    x = torch.randn(40, 32)
    for w, fmt in ((_weight(2, 16, 32, 6).bfloat16(), "nm(2, 4)"), (torch.randn(16, 32), "csr")):
        xx = x.to(w.dtype)
        y = F.linear(xx, scorch.asformat(w, fmt))
        torch.testing.assert_close(y.float(), F.linear(xx, w).float(), rtol=3e-2, atol=3e-2)
    w8 = torch.randn(16, 32) * scorch.nn.NM(2, 8).mask(torch.randn(16, 32))
    F.linear(x, scorch.asformat(w8, "nm(2, 8)"))
    assert lane_picks == []


@pytest.mark.parametrize("lanes", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_loop_ir_in_the_interpreter(lanes, n):
    """The kernel's loop IR in the NumPy interpreter (every access checked), the weight laid out by the engine."""
    out, inp, tokens = 11, 12, 19
    w = _weight(n, out, inp, 7, 0.7)
    s = scorch.asformat(w, f"nm({n}, 4)")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    target = Target("cpu", vector_bytes=4 * lanes, lane_picks=True)
    plan = family.tiles(target, "nm", tokens, "f32", "f32", "i64", L.type_of(crd.dtype), (1, 1), (n, 4), bias=True)
    plan = picks.planned(plan)
    blocks = -(-out // plan.lanes)
    k = crd.reshape(out, inp // 4, n).long()
    fields = (k << (2 * torch.arange(n))).sum(-1, keepdim=True).to(torch.int8)
    x, b = torch.randn(tokens, inp), torch.randn(out)
    bias = torch.zeros(blocks * plan.lanes)
    bias[:out] = b
    y = np.zeros(tokens * out, dtype=np.float32)
    interp.run(picks.forward(plan), {
        "sel": kernels._lane_blocks(fields, out, plan.lanes).numpy(),
        "vals": kernels._lane_blocks(s._vals.reshape(out, inp // 4, n), out, plan.lanes).numpy(),
        "bias": bias.numpy(), "x": x.reshape(-1).numpy(), "y": y, "n": tokens, "n_in": inp, "n_out": out,
        "groups": inp // 4, "chunks": 2, "row_chunk": -(-(-(-out // 2)) // plan.lanes) * plan.lanes, "nthreads": 1})
    torch.testing.assert_close(torch.from_numpy(y).reshape(tokens, out), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_generated_kernel_permutes_a_broadcast_group():
    """The C++ of the micro-kernel: a lane pick per stored value and token, the token's group read once a pick."""
    plan = picks.planned(family.tiles(Target("cpu", vector_bytes=cpp.VECTOR_BYTES, lane_picks=True), "nm", 64,
                                      "f32", "f32", "i64", "i8", (1, 1), (2, 4)))
    src = cpp.generate(picks.forward(plan))
    assert src.count("scorch_lane_pick<0>(") == picks.PICK_TOKENS
    assert src.count("scorch_lane_pick<2>(") == picks.PICK_TOKENS
    assert "_mm256_permutevar_ps" in src


def test_the_planner_refuses_what_the_kernel_does_not_serve():
    t = Target("cpu", vector_bytes=32, lane_picks=True)
    assert picks.serves(t, "nm", (2, 4), "f32", "f32", 64)
    assert not picks.serves(replace(t, lane_picks=False), "nm", (2, 4), "f32", "f32", 64)
    assert not picks.serves(t, "nm", (2, 8), "f32", "f32", 64)
    assert not picks.serves(t, "nm", (2, 4), "bf16", "bf16", 64)
    assert not picks.serves(t, "nm", (2, 4), "f32", "f32", picks.PICK_MIN_TOKENS - 1)
    with pytest.raises(ValueError, match="n:4 forward"):
        picks.planned(family.tiles(t, "csr", 64, "f32", "f32", "i32", "i32"))


def test_chains_and_stacks_take_two_calls(lane_picks):
    """A chain or a stack of products with an n:4 weight the kernel serves runs as separate calls (their one kernel
    holds tokens in the lanes): the same values."""
    chains_take_two_calls(lane_picks, _weight(2, 32, 16, 8), _weight(2, 16, 32, 9), 48)
