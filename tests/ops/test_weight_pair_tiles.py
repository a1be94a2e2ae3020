"""A bfloat16 CSR weight at a few tokens through its pair operations in column tiles (``compiler.weights_tiled``,
``engine.weights._by_pair_tiles``): against dense torch on the masked weight across shapes (odd widths, whose
last pair has one feature; rows past the last block; several tiles), densities (all-zero, full), token counts,
bias, thread counts, index widths, values trained in place, gradients, and the loop IR in the interpreter.
The kernel is forced on (``PAIR_TILES``): the CPU only decides whether it is the faster one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_tiled as tiled
from scorch.compiler.target import Target
from scorch.engine import weights as kernels

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _forced(monkeypatch):
    monkeypatch.setattr(kernels, "PAIR_TILES", True)


def _calls(monkeypatch):
    """A list recording each product's pair layout (None where the weight's values are not in row order)."""
    calls, real = [], kernels._pair_tiles
    monkeypatch.setattr(kernels, "_pair_tiles", lambda w, T: calls.append(real(w, T)) or calls[-1])
    return calls


def _masked(out, inp, density, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g) * (torch.rand(out, inp, generator=g) < density)).bfloat16()


def _check(w, x, b, s=None):
    y = F.linear(x, scorch.asformat(w, "csr") if s is None else s, b)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0]) and y.is_contiguous()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=3e-2)


@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 70), inp=st.integers(1, 90), tokens=st.integers(2, 80),
       density=st.sampled_from([0.2, 0.35, 0.5, 0.8, 1.0]), bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_pair_tiles_equal_the_dense_linear(out, inp, tokens, density, bias, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "PAIR_TILES", True)
        calls = _calls(mp)
        w = _masked(out, inp, density, seed)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(tokens, inp, generator=g).bfloat16()
        _check(w, x, torch.randn(out, generator=g).bfloat16() if bias else None)
        assert w.count_nonzero() < 0.2 * w.numel() or (calls and calls[-1] is not None)


@pytest.mark.parametrize("out, inp, tokens", [(1, 1, 2), (16, 2, 3), (17, 3, 16), (40, 1100, 17), (33, 4097, 5)])
def test_edges_and_several_tiles(out, inp, tokens, monkeypatch):
    """A single entry; one pair; an odd last pair; more columns than a tile holds at 32 tokens (512 pairs) and 16
    (1024 pairs), with a row of every column and an all-zero row."""
    calls = _calls(monkeypatch)
    w = _masked(out, inp, 0.5, inp)
    w[out // 2] = 0
    w[0] = 1.0
    _check(w, torch.randn(tokens, inp).bfloat16(), torch.randn(out).bfloat16())
    assert calls[-1] is not None
    seg = calls[-1][0]
    assert (seg.numel() - 1) % family.STORE_ROWS == 0 and int(seg[-1]) == calls[-1][3]


def test_below_the_density_and_in_float32_the_panel_kernel_serves(monkeypatch):
    calls = _calls(monkeypatch)
    x = torch.randn(8, 64)
    _check(_masked(20, 64, 0.1, 1), x.bfloat16(), None)
    F.linear(x, scorch.asformat(_masked(20, 64, 0.5, 1).float(), "csr"))
    assert calls == []


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_threads_and_index_widths(threads, index_dtype, monkeypatch):
    calls = _calls(monkeypatch)
    w = _masked(100, 77, 0.4, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tokens in (2, 16, 40):
            _check(w, torch.randn(tokens, 77).bfloat16(), None, scorch.asformat(w, "csr", index_dtype=index_dtype))
    finally:
        torch.set_num_threads(before)
    assert calls and all(c is not None for c in calls)


def test_values_changed_in_place_are_read_anew(monkeypatch):
    """The operations' values are a copy made once per version of the weight's values: a weight trained in place
    (same index arrays, new values) is read with its new values; another weight of the same values' size is not
    served the first one's copy."""
    w = _masked(30, 40, 0.5, 4)
    s = scorch.asformat(w, "csr")
    x = torch.randn(16, 40).bfloat16()
    _check(w, x, None, s)
    with torch.no_grad():
        s._vals.mul_(-2)
    _check(w * -2, x, None, s)
    other = scorch.asformat(_masked(30, 40, 0.5, 5), "csr")
    _check(other.to_dense(), x, None, other)
    assert len(kernels._PAIR_WORDS) >= 1


def _gradients_match(w, fmt, calls, tokens=16):
    """The input and weight gradients of ``F.linear`` with ``w`` stored as ``fmt`` equal the masked dense layer's
    (the forward through the kernel ``calls`` records); the sparse weight and an input back."""
    s = scorch.asformat(w, fmt).requires_grad_()
    d = w.clone().requires_grad_()
    x1 = torch.randn(tokens, w.shape[1]).bfloat16().requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(tokens, w.shape[0]).bfloat16()
    for y in (F.linear(x1, s), F.linear(x2, d)):
        y.backward(g)
    assert calls and calls[-1] is not None
    on = w != 0
    for got, want in ((x1.grad, x2.grad), (s.grad.to_dense() * on, d.grad * on)):
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    return s, x1.detach()


def test_gradients_equal_the_masked_dense_layer(monkeypatch):
    _gradients_match(_masked(24, 50, 0.5, 6), "csr", _calls(monkeypatch))


@pytest.mark.parametrize("lanes, tokens", [(4, 3), (16, 20)])
def test_the_loop_ir_in_the_interpreter(lanes, tokens):
    """The kernel's loop IR (pair panel with an odd width's zero partner, tiles, segments, ``PairDot``) in the
    NumPy interpreter, every access checked (bfloat16 held as float32: values it holds exactly). The values are
    multiples of 1/8 and small, so that every product and partial sum is exact in float32 and the interpreter's
    order of summation cannot differ from torch's (random float inputs made this test fail once in a while)."""
    out, inp = 21, 2 * tiled.tile_pairs(4 * ((tokens + lanes - 1) // lanes)) + 7  # (two tiles and an odd pair)
    w = (_masked(out, inp, 0.5, 7).float() * 8).round() / 8
    w[3] = 0
    s = scorch.asformat(w, "csr")
    target = Target("cpu", vector_bytes=4 * lanes)
    plan = tiled.planned(family.tiles(target, "csr", tokens, "bf16", "bf16", "i64", "i64", bias=True))
    seg, idx, dest, count, tiles = kernels._pair_tiles(s, plan.T)
    words = torch.zeros(2 * (count + tiled.AHEAD))  # (the prefetches reach ``AHEAD`` operations past the last)
    words[dest] = s._vals
    g = torch.Generator().manual_seed(tokens)
    x, b = torch.randint(-16, 17, (tokens, inp), generator=g) / 8, torch.randint(-16, 17, (out,), generator=g) / 8
    assert torch.equal(x.bfloat16().float(), x) and torch.equal(w.bfloat16().float(), w)
    y = np.zeros(tokens * out, dtype=np.float32)
    blocks = -(-out // family.STORE_ROWS)
    interp.run(tiled.forward(plan), {
        "seg": seg.numpy(), "idx": idx.numpy(), "words": words.numpy(), "bias": b.numpy(),
        "x": x.reshape(-1).numpy(), "y": y, "n": tokens, "n_in": inp, "n_out": out, "groups": inp, "chunks": 2,
        "row_chunk": 16, "nthreads": 1, "tiles": tiles})
    assert tiles == (seg.numel() - 1) // (blocks * family.STORE_ROWS) >= 2
    torch.testing.assert_close(torch.from_numpy(y).reshape(tokens, out), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # (four 16-bit pair offsets a 64-bit word: every segment whole groups of operations, each offset a whole pair's
    #  in its tile, the array running ``AHEAD`` operations on)
    assert L.type_of(idx.dtype) == "i64" and bool((seg % tiled.UNROLL == 0).all())
    assert count + tiled.AHEAD == 4 * idx.numel() and int(seg[-1]) == count
    fields = idx.view(torch.int16).long()
    assert bool(((fields >= 0) & (fields < tiled.tile_pairs(plan.T) * plan.T) & (fields % plan.T == 0)).all())


# --- 2:4 weights: an operation a row's group, against the panel of every pair of a group's features ---------------

def _nm(out, groups, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, 4 * groups, generator=g)
    return (w * scorch.nn.NM(2, 4).mask(w)).bfloat16()


def _combo_calls(monkeypatch):
    """A list recording each 2:4 product's tile layout."""
    calls, real = [], kernels._combo_tiles
    monkeypatch.setattr(kernels, "_combo_tiles", lambda w, T, combo: calls.append(real(w, T, combo)) or calls[-1])
    return calls


@settings(max_examples=30, deadline=None)
@given(out=st.integers(1, 140), groups=st.integers(1, 100), tokens=st.integers(2, 70), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_2_4_combo_tiles_equal_the_dense_linear(out, groups, tokens, bias, seed):
    """Rows past a 64-row block and its last, groups over several tiles (40 groups a tile at 16 tokens), partial
    token tiles, with and without bias."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "PAIR_TILES", True)
        calls = _combo_calls(mp)
        w = _nm(out, groups, seed)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(tokens, 4 * groups, generator=g).bfloat16()
        _check(w, x, torch.randn(out, generator=g).bfloat16() if bias else None, scorch.asformat(w, "nm(2, 4)"))
        assert calls and calls[-1] is not None
        seg = calls[-1][0]
        assert int(seg[-1]) == calls[-1][3] and (seg.numel() - 1) % tiled.COMBO_ROWS == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out, groups, tokens", [(1, 1, 2), (70, 90, 16), (130, 41, 17), (9, 3, 40)])
def test_2_4_combo_tiles_across_shapes_and_threads(out, groups, tokens, threads, monkeypatch):
    """A row whose values are all zero (stored zeros: the pattern stays 2:4), one group, several tiles and
    blocks, more threads than row chunks; against dense torch on the same weight."""
    calls = _combo_calls(monkeypatch)
    w = _nm(out, groups, out + groups)
    s = scorch.asformat(w, "nm(2, 4)")
    with torch.no_grad():
        s._vals.view(out, -1)[out // 2] = 0
    w = s.to_dense()
    x, b = torch.randn(tokens, 4 * groups).bfloat16(), torch.randn(out).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = F.linear(x, s, b)
    finally:
        torch.set_num_threads(before)
    assert calls and calls[-1] is not None and y.dtype == torch.bfloat16 and y.is_contiguous()
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=3e-2)
    assert bool((y[:, out // 2].float() == b[out // 2].float()).all())


def test_2_4_combo_tiles_gradients_and_values_changed_in_place(monkeypatch):
    """Training: the forward through the combo tiles, the input and weight gradients equal the masked dense
    layer's; after a step in place the forward reads the new values."""
    w = _nm(24, 13, 8)
    s, x = _gradients_match(w, "nm(2, 4)", _combo_calls(monkeypatch))
    with torch.no_grad():
        s._vals.mul_(-2)
        y = F.linear(x, s)
    torch.testing.assert_close(y.float(), F.linear(x.float(), -2 * w.float()), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("lanes, tokens", [(4, 3), (16, 20)])
def test_combo_tiles_loop_ir_in_the_interpreter(lanes, tokens):
    """The kernel's loop IR on a 2:4 weight (the combinations' panel, tiles of whole groups, 64-row blocks) in
    the NumPy interpreter, every access checked; values exact in float32 (``test_the_loop_ir_in_the_interpreter``)."""
    target = Target("cpu", vector_bytes=4 * lanes)
    plan = tiled.planned(family.tiles(target, "nm", tokens, "bf16", "bf16", "i64", "i8", (1, 1), (2, 4), bias=True))
    assert plan.combos and not plan.pairs and plan.rows == tiled.COMBO_ROWS
    T = plan.T
    groups = tiled.tile_units(T, True) // len(family.COMBOS) + 3  # (two tiles, the last partial)
    out = tiled.COMBO_ROWS + 5
    w = _nm(out, groups, 9).float()
    w = torch.where(w == 0, 0.0, w.sign() * (1 + (w.abs() * 8).round()) / 8)  # (no kept value rounds to 0)
    s = scorch.asformat(w.bfloat16(), "nm(2, 4)")
    crd = [lv for lv in s._levels if lv.arrays()][-1].arrays()["crd"]
    combo = kernels._combos(s, crd)
    seg, idx, dest, count, tiles = kernels._combo_tiles(s, T, combo)
    words = torch.zeros(2 * (count + tiled.AHEAD))
    words[dest] = s._vals.float()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randint(-16, 17, (tokens, 4 * groups), generator=g) / 8
    b = torch.randint(-16, 17, (out,), generator=g) / 8
    y = np.zeros(tokens * out, dtype=np.float32)
    interp.run(tiled.forward(plan), {
        "seg": seg.numpy(), "idx": idx.numpy(), "words": words.numpy(), "bias": b.numpy(),
        "x": x.reshape(-1).numpy(), "y": y, "n": tokens, "n_in": 4 * groups, "n_out": out, "groups": groups,
        "chunks": 2, "row_chunk": tiled.COMBO_ROWS, "nthreads": 1, "tiles": tiles})
    # (each row an operation a group: the first tile's whole groups of 4, the last's 3 padded to 4)
    assert tiles == 2 and count == out * (groups - 3 + 4)
    torch.testing.assert_close(torch.from_numpy(y).reshape(tokens, out), F.linear(x, s.to_dense().float(), b),
                               rtol=1e-5, atol=1e-5)
