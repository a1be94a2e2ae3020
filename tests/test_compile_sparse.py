"""scorch under ``torch.compile`` with sparse results inside the graph (``scorch/dynamo_sparse.py``): sparse attention
(``sampled_addmm -> softmax -> mm``), zero-preserving maps, sparse tensors built inside the compiled function (the
MoE's gates), models rewritten by ``scorch.schedule``, patterns of another nnz. Values and gradients equal to eager
(and to dense torch), one graph, no breaks."""
import copy
import math

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import scorch
from scorch import fusion

from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)


def _mask(n, density, seed=0, fmt="csr"):
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(n, n, generator=g) < density) | torch.eye(n, dtype=torch.bool)
    return scorch.asformat(keep.float(), fmt), keep


def attention(mask, q, k, v):
    scores = torch.sparse.sampled_addmm(mask, q, k.transpose(0, 1), beta=0.0, alpha=1 / math.sqrt(q.shape[1]))
    return torch.sparse.mm(torch.sparse.softmax(scores, dim=1), v)


def attention_loss(mask, q, k, v):
    return (attention(mask, q, k, v) ** 2).sum()


def _qkv(n, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, requires_grad=True) for _ in range(3)]


def _check_attention(backend, n=24, d=8, fn=attention_loss):
    mask, keep = _mask(n, 0.2)
    q, k, v = _qkv(n, d)
    ref = fn(mask, q, k, v)
    grads = torch.autograd.grad(ref, (q, k, v))
    if fn is attention_loss:  # eager scorch is dense torch's masked attention
        dense = ((torch.softmax((q @ k.T / math.sqrt(d)).masked_fill(~keep, float("-inf")), 1) @ v) ** 2).sum()
        torch.testing.assert_close(ref, dense)
    out = torch.compile(fn, fullgraph=True, backend=backend)(mask, q, k, v)
    got = torch.autograd.grad(out, (q, k, v))
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b)


def test_sparse_attention_inductor():
    _check_attention("inductor")


def test_attention_backward_where_the_fused_one_declines(monkeypatch):
    """Where the fused backward kernel does not serve the shapes (``attention_backward`` gives None), the compiled
    backward takes eager autograd through the op: the same gradients."""
    monkeypatch.setattr(fusion, "attention_backward", lambda *args, **kwargs: None)
    _check_attention("aot_eager", n=20, d=6)


def test_attention_backward_keeps_the_transposed_pattern(monkeypatch):
    """The compiled attention's backward transposes the mask's pattern once, on its first step (``_kv_grad``'s memo,
    by the index arrays: the backward gets aliases of the arrays its forward saved, which ``dynamo._canonical`` maps
    back), not on every step; its gradients stay eager's."""
    from scorch import dynamo_sparse
    made = []
    real = dynamo_sparse._kv.transpose
    monkeypatch.setattr(dynamo_sparse._kv, "transpose", lambda *a: made.append(1) or real(*a))
    mask, _ = _mask(64, 0.2)
    q, k, v = _qkv(64, 16)
    want = torch.autograd.grad(attention_loss(mask, q, k, v), (q, k, v))
    compiled = torch.compile(attention_loss, fullgraph=True)  # (Inductor: its backward gets aliases)
    for step in range(4):
        for a, b in zip(torch.autograd.grad(compiled(mask, q, k, v), (q, k, v)), want):
            torch.testing.assert_close(a, b)
    assert len(made) == 1, made


def test_sparse_attention_one_graph():
    mask, _ = _mask(16, 0.3)
    explained = torch._dynamo.explain(attention_loss)(mask, *_qkv(16, 4))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained


def test_attention_runs_the_fused_kernel(monkeypatch):
    """The traced ``sampled_addmm -> softmax -> mm`` is scorch's fused attention (one row kernel forward, the fused
    backward kernel), and the unfused values ops it replaces are not in the graph."""
    calls = {"forward": 0, "backward": 0}
    forward, backward = fusion.attention, fusion.attention_backward

    def spy_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def spy_backward(*args, **kwargs):
        calls["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(fusion, "attention", spy_forward)
    monkeypatch.setattr(fusion, "attention_backward", spy_backward)
    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            graphs.append(g)
            return g.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    _check_attention(backend)
    assert calls["forward"] >= 1 and calls["backward"] >= 1, calls
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    names = [(n.args[0] if n.target is torch.ops.scorch.eager.default else None) for g in graphs
             for n in g.graph.nodes if n.op == "call_function"]
    assert "sddmm" not in names and "softmax" not in names and "attention" not in names, names
    # the forward keeps its probabilities for the fused backward (which does not run the forward again)
    assert torch.ops.scorch.attention.default in targets and torch.ops.scorch.attention_grad.default in targets
    assert torch.ops.scorch.eager_grad.default not in targets


def test_probabilities_read_otherwise_stay_in_the_graph():
    """Where the softmax's values are read besides the product, they are computed too (and their gradient flows)."""
    def fn(mask, q, k, v):
        scores = torch.sparse.sampled_addmm(mask, q, k.t(), beta=0.0, alpha=0.5)
        p = torch.sparse.softmax(scores, dim=1)
        return (torch.sparse.mm(p, v) ** 2).sum() + (p.values() ** 2).sum()

    _check_attention("aot_eager", fn=fn)


def test_zero_preserving_maps_stay_sparse():
    mask, _ = _mask(12, 0.4)
    A = mask.with_values(torch.randn(mask.nnz, generator=torch.Generator().manual_seed(3)))
    A.requires_grad_()
    X = torch.randn(12, 5, requires_grad=True)

    def fn(A, X):
        B = torch.relu(A) * 2.0
        return (torch.tanh(-B / 3) @ X).sum()

    ref = fn(A, X)
    ref.backward()
    ga, gx = A.grad.values().clone(), X.grad.clone()
    A.grad, X.grad = None, None
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(A, X)
    out.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(A.grad.values(), ga)
    torch.testing.assert_close(X.grad, gx)


def test_new_nnz_recompiles_at_most_once():
    """Patterns of the same shape and another nnz each call: one compile, then at most one more (Dynamo makes the
    arrays' sizes symbolic), never one per pattern."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attention_loss, backend=counter, fullgraph=True)
    q, k, v = _qkv(20, 4)
    for seed, density in enumerate([0.1, 0.2, 0.3, 0.4, 0.5]):
        mask, _ = _mask(20, density, seed)
        torch.testing.assert_close(compiled(mask, q, k, v), attention_loss(mask, q, k, v))
    assert counter.frame_count <= 2, counter.frame_count


def _moe(einsum, top_k=2):
    from apps.moe.model import build
    torch.manual_seed(0)
    return build(scorch, 8, 6, 4, top_k, sparse_gate=True, einsum=einsum)


def _check_moe(einsum, backend="aot_eager"):
    model = _moe(einsum)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    loss = lambda x: (model(x) ** 2).sum()  # noqa: E731
    ref = loss(x)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    explained = torch._dynamo.explain(loss)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    out = torch.compile(loss, fullgraph=True, backend=backend)(x)
    out.backward()
    torch.testing.assert_close(out, ref)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_moe_sparse_gate():
    """The MoE app's block with its sparse CSR gate, built inside the compiled function (``torch.sparse_csr_tensor``
    of the top-k), the ``bn,bd,ndh->bh`` spelling."""
    _check_moe("fused")


def test_moe_slots_default_spelling():
    """The app's default spelling (``slots``): under torch.compile the slot capacity is its static bound (the tokens),
    one graph, the same values and gradients as eager's capacity read from the routing."""
    _check_moe("slots")


@pytest.mark.slow
@pytest.mark.parametrize("einsum", ["dispatch", "combine"])
def test_moe_sparse_gate_spellings(einsum):
    _check_moe(einsum, "inductor")


@pytest.mark.slow
def test_moe_slots_capacity_from_data():
    """The ``slots`` spelling reads its capacity from the routing (``int(...)``): one graph where Dynamo captures
    that number (``capture_scalar_outputs``), the gates' sizes then symbolic."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _check_moe("slots")


def test_sparse_tensor_built_inside():
    rows = torch.tensor([0, 2, 3, 3, 5])
    cols = torch.tensor([1, 3, 0, 0, 2])
    W = torch.randn(4, 3, requires_grad=True)

    def fn(vals, W):
        A = scorch.sparse_csr_tensor(rows, cols, vals.exp(), (4, 4))
        return (A @ W).sin().sum()

    vals = torch.randn(5, requires_grad=True)
    ref = fn(vals, W)
    gv, gw = torch.autograd.grad(ref, (vals, W))
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(vals, W)
    got_v, got_w = torch.autograd.grad(out, (vals, W))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got_v, gv)
    torch.testing.assert_close(got_w, gw)


def _train(model, fwd, X, Y, steps, schedule=None):
    """``steps`` Adam steps of ``fwd`` (the model, or it compiled) on the MSE to ``Y``: each step's loss and the
    first layer's nnz (``schedule``, where given, attached to the optimizer: a dynamic pattern)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    if schedule is not None:
        schedule.attach(opt)
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(fwd(X), Y)
        loss.backward()
        opt.step()
        seen.append((loss.detach(), model[0].weight.nnz))
    return seen


def _scheduled(fmt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
    s = scorch.schedule(model)
    s.glob("*.weight").sparsify(scorch.nn.ScalarFraction(0.5)).set_format(fmt)
    s.apply()
    return model


def _check_scheduled_training(fmt, backend):
    """A model rewritten by ``scorch.schedule(model).apply()`` (sparse weights as ``nn.Parameter(SparseTensor)``)
    trains under ``torch.compile(model)`` with ``torch.optim.Adam``: the same losses and parameters as eager."""
    eager = _scheduled(fmt)
    compiled_model = copy.deepcopy(eager)
    assert isinstance(eager[0].weight, scorch.SparseTensor)
    g = torch.Generator().manual_seed(5)
    X, Y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)

    a = _train(eager, eager, X, Y, 3)
    b = _train(compiled_model, torch.compile(compiled_model, fullgraph=True, backend=backend), X, Y, 3)
    torch.testing.assert_close(torch.stack([x for x, _ in b]), torch.stack([x for x, _ in a]))
    for p, q in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(getattr(p, "_vals", p), getattr(q, "_vals", q))


def test_scheduled_model_trains():
    _check_scheduled_training("csr", "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)"])
def test_scheduled_model_trains_inductor(fmt):
    _check_scheduled_training(fmt, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)"])
def test_einsum_then_dense_ops(fmt):
    """``torch.einsum`` with a sparse operand followed by dense ops, gradients of the dense operands and of the
    sparse one's values."""
    A, _ = _mask(16, 0.3, fmt=fmt)
    A = A.with_values(torch.randn(A.nnz, generator=torch.Generator().manual_seed(4))).requires_grad_()
    X = torch.randn(16, 6, requires_grad=True)
    W = torch.randn(6, 3, requires_grad=True)
    fn = lambda A, X, W: torch.log_softmax(torch.einsum("ij,jk->ik", A, X).tanh() @ W, 1).sum()  # noqa: E731
    ref = fn(A, X, W)
    ref.backward()
    grads = A.grad.values().clone(), X.grad.clone(), W.grad.clone()
    A.grad = X.grad = W.grad = None
    assert torch._dynamo.explain(fn)(A, X, W).graph_break_count == 0
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True)(A, X, W)
    out.backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip((A.grad.values(), X.grad, W.grad), grads):
        torch.testing.assert_close(got, want)


def test_scorch_compile_inside_torch_compile():
    """A ``scorch.compile``d function called inside ``torch.compile``: traced through (the graph fuses)."""
    fused = scorch.compile(attention_loss)
    _check_attention("aot_eager", fn=lambda *a: fused(*a))


def test_unsupported_sparse_result_names_itself():
    mask, _ = _mask(8, 0.3)
    with pytest.raises(Exception, match="exp on a SparseTensor is not supported under torch.compile"):
        torch.compile(lambda A: torch.exp(A).sum(), fullgraph=True, backend="aot_eager")(mask)


def test_eager_op_opcheck():
    """``scorch::eager`` (schema, fake kernel, autograd registration) for the SDDMM, the sparse softmax and the fused
    attention."""
    from scorch.dynamo import _flatten
    mask, _ = _mask(10, 0.3)
    q, k, v = _qkv(10, 4)
    scores = torch.sparse.sampled_addmm(mask, q.detach(), k.detach().t(), beta=0.0, alpha=0.5)
    cases = [("sddmm", [mask, q, k.t()], [0.0, 0.5]), ("attention", [mask, q, k.t(), v], [0.5]),
             ("softmax", [scores.with_values(scores.values().clone().requires_grad_())], [1.0, 0.0])]
    for name, operands, scalars in cases:
        meta, arrays, sizes = _flatten(operands)
        torch.library.opcheck(torch.ops.scorch.eager.default, (name, meta, arrays, sizes, scalars))


@pytest.mark.slow
def test_gcn_new_nnz_inductor():
    """The GCN layer under Inductor with a new pattern (nnz) each call: values and gradients equal to eager, at most
    one recompile (the arrays' sizes symbolic in the generated code)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    gcn = lambda A, X, W: torch.relu(A @ (X @ W)).sum()  # noqa: E731
    compiled = torch.compile(gcn, fullgraph=True, backend=counter)
    W = torch.randn(8, 4, requires_grad=True)
    for seed, density in enumerate([0.2, 0.3, 0.4, 0.5]):
        g = torch.Generator().manual_seed(seed)
        A = scorch.asformat(torch.randn(16, 16, generator=g) * (torch.rand(16, 16, generator=g) < density), "csr")
        X = torch.randn(16, 8, generator=g, requires_grad=True)
        out = compiled(A, X, W)
        got = torch.autograd.grad(out, (X, W))
        ref = gcn(A, X, W)
        want = torch.autograd.grad(ref, (X, W))
        torch.testing.assert_close(out, ref)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.slow
def test_dynamic_schedule_trains():
    """A dynamic schedule (the pattern recomputed after every optimizer step, ``attach``) under ``torch.compile``:
    eager's losses and patterns. Dynamo keeps a module parameter's shapes static, so a new nnz recompiles unless
    ``force_parameter_static_shapes`` and ``force_nn_module_property_static_shapes`` are off: then at most once."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
        s = scorch.schedule(model)
        s.glob("*.weight").sparsify(scorch.nn.ScalarThreshold(0.1), dynamic=True).set_format("csr")
        s.apply()
        return model, s

    g = torch.Generator().manual_seed(6)
    X, Y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)

    (a, sa), (b, sb) = make(), make()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    want = _train(a, a, X, Y, 5, sa)
    with torch._dynamo.config.patch(force_parameter_static_shapes=False, force_nn_module_property_static_shapes=False):
        got = _train(b, torch.compile(b, backend=counter), X, Y, 5, sb)
    assert len({nnz for _, nnz in want}) > 2  # the pattern did change
    assert [n for _, n in got] == [n for _, n in want]
    torch.testing.assert_close(torch.stack([x for x, _ in got]), torch.stack([x for x, _ in want]))
    assert counter.frame_count <= 2, counter.frame_count


def test_canonical_arrays_follow_in_place_changes():
    from scorch.dynamo import _canonical
    a = torch.arange(6, dtype=torch.int32)
    alias = a.view(6)
    assert _canonical(a) is a and _canonical(alias) is a
    b = torch.arange(6, dtype=torch.int32)
    assert _canonical(b) is b  # (other memory: itself)
    other = a[1:]  # (another view of the same storage: not the same array)
    assert _canonical(other) is other
    ro = torch.arange(6, dtype=torch.int32)
    with torch.inference_mode():
        inf = torch.arange(3)
    assert _canonical(inf) is inf and _canonical(ro) is ro
