"""``F.scaled_dot_product_attention`` with a sparse ``attn_mask`` (``scorch/ops/attention.py``): values and
gradients against torch's dense SDPA given the same mask densified (a bool mask as it is; an additive mask with its
unstored positions ``-inf``), across formats (CSR, COO, blocked, N-d COO), mask shapes, dtypes, ``is_causal``,
``scale``, ``enable_gqa``, dropout and empty rows; the fused kernels run, and nothing falls back to dense."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch import fusion
from scorch.nn import functional as F

from fallback_check import falls_back

_TF = torch.nn.functional  # (torch's own: the reference)


def _coords(sparse):
    """``(positions, coordinates)``: each stored value's position in ``values()`` and its coordinates."""
    coo = scorch.asformat(sparse.with_values(torch.arange(1, sparse.values().numel() + 1)
                                            .reshape(sparse.values().shape)), "coo")
    return coo.values() - 1, tuple(lvl.crd.long() for lvl in coo.levels)


def _set_values(sparse, dense):
    """``sparse`` with each stored value read from ``dense`` at its coordinates (a blocked format's padding too)."""
    at, where = _coords(sparse)
    vals = torch.zeros(sparse.values().numel(), dtype=dense.dtype)
    vals[at] = dense[where]
    return sparse.with_values(vals.reshape(sparse.values().shape))


def _dense_of(sparse):
    """The dense mask a sparse one means: a bool mask densified; an additive one with unstored positions -inf."""
    if sparse.dtype == torch.bool:
        return sparse.to_dense()
    at, where = _coords(sparse)
    out = torch.zeros(sparse.shape, dtype=sparse.dtype).index_put(where, sparse.values().reshape(-1)[at],
                                                                  accumulate=True)
    stored = torch.zeros(sparse.shape, dtype=torch.bool).index_put(where, torch.tensor(True))
    return out.masked_fill(~stored, float("-inf"))


def _mask(shape, density, fmt, additive, dtype, g):
    """``(sparse mask, dense reference mask)``: a bool mask with some stored False entries, or an additive one."""
    keep = torch.rand(shape, generator=g) < density
    stored = keep | (torch.rand(shape, generator=g) < 0.2)
    values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) if additive else keep
    sparse = _set_values(scorch.asformat(keep if additive else stored, fmt), values)
    return sparse, _dense_of(sparse)


def _qkv(B, H, L, S, E, Ev, dtype, g):
    return [torch.randn(B, H, n, e, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n, e in ((L, E), (S, E), (S, Ev))]


def _compare(mask, dense, q, k, v, tol=None, **kw):
    """The sparse mask's SDPA against torch's with the dense mask: output and the gradients of q, k, v (and the
    mask's values where they require grad); no fallback, nothing densified."""
    scorch.reset_stats()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert scorch.stats() == {"densified": {}, "fallback": {}}, scorch.stats()
    causal = kw.pop("is_causal", False)
    if causal:
        tri = torch.ones(dense.shape[-2:], dtype=torch.bool).tril()
        dense = dense & tri if dense.dtype == torch.bool else dense.masked_fill(~tri, float("-inf"))
    ref = _TF.scaled_dot_product_attention(q, k, v, attn_mask=dense, **kw)
    tol = tol or {}
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    return out


FORMATS = ["csr", "coo", "bsr(2, 2)", "csc"]


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 5), S=st.integers(1, 5), E=st.integers(1, 5),
       Ev=st.integers(1, 4), density=st.sampled_from([0.0, 0.2, 0.5, 1.0]), fmt=st.sampled_from(FORMATS),
       additive=st.booleans(), causal=st.booleans(), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 99))
def test_matches_dense_sdpa(B, H, L, S, E, Ev, density, fmt, additive, causal, scale, seed):
    g = torch.Generator().manual_seed(seed)
    if fmt.startswith("bsr"):
        L, S = 2 * L, 2 * S
    mask, dense = _mask((L, S), density, fmt, additive, torch.float64, g)
    q, k, v = _qkv(B, H, L, S, E, Ev, torch.float64, g)
    _compare(mask, dense, q, k, v, is_causal=causal, scale=scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, None), (torch.bfloat16, dict(atol=3e-2, rtol=3e-2))])
@pytest.mark.parametrize("additive", [False, True])
def test_float32_and_bfloat16(dtype, tol, additive):
    g = torch.Generator().manual_seed(1)
    mask, dense = _mask((7, 9), 0.4, "csr", additive, dtype, g)
    q, k, v = _qkv(2, 2, 7, 9, 8, 5, dtype, g)
    _compare(mask, dense, q, k, v, tol=tol)


@pytest.mark.parametrize("mshape", [(2, 3, 5, 6), (2, 1, 5, 6), (1, 3, 5, 6), (3, 5, 6), (1, 6), (5, 1)])
@pytest.mark.parametrize("additive", [False, True])
def test_mask_shapes_broadcast(mshape, additive):
    g = torch.Generator().manual_seed(2)
    mask, dense = _mask(mshape, 0.5, "coo", additive, torch.float64, g)
    q, k, v = _qkv(2, 3, 5, 6, 4, 3, torch.float64, g)
    _compare(mask, dense, q, k, v)


def test_3d_inputs_and_one_token():
    g = torch.Generator().manual_seed(3)
    mask, dense = _mask((1, 4), 1.0, "csr", False, torch.float64, g)
    q, k, v = (x[0] for x in _qkv(1, 3, 1, 4, 4, 2, torch.float64, g))
    _compare(mask, dense, q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_())


@pytest.mark.parametrize("additive", [False, True])
def test_the_fused_kernels_run(monkeypatch, additive):
    used = []
    forward, backward = fusion.attention, fusion.attention_backward
    monkeypatch.setattr(fusion, "attention", lambda *a, **kw: used.append("forward") or forward(*a, **kw))
    monkeypatch.setattr(fusion, "attention_backward", lambda *a: used.append("backward") or backward(*a))
    g = torch.Generator().manual_seed(4)
    mask, dense = _mask((16, 12), 0.3, "csr", additive, torch.float32, g)
    q, k, v = _qkv(2, 2, 16, 12, 8, 8, torch.float32, g)
    _compare(mask, dense, q, k, v)
    assert used == ["forward", "backward"]


def test_empty_rows_give_zeros_as_torch():
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(6, 5, generator=g) < 0.5
    keep[[1, 4]] = False
    q, k, v = _qkv(1, 2, 6, 5, 3, 4, torch.float64, g)
    for mask in (scorch.asformat(keep, "csr"), _set_values(scorch.asformat(keep | True, "csr"), keep)):
        out = _compare(mask, keep, q, k, v)
        assert (out[..., [1, 4], :] == 0).all()
    # an additive mask whose stored values on a row are all -inf: zeros too (not the softmax's NaN)
    bias = torch.where(keep, 0.5, float("-inf"))
    bias[2] = float("-inf")
    stored = scorch.asformat(torch.ones(6, 5, dtype=torch.float64), "csr").with_values(bias.to(torch.float64).reshape(-1))
    out = _compare(stored, bias.to(torch.float64), q, k, v)
    assert (out[..., [1, 2, 4], :] == 0).all()


def test_additive_mask_values_get_gradients():
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(5, 7, generator=g) < 0.5
    bias = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = scorch.asformat(torch.where(keep, bias, 0), "csr")
    leaf = mask.values().clone().requires_grad_()
    q, k, v = _qkv(2, 2, 5, 7, 4, 3, torch.float64, g)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.with_values(leaf * 1.0))
    dense_leaf = torch.where(keep, bias, 0).requires_grad_()
    ref = _TF.scaled_dot_product_attention(q, k, v, attn_mask=dense_leaf.masked_fill(~keep, float("-inf")))
    gout = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, leaf, gout)
    (want,) = torch.autograd.grad(ref, dense_leaf, gout)
    torch.testing.assert_close(got, want[keep])


def test_uncoalesced_coo_mask_sums_duplicates():
    g = torch.Generator().manual_seed(7)
    idx = torch.tensor([[0, 2, 0, 1, 2], [1, 3, 1, 0, 3]])
    q, k, v = _qkv(1, 2, 3, 4, 3, 2, torch.float64, g)
    bias = torch.tensor([0.5, -1.0, 0.25, 2.0, 0.0], dtype=torch.float64)
    mask = scorch.sparse_coo_tensor(idx, bias, (3, 4))
    dense = torch.full((3, 4), float("-inf"), dtype=torch.float64)
    dense[0, 1], dense[2, 3], dense[1, 0] = 0.75, -1.0, 2.0
    _compare(mask, dense, q, k, v)
    flags = scorch.sparse_coo_tensor(idx, torch.tensor([False, True, True, False, False]), (3, 4))
    _compare(flags, flags.to_dense(), q, k, v)


def test_grouped_query_attention():
    g = torch.Generator().manual_seed(8)
    mask, dense = _mask((5, 6), 0.5, "csr", False, torch.float64, g)
    q = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    _compare(mask, dense, q, k, v, enable_gqa=True)


@pytest.mark.parametrize("additive", [False, True])
def test_dropout(additive):
    g = torch.Generator().manual_seed(9)
    mask, dense = _mask((6, 8), 0.5, "csr", additive, torch.float64, g)
    q, k, v = _qkv(1, 2, 6, 8, 4, 8, torch.float64, g)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0), plain)
    # with v the identity, the output is the dropped probabilities themselves; the same seed drops the same entries
    eye = torch.eye(8, dtype=torch.float64).expand(1, 2, 8, 8)
    p = 0.4
    torch.manual_seed(0)
    dropped = F.scaled_dot_product_attention(q, k, eye, attn_mask=mask, dropout_p=p)
    probs = _TF.scaled_dot_product_attention(q, k, eye, attn_mask=dense)
    kept = dropped != 0
    assert not (kept & (probs == 0)).any()  # never outside the mask
    torch.testing.assert_close(dropped[kept], probs[kept] / (1 - p))
    assert 0 < kept.sum() < (probs != 0).sum()
    torch.manual_seed(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    torch.testing.assert_close(out, dropped.detach() @ v)
    gout = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, v, gout)
    torch.testing.assert_close(dv, dropped.detach().transpose(-1, -2) @ gout)


def test_dropout_expectation():
    g = torch.Generator().manual_seed(10)
    mask, dense = _mask((4, 6), 0.6, "csr", False, torch.float64, g)
    q, k, v = _qkv(1, 1, 4, 6, 3, 2, torch.float64, g)
    torch.manual_seed(1)
    with torch.no_grad():
        mean = sum(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5) for _ in range(400)) / 400
        ref = _TF.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(mean, ref, atol=0.25, rtol=0)


def test_double_backward_matches_dense():
    g = torch.Generator().manual_seed(11)
    mask, dense = _mask((4, 5), 0.6, "csr", False, torch.float64, g)
    q, k, v = _qkv(1, 1, 4, 5, 3, 2, torch.float64, g)
    results = []
    for fn, m in ((F.scaled_dot_product_attention, mask), (_TF.scaled_dot_product_attention, dense)):
        out = fn(q, k, v, attn_mask=m)
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        results.append(torch.autograd.grad(gq.sum(), (k, v)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_dense_or_no_mask_is_torch():
    g = torch.Generator().manual_seed(12)
    q, k, v = _qkv(1, 2, 4, 5, 3, 2, torch.float64, g)
    keep = torch.rand(4, 5, generator=g) < 0.5
    scorch.reset_stats()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                       _TF.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), _TF.scaled_dot_product_attention(q, k, v))
    assert scorch.stats() == {"densified": {}, "fallback": {}}


def test_sparse_query_falls_back():
    g = torch.Generator().manual_seed(13)
    q, k, v = (x.detach() for x in _qkv(1, 1, 4, 5, 3, 2, torch.float64, g))
    sq = scorch.asformat(q[0, 0], "csr")
    falls_back(lambda: F.scaled_dot_product_attention(sq, k[0, 0], v[0, 0]),
               lambda: _TF.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0]),
               "torch.scaled_dot_product_attention")


def test_bad_masks_raise():
    q, k, v = (torch.randn(2, 3, n, 4) for n in (5, 6, 6))
    with pytest.raises(RuntimeError, match="broadcast"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=scorch.asformat(torch.ones(5, 7, dtype=torch.bool), "csr"))
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=scorch.asformat(torch.ones(5, 6, dtype=torch.int64), "csr"))
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q.double(), k, v, attn_mask=scorch.asformat(torch.ones(5, 6).bool(), "csr"))


def test_the_mask_pattern_is_made_once():
    g = torch.Generator().manual_seed(14)
    keep = torch.rand(6, 6, generator=g) < 0.5
    keep[0, 0] = True
    mask = scorch.asformat(keep, "csr")
    q, k, v = (x.detach() for x in _qkv(2, 2, 6, 6, 4, 4, torch.float32, g))
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    made = len(scorch.ops.attention._PATTERNS)
    again = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(scorch.ops.attention._PATTERNS) == made and torch.equal(first, again)
    mask.values()[0] = False  # (entry (0, 0)) a changed bool value changes the pattern: made again
    keep[0, 0] = False
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               _TF.scaled_dot_product_attention(q, k, v, attn_mask=keep))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["csr", "coo", "bsr"])
def test_torch_sparse_layout_masks(layout):
    g = torch.Generator().manual_seed(15)
    keep = torch.rand(6, 8, generator=g) < 0.5
    mask = {"csr": keep.to_sparse_csr, "coo": keep.to_sparse, "bsr": lambda: keep.to_sparse_bsr((2, 2))}[layout]()
    q, k, v = _qkv(2, 1, 6, 8, 4, 3, torch.float64, g)
    _compare(mask, mask.to_dense(), q, k, v)


def test_a_sparse_leaf_mask_gets_a_sparse_gradient():
    g = torch.Generator().manual_seed(16)
    keep = torch.rand(5, 6, generator=g) < 0.5
    bias = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = scorch.asformat(torch.where(keep, bias, 0), "csr").requires_grad_()
    q, k, v = (x.detach() for x in _qkv(2, 1, 5, 6, 4, 3, torch.float64, g))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    gout = torch.randn_like(out)
    out.backward(gout)
    dense = torch.where(keep, bias, float("-inf")).requires_grad_()
    _TF.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(gout)
    assert type(mask.grad) is scorch.SparseTensor
    torch.testing.assert_close(mask.grad.values(), dense.grad[keep])


def test_a_float32_mask_adds_to_float64_scores():
    g = torch.Generator().manual_seed(17)
    mask, dense = _mask((4, 5), 0.6, "csr", True, torch.float32, g)
    q, k, v = _qkv(1, 2, 4, 5, 3, 2, torch.float64, g)
    _compare(mask, dense, q, k, v)


@pytest.mark.parametrize("keep_probs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_additive_fused_kernel_interpreted_matches_compiled(keep_probs, dtype):
    """The fused kernel with the bias added to the scores as they are stored (``fuse.add_stores``): its IR through
    the loop-IR interpreter (bounds-checked) gives the compiled kernel's result, and that is the dense softmax of
    the biased scores."""
    from scorch import loopir as L
    from scorch.compiler import interp
    g = torch.Generator().manual_seed(18)
    keep = torch.rand(9, 7, generator=g) < 0.5
    keep[3] = False  # (an empty row)
    pattern = scorch.asformat(keep.to(dtype), "csr")
    q, k, v = (torch.randn(n, e, generator=g, dtype=torch.float64).to(dtype) for n, e in ((9, 4), (7, 4), (7, 3)))
    bias = torch.randn(pattern.nnz, generator=g, dtype=torch.float64).to(dtype)
    sddmm = fusion.SddmmExpr(pattern, q, k, 0.5, bias)
    out, probs = fusion.attention(sddmm, v, keep_probs=keep_probs)
    fused, _, values = fusion.prepare(sddmm, v, keep_probs)
    assert "bias" in [p.name for p in fused.params]
    assert len(fused.body.stmts) == 1 and isinstance(fused.body.stmts[0], L.For)  # one row loop
    interp.run(fused, {name: (x.reshape(-1).numpy() if isinstance(x, torch.Tensor) else x)
                       for name, x in values.items()})
    torch.testing.assert_close(values["out"], out)
    dense = torch.full((9, 7), float("-inf"), dtype=dtype).masked_scatter(keep, bias)
    want = torch.softmax(0.5 * q @ k.T + dense, 1).nan_to_num(0.0) @ v
    torch.testing.assert_close(out, want)


def test_an_additive_mask_changed_in_place_or_reused_causally():
    """The values of an additive mask are kept per mask with the pattern: a change in place is seen, and the same
    mask with and without ``is_causal`` gets the entries of each."""
    g = torch.Generator().manual_seed(19)
    mask, dense = _mask((6, 6), 0.7, "csr", True, torch.float64, g)
    q, k, v = (x.detach() for x in _qkv(2, 2, 6, 6, 4, 3, torch.float64, g))
    tri = torch.ones(6, 6, dtype=torch.bool).tril()
    for _ in range(2):
        for causal in (False, True):
            want = _TF.scaled_dot_product_attention(q, k, v, attn_mask=dense.masked_fill(~tri, float("-inf"))
                                                    if causal else dense)
            torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal),
                                       want)
        mask.values().mul_(3.0)
        dense = dense * 3.0


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_one_input_needs_grad_and_a_transposed_query(additive, which):
    """Multi-head code passes ``x.view(B, L, H, E).transpose(1, 2)``: a strided query; only one input needing a
    gradient."""
    g = torch.Generator().manual_seed(20)
    mask, dense = _mask((6, 7), 0.5, "csr", additive, torch.float64, g)
    q = torch.randn(2, 6, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(2, 3, 7, e, generator=g, dtype=torch.float64) for e in (4, 5))
    xs = [q, k, v]
    xs[which] = xs[which].detach().requires_grad_()
    out = F.scaled_dot_product_attention(*xs, attn_mask=mask)
    ref = _TF.scaled_dot_product_attention(*xs, attn_mask=dense)
    torch.testing.assert_close(out, ref)
    gout = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, xs[which], gout), torch.autograd.grad(ref, xs[which], gout))


@pytest.mark.parametrize("L,S", [(0, 7), (5, 0)])
def test_empty_problems(L, S):
    q, k, v = torch.randn(2, L, 4), torch.randn(2, S, 4), torch.randn(2, S, 3)
    keep = torch.ones(L, S, dtype=torch.bool)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=scorch.asformat(keep, "coo"))
    torch.testing.assert_close(out, _TF.scaled_dot_product_attention(q, k, v, attn_mask=keep))
