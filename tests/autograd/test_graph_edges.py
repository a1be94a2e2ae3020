"""Gradients that went wrong on the edges of the graph (stop 39's probing against dense torch): padding slots of
ELL / n:m given gradient by same-pattern sums, extrema at a stored zero or over every dimension, in-place ops of
another pattern or on padded tensors inside a graph, and SparseTensors as ``torch.autograd.grad`` /
``backward(inputs=...)`` inputs or as outputs with a dense gradient."""
import warnings

import pytest
import torch

import scorch

X = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
@pytest.mark.parametrize("op", ["add", "mul"])
def test_same_pattern_sums_and_products_give_padding_no_gradient(fmt, op):
    """``(W + 2 * W).values().sum()``: the padding slots' gradient was 1, and an SGD step made (2, 0) an entry."""
    w = torch.nn.Parameter(scorch.asformat(X, fmt))
    r = w + w * 2.0 if op == "add" else w * (w * 2.0)
    r.values().sum().backward()
    expected = 3.0 * (X != 0).double() if op == "add" else 4.0 * X
    torch.testing.assert_close(w.grad.to_dense(), expected)
    torch.optim.SGD([w], lr=0.1).step()
    torch.testing.assert_close(w.to_dense(), X - 0.1 * expected)
    assert int((w.to_dense() != 0).sum()) == 3


@pytest.mark.parametrize("fmt", ["csr", "coo", "dia", "bsr(2, 2)"])
@pytest.mark.parametrize("dim", [0, 1])
def test_extrema_at_a_stored_zero_take_their_gradient(fmt, dim):
    """A column whose min is a stored 0: the result, sparse, left that cell out and the gradient with it."""
    crow, col = torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1])
    vals = torch.tensor([-1.0, 0.0, 3.0, 2.0], dtype=torch.float64)
    s = scorch.asformat(scorch.sparse_csr_tensor(crow, col, vals, (2, 2)), fmt).requires_grad_()
    r = s.amin(dim)
    assert type(r) is torch.Tensor
    r.sum().backward()
    d = vals.reshape(2, 2).clone().requires_grad_()
    d.amin(dim).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), d.grad)


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
@pytest.mark.parametrize("name", ["amax", "amin"])
def test_extrema_over_every_dimension_differentiate(fmt, name):
    s = scorch.asformat(X * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=X.dtype), fmt).requires_grad_()
    d = s.detach().to_dense().requires_grad_()
    getattr(s, name)().backward()
    getattr(d, name)().backward()
    torch.testing.assert_close(s.grad.to_dense(), d.grad * (s.detach().to_dense() != 0).double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extremum_ties_counted_beyond_16_bit_precision(dtype):
    """3000 tied entries: counted in the 16-bit dtype, bfloat16 stopped at 256 and each got 1/256."""
    s = scorch.asformat(torch.ones(2, 3000, dtype=dtype), "csr").requires_grad_()
    s.amax(1).float().sum().backward()
    torch.testing.assert_close(s.grad.values().float().reshape(2, -1).sum(1), torch.ones(2), atol=0.01, rtol=0)


@pytest.mark.parametrize("name", ["add_", "__iadd__", "mul_", "sub_"])
def test_in_place_ops_of_another_pattern_keep_the_graph(name):
    """``T = S * 2; T.add_(U)`` with U of another pattern: T became a new leaf and S got no gradient."""
    u = torch.tensor([[0.0, 5.0, 0.0, 0.0], [7.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.arange(4.0, dtype=torch.float64)[:, None] + 1
    s = scorch.asformat(X, "csr").requires_grad_()
    t = s * 2.0
    getattr(t, name)(scorch.asformat(u, "csr"))
    assert not t.is_leaf
    (t @ b).sum().backward()
    d = X.clone().requires_grad_()
    td = d * 2.0
    getattr(td, name)(u)
    (td @ b).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), d.grad * (X != 0).double())
    leaf = scorch.asformat(X, "csr").requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable"):
        getattr(leaf, name)(scorch.asformat(u, "csr"))


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
@pytest.mark.parametrize("name", ["relu_", "abs_", "neg_"])
def test_in_place_maps_on_padded_tensors_in_a_graph(fmt, name):
    """The padding was re-zeroed in place after the map: the map's saved output changed (a version error)."""
    x = torch.tensor([[1.0, -2.0, 0.0, 0.0], [0.0, 3.0, 0.0, -4.0]], dtype=torch.float64)
    b = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
    s = scorch.asformat(x, fmt).requires_grad_()
    t = s * 1.0
    getattr(t, name)()
    (t @ b).sum().backward()
    d = x.clone().requires_grad_()
    td = d * 1.0
    getattr(td, name)()
    (td @ b).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), d.grad * (x != 0).double())


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
def test_sparse_tensors_as_autograd_inputs_and_outputs(fmt):
    """``torch.autograd.grad(loss, S)`` and ``loss.backward(inputs=[S])`` found no graph through the wrapper;
    ``r.backward(G)`` with a dense G for a sparse result raised a shape mismatch."""
    b = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = scorch.asformat(X, fmt).requires_grad_()
    ref = (X.clone().requires_grad_())
    (ref @ b).square().sum().backward()
    expected = ref.grad * (X != 0).double()
    (g,) = torch.autograd.grad((s @ b).square().sum(), s)
    assert isinstance(g, scorch.SparseTensor)
    torch.testing.assert_close(g.to_dense(), expected)
    (g,) = torch.autograd.grad([(s @ b).square().sum()], [s], create_graph=True)
    torch.testing.assert_close(g.to_dense(), expected)
    (s @ b).square().sum().backward(inputs=[s])
    torch.testing.assert_close(s.grad.to_dense(), expected)
    s.grad = None
    r = s * 3.0
    G = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    r.backward(G, retain_graph=True)
    torch.testing.assert_close(s.grad.to_dense(), 3 * G * (X != 0).double())
    s.grad = None
    torch.autograd.backward([r], [G])
    torch.testing.assert_close(s.grad.to_dense(), 3 * G * (X != 0).double())
    lin = scorch.nn.SparseLinear(4, 3) if hasattr(scorch.nn, "SparseLinear") else None
    if lin is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(lin(torch.randn(2, 4)).sum(), list(lin.parameters()))
        assert [type(g) for g in grads][0] is scorch.SparseTensor


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
def test_a_gradient_on_the_outputs_own_arrays_gives_padding_none(fmt):
    """``torch.autograd.grad(r, W, r)`` with ``r = W * 2`` (the gradient shares r's arrays, padding included): the
    padding slots' values of the gradient must not flow back into W's padding."""
    w = scorch.asformat(X, fmt).requires_grad_()
    r = w * 2.0
    g_out = r.detach().with_values(torch.ones_like(r.values()))  # 1 in every slot, padding too
    (g,) = torch.autograd.grad(r, w, g_out)
    torch.testing.assert_close(g.to_dense(), 2.0 * (X != 0).double())
    assert float(g.values().sum()) == 2.0 * int((X != 0).sum())


@pytest.mark.parametrize("fmt", ["csr", "ell"])
def test_gradient_hooks_on_sparse_parameters(fmt):
    """``register_hook`` / ``register_post_accumulate_grad_hook`` raised on a SparseTensor (gradient masking or
    clipping hooks, optimizer-in-backward): the hook sees the gradient on the pattern, and may replace it."""
    w = torch.nn.Parameter(scorch.asformat(X, fmt))
    seen = []
    handle = w.register_hook(lambda g: (seen.append(type(g)), g * 2)[1])
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.to_dense().sum().item()))
    b = torch.ones(4, 2, dtype=torch.float64)
    (w @ b).sum().backward()
    assert seen[0] is scorch.SparseTensor
    torch.testing.assert_close(w.grad.to_dense(), 4 * (X != 0).double())
    assert seen[1] == pytest.approx(12.0)
    handle.remove()
    w.grad = None
    (w @ b).sum().backward()
    torch.testing.assert_close(w.grad.to_dense(), 2 * (X != 0).double())


def test_torch_func_transforms_of_sparse_products_run_on_the_dense_form():
    """vmap, jvp and torch.func.grad wrap their tensors, which have no storage a kernel reads (``Cannot access data
    pointer``): under them a product with a sparse operand runs on the dense form (a visible fallback), also
    where the product was kept for the operand's shape before."""
    import warnings
    d = torch.eye(4, dtype=torch.float64) + torch.diag(torch.ones(3, dtype=torch.float64), 1)
    s = scorch.asformat(d, "csr")
    x = torch.randn(4, 2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for _ in range(3):
            s @ x[:, 0]  # (kept: the C operator's kept call meets the batched tensor next)
        batch = torch.randn(3, 4, dtype=torch.float64)
        torch.testing.assert_close(torch.func.vmap(lambda v: s @ v)(batch), batch @ d.T)
        torch.testing.assert_close(torch.func.vmap(lambda v: torch.mm(s, v))(batch.unsqueeze(-1)),
                                   (batch @ d.T).unsqueeze(-1))
        torch.testing.assert_close(torch.func.jvp(lambda v: s @ v, (x,), (x,))[1], d @ x)
        torch.testing.assert_close(torch.func.grad(lambda v: (s @ v).sum())(x), torch.func.grad(lambda v: (d @ v).sum())(x))
    torch.testing.assert_close(s @ x, d @ x)  # (and the kept call still serves outside them)


def test_detach_in_place():
    s = scorch.asformat(torch.eye(3), "csr").requires_grad_()
    t = s * 2
    assert t.requires_grad and t.detach_() is t and not t.requires_grad
    torch.testing.assert_close(t.to_dense(), 2 * torch.eye(3))
