"""No gradient is lost silently (issue 42, part 4): every way torch hands a gradient to a tensor, checked with a
sparse tensor against dense torch doing the same computation. A sparse leaf's gradient is the dense gradient on its
pattern, in its format; what scorch cannot do raises, naming what is missing."""
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import scorch
from scorch import SparseTensor

FORMATS = ["csr", "coo", "csc"]


def _weight(fmt="csr", seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(5, 4, generator=g, dtype=torch.float64).relu()
    d[0, 0] = 0.0  # (an empty position, whatever the draw)
    return d, torch.nn.Parameter(scorch.asformat(d, fmt))


def _x(seed=1):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _on_pattern(dense_grad, d):
    return dense_grad * (d != 0)


def _assert_pattern_grad(w, expected_dense, d):
    """``w.grad`` is a SparseTensor in ``w``'s format on ``w``'s index arrays, equal to the dense gradient there."""
    g = w.grad
    assert type(g) is SparseTensor and g.format == w.format
    assert all(a.pos is b.pos and a.crd is b.crd for a, b in zip(g.levels, w.levels))
    torch.testing.assert_close(g.to_dense(), _on_pattern(expected_dense, d))


class Scaled(torch.autograd.Function):
    """The issue's example: ``x @ w.t() * 2``, written by a user, who knows nothing of sparse tensors."""
    seen = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t() * 2

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        Scaled.seen.append(ctx.needs_input_grad)
        return (g @ w) * 2, (g.t() @ x) * 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_custom_function_with_a_sparse_parameter(fmt):
    d, w = _weight(fmt)
    x = _x().requires_grad_()
    Scaled.seen.clear()
    y = Scaled.apply(x, w)
    y.pow(2).sum().backward()
    assert Scaled.seen == [(True, True)]  # (w was seen not to require grad, and its gradient dropped)
    dd, xd = d.clone().requires_grad_(), x.detach().clone().requires_grad_()
    Scaled.apply(xd, dd).pow(2).sum().backward()
    _assert_pattern_grad(w, dd.grad, d)
    torch.testing.assert_close(x.grad, xd.grad)
    # a second backward accumulates, as torch's
    Scaled.apply(x, w).pow(2).sum().backward()
    Scaled.apply(xd, dd).pow(2).sum().backward()
    _assert_pattern_grad(w, dd.grad, d)
    torch.testing.assert_close(x.grad, xd.grad)


def test_custom_function_gradient_reaches_optimizer_step():
    d, w = _weight()
    dd = torch.nn.Parameter(d.clone())
    for p, opt in ((w, torch.optim.SGD([w], lr=0.1)), (dd, torch.optim.SGD([dd], lr=0.1))):
        Scaled.apply(_x(), p).pow(2).sum().backward()
        opt.step()
    torch.testing.assert_close(w.to_dense(), dd.detach() * (d != 0))


def test_custom_function_returning_a_sparse_gradient_of_another_pattern():
    """A gradient the user returns as a SparseTensor of another pattern is read on ``w``'s."""
    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.to_dense().sum()

        @staticmethod
        def backward(ctx, g):
            return scorch.asformat(torch.ones(5, 4, dtype=torch.float64) * g, "coo")

    d, w = _weight()
    Sum.apply(w).backward()
    _assert_pattern_grad(w, torch.ones(5, 4, dtype=torch.float64), d)


def test_custom_function_with_a_computed_sparse_input():
    """A non-leaf SparseTensor (``w * 3``) as the Function's input: its gradient flows on to ``w``."""
    d, w = _weight()
    x = _x()
    t = w * 3
    t.retain_grad()
    Scaled.apply(x, t).sum().backward()
    dd = d.clone().requires_grad_()
    td = dd * 3
    td.retain_grad()
    Scaled.apply(x, td).sum().backward()
    _assert_pattern_grad(w, dd.grad, d)
    _assert_pattern_grad(t, td.grad, d)


_OTHER = torch.tensor([[0, 1, 0, 2], [3, 0, 0, 1], [1, 1, 0, 0], [0, 0, 2, 0], [1, 0, 0, 1]], dtype=torch.float64)
_PRODUCERS = {  # computed sparse tensors, each made by another of scorch's autograd paths
    "map": lambda w: torch.relu(w * 3),
    "sum of patterns": lambda w: w + scorch.asformat(_OTHER, "csr"),
    "product of patterns": lambda w: w * scorch.asformat(_OTHER, "csr"),
    "conversion": lambda w: w.to_sparse_coo(),
}
_DENSE_PRODUCERS = {"map": lambda d: torch.relu(d * 3), "sum of patterns": lambda d: d + _OTHER,
                    "product of patterns": lambda d: d * _OTHER, "conversion": lambda d: d}


@pytest.mark.parametrize("producer", list(_PRODUCERS))
def test_computed_sparse_inputs_of_a_custom_function(producer):
    """A SparseTensor computed by each kind of scorch op is in torch's graph: its gradient reaches ``w``, and
    ``torch.autograd.grad`` and ``retain_grad`` on it see the gradient the Function gave it."""
    d, w = _weight()
    x = _x()
    t = _PRODUCERS[producer](w)
    (gt,) = torch.autograd.grad(Scaled.apply(x, t).pow(2).sum(), t, retain_graph=False)
    t2 = _PRODUCERS[producer](w)
    t2.retain_grad()
    Scaled.apply(x, t2).pow(2).sum().backward()
    dd = d.clone().requires_grad_()
    td = _DENSE_PRODUCERS[producer](dd)
    (gtd,) = torch.autograd.grad(Scaled.apply(x, td).pow(2).sum(), td, retain_graph=True)
    Scaled.apply(x, td).pow(2).sum().backward()
    assert type(gt) is SparseTensor and gt.format == t.format
    torch.testing.assert_close(gt.to_dense(), gtd * (t.to_dense() != 0))
    torch.testing.assert_close(t2.grad.to_dense(), gt.to_dense())
    _assert_pattern_grad(w, dd.grad, d)


def test_custom_function_returning_a_sparse_tensor():
    """A user's Function whose output is a SparseTensor (computed without a graph inside ``forward``): scorch's ops
    on it pass its gradient back through the user's ``backward``."""
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    d, w = _weight()
    X = _x().t().contiguous()
    y = Double.apply(w)
    assert type(y) is SparseTensor and y.requires_grad
    with torch.no_grad():
        for _ in range(3):
            y @ X  # (products under no_grad first: no call kept for it that would skip its values' history later)
    (y @ X).pow(2).sum().backward()
    dd = d.clone().requires_grad_()
    (Double.apply(dd) @ X).pow(2).sum().backward()
    _assert_pattern_grad(w, dd.grad, d)


def test_register_hook_on_a_sparse_leaf_is_called_and_can_change_the_gradient():
    d, w = _weight()
    dd = d.clone().requires_grad_()
    calls = []

    def hook(g):
        calls.append(g)
        return g * 3

    w.register_hook(hook)
    dd.register_hook(lambda g: g * 3)
    X = _x().t().contiguous()
    (w @ X).pow(2).sum().backward()  # (scorch's own op)
    Scaled.apply(_x(), w).sum().backward()  # (the gradient through the wrapper: the same hook sees it)
    (dd @ X).pow(2).sum().backward()
    Scaled.apply(_x(), dd).sum().backward()
    assert len(calls) == 2 and all(type(g) is SparseTensor and g.format == w.format for g in calls)
    _assert_pattern_grad(w, dd.grad, d)


def test_post_accumulate_grad_hook_sees_the_accumulated_gradient():
    d, w = _weight()
    dd = d.clone().requires_grad_()
    seen, seen_dense = [], []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.to_dense().clone()))
    dd.register_post_accumulate_grad_hook(lambda p: seen_dense.append(p.grad.clone()))
    for p in (w, dd):
        for _ in range(2):
            Scaled.apply(_x(), p).sum().backward()
    assert len(seen) == len(seen_dense) == 2
    for a, b in zip(seen, seen_dense):
        torch.testing.assert_close(a, _on_pattern(b, d))


def test_retain_grad_on_a_computed_sparse_result():
    d, w = _weight()
    X = _x().t().contiguous()
    t = torch.relu(w * 2)
    t.retain_grad()
    (t @ X).pow(2).sum().backward()
    dd = d.clone().requires_grad_()
    td = torch.relu(dd * 2)
    td.retain_grad()
    (td @ X).pow(2).sum().backward()
    _assert_pattern_grad(t, td.grad, d)
    _assert_pattern_grad(w, dd.grad, d)


def test_autograd_grad_through_a_custom_function():
    d, w = _weight()
    (g,) = torch.autograd.grad(Scaled.apply(_x(), w).sum(), w)
    dd = d.clone().requires_grad_()
    (gd,) = torch.autograd.grad(Scaled.apply(_x(), dd).sum(), dd)
    assert type(g) is SparseTensor and g.format == w.format
    torch.testing.assert_close(g.to_dense(), _on_pattern(gd, d))
    assert w.grad is None


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_a_sparse_product(reentrant):
    d, w = _weight()
    x = _x().requires_grad_()
    xd = x.detach().clone().requires_grad_()
    dd = d.clone().requires_grad_()
    for p, xx in ((w, x), (dd, xd)):
        checkpoint(lambda a, b: (a @ b.t()).pow(2), p, xx, use_reentrant=reentrant).sum().backward()
        # a checkpointed function whose output is sparse
        y = checkpoint(lambda a: a * 3, p, use_reentrant=reentrant)
        (y @ xx.t()).pow(2).sum().backward()
    _assert_pattern_grad(w, dd.grad, d)
    torch.testing.assert_close(x.grad, xd.grad)


def test_torch_func_differentiates_a_sparse_argument_as_its_dense_form():
    """Under torch.func a sparse argument is a transform's tensor, whose ops run on the dense form (a visible
    fallback): the gradient is dense torch's, at every position, as for the dense argument; in strict mode the
    fallback raises, naming the op."""
    d, _ = _weight()
    w = scorch.asformat(d, "csr")
    x = _x()

    def f(s):
        return (s @ x.t()).pow(2).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        torch.testing.assert_close(torch.func.grad(f)(w), torch.func.grad(f)(d))
        out, pull = torch.func.vjp(lambda s: s @ x.t(), w)
        out_d, pull_d = torch.func.vjp(lambda s: s @ x.t(), d)
        torch.testing.assert_close(out, out_d)
        cot = torch.ones_like(out_d)
        torch.testing.assert_close(pull(cot)[0], pull_d(cot)[0])
    with scorch.strict(), pytest.raises(Exception, match="mm"):
        torch.func.grad(f)(w)


def test_a_computed_sparse_input_across_a_graph_break():
    """``w * 3`` computed before a graph break (eager backend: each piece runs as traced) and a computed SparseTensor
    given to a compiled function (aot_eager): the gradient reaches ``w``."""
    d, w = _weight()
    x = _x()
    dd = d.clone().requires_grad_()

    def f(p):
        s = p * 3
        torch._dynamo.graph_break()
        return (s @ x.t()).pow(2).sum()

    f(dd).backward()
    torch._dynamo.reset()
    torch.compile(f, backend="eager")(w).backward()
    _assert_pattern_grad(w, dd.grad, d)
    w.grad = None
    compiled = torch.compile(lambda s: (s @ x.t()).pow(2).sum(), backend="aot_eager", fullgraph=True)
    compiled(w * 3).backward()
    _assert_pattern_grad(w, dd.grad, d)


def test_a_sparse_result_of_a_compiled_graph_that_requires_grad_is_refused():
    """A compiled graph whose output is a SparseTensor requiring grad is not supported yet: it raises, naming
    what is missing, rather than giving an output without its graph."""
    _, w = _weight()
    with pytest.raises(Exception, match="not supported under torch.compile"):
        torch.compile(lambda p: p * 3, backend="aot_eager", fullgraph=True)(w)


def test_requires_grad_off_and_detach_take_the_wrapper_out_of_the_graph():
    d, w = _weight()
    w.requires_grad_(False)
    Scaled.seen.clear()
    x = _x().requires_grad_()
    Scaled.apply(x, w).sum().backward()
    assert Scaled.seen == [(True, False)] and w.grad is None
    w.requires_grad_(True)
    Scaled.apply(x, w).sum().backward()
    assert Scaled.seen[-1] == (True, True) and w.grad is not None
    t = w * 2
    t.detach_()
    assert not t.requires_grad
    Scaled.apply(x, t).sum().backward()
    assert Scaled.seen[-1] == (True, False)


def test_a_sparse_parameter_stays_a_leaf():
    _, w = _weight()
    assert w.is_leaf and w.grad_fn is None and w.requires_grad
    t = w * 2
    assert not t.is_leaf and t.grad_fn is not None and t.values().grad_fn is not None
    torch.optim.Adam([w])  # (refuses a non-leaf)
