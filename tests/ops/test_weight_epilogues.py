"""Activation epilogues of the sparse-weight kernel family (issue 43): ``engine.weights.linear(W, x, b, act)`` against
``act(F.linear(x, W_masked, b))`` in torch for CSR, BSR and n:m weights, ReLU, GELU (erf and tanh) and SiLU, float32
and bfloat16, one token (row dots, the bitmap) and many (tiles, the bfloat16 pair tiles), with and without bias;
the loop IR with the activation in the NumPy interpreter; values far out in the activations' tails; two products
chained through panels (``linear_chain``), in C++ and in the interpreter."""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

import scorch
from scorch import loopir as L
from scorch.compiler import interp, weights as family
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


@pytest.mark.parametrize("fmt1, fmt2, tokens", [("csr", "csr", 37), ("bsr(4, 8)", "bsr(2, 2)", 40),
                                                ("nm(2, 4)", "csr", 16), ("csr", "csr", 1)])
def test_two_products_chained_through_panels(fmt1, fmt2, tokens, monkeypatch):
    """``linear_chain``: the first product's tiles stored as the second's panels, read in place (partial last tile,
    rows split into chunks for the threads); one token, where the tiles do not serve, the two calls."""
    runs, real = [], kernels._run
    monkeypatch.setattr(kernels, "_run", lambda part, plan, *a, **k: runs.append(plan) or real(part, plan, *a, **k))
    w1, w2 = _masked(fmt1, 64, 48, 5), _masked(fmt2, 40, 64, 6)
    x, b1 = 2 * torch.randn(tokens, 48), torch.randn(64)
    y = kernels.linear_chain(scorch.asformat(w1, fmt1), x, b1, "gelu", scorch.asformat(w2, fmt2), None, "silu")
    # (two float32 products, each summed in its own order)
    torch.testing.assert_close(y, F.silu(F.linear(F.gelu(F.linear(x, w1, b1)), w2)), rtol=1e-4, atol=1e-4)
    chained = [(p.out_panel, p.in_panel) for p in runs]
    assert chained == [(True, False), (False, True)] if tokens > 1 else not any(map(any, chained))


def test_chain_falls_back_where_panels_do_not_serve():
    """bfloat16 (panels of float32 only), or tiles of different sizes (a BSR weight's one vector of tokens against
    CSR's two): the two calls, the same values."""
    w1, w2 = _masked("csr", 32, 32, 7), _masked("bsr(4, 8)", 16, 32, 8)
    x = torch.randn(40, 32)
    for a, b, dtype in ((w1, w1, torch.bfloat16), (w1, w2, torch.float32)):
        fa, fb = ("csr", "bsr(4, 8)") if b is w2 else ("csr", "csr")
        y = kernels.linear_chain(scorch.asformat(a.to(dtype), fa), x.to(dtype), None, "relu",
                                 scorch.asformat(b.to(dtype), fb), None, None)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = F.linear(torch.relu(F.linear(x.to(dtype), a.to(dtype))).float(), b.to(dtype).float())
        torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="linear_chain"):
        kernels.linear_chain(scorch.asformat(w1, "csr"), x, None, None, scorch.asformat(w2, "bsr(4, 8)").t(), None)


def test_chained_panels_in_the_interpreter():
    """The panel store (``out_panel``: lanes past the last token zero) and the in-place panel reads (``in_panel``)
    in the NumPy interpreter."""
    target = Target("cpu", vector_bytes=16)
    w1, w2 = _masked("csr", 12, 8, 9), _masked("nm(2, 4)", 6, 12, 10)
    s1, s2 = scorch.asformat(w1, "csr"), scorch.asformat(w2, "nm(2, 4)")
    x, b1 = torch.randn(7, 8), torch.randn(12)
    plans = []
    for s, bias, act, flag in ((s1, True, "gelu", "out_panel"), (s2, False, None, "in_panel")):
        kind, block, group = kernels.kind_of(s)
        arrays = [lv for lv in s._levels if lv.arrays()][-1].arrays()
        ptype = L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64"
        plan = family.tiles(target, kind, 7, "f32", "f32", ptype, L.type_of(arrays["crd"].dtype), block, group,
                            bias=bias, activation=act)
        plans.append(replace(plan, **{flag: True}))
    assert plans[0].T == plans[1].T == 8
    mid, y = np.full(12 * 8, np.nan, dtype=np.float32), np.zeros((7, 6), dtype=np.float32)
    interp.run(family.forward(plans[0]), _args(s1, x, mid, b1, plans[0]))
    panels = torch.from_numpy(mid).reshape(12, 8)  # (one tile: feature-major, 8 token lanes)
    assert bool((panels[:, 7] == 0).all())
    torch.testing.assert_close(panels[:, :7].t(), F.gelu(F.linear(x, w1, b1)), rtol=1e-5, atol=1e-5)
    interp.run(family.forward(plans[1]), {**_args(s2, x, y, None, plans[1]), "x": mid})
    torch.testing.assert_close(torch.from_numpy(y), F.linear(F.gelu(F.linear(x, w1, b1)), w2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [33, 1])
def test_products_of_one_input_share_its_panels(tokens, monkeypatch):
    """``linear_shared``: the input made into panels once (``panels``), each product reading them in place, each
    with its own bias and activation; one token: the separate calls."""
    runs, real = [], kernels._run
    monkeypatch.setattr(kernels, "_run", lambda part, plan, *a, **k: runs.append(plan) or real(part, plan, *a, **k))
    ws = [_masked(fmt, 16, 24, 11 + k) for k, fmt in enumerate(("csr", "nm(2, 4)", "csr"))]
    x, b = torch.randn(tokens, 24), torch.randn(16)
    out = kernels.linear_shared([scorch.asformat(w, f) for w, f in zip(ws, ("csr", "nm(2, 4)", "csr"))], x,
                                [b, None, b], [None, "gelu", "relu"])
    want = [F.linear(x, ws[0], b), F.gelu(F.linear(x, ws[1])), torch.relu(F.linear(x, ws[2], b))]
    for y, w in zip(out, want):
        torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)
    assert [p.in_panel for p in runs] == ([True] * 3 if tokens > 1 else [False] * len(runs))
    panel = kernels.panels(x, 16)
    assert panel.shape == (-(-tokens // 16), 24, 16) and torch.equal(panel[0, :, 0], x[0])
    with pytest.raises(ValueError, match="linear_shared"):
        kernels.linear_shared([scorch.asformat(ws[0].t().contiguous(), "csr")], x, [None], [None])
