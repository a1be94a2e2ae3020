"""scorch under ``torch.compile`` (issue 20): a sparse x dense product is one custom op in one graph
(``scorch/dynamo.py``), values and gradients equal to eager."""
import pytest
import torch
import torch._dynamo

import scorch



@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles anew: no graph of another test, no on-disk cache (a cached graph would hide a change)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def _graph(fmt, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, n, generator=g).relu()
    return scorch.asformat(dense, fmt), torch.randn(n, 8, generator=g), torch.randn(8, 4, generator=g)


def gcn_loss(A, X, W):
    return torch.relu(A @ (X @ W)).sum()


def _check_gcn(fmt, backend):
    A, X, W = _graph(fmt)
    X.requires_grad_()
    W.requires_grad_()
    ref = gcn_loss(A, X, W)
    gx, gw = torch.autograd.grad(ref, (X, W))
    explained = torch._dynamo.explain(gcn_loss)(A, X, W)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained
    torch._dynamo.reset()
    out = torch.compile(gcn_loss, fullgraph=True, backend=backend)(A, X, W)
    got_x, got_w = torch.autograd.grad(out, (X, W))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got_x, gx)
    torch.testing.assert_close(got_w, gw)


def test_gcn_layer_csr_inductor():
    _check_gcn("csr", "inductor")


def test_issue_example():
    S, X, _ = _graph("csr", 64)
    fn = lambda S, X: (S @ X).relu().sum()  # noqa: E731
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(S, X), fn(S, X))


def test_one_graph_no_breaks():
    A, X, W = _graph("csr")
    explained = torch._dynamo.explain(gcn_loss)(A, X, W)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained


@pytest.mark.parametrize("spelling", ["mm", "matmul", "einsum", "rmatmul", "mv", "torch.mv", "Tensor.mv",
                                      "addmm"])
def test_spellings(spelling):
    A, X, W = _graph("csr")
    fns = {"mm": lambda A, X: torch.mm(A, X), "matmul": lambda A, X: torch.matmul(A, X),
           "einsum": lambda A, X: torch.einsum("ij,jk->ik", A, X), "rmatmul": lambda A, X: X.t() @ A,
           "mv": lambda A, X: A @ X[:, 0], "torch.mv": lambda A, X: torch.mv(A, X[:, 0]),
           "Tensor.mv": lambda A, X: A.mv(X[:, 1]),
           "addmm": lambda A, X: torch.addmm(X[:, :3] * 0 + 1, A, X[:, :3], beta=0.5, alpha=2.0)}
    fn = fns[spelling]
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(A, X), fn(A, X))


def test_custom_op_opcheck():
    from scorch.dynamo import _flatten
    A, X, _ = _graph("csr")
    meta, arrays, sizes = _flatten([A, X])
    torch.library.opcheck(torch.ops.scorch.einsum_dense.default, ("ij,jk->ik", meta, arrays, sizes),
                          test_utils=("test_schema", "test_faketensor"))


def _check_sparse_grad(fmt, backend, steps=1):
    """A's values require grad: the compiled graph's SDDMM gradient reaches ``A.values().grad`` (through the
    wrapper, a leaf of torch's graph itself: ``_autograd.attach_wrapper``), as eager's does, accumulating over calls."""
    A, X, W = _graph(fmt)
    A.requires_grad_()
    W.requires_grad_()
    for _ in range(steps):
        gcn_loss(A, X, W).backward()
    ga, gw = A.grad.values().clone(), W.grad.clone()
    A.grad, W.grad = None, None
    compiled = torch.compile(gcn_loss, fullgraph=True, backend=backend)
    for _ in range(steps):
        compiled(A, X, W).backward()
    torch.testing.assert_close(A.grad.values(), ga)
    torch.testing.assert_close(W.grad, gw)
    with torch._C.DisableTorchFunctionSubclass():
        assert torch._C.TensorBase.grad.__get__(A) is None  # the wrapper keeps none: the values have it
    # eager afterwards: as before
    A.grad = None
    gcn_loss(A, X, W).backward()
    torch.testing.assert_close(A.grad.values(), ga / steps)


def test_sparse_input_gradient():
    _check_sparse_grad("csr", "aot_eager", steps=2)


def test_sparse_input_non_leaf_passes_its_gradient_on():
    """A SparseTensor computed before the compiled function (its values a non-leaf) is in torch's graph as a node over
    its values: the compiled graph's gradient for it reaches the leaf, as eager's does."""
    A, X, W = _graph("csr")
    leaf = A.values().detach().requires_grad_()
    gcn_loss(A.with_values(leaf * 2), X, W).backward()
    expected, leaf.grad = leaf.grad.clone(), None
    torch.compile(gcn_loss, fullgraph=True, backend="aot_eager")(A.with_values(leaf * 2), X, W).backward()
    torch.testing.assert_close(leaf.grad, expected)


def test_unsupported_op_names_itself():
    A, X, _ = _graph("csr")
    with pytest.raises(Exception, match="not supported under torch.compile"):
        torch.compile(lambda A: torch.exp(A).sum(), fullgraph=True, backend="aot_eager")(A)


def test_eager_unchanged_after_compile():
    A, X, W = _graph("csr")
    torch.compile(gcn_loss, fullgraph=True, backend="aot_eager")(A, X, W)
    assert A.layout == torch.sparse_csr and not torch.compiler.is_compiling()
    torch.testing.assert_close(A @ X, A.to_dense() @ X)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["coo", "bsr(2, 2)", "csc", "dcsr"])
def test_gcn_layer_formats(fmt):
    _check_gcn(fmt, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)"])
def test_sparse_input_gradient_formats(fmt):
    _check_sparse_grad(fmt, "inductor")


def test_new_patterns_and_shapes():
    """Another pattern (nnz) reuses the graph once Dynamo makes the array sizes dynamic; another sparse shape
    compiles a new graph (the wrapper's sizes are static: ``_traceable.Traceable._dynamo_static_indices``)."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(8, 4, generator=g, requires_grad=True)
    compiled = torch.compile(gcn_loss, fullgraph=True, backend="aot_eager")
    for n, density in [(16, 0.3), (16, 0.5), (16, 0.7), (24, 0.5)]:
        dense = torch.randn(n, n, generator=g) * (torch.rand(n, n, generator=g) < density)
        A, X = scorch.asformat(dense, "csr"), torch.randn(n, 8, generator=g)
        torch.testing.assert_close(compiled(A, X, W), gcn_loss(A, X, W))


def test_sparse_linear_layer_trains():
    """``scorch.nn.SparseLinear`` (an ``nn.Parameter(SparseTensor)`` weight) compiled: output and the weight values'
    and bias's gradients equal to eager."""
    torch.manual_seed(0)
    layer = scorch.nn.SparseLinear(8, 4, density=0.5)
    X = torch.randn(3, 5, 8)
    ref = layer(X).relu().sum()
    ref.backward()
    gw, gb = layer.weight.grad.values().clone(), layer.bias.grad.clone()
    layer.zero_grad()
    out = torch.compile(lambda X: layer(X).relu().sum(), fullgraph=True, backend="aot_eager")(X)
    out.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(layer.weight.grad.values(), gw)
    torch.testing.assert_close(layer.bias.grad, gb)


def test_training_steps_match_eager():
    """Three Adam steps on a SparseLinear, compiled and eager: the same losses and weight values (the compiled
    graph runs on the updated values each step, no recompile)."""
    import copy
    torch.manual_seed(0)
    eager = scorch.nn.SparseLinear(8, 4, density=0.5)
    compiled = copy.deepcopy(eager)
    X = torch.randn(6, 8)

    def train(layer, fn):
        opt = torch.optim.Adam(layer.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            loss = fn(X)
            loss.backward()
            opt.step()
        return loss

    a = train(eager, lambda X: eager(X).relu().sum())
    b = train(compiled, torch.compile(lambda X: compiled(X).relu().sum(), fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(compiled.weight.values(), eager.weight.values())


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
def test_to_dense_compiles(fmt):
    """``S.to_dense()`` under ``fullgraph=True``: Dynamo traced into the storage code and failed on a
    data-dependent size; now one custom op (values and the gradient of the stored values as eager)."""
    A, X, _ = _graph(fmt)
    A.requires_grad_()
    fn = lambda A, X: (A.to_dense() @ X).relu().sum()  # noqa: E731
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(A, X)
    (g,) = torch.autograd.grad(got, A)
    ref = fn(A, X)
    (gr,) = torch.autograd.grad(ref, A)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g.to_dense(), gr.to_dense())


def test_sparse_input_gradient_through_autograd_grad_and_backward_inputs():
    A, X, W = _graph("csr")
    A.requires_grad_()
    ref = torch.autograd.grad(gcn_loss(A, X, W), A)[0].values()
    compiled = torch.compile(gcn_loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(A, X, W), A)[0].values(), ref)
    compiled(A, X, W).backward(inputs=[A])
    torch.testing.assert_close(A.grad.values(), ref)


@pytest.mark.parametrize("fmt", ["csr", "bsr", "nm"])
def test_sparse_weight_linear_runs_the_weight_kernels(fmt, monkeypatch):
    """``F.linear`` with a sparse weight in a compiled graph calls the kernels eager ``F.linear`` calls
    (``engine.weights``: forward, input gradient, weight gradient), not the general lowering's; values and
    gradients equal to eager; a second backward accumulates as eager's does, and reads the gradient off the
    parameter's own index arrays (no pattern lookup per step)."""
    from scorch.engine import weights, weights_grad
    from scorch.formats import storage
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    s = scorch.schedule(layer)
    sel = s["weight"]
    if fmt == "csr":
        sel.sparsify(scorch.nn.ScalarFraction(0.7)).set_format("csr")
    elif fmt == "bsr":
        sel.sparsify(scorch.nn.BlockFraction(0.5, (4, 4))).block(4, 4)
    else:
        sel.sparsify(scorch.nn.NM(2, 4)).set_format(scorch.formats.named.nm(2, 4))
    s.apply()
    X = torch.randn(2, 24, 32, requires_grad=True)
    ref = layer(X).relu().sum()
    gx, = torch.autograd.grad(ref, X, retain_graph=True)
    ref.backward()
    layer(X).relu().sum().backward()
    gw, gb = layer.weight.grad.values().clone(), layer.bias.grad.clone()
    layer.zero_grad()
    calls = {}
    for module, name in ((weights, "linear"), (weights_grad, "input_grad"), (weights_grad, "weight_grad")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: (
            calls.__setitem__(_name, calls.get(_name, 0) + 1), _real(*a, **k))[1])
    compiled = torch.compile(lambda X: layer(X).relu().sum(), fullgraph=True)
    out = compiled(X)
    got_x, = torch.autograd.grad(out, X, retain_graph=True)
    monkeypatch.setattr(storage, "lookup", lambda *a, **k: pytest.fail("the gradient took a pattern lookup"))
    out.backward()
    compiled(X).backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got_x, gx)
    torch.testing.assert_close(layer.weight.grad.values(), gw)
    torch.testing.assert_close(layer.bias.grad, gb)
    assert calls.get("linear", 0) >= 2 and calls.get("input_grad", 0) >= 1 and calls.get("weight_grad", 0) >= 2, calls


def _scheduled_mlp():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    s = scorch.schedule(m)
    s.regex(r".*weight").sparsify(scorch.nn.ScalarFraction(0.8)).set_format("csr")
    s.apply()
    return m


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_modes_on_cpu(mode):
    """``mode="reduce-overhead"`` (CUDA graphs: none on CPU, Inductor's default code) and the autotuning modes take
    a model with sparse weights: values and gradients equal to eager."""
    m = _scheduled_mlp()
    X = torch.randn(16, 32)
    ref = m(X)
    ref.sum().backward()
    gw = m[0].weight.grad.values().clone()
    m.zero_grad()
    out = torch.compile(m, mode=mode, fullgraph=True)(X)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(m[0].weight.grad.values(), gw)


@pytest.mark.parametrize("strict", [False, True])
def test_export_refused_clearly(strict):
    """torch.export traces below torch functions, where scorch's ops are not seen: a model with sparse parameters,
    or a sparse input, is refused with an error naming torch.export (it failed inside torch, "Expected meta !=
    nullptr", or exported a program that ran the sparse weights densely)."""
    m = _scheduled_mlp()
    with pytest.raises(Exception, match="torch.export of a SparseTensor"):
        torch.export.export(m, (torch.randn(4, 32),), strict=strict)
    A = scorch.asformat(torch.randn(8, 8).relu(), "csr")

    class Product(torch.nn.Module):
        def forward(self, A, X):
            return A @ X

    with pytest.raises(Exception, match="torch.export of a SparseTensor"):
        torch.export.export(Product(), (A, torch.randn(8, 2)), strict=strict)
