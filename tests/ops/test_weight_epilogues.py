"""Activation epilogues of the sparse-weight kernel family (issue 43): ``engine.weights.linear(W, x, b, act)`` against
``act(F.linear(x, W_masked, b))`` in torch for CSR, BSR and n:m weights, ReLU, GELU (erf and tanh) and SiLU, float32
and bfloat16, one token (row dots, the bitmap) and many (tiles, the bfloat16 pair tiles), with and without bias;
the loop IR with the activation in the NumPy interpreter; values far out in the activations' tails; two products
chained in one kernel a token tile at a time (``linear_chain``), in C++ and in the interpreter; products of one
input stacked into one (``linear_stacked``)."""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family, weights_chain as chain
from scorch.compiler.target import Target
from scorch.engine import weights as kernels

F = torch.nn.functional
TORCH = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
         "silu": F.silu}


def _masked(fmt: str, out: int, inp: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A random ``out x inp`` weight with the pattern of ``fmt`` (about half kept), as a dense tensor."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * scale
    if fmt.startswith("bsr"):
        bh, bw = scorch.formats.named.block_size(scorch.formats.named.resolve(fmt))
        keep = torch.rand(out // bh, inp // bw, generator=g) < 0.5
        return w * keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    if fmt.startswith("nm"):
        return w * scorch.nn.NM(2, 4).mask(w)
    return w * (torch.rand(out, inp, generator=g) < 0.5)


def _check(fmt, act, tokens, bias, dtype=torch.float32, out=48, inp=64, seed=0):
    w = _masked(fmt, out, inp, seed).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = (2 * torch.randn(tokens, inp, generator=g)).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    s = scorch.asformat(w, fmt)
    assert kernels.applies(s, x)
    y = kernels.linear(s, x, b, act)
    want = TORCH[act](F.linear(x.float(), w.float(), None if b is None else b.float()))
    assert y.dtype == dtype and y.shape == (tokens, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("act", list(TORCH))
@pytest.mark.parametrize("fmt", ["csr", "bsr(4, 8)", "nm(2, 4)"])
def test_activation_in_the_store(fmt, act):
    """Many tokens (two tiles and a partial one) with bias: each format's tiles, each activation."""
    _check(fmt, act, 37, bias=True)


@pytest.mark.parametrize("fmt, act", [("csr", "gelu"), ("csr", "silu"), ("nm(2, 4)", "gelu_tanh"),
                                      ("nm(2, 4)", "relu")])
def test_one_token_without_bias(fmt, act, monkeypatch):
    """One token (decode): the row dots, no bias."""
    monkeypatch.setitem(kernels.BITS_DENSITY, "f32", 2.0)
    _check(fmt, act, 1, bias=False)


def test_one_token_through_the_bitmap(monkeypatch):
    monkeypatch.setitem(kernels.BITS_DENSITY, "f32", 0.0)
    seen, real = [], kernels._bitmap
    monkeypatch.setattr(kernels, "_bitmap", lambda w: seen.append(real(w)) or seen[-1])
    _check("csr", "gelu", 1, bias=True)
    assert seen and seen[-1] is not None


@pytest.mark.parametrize("fmt, act", [("csr", "gelu"), ("bsr(4, 8)", "silu"), ("nm(2, 4)", "gelu_tanh")])
def test_bfloat16_rounded_once_after_the_activation(fmt, act):
    _check(fmt, act, 40, bias=True, dtype=torch.bfloat16)


def test_bfloat16_pair_tiles(monkeypatch):
    monkeypatch.setattr(kernels, "PAIR_TILES", True)
    seen, real = [], kernels._pair_tiles
    monkeypatch.setattr(kernels, "_pair_tiles", lambda w, T: seen.append(real(w, T)) or seen[-1])
    _check("csr", "gelu", 20, bias=False, dtype=torch.bfloat16)
    assert seen and seen[-1] is not None


def test_tails_and_specials():
    """Sums far out in the tails (the erf clamped at 4, exp overflowing) and NaN, as torch gives them."""
    w = torch.eye(16)
    x = torch.tensor([[-200.0, -30.0, -9.0, -5.5, -3.0, -0.5, -1e-3, 0.0, 1e-3, 0.5, 3.0, 5.5, 9.0, 30.0, 200.0,
                       float("nan")]]).repeat(20, 1)
    s = scorch.asformat(w, "csr")
    for act, fn in TORCH.items():
        torch.testing.assert_close(kernels.linear(s, x, None, act), fn(x), rtol=1e-5, atol=2e-6, equal_nan=True)


def test_unknown_activation_and_gradient_refused():
    s = scorch.asformat(torch.eye(4), "csr")
    with pytest.raises(ValueError, match="activation"):
        kernels.linear(s, torch.randn(3, 4), None, "tanh")
    with pytest.raises(ValueError, match="input gradient"):
        family.tiles(Target("cpu", vector_bytes=16), "bsr", 8, "f32", "f32", "i32", "i32", (2, 2),
                     transposed=True, activation="relu")


def _args(s, x, y, b, plan):
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    out = {k: arrays[k].numpy() for k in ("pos", "crd") if k in arrays}
    n_out, n_in = s.shape
    out.update({"vals": s._vals.numpy(), "x": x.reshape(-1).numpy(), "y": y.reshape(-1), "n": x.shape[0],
                "n_in": n_in, "n_out": n_out, "groups": n_in // plan.group[1], "chunks": 2,
                "row_chunk": -(-n_out // 2 // plan.rows) * plan.rows, "nthreads": 1})
    if b is not None:
        out["bias"] = b.numpy()
    return out


@pytest.mark.parametrize("fmt, act, tokens", [("csr", "gelu", 7), ("bsr(2, 2)", "silu", 7),
                                              ("nm(2, 4)", "gelu_tanh", 7), ("csr", "relu", 1), ("nm(2, 4)", "silu", 1)])
def test_the_loop_ir_in_the_interpreter(fmt, act, tokens):
    """The interpreter runs the same program, the activation included (tiles; one token: the row dots)."""
    w = _masked(fmt, 12, 8, 3)
    s = scorch.asformat(w, fmt)
    kind, block, group = kernels.kind_of(s)
    arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
    ptype = L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64"
    plan = family.tiles(Target("cpu", vector_bytes=16), kind, tokens, "f32", "f32", ptype,
                        L.type_of(arrays["crd"].dtype), block, group, bias=True, activation=act)
    x, b = 2 * torch.randn(tokens, 8), torch.randn(12)
    y = np.zeros((tokens, 12), dtype=np.float32)
    kernel = family.row_dots(plan) if tokens == 1 else family.forward(plan)
    interp.run(kernel, _args(s, x, y, b, plan))
    torch.testing.assert_close(torch.from_numpy(y), TORCH[act](F.linear(x, w, b)), rtol=1e-5, atol=1e-5)


def _chains(monkeypatch) -> list:
    """The plan pairs ``linear_chain`` runs as one kernel, recorded."""
    seen, real = [], chain.forward_chain
    monkeypatch.setattr(chain, "forward_chain", lambda p1, p2, *norm: seen.append((p1, p2)) or real(p1, p2, *norm))
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # (a tile a thread is enough: any CPU chains)
    # (n:4 float32 weights run with their rows in lanes or in depth blocks where the CPU takes it, outside chains:
    # not here)
    monkeypatch.setattr(kernels, "CPU", replace(kernels.CPU, lane_picks=False))
    monkeypatch.setattr(kernels, "_depth", lambda plan, n: False)
    return seen


@pytest.mark.parametrize("fmt1, fmt2, tokens", [("csr", "csr", 37), ("bsr(4, 8)", "bsr(2, 2)", 40),
                                                ("nm(2, 4)", "csr", 70), ("csr", "nm(2, 4)", 33), ("csr", "csr", 1)])
def test_two_products_chained_a_tile_at_a_time(fmt1, fmt2, tokens, monkeypatch):
    """``linear_chain``: one kernel, each token tile's intermediate kept as the second product's panel (partial last
    tile, n:m and BSR on either side); one token, where the tiles do not serve, the two calls. The values are the
    two calls' to the bit where both weights are of one kind (each output summed in the same order; a CSR weight
    chained with an n:m one takes the n:m tile, shorter than its own alone: ``chain.matched``)."""
    seen = _chains(monkeypatch)
    w1, w2 = _masked(fmt1, 64, 48, 5), _masked(fmt2, 40, 64, 6)
    x, b1, b2 = 2 * torch.randn(tokens, 48), torch.randn(64), torch.randn(40)
    s1, s2 = scorch.asformat(w1, fmt1), scorch.asformat(w2, fmt2)
    y = kernels.linear_chain(s1, x, b1, "gelu", s2, b2, "silu")
    # (two float32 products, each summed in its own order)
    torch.testing.assert_close(y, F.silu(F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)), rtol=1e-4, atol=1e-4)
    two = kernels.linear(s2, kernels.linear(s1, x, b1, "gelu"), b2, "silu")
    if fmt1.split("(")[0] == fmt2.split("(")[0]:
        assert torch.equal(y, two)
    torch.testing.assert_close(y, two, rtol=1e-5, atol=1e-5)
    assert len(seen) == (tokens > 1)


def test_chain_falls_back_where_one_kernel_does_not_serve(monkeypatch):
    """bfloat16 (panels of float32 only), tiles of different sizes (a BSR weight's one vector of tokens against
    CSR's two), or fewer token tiles than twice the threads: the two calls, the same values."""
    seen = _chains(monkeypatch)
    w1, w2 = _masked("csr", 32, 32, 7), _masked("bsr(4, 8)", 16, 32, 8)
    x = torch.randn(40, 32)
    for a, b, dtype in ((w1, w1, torch.bfloat16), (w1, w2, torch.float32)):
        fa, fb = ("csr", "bsr(4, 8)") if b is w2 else ("csr", "csr")
        y = kernels.linear_chain(scorch.asformat(a.to(dtype), fa), x.to(dtype), None, "relu",
                                 scorch.asformat(b.to(dtype), fb), None, None)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = F.linear(torch.relu(F.linear(x.to(dtype), a.to(dtype))).float(), b.to(dtype).float())
        torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # (40 tokens: two tiles of 32, one a thread)
    y = kernels.linear_chain(scorch.asformat(w1, "csr"), x, None, "relu", scorch.asformat(w1, "csr"), None, None)
    torch.testing.assert_close(y, F.linear(torch.relu(F.linear(x, w1)), w1), rtol=1e-4, atol=1e-4)
    assert not seen
    with pytest.raises(ValueError, match="linear_chain"):
        kernels.linear_chain(scorch.asformat(w1, "csr"), x, None, None, scorch.asformat(w2, "bsr(4, 8)").t(), None)
    with pytest.raises(ValueError, match="chain"):
        p = family.tiles(Target("cpu", vector_bytes=16), "csr", 8, "bf16", "bf16", "i32", "i16")
        chain.forward_chain(p, p)


def test_chained_kernel_in_the_interpreter():
    """The chained kernel's program in the NumPy interpreter: a partial tile, bias and activation on both sides,
    an n:m second product (its groups renamed with its arrays)."""
    target = Target("cpu", vector_bytes=16)
    w1, w2 = _masked("csr", 12, 8, 9), _masked("nm(2, 4)", 6, 12, 10)
    s1, s2 = scorch.asformat(w1, "csr"), scorch.asformat(w2, "nm(2, 4)")
    x, b1, b2 = torch.randn(7, 8), torch.randn(12), torch.randn(6)
    plans = []
    for s, act in ((s1, "gelu"), (s2, "silu")):
        kind, block, group = kernels.kind_of(s)
        arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
        ptype = L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64"
        plans.append(family.tiles(target, kind, 7, "f32", "f32", ptype, L.type_of(arrays["crd"].dtype), block,
                                  group, bias=True, activation=act))
    y = np.zeros((7, 6), dtype=np.float32)
    args = _args(s1, x, y, b1, plans[0])
    second = _args(s2, x, y, b2, plans[1])
    args.update({f"{k}2": second[k] for k in ("crd", "vals", "bias")})
    args.update({"n_out": 6, "n_mid": 12, "groups2": 12 // 4, "chunks": 1, "row_chunk": 12})
    interp.run(chain.forward_chain(*plans), args)
    torch.testing.assert_close(torch.from_numpy(y), F.silu(F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [33, 1])
def test_products_of_one_input_stacked(tokens, monkeypatch):
    """``linear_stacked``: the weights' rows stacked into one product (one pack of the input), biases where some
    are missing, the index arrays stacked once per set of patterns; one token, or weights of different formats: the
    separate calls, side by side."""
    runs, real = [], kernels._run
    monkeypatch.setattr(kernels, "_run", lambda part, plan, *a, **k: runs.append(a[0]) or real(part, plan, *a, **k))
    ws = [_masked("csr", 16 + 8 * k, 24, 11 + k) for k in range(3)]
    x, bs = torch.randn(tokens, 24), [torch.randn(16), None, torch.randn(32)]
    ss = [scorch.asformat(w, "csr") for w in ws]
    out = kernels.linear_stacked(ss, x, bs, "gelu")
    want = torch.cat([F.gelu(F.linear(x, w, bias)) for w, bias in zip(ws, bs)], 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert (runs == [(72, 24)]) if tokens > 1 else (72, 24) not in runs
    # (the stacked pattern and values kept: the same objects again; a weight changed in place: its values anew)
    first = kernels.stacked(ss)[0]
    assert first["pos"] is kernels.stacked(ss)[0]["pos"] and first["vals"] is kernels.stacked(ss)[0]["vals"]
    with torch.no_grad():
        ss[1]._vals.mul_(2)
    torch.testing.assert_close(kernels.linear_stacked(ss, x, bs, "gelu")[:, 16:40], F.gelu(F.linear(x, 2 * ws[1])),
                               rtol=1e-5, atol=1e-5)
    mixed = [ss[0], scorch.asformat(_masked("nm(2, 4)", 8, 24, 20), "nm(2, 4)")]
    got = kernels.linear_stacked(mixed, x, [None, None], None)
    torch.testing.assert_close(got, torch.cat([F.linear(x, ws[0]), F.linear(x, mixed[1].to_dense())], 1), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="linear_stacked"):
        kernels.linear_stacked([scorch.asformat(ws[0].t().contiguous(), "csr")], x, [None], None)


@pytest.mark.parametrize("fmt", ["bsr(4, 8)", "nm(2, 4)"])
def test_stacked_blocks_and_groups(fmt):
    """BSR (block rows offset by the blocks before) and n:m (no row positions) weights stacked."""
    ws = [_masked(fmt, 16, 32, 30 + k) for k in range(3)]
    x = torch.randn(40, 32)
    out = kernels.linear_stacked([scorch.asformat(w, fmt) for w in ws], x, [None] * 3, "relu")
    torch.testing.assert_close(out, torch.cat([torch.relu(F.linear(x, w)) for w in ws], 1), rtol=1e-5, atol=1e-5)
