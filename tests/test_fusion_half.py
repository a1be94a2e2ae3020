"""Fused attention (``scorch.compile``) on bfloat16 and float16 values: the fused forward and backward kernels
compute in float32 (row buffers, softmax max and sum, output accumulators) and round once into each 16-bit array
they write, so results are checked against the exact attention (float64 from the 16-bit inputs) rounded once.

Tolerances: a value rounded once from an accurate float32 result is within one ulp of the 16-bit type of the
exact value (half an ulp from the rounding, the float32 errors may tip a near tie), plus a float32-sized slack
relative to the magnitude of its terms (``mag``: the sum of their absolute values). The gradients read the
probabilities as the forward kept them (rounded once to 16 bits) and ``dk`` reads the scores' gradient rounded
once, so their tolerance adds one 16-bit epsilon relative to the terms' magnitude. A kernel that rounded its
probabilities before the product, or accumulated an output in 16 bits, fails ``test_per_step_rounding_fails``.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch import fusion
from scorch import loopir as L
from scorch.ops import segment
from scorch.unary_maps import MAPS

DTYPES = [torch.bfloat16, torch.float16]


def attention(q, k, v, mask):
    s = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=q.shape[1] ** -0.5)
    return torch.sparse.mm(torch.sparse.softmax(s, dim=1), v)


fused_attention = scorch.compile(attention)


def _ulp(x, dtype):
    """The spacing of the 16-bit type at ``|x|`` (its subnormal spacing below its normal range)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp_min(fi.tiny))
    return torch.ldexp(torch.full_like(x, fi.eps), e - 1)


def _close(got, ref, mag, dtype, grad=False):
    """``got`` (16-bit) within one ulp of ``ref`` (exact, float64) plus slack relative to the terms' magnitude."""
    assert got.dtype == dtype and got.shape == ref.shape
    slack = 2.0 ** -16 + (torch.finfo(dtype).eps if grad else 0.0)
    err = (got.double() - ref).abs()
    bad = err > _ulp(ref, dtype) + slack * mag
    assert not bad.any(), (got[bad], ref[bad], mag[bad])


def _reference(q, k, v, keep, alpha, g):
    """``{name: (exact value, magnitude of its terms)}`` of the attention's output and gradients (output gradient
    ``g``), in float64 from the 16-bit inputs. A row without entries gives zeros. The magnitudes count a
    probability or a score's gradient as at least the 16-bit type's smallest normal (``tiny``): below it, rounding
    one loses up to half the subnormal spacing, ``eps * tiny / 2``, not a relative ``eps / 2``."""
    tiny = torch.finfo(q.dtype).tiny
    q, k, v, g = (t.double() for t in (q, k, v, g))
    p = torch.softmax((alpha * q @ k.T).masked_fill(~keep, float("-inf")), 1).nan_to_num(0.0)
    dp = (g @ v.T) * keep
    t = (p * dp).sum(1, keepdim=True)
    ds = alpha * p * (dp - t)
    pm = torch.where(keep, p.clamp_min(tiny), 0.0)
    m = abs(alpha) * pm * ((dp - t).abs() + (pm * dp.abs()).sum(1, keepdim=True))  # (bounds |ds| and its error)
    m = torch.where(keep, m.clamp_min(tiny), 0.0)
    return {"p": p, "out": (p @ v, pm @ v.abs()), "dq": (ds @ k, m @ k.abs()), "dk": (ds.T @ q, m.T @ q.abs()),
            "dv": (p.T @ g, pm.T @ g.abs())}


def _spy(monkeypatch):
    """The fused kernels' ``(IR, compiled, values)`` as ``prepare`` and ``prepare_backward`` return them."""
    seen = {"forward": [], "backward": []}

    def spying(real, key):
        def spy(*args, **kwargs):
            seen[key].append(real(*args, **kwargs))
            return seen[key][-1]
        return spy
    monkeypatch.setattr(fusion, "prepare", spying(fusion.prepare, "forward"))
    monkeypatch.setattr(fusion, "prepare_backward", spying(fusion.prepare_backward, "backward"))
    return seen


def _case(n, m, d, dv, density, dtype, seed):
    """q, k, v (16-bit), a CSR mask and its dense pattern: row 0 empty, row 1 with one entry."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, m, generator=g) < density
    keep[0] = False
    keep[1] = False
    keep[1, seed % m] = True
    mask = scorch.asformat(keep.to(dtype), "csr", index_dtype=torch.int32)
    q, k, v = (torch.randn(r, c, generator=g).mul(2).to(dtype) for r, c in ((n, d), (m, d), (m, dv)))
    return q, k, v, mask, keep


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), m=st.integers(1, 24), d=st.sampled_from([4, 16]), dv=st.sampled_from([3, 32]),
       density=st.sampled_from([0.1, 0.5, 1.0]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_fused_attention_and_gradients_round_once(n, m, d, dv, density, dtype, seed):
    """Forward without a backward (no probabilities kept), then with one: the output, the kept probabilities and
    the gradients of q, k and v, each by the fused kernels (16-bit arrays in and out, float32 inside)."""
    with pytest.MonkeyPatch.context() as mp:
        seen = _spy(mp)
        q, k, v, mask, keep = _case(n, m, d, dv, density, dtype, seed)
        alpha = d ** -0.5
        w = torch.randn(n, dv, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        ref = _reference(q, k, v, keep, alpha, w)
        _close(fused_attention(q, k, v, mask), *ref["out"], dtype)
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fused_attention(qs, ks, vs, mask)
        _close(out.detach(), *ref["out"], dtype)
        (out.float() * w.float()).sum().backward()  # (the output's gradient is w, exactly)
        for name, t in (("dq", qs), ("dk", ks), ("dv", vs)):
            _close(t.grad, *ref[name], dtype, grad=True)
    vt = L.type_of(dtype)
    kinds = [(kernel.name, kernel.param("out").type, "probs" in values) for kernel, _, values in seen["forward"]]
    assert kinds == [("scorch_attention", vt, False), ("scorch_attention", vt, True)]  # fused, both times
    (kernel, _, values), = seen["backward"]
    assert kernel.param("ds").type == vt and kernel.param("dq").type == vt
    # the intermediates are float32 row buffers, not arrays: the scores, the probabilities the product reads
    assert not {"scores", "p32", "dp", "ds32"} & {p.name for p in kernel.params + seen["forward"][1][0].params}
    probs = seen["forward"][1][2]["probs"]
    _close(probs, ref["p"][keep], torch.ones(int(keep.sum()), dtype=torch.float64), dtype)
    assert (out[0] == 0).all() and (qs.grad[0] == 0).all()  # the empty row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_step_rounding_fails(dtype, monkeypatch):
    """Two rows on which rounding between the steps would show. Probabilities (or the exponentials they are made
    of) rounded to 16 bits before the product: scores (0, delta) and v = (1, -1) give p0 - p1, a difference that
    their rounding moves by more than two ulps. An output accumulated in 16 bits: 32 equal scores (probabilities
    1/32, exact) and v = 32 * (1024, 0.25, ...) give 1024 + 31 / 4, which rounds to 1032 in both types; a 16-bit
    sum stays at 1024 (1024 + 0.25 rounds back to 1024). The fused kernel must give each rounded once."""
    seen = _spy(monkeypatch)
    delta = torch.tensor(0.07).to(dtype)
    q = torch.tensor([[1.0]], dtype=dtype)
    k = torch.stack([torch.zeros((), dtype=dtype), delta]).reshape(2, 1)
    v = torch.tensor([[1.0], [-1.0]], dtype=dtype)
    mask = scorch.asformat(torch.ones(1, 2, dtype=dtype), "csr")
    keep = torch.ones(1, 2, dtype=torch.bool)
    exact = _reference(q, k, v, keep, 1.0, torch.zeros(1, 1))
    (ref, mag), p = exact["out"], exact["p"]
    e = torch.exp(p.log() - p.log().max()).to(dtype).double()
    for rounded in (p.to(dtype).double(), e / e.sum()):
        with pytest.raises(AssertionError):
            _close((rounded @ v.double()).to(dtype), ref, mag, dtype)
    _close(fused_attention(q, k, v, mask), ref, mag, dtype)

    q, k = torch.zeros(1, 4, dtype=dtype), torch.randn(32, 4).to(dtype)
    v = torch.full((32, 2), 8.0, dtype=dtype)
    v[0] = 32 * 1024
    mask = scorch.asformat(torch.ones(1, 32, dtype=dtype), "csr")
    total = torch.zeros((), dtype=dtype)
    for x in v[:, 0] / 32:  # (exact: powers of two)
        total += x
    assert total == 1024
    assert torch.equal(fused_attention(q, k, v, mask), torch.full((1, 2), 1032.0, dtype=dtype))
    assert len(seen["forward"]) == 2 and all(s is not None for s in seen["forward"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lazy_values_used_elsewhere_and_their_gradients(dtype):
    """Scores and probabilities returned too (the scores computed op by op, the probabilities kept by the fused
    kernel) and in the loss: their gradients go through the lazy nodes (the segment softmax's backward on 16-bit
    values) and add to the fused backward's; against float64."""
    q, k, v, mask, keep = _case(20, 16, 8, 4, 0.5, dtype, seed=4)

    def both(q, k, v, mask):
        s = torch.sparse.sampled_addmm(mask, q, k.T, beta=0.0, alpha=0.5)
        a = torch.sparse.softmax(s, dim=1)
        return a @ v, a, s

    qs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, a, s = scorch.compile(both)(*qs, mask)
    assert torch.equal(s.values(), both(q, k, v, mask)[2].values())
    ref = _reference(q, k, v, keep, 0.5, torch.zeros(20, 4))
    _close(out.detach(), *ref["out"], dtype)
    _close(a.values().detach(), ref["p"][keep], torch.ones(int(keep.sum()), dtype=torch.float64), dtype)
    ((out.float() ** 2).sum() + (a.values().float() ** 3).sum()).backward()
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    p = torch.softmax((0.5 * refs[0] @ refs[1].T).masked_fill(~keep, float("-inf")), 1).nan_to_num(0.0)
    (((p @ refs[2]) ** 2).sum() + (p[keep] ** 3).sum()).backward()
    for g, r in zip(qs, refs):
        torch.testing.assert_close(g.grad.double(), r.grad, atol=4 * torch.finfo(dtype).eps * r.grad.abs().max(),
                                   rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_segment_softmax_rounds_once(dtype):
    """The op-by-op row softmax and its backward on 16-bit values: the float32 kernels on widened copies,
    rounded once (the exact values within an ulp)."""
    pos = torch.tensor([0, 3, 3, 4, 40], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(40, generator=g).mul(3).to(dtype) for _ in range(2))
    y = segment.softmax(x, pos)
    with torch.no_grad():  # (as in a backward pass; recording a graph, it runs torch's ops)
        dx = segment.softmax_backward(y, dy, pos)
    for lo, hi in zip(pos[:-1].tolist(), pos[1:].tolist()):
        ref = torch.softmax(x[lo:hi].double(), 0)
        _close(y[lo:hi], ref, torch.ones_like(ref), dtype)
        yd, gd = y[lo:hi].double(), dy[lo:hi].double()
        ref = yd * (gd - (yd * gd).sum())
        _close(dx[lo:hi], ref, yd * (gd.abs() + (yd * gd.abs()).sum()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["op by op", "scorch.compile"])
def test_sampled_product_scaled_by_alpha_rounds_once(dtype, compiled):
    """``sampled_addmm(S, A, B, beta=0, alpha)`` on 16-bit values with integer A and B: every dot product is an
    integer exact in float32 (beyond the 16-bit types' integers) and so is its product with alpha = 3/8, however
    the kernel orders the products, so scaling inside the kernel and rounding once gives exactly
    ``(alpha * (A @ B)).to(dtype)``; rounding the product first and scaling it afterwards does not (the lazy SDDMM
    of ``scorch.compile`` and the op-by-op one alike)."""
    g = torch.Generator().manual_seed(7)
    a = torch.randint(-16, 17, (24, 32), generator=g).to(dtype)
    b = torch.randint(-16, 17, (32, 20), generator=g).to(dtype)
    keep = torch.rand(24, 20, generator=g) < 0.5
    mask = scorch.asformat(keep.to(dtype), "csr")

    def scores(a, b, mask):
        return torch.sparse.sampled_addmm(mask, a, b, beta=0.0, alpha=0.375)

    got = (scorch.compile(scores) if compiled else scores)(a, b, mask)
    want = (0.375 * (a.float() @ b.float())).to(dtype)[keep]
    assert torch.equal(got.values(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("step", [m.name for m in MAPS if m.epilogue])
def test_epilogue_maps_compile_for_16_bit_values(dtype, step):
    """``scorch.compile(tanh(S @ X + b))`` in float16 did not compile: the C++ library has no ``_Float16`` overload of
    ``tanh`` / ``exp``; the maps run in float32 and round once."""
    g = torch.Generator().manual_seed(2)
    d = (torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) < 0.5)).to(dtype)
    s = scorch.asformat(d, "csr")
    x, b = torch.randn(5, 4, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype)
    fn = getattr(torch, step)
    got = scorch.compile(lambda s, x, b: fn(s @ x + b))(s, x, b)
    want = fn(d.float() @ x.float() + b.float())
    assert got.dtype == dtype
    # (square doubles the rounding of its 16-bit operand: a relative tolerance; sqrt is nan where both are)
    torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=2e-3,
                               equal_nan=True)
