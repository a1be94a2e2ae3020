"""``F.dropout(F.relu(h))`` as one ``scorch::relu_dropout`` op in a compiled training graph (issue 46,
``scorch/dynamo_train.py``): the pre-grad pass rewrites what it should and nothing else; the kept values, the scale
and the gradients are eager's; the mask follows ``torch.manual_seed``, not the thread count; one graph."""
import pytest
import torch
import torch._dynamo
from torch._inductor.utils import run_and_get_code

import scorch
from scorch import dynamo_train
from test_compile import fresh_dynamo  # noqa: F401  (every test compiles anew)

F = torch.nn.functional


def _graph(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = scorch.asformat(torch.randn(n, n, generator=g).relu() * (torch.rand(n, n, generator=g) < 0.2), "csr")
    return A, torch.randn(n, 12, generator=g), torch.randn(12, 16, generator=g), torch.randn(16, generator=g)


def layer(A, X, W, b, p=0.5):
    return F.dropout(F.relu(A @ (X @ W) + b), p=p, training=True)


def _capture(counts):
    """A backend running the pass on Dynamo's graph (as Inductor's pre-grad passes would), then the graph."""
    def backend(gm, example_inputs):
        counts.append(dynamo_train.rewrite(gm.graph))
        gm.recompile()
        return gm.forward
    return backend


SPELLINGS = {
    "F.relu": lambda A, X, W, b: F.dropout(F.relu(A @ X @ W + b), 0.3, True),
    "torch.relu": lambda A, X, W, b: F.dropout(torch.relu(A @ X @ W + b), p=0.3),
    "method": lambda A, X, W, b: F.dropout((A @ X @ W + b).relu(), 0.3, training=True),
    "module": lambda A, X, W, b: torch.nn.Dropout(0.3)(torch.nn.ReLU()(A @ X @ W + b)),
}
NOT_REWRITTEN = {
    "eval": lambda A, X, W, b: F.dropout(F.relu(A @ X @ W + b), 0.3, training=False),
    "relu read twice": lambda A, X, W, b: (lambda r: F.dropout(r, 0.3) + r)(F.relu(A @ X @ W + b)),
    "inplace relu": lambda A, X, W, b: F.dropout(F.relu(A @ X @ W + b, inplace=True), 0.3),
    "no relu": lambda A, X, W, b: F.dropout(torch.tanh(A @ X @ W + b), 0.3),
    "dense graph": lambda A, X, W, b: F.dropout(F.relu(A.to_dense() @ X @ W + b), 0.3),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_pass_rewrites_each_spelling(name):
    counts = []
    torch.compile(SPELLINGS[name], fullgraph=True, backend=_capture(counts))(*_graph())
    assert counts == [1]


@pytest.mark.parametrize("name", NOT_REWRITTEN)
def test_pass_leaves_other_graphs(name):
    A, X, W, b = _graph()
    if name == "dense graph":
        counts = []
        torch.compile(NOT_REWRITTEN[name], fullgraph=True, backend=_capture(counts))(A.to_dense(), X, W, b)
    else:
        counts = []
        torch.compile(NOT_REWRITTEN[name], fullgraph=True, backend=_capture(counts))(A, X, W, b)
    assert counts == [0]


def _mask_reference(A, X, W, b, out, p):
    """Eager ``relu(h) * mask * scale`` with the mask the compiled output shows (kept where it is positive)."""
    mask = (out > 0).to(out.dtype)
    return F.relu(A @ (X @ W) + b) * mask * (1 / (1 - p))


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_values_and_gradients_equal_eager_under_the_mask(p):
    """Inductor: where kept, ``relu(h) / (1 - p)``, elsewhere 0; the gradients of X, W and b are eager's under the
    same mask; about a fraction p of the positive elements dropped."""
    A, X, W, b = _graph(n=200)
    for t in (X, W, b):
        t.requires_grad_()
    compiled = torch.compile(layer, fullgraph=True)
    out, (code,) = run_and_get_code(compiled, A, X, W, b, p)
    assert "scorch.relu_dropout" in code and "bool" not in code  # no mask in the forward
    ref = _mask_reference(A, X, W, b, out.detach(), p)
    torch.testing.assert_close(out, ref)
    positive = (A @ (X @ W) + b > 0).sum().item()
    kept = (out > 0).sum().item()
    sd = (positive * p * (1 - p)) ** 0.5
    assert abs(kept - positive * (1 - p)) < 6 * sd, (kept, positive)
    up = torch.randn_like(out)
    got = torch.autograd.grad((out * up).sum(), (X, W, b))
    want = torch.autograd.grad((ref * up).sum(), (X, W, b))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_one_graph_no_breaks():
    explained = torch._dynamo.explain(layer)(*_graph())
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained


def test_p_zero_equals_eager_exactly():
    """p = 0 keeps everything: the compiled layer, its loss and its gradients are eager's."""
    A, X, W, b = _graph(n=100)
    for t in (X, W, b):
        t.requires_grad_()
    ref = layer(A, X, W, b, 0.0)
    want = torch.autograd.grad(ref.square().sum(), (X, W, b))
    out = torch.compile(layer, fullgraph=True)(A, X, W, b, 0.0)
    got = torch.autograd.grad(out.square().sum(), (X, W, b))
    torch.testing.assert_close(out, ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_mask_follows_the_seed():
    """``torch.manual_seed`` repeats the mask; the next call draws another."""
    A, X, W, b = _graph(n=100)
    compiled = torch.compile(layer, fullgraph=True)
    torch.manual_seed(3)
    first, second = compiled(A, X, W, b), compiled(A, X, W, b)
    torch.manual_seed(3)
    assert torch.equal(compiled(A, X, W, b), first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_keeps_a_fraction_and_is_thread_independent(dtype):
    x = torch.linspace(-1, 3, 300_000, dtype=dtype)
    seed = torch.tensor(12345)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.scorch.relu_dropout(x, 0.25, seed)
        torch.set_num_threads(2)
        two = torch.ops.scorch.relu_dropout(x, 0.25, seed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    positive = x > 0
    assert torch.equal(one[~positive], torch.zeros_like(one[~positive]))
    kept = one[positive] != 0
    torch.testing.assert_close(one[positive][kept], x[positive][kept] * (1 / 0.75))
    n = positive.sum().item()
    assert abs(kept.sum().item() - 0.75 * n) < 6 * (n * 0.25 * 0.75) ** 0.5
    assert not torch.equal(one, torch.ops.scorch.relu_dropout(x, 0.25, torch.tensor(54321)))


def test_op_edges():
    x = torch.tensor([-1.0, 0.0, 2.0, float("inf"), float("nan")] * 20)
    seed = torch.tensor(7)
    torch.testing.assert_close(torch.ops.scorch.relu_dropout(x, 0.0, seed), F.dropout(F.relu(x), 0.0), equal_nan=True)
    # p = 1 drops everything, as torch's dropout: 0, and inf * 0 = NaN where torch gives it
    torch.testing.assert_close(torch.ops.scorch.relu_dropout(x, 1.0, seed), F.dropout(F.relu(x), 1.0), equal_nan=True)
    with pytest.raises(ValueError, match="between 0 and 1"):
        torch.ops.scorch.relu_dropout(x, 1.5, seed)
    with pytest.raises(ValueError, match="float32 or float64"):
        torch.ops.scorch.relu_dropout(x.half(), 0.5, seed)
    out = torch.ops.scorch.relu_dropout(x, 0.5, seed)
    with pytest.raises(ValueError, match="gradient of shape"):
        torch.ops.scorch.relu_dropout_backward(x[:10], out, 0.5)
    with pytest.raises(ValueError, match="float32 or float64"):
        torch.ops.scorch.relu_dropout_backward(x.half(), out.half(), 0.5)


def test_opcheck():
    x = torch.randn(40, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.scorch.relu_dropout.default, (x, 0.5, torch.tensor(3)))
    out = torch.ops.scorch.relu_dropout(x.detach(), 0.5, torch.tensor(3))
    torch.library.opcheck(torch.ops.scorch.relu_dropout_backward.default, (torch.randn(40, 8), out, 0.5))


def test_gcn_app_compiled_without_dropout_trains_as_eager():
    """The GCN of ``apps/gnn`` (CSR features and adjacency) with dropout 0: compiled (Inductor, the pass on) and
    eager training give the same losses."""
    from apps.gnn import model as gnn_model
    from apps.gnn.data import dataset
    g = dataset("sbm-300", None, seed=0)
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        gt = gnn_model.graph_tensors(scorch, g)
        net = gnn_model.build(scorch, "gcn", g.num_features, 16, g.num_classes, dropout=0.0)
        fwd = torch.compile(net, fullgraph=True) if compiled else net
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        run = []
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(fwd(gt.x, gt)[gt.train_idx], gt.labels[gt.train_idx])
            loss.backward()
            opt.step()
            run.append(loss.detach())
        losses.append(torch.stack(run))
    torch.testing.assert_close(losses[1], losses[0])


def test_install_keeps_the_passes_already_set_and_runs_before_the_epilogue_pass():
    import torch._inductor.config as inductor_config
    from scorch import dynamo_fuse

    def user_pass(graph):
        pass
    with inductor_config.patch(pre_grad_custom_pass=user_pass):
        dynamo_fuse.install()
        dynamo_train.install()
        dynamo_train.install()
        assert inductor_config.pre_grad_custom_pass == [user_pass, dynamo_train.PASS, dynamo_fuse.PASS]
    with inductor_config.patch(pre_grad_custom_pass=None):
        dynamo_train.install()
        assert inductor_config.pre_grad_custom_pass is dynamo_train.PASS


def test_new_nnz_recompiles_at_most_once():
    """Inductor with the pass: graphs of other nnz (same size) run on the graph compiled with symbolic sizes, each
    output the layer's under its mask."""
    import torch._dynamo.testing
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for seed in range(3):
        A, X, W, b = _graph(n=80, seed=seed)
        out = compiled(A, X, W, b, 0.5)
        torch.testing.assert_close(out, _mask_reference(A, X, W, b, out, 0.5))
    assert counter.frame_count <= 2, counter.frame_count


def test_compiled_backward_keeps_a_constant_operands_transposition(monkeypatch):
    """A compiled graph's sparse operand is rebuilt every call; the transposition its backward product needs is
    made on the first step only (``dynamo._share_conversions``), and the gradients stay eager's."""
    import importlib
    convert = importlib.import_module("scorch.engine.convert")  # (the module: ``engine.convert`` is a function)
    made = []
    real = convert._by_known_permutation
    monkeypatch.setattr(convert, "_by_known_permutation", lambda *a: made.append(1) or real(*a))
    A, X, W, b = _graph(n=120)
    X.requires_grad_()

    def f(A, X):
        return (A @ X).square().sum()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(f(A, X), X)[0]
    made.clear()
    for step in range(4):
        torch.testing.assert_close(torch.autograd.grad(compiled(A, X), X)[0], want)
    assert len(made) <= 1, len(made)
    with torch.no_grad():
        A.values().mul_(2)  # new values, same pattern: the kept transposition is checked, not reused as it was
    torch.testing.assert_close(torch.autograd.grad(compiled(A, X), X)[0], torch.autograd.grad(f(A, X), X)[0])


def _products(A, X, S, V):
    """A product with a transposed sparse operand in its backward (``A @ X``) and ``F.linear`` of a sparse input."""
    return (A @ X).square().sum() + F.linear(S, V).sin().sum()


def _products_inputs(n, k):
    """``(A, X, S, V)``: ``_graph``'s adjacency and features (requiring a gradient), a sparse ``n x k`` input and a
    parameter (the graph hands the op the Parameter itself)."""
    A, X, _, _ = _graph(n=n)
    S = scorch.asformat(torch.randn(n, k) * (torch.rand(n, k) < 0.1), "csr")
    return A, X.requires_grad_(), S, torch.nn.Parameter(torch.randn(16, k))


def _check_products(compiled, A, X, S, V):
    """The compiled ``_products``' gradients of ``X`` and ``V`` against eager's on dense copies."""
    want = torch.autograd.grad(_products(A.to_dense(), X, S.to_dense(), V), (X, V))
    for g, w in zip(torch.autograd.grad(compiled(A, X, S, V), (X, V)), want):
        torch.testing.assert_close(g, w)


def _counted_steps(monkeypatch, name, n, k):
    """``(calls, compiled, inputs)``: three steps of the compiled ``_products`` checked against eager, counting the
    calls of ``dynamo.<name>`` in the last one."""
    from scorch import dynamo
    calls = []
    real = getattr(dynamo, name)
    monkeypatch.setattr(dynamo, name, lambda *a: calls.append(1) or real(*a))
    inputs = _products_inputs(n, k)
    compiled = torch.compile(_products, fullgraph=True, backend="aot_eager")
    for step in range(3):
        calls.clear()
        _check_products(compiled, *inputs)
    return calls, compiled, inputs


def test_compiled_backward_keeps_the_dense_operands_gradient_call(monkeypatch):
    """The gradient of a dense operand of a product with a sparse one runs the product's kept call from the second
    step on (``dynamo._kept_gradient``: no ``_einsum_grad`` planning again), for ``A @ X`` (a transposed sparse
    operand) and ``F.linear`` of a sparse input (``X`` sparse times a weight); its gradients stay eager's, also after
    the sparse values change in place, through ``.data`` (no version bump: the fingerprints tell) or not."""
    planned, compiled, (A, X, S, V) = _counted_steps(monkeypatch, "_einsum_grad", 90, 40)
    assert planned == [], "the dense operands' gradients were planned again"
    A.values().data.mul_(-2)  # (no version bump)
    with torch.no_grad():
        S.values().add_(1)
    _check_products(compiled, A, X, S, V)


def test_graph_ops_run_on_the_sparse_inputs_themselves(monkeypatch):
    """A compiled call's ops get its SparseTensor inputs' arrays and run on those tensors themselves (found by the
    arrays' identity: ``_traceable.FLATTENED``), not on new wrappers made every call; values and gradients stay
    eager's, also after an input's arrays are replaced (another pattern) or its values change in place."""
    made, compiled, (A, X, S, V) = _counted_steps(monkeypatch, "assemble", 80, 30)
    assert made == [], "the graph's ops wrapped its sparse inputs' arrays again"
    with torch.no_grad():
        S.values().mul_(-3)
    A2 = scorch.asformat(A.to_dense() * (torch.rand(80, 80) < 0.5), "csr")  # (new arrays, fewer entries)
    _check_products(compiled, A2, X, S, V)


def test_ops_record_a_graph_only_where_asked():
    """Outside a compiled graph a scorch op's autograd is custom_op's (``_compile_hook._autograd_cpu``): with an input
    requiring a gradient under grad mode it records its node and differentiates; otherwise it runs its function
    and records none."""
    from scorch import dynamo
    A, X, W, _ = _graph(n=30)
    meta, arrays, sizes = dynamo._flatten([A, X.requires_grad_()])
    out = torch.ops.scorch.einsum_dense("ij,jk->ik", meta, arrays, sizes)
    assert out.grad_fn is not None
    (g,) = torch.autograd.grad(out.sum(), X)
    torch.testing.assert_close(g, A.to_dense().t() @ torch.ones(30, 12))
    with torch.no_grad():
        plain = torch.ops.scorch.einsum_dense("ij,jk->ik", meta, arrays, sizes)
    assert plain.grad_fn is None and not plain.requires_grad
    torch.testing.assert_close(plain, A.to_dense() @ X.detach())
