"""``scorch.compile`` (``scorch/fusion.py``) and row fusion of loop-IR kernels (``scorch/compiler/fuse.py``):
the fused attention kernel against the op-by-op path and dense torch, across shapes (empty rows, one entry, fully
dense), dtypes and index widths; its gradients; the fallback when a lazy value is used otherwise; the fused
kernel's IR through the interpreter (the oracle) against the compiled C++."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch.deferred import Deferred
from scorch import loopir as L
from scorch.compiler import fuse, interp


def attention(q, k, v, mask):
    s = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=q.shape[1] ** -0.5)
    a = torch.sparse.softmax(s, dim=1)
    return torch.sparse.mm(a, v)


fused_attention = scorch.compile(attention)


def _dense_reference(q, k, v, keep, scale=None):
    s = (q @ k.T) * (q.shape[1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=1).nan_to_num(0.0)  # a row without entries: no output
    return p @ v


def _case(n, m, d, dv, density, dtype, index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, m, generator=g) < density
    mask = scorch.asformat(keep.to(dtype), "csr", index_dtype=index_dtype)
    q = torch.randn(n, d, generator=g, dtype=dtype)
    k = torch.randn(m, d, generator=g, dtype=dtype)
    v = torch.randn(m, dv, generator=g, dtype=dtype)
    return q, k, v, mask, keep


@settings(max_examples=20)
@given(n=st.integers(1, 40), m=st.integers(1, 40), d=st.sampled_from([1, 4, 16]), dv=st.sampled_from([1, 3, 16]),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), dtype=st.sampled_from([torch.float32, torch.float64]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_fused_matches_op_by_op_and_dense(n, m, d, dv, density, dtype, index_dtype):
    q, k, v, mask, keep = _case(n, m, d, dv, density, dtype, index_dtype)
    got = fused_attention(q, k, v, mask)
    assert type(got) is torch.Tensor and got.dtype == dtype and got.shape == (n, dv)
    torch.testing.assert_close(got, attention(q, k, v, mask))
    torch.testing.assert_close(got, _dense_reference(q, k, v, keep))


def test_the_fused_kernel_runs(monkeypatch):
    from scorch import fusion
    calls = []
    kernel = fusion.attention
    monkeypatch.setattr(fusion, "attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, k, v, mask, _ = _case(64, 64, 16, 16, 0.2, torch.float32, torch.int32)
    fused_attention(q, k, v, mask)
    assert calls == [1]
    attention(q, k, v, mask)  # outside scorch.compile: op by op
    assert calls == [1]


def test_lazy_values_used_elsewhere_fall_back():
    """Returning the scores and probabilities too: each is computed as the op-by-op path computes it."""
    q, k, v, mask, _ = _case(30, 20, 8, 5, 0.3, torch.float64, torch.int64)

    def with_intermediates(q, k, v, mask):
        s = torch.sparse.sampled_addmm(mask, q, k.T, beta=0.0, alpha=0.5)
        a = torch.sparse.softmax(s, dim=1)
        return s, a, a @ v, s.values().sum()

    got = scorch.compile(with_intermediates)(q, k, v, mask)
    want = with_intermediates(q, k, v, mask)
    for g, w in zip(got, want):
        if isinstance(w, scorch.SparseTensor):
            assert type(g.values()) is torch.Tensor
            g, w = g.to_dense(), w.to_dense()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("shape", [(24, 18, 6, 5, 0.4), (40, 50, 16, 32, 0.6), (5, 7, 8, 8, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_gradients(shape, dtype, monkeypatch):
    """The backward: the scores' gradient and dq by the fused backward kernel, dk and dv by transposed products
    (the lazy softmax and SDDMM nodes get no gradient and do nothing); against dense torch."""
    from scorch import fusion
    used = []
    kernel = fusion.attention_backward
    monkeypatch.setattr(fusion, "attention_backward", lambda *a: used.append(1) or kernel(*a))
    q, k, v, mask, keep = _case(*shape, dtype, torch.int32, seed=3)
    for t in (q, k, v):
        t.requires_grad_(True)
    w = torch.randn(shape[0], shape[3], dtype=dtype)
    (fused_attention(q, k, v, mask) * w).sum().backward()
    assert used == [1]
    got = [t.grad.clone() for t in (q, k, v)]
    refs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    (_dense_reference(*refs, keep) * w).sum().backward()
    for g, r in zip(got, refs):
        torch.testing.assert_close(g, r.grad)


def test_gradients_when_the_probabilities_are_used_elsewhere_too():
    """The probabilities returned and in the loss too: their gradient goes through the lazy softmax and SDDMM
    nodes and adds to the fused backward's; double backward (a graph of the backward) goes op by op."""
    q, k, v, mask, keep = _case(20, 16, 8, 4, 0.5, torch.float64, torch.int64, seed=4)

    def both(q, k, v, mask):
        a = torch.sparse.softmax(torch.sparse.sampled_addmm(mask, q, k.T, beta=0.0, alpha=0.5), dim=1)
        return a @ v, a

    qs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, a = scorch.compile(both)(*qs, mask)
    ((out ** 2).sum() + (a.values() ** 3).sum()).backward()
    refs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_r, a_r = both(*refs, mask)
    ((out_r ** 2).sum() + (a_r.values() ** 3).sum()).backward()
    for g, r in zip(qs, refs):
        torch.testing.assert_close(g.grad, r.grad)
    qs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = scorch.compile(both)(*qs, mask)
    (gq,) = torch.autograd.grad((out ** 2).sum(), qs[0], create_graph=True)
    (gq_r,) = torch.autograd.grad((both(*refs, mask)[0] ** 2).sum(), refs[0], create_graph=True)
    torch.testing.assert_close(gq, gq_r)


def test_fused_backward_kernel_interpreted_matches_compiled():
    from scorch import fusion
    q, k, v, mask, keep = _case(40, 50, 16, 32, 0.6, torch.float64, torch.int32, seed=6)
    p = fusion.attention(fusion.SddmmExpr(mask, q, k, 0.25), v)[1]
    g = torch.randn(40, 32, dtype=torch.float64)
    ds, dq = fusion.attention_backward(mask, p, g, v, k, 0.25)
    dp = (g @ v.T)[keep]  # the op-by-op gradients
    ds_ref = scorch.ops.segment.softmax_backward(p, dp, mask.levels[1].pos) * 0.25
    torch.testing.assert_close(ds, ds_ref)
    torch.testing.assert_close(dq, mask.with_values(ds_ref).to_dense() @ k)
    fused, _, values = fusion.prepare_backward(mask, p, g, v, k, 0.25)
    assert "dp" not in values  # (a row's g @ v^T in a row buffer)
    interp.run(fused, {name: (x.reshape(-1).numpy() if isinstance(x, torch.Tensor) else x)
                       for name, x in values.items()})
    torch.testing.assert_close(values["ds"], ds)
    torch.testing.assert_close(values["dq"], dq)


def test_compile_as_decorator_and_outputs():
    @scorch.compile
    def f(x, w):
        return {"y": scorch.einsum("ij,jk->ik", x, w), "pair": (x.sum(), scorch.einsum("ij->j", x))}

    x, w = torch.randn(5, 4), torch.randn(4, 3)
    out = f(x, w)
    assert type(out["y"]) is torch.Tensor and not isinstance(out["pair"][1], Deferred)
    torch.testing.assert_close(out["y"], x @ w)
    torch.testing.assert_close(out["pair"][1], x.sum(0))
    assert scorch.compile(mode="max-autotune")(lambda a: a * 2)(x).equal(x * 2)


def test_errors_inside_compile_are_the_eager_ones():
    q, k, v, mask, _ = _case(8, 8, 4, 4, 0.5, torch.float32, torch.int32)
    with pytest.raises(ValueError) as eager:
        attention(q, k[:, :3], v, mask)
    with pytest.raises(ValueError) as fused:
        fused_attention(q, k[:, :3], v, mask)
    assert str(eager.value) == str(fused.value)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_interpreted_matches_torch(log):
    """The row softmax and its backward as loop IR (log-space too), through the interpreter, against torch."""
    pos = torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32)
    x = torch.randn(8, dtype=torch.float64)
    y = torch.zeros(8, dtype=torch.float64)
    kernel = fuse.softmax_rows("f64", "i32", log=log)
    interp.run(kernel, {"t0_l0_lo": 0, "t0_l0_ext": 4, "t0_l1_pos": pos.numpy(), "x": x.numpy(), "y": y.numpy(),
                        "scale": 2.0, "nthreads": 1})
    g, dx = torch.randn(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    interp.run(fuse.softmax_backward_rows("f64", "i32", log=log), {
        "t0_l0_lo": 0, "t0_l0_ext": 4, "t0_l1_pos": pos.numpy(), "y": y.numpy(), "g": g.numpy(), "dx": dx.numpy(),
        "scale": 2.0, "nthreads": 1})
    f = torch.log_softmax if log else torch.softmax
    for lo, hi in zip(pos[:-1].tolist(), pos[1:].tolist()):
        xs = x[lo:hi].clone().requires_grad_(True)
        out = f(2.0 * xs, 0)
        torch.testing.assert_close(y[lo:hi], out.detach())
        if hi > lo:
            out.backward(g[lo:hi])
            torch.testing.assert_close(dx[lo:hi], xs.grad)


@pytest.mark.parametrize("keep_probs", [True, False])
@pytest.mark.parametrize("shape", [(9, 7, 4, 3, 0.4), (40, 50, 16, 32, 0.6)])  # (the second: whole vector tiles)
def test_fused_kernel_interpreted_matches_compiled(keep_probs, shape):
    """The fused kernel's IR through the loop-IR interpreter (bounds-checked: the row buffers too) gives the
    compiled kernel's result, with the probabilities kept (for a backward) or not (row buffers only, the
    normalization applied to the output rows)."""
    from scorch import fusion
    q, k, v, mask, keep = _case(*shape, torch.float64, torch.int32, seed=5)
    sddmm = fusion.SddmmExpr(mask, q, k, 0.5)
    out, probs = fusion.attention(sddmm, v, keep_probs=keep_probs)
    assert (probs is None) == (not keep_probs)
    fused, _, values = fusion.prepare(sddmm, v, keep_probs)
    assert [p.name for p in fused.params].count("t0_l1_pos") == 1  # the pattern is one argument
    assert "scores" not in values and ("probs" in values) == keep_probs  # intermediates in row buffers
    assert len(fused.body.stmts) == 1 and isinstance(fused.body.stmts[0], L.For)  # one row loop
    interp.run(fused, {name: (x.reshape(-1).numpy() if isinstance(x, torch.Tensor) else x)
                       for name, x in values.items()})
    torch.testing.assert_close(values["out"], out)
    torch.testing.assert_close(out, _dense_reference(q, k, v, keep, scale=0.5))
    if keep_probs:
        torch.testing.assert_close(values["probs"], probs)


def test_rows_refuses_different_row_loops():
    a = fuse.softmax_rows("f32", "i32")
    other = L.Kernel("k", a.params, L.block(L.For(L.Var("c0"), L.Const(0), L.Const(3), L.block(),
                                                  parallel=L.Parallel("static"))))
    with pytest.raises(ValueError, match="row loop differs"):
        fuse.rows("f", [(a, {}), (other, {})])
    with pytest.raises(ValueError, match="not one parallel row loop"):
        fuse.rows("f", [(L.Kernel("k", (), L.block()), {})])


# --- elementwise epilogues on a product ---------------------------------------------------------------------------

@scorch.compile
def _epilogue_model(s, x, b):
    return torch.sigmoid(torch.relu(2.0 * (s @ x) + b) - 0.5 * 0 + 0.25) if b is not None else torch.tanh(s @ x)


def _epilogue_reference(a, x, b):
    return torch.sigmoid(torch.relu(2.0 * (a @ x) + b) + 0.25) if b is not None else torch.tanh(a @ x)


@settings(max_examples=20)
@given(n=st.integers(0, 30), m=st.integers(1, 30), k=st.sampled_from([1, 5, 16, 33]),
       density=st.sampled_from([0.0, 0.2, 1.0]), dtype=st.sampled_from([torch.float32, torch.float64]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]), bias=st.booleans(),
       fmt=st.sampled_from(["csr", "csr", "coo", "csc"]))
def test_epilogue_matches_eager(n, m, k, density, dtype, index_dtype, bias, fmt):
    g = torch.Generator().manual_seed(n * 31 + m)
    a = (torch.rand(n, m, generator=g) < density).to(dtype) * torch.randn(n, m, generator=g, dtype=dtype)
    s = scorch.asformat(a, fmt, index_dtype=index_dtype)
    x = torch.randn(m, k, generator=g, dtype=dtype)
    b = torch.randn(k, generator=g, dtype=dtype) if bias else None
    got = _epilogue_model(s, x, b)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, _epilogue_reference(a, x, b))


def test_epilogue_runs_as_one_kernel_and_falls_back(monkeypatch):
    from scorch import fusion_epilogue as fusion
    fused = []
    kernel = fusion.epilogue_kernel

    def spy(e):
        r = kernel(e)
        fused.append(r is not None)
        return r

    monkeypatch.setattr(fusion, "epilogue_kernel", spy)
    a = torch.randn(20, 12) * (torch.rand(20, 12) < 0.3)
    x, b = torch.randn(12, 8), torch.randn(8)
    torch.testing.assert_close(_epilogue_model(scorch.asformat(a, "csr"), x, b), _epilogue_reference(a, x, b))
    assert fused == [True]
    # another format: the product, then the steps in torch
    torch.testing.assert_close(_epilogue_model(scorch.asformat(a, "coo"), x, b), _epilogue_reference(a, x, b))
    assert fused[-1] is False
    # an op outside the epilogue set, or a bias of another shape: computed op by op, same values
    f = scorch.compile(lambda s, x: torch.exp(s @ x) + torch.ones(20, 8))
    torch.testing.assert_close(f(scorch.asformat(a, "csr"), x), torch.exp(a @ x) + 1)


def test_epilogue_under_autograd_runs_op_by_op():
    a = torch.randn(10, 6, dtype=torch.float64) * (torch.rand(10, 6) < 0.5)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    _epilogue_model(scorch.asformat(a, "csr"), x, b).sum().backward()
    xr, br = x.detach().requires_grad_(), b.detach().requires_grad_()
    _epilogue_reference(a, xr, br).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(b.grad, br.grad)


def test_epilogue_kernel_interpreted_matches_compiled():
    from scorch import fusion_epilogue
    k = fusion_epilogue.epilogue_rows("f64", "i32", (("add", torch.zeros(3)), ("mul", 2.0), ("relu",), ("sigmoid",)), 3)
    out = torch.tensor([[-1.0, 0.5, 2.0], [0.0, -3.0, 1.0]], dtype=torch.float64)
    got = out.clone()
    bias = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)
    interp.run(k, {"t0_l0_lo": 0, "t0_l0_ext": 2, "t0_l1_pos": torch.tensor([0, 1, 2], dtype=torch.int32).numpy(),
                   "out": got.reshape(-1).numpy(), "bias0": bias.numpy(), "num1": 2.0, "nthreads": 1})
    torch.testing.assert_close(got, torch.sigmoid(torch.relu((out + bias) * 2.0)))


def test_repeated_calls_reuse_the_prepared_call_until_the_pattern_changes():
    """A second call on the same mask takes the prepared call (``fusion.READY``); a pattern modified in place
    (other columns, then other row lengths: the longest row grows) is prepared again and still right."""
    from scorch import fusion
    q, k, v, mask, keep = _case(30, 40, 16, 16, 0.3, torch.float32, torch.int64, seed=9)
    first = fused_attention(q, k, v, mask)
    assert any(key[0] == id(mask.levels[1].pos) for key in fusion.READY)
    torch.testing.assert_close(fused_attention(q, k, v, mask), first)
    pos, crd = mask.levels[1].pos, mask.levels[1].crd
    # every row's entries moved to the first columns (still sorted, unique): the same lengths
    for i in range(30):
        a, b = int(pos[i]), int(pos[i + 1])
        crd[a:b] = torch.arange(b - a)
    keep = torch.zeros(30, 40, dtype=torch.bool)
    for i in range(30):
        keep[i, :int(pos[i + 1] - pos[i])] = True
    torch.testing.assert_close(fused_attention(q, k, v, mask), _dense_reference(q, k, v, keep))
    # all entries to the first rows, up to 40 a row: the longest row changes
    nnz = int(pos[-1])
    counts = torch.tensor([min(40, max(0, nnz - 40 * i)) for i in range(30)])
    pos[1:] = torch.cumsum(counts, 0)
    crd[:] = torch.cat([torch.arange(int(c)) for c in counts])
    keep = torch.arange(40)[None, :] < counts[:, None]
    torch.testing.assert_close(fused_attention(q, k, v, mask), _dense_reference(q, k, v, keep))


def test_a_tensor_in_two_roles_does_not_bind_later_calls():
    """A first call passing ``q`` as ``v`` too must not make later calls (same shapes, other tensors) read ``q`` for
    ``v``: the prepared call binds arguments by the first call's tensors only where each plays one role."""
    q, k, v, mask, keep = _case(40, 40, 16, 16, 0.5, torch.float32, torch.int64, seed=12)
    torch.testing.assert_close(fused_attention(q, k, q, mask), _dense_reference(q, k, q, keep))
    torch.testing.assert_close(fused_attention(q, k, v, mask), _dense_reference(q, k, v, keep))
    torch.testing.assert_close(fused_attention(k, q, v, mask), _dense_reference(k, q, v, keep))


def test_moe_benchmark_versions_agree_and_report():
    """The fusion benchmark's MoE versions (dense gates, sparse gates, deferral off, the per-expert loop, and a
    training step of each) compute the same thing at a small size, and the MoE part reports alone (``--only``)."""
    from benchmarks import fusion as bench
    bench.moe_check(48, 8, 4)
    m = {"B": 48, "D": 8, "N": 4, "rows": [("dense gates", 2.0, 1.0, 3.0), ("per-expert loop (torch)", 1.0, 2.0, 1.0)],
         "train": [("dense gates", 4.0, 1.0), ("sparse gates", 1.0, 4.0)]}
    text = bench.report(m, None, None, threads=1, quick=True)
    assert "| per-expert loop (torch) | 1.0 | 2.0x | 1 |" in text and "| sparse gates | 1.0 | 4.0x |" in text
    assert "Sparse attention" not in text and "Dense-only" not in text


def _band_attention(fmt, n=6, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    band = ((torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 1).to(torch.float64)
    qkv = [torch.randn(n, d, dtype=torch.float64, generator=g) for _ in range(3)]
    return scorch.asformat(band, fmt), band, qkv


def _attn(p, q, k, v):
    return torch.sparse.softmax(torch.sparse.sampled_addmm(p, q, k.t(), beta=0.0, alpha=0.5), 1) @ v


def test_double_backward_through_the_fused_attention():
    """``create_graph=True`` through the fused kernel: its probabilities were saved values, so the second-order
    terms through them were lost (q's and k's off by up to 1.6)."""
    p, band, qkv = _band_attention("csr")

    def dense(q, k, v):
        return torch.softmax(torch.where(band != 0, (q @ k.t()) * 0.5, float("-inf")), 1) @ v

    def second_order(fn):
        xs = [t.clone().requires_grad_() for t in qkv]
        g = torch.autograd.grad(fn(*xs).pow(2).sum(), xs, create_graph=True)
        return torch.autograd.grad(sum(x.pow(2).sum() for x in g), xs)

    ref = second_order(dense)
    for got in (second_order(lambda *xs: _attn(p, *xs)), second_order(lambda *xs: scorch.compile(_attn)(p, *xs))):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad", [False, True])
def test_compiled_attention_on_a_dcsr_pattern_runs_op_by_op(grad):
    """A DCSR pattern's SDDMM and softmax loops differ: the fused kernel raised instead of running unfused."""
    p, _, qkv = _band_attention("dcsr")
    xs = [t.clone().requires_grad_(grad) for t in qkv]
    eager = _attn(p, *qkv)
    out = scorch.compile(_attn)(p, *xs)
    torch.testing.assert_close(out, eager)
    if grad:
        out.sum().backward()
        ref = [t.clone().requires_grad_() for t in qkv]
        _attn(p, *ref).sum().backward()
        for a, b in zip(xs, ref):
            torch.testing.assert_close(a.grad, b.grad)


def test_compile_of_a_module_gives_a_module():
    """Under ``import scorch as torch``, ``torch.compile(model)`` returned a plain function (``model.parameters()``
    then raised): a module goes to ``torch.compile`` with its arguments."""
    torch.manual_seed(0)
    w = torch.randn(3, 4) * (torch.rand(3, 4) < 0.5)
    lin = torch.nn.Linear(4, 3)
    lin.weight = torch.nn.Parameter(scorch.asformat(w, "csr"))
    model = scorch.compile(torch.nn.Sequential(lin, torch.nn.ReLU()), backend="aot_eager")
    assert isinstance(model, torch.nn.Module)
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), torch.relu(x @ w.t() + lin.bias))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    opt.step()
    assert isinstance(lin.weight, scorch.SparseTensor) and "0.weight" in model.state_dict() or \
        "_orig_mod.0.weight" in model.state_dict()
    f = scorch.compile(fullgraph=True)(lambda a: a * 2)  # (the decorator form keeps its arguments)
    torch.testing.assert_close(f(x), x * 2)
