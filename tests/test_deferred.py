"""Deferred einsum results (``scorch/deferred.py``): invisible to the user (values, metadata, errors, autograd,
printing, conversion), computed when touched, substituted into a product with a sparse operand, and the issue's
mixture-of-experts program computing only the kept entries."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import scorch
from scorch.deferred import Deferred, pending


@pytest.fixture(autouse=True)
def _defer_all():
    with scorch.deferral("all"):
        yield


def _pair():
    torch.manual_seed(0)
    return torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)


def test_metadata_without_computing():
    a, b = _pair()
    y = scorch.einsum("ij,jk->ik", a, b)
    assert pending(y)
    assert y.shape == (5, 3) and y.dtype == torch.float64 and y.device == a.device and y.dim() == 2
    assert y.numel() == 15 and len(y) == 5 and not y.requires_grad and y.grad_fn is None
    assert pending(y)  # none of these computed it
    torch.testing.assert_close(y + 0, a @ b)
    assert not pending(y) and type(y) is torch.Tensor  # now a plain tensor holding the value


@pytest.mark.parametrize("use", [
    lambda y: y.sum(), lambda y: y * 2, lambda y: torch.relu(y), lambda y: y[1:3], lambda y: y.T.contiguous(),
    lambda y: y.item() if y.numel() == 1 else y.tolist(), lambda y: y.numpy(), lambda y: np.asarray(y),
    lambda y: repr(y), lambda y: str(y), lambda y: torch.cat([y, y]), lambda y: y.clone(),
    lambda y: copy.deepcopy(y), lambda y: pickle.loads(pickle.dumps(y)), lambda y: y.stride(),
    lambda y: y.is_contiguous(), lambda y: y.to(torch.float32), lambda y: y.add_(1),
])
def test_any_use_sees_the_eager_value(use):
    a, b = _pair()
    eager = torch.einsum("ij,jk->ik", a, b)
    with scorch.deferral("off"):
        expect = use(eager.clone())
    y = scorch.einsum("ij,jk->ik", a, b)
    got = use(y)
    if isinstance(expect, torch.Tensor):
        torch.testing.assert_close(got, expect)
    elif isinstance(expect, np.ndarray):
        np.testing.assert_allclose(got, expect)
    else:
        assert got == expect


def test_errors_are_the_eager_ones():
    a, b = _pair()
    for eq, ops in [("ij,jk->ik", (a, a)), ("ij,jk", (a,)), ("ij->q", (a,)), ("i$j", (a,))]:
        with pytest.raises(Exception) as deferred_error:
            scorch.einsum(eq, *ops) + 0
        with scorch.deferral("off"), pytest.raises(Exception) as eager_error:
            scorch.einsum(eq, *ops)
        assert type(deferred_error.value) is type(eager_error.value)
        assert str(deferred_error.value) == str(eager_error.value)


def test_autograd_through_a_deferred_result():
    a, b = _pair()
    a.requires_grad_(True)
    y = scorch.einsum("ij,jk->ik", a, b)
    assert pending(y) and y.requires_grad and y.grad_fn is not None
    (y * y).sum().backward()
    expect = 2 * (a @ b) @ b.T
    torch.testing.assert_close(a.grad, expect.detach())
    gradcheck_a = a.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: scorch.einsum("ij,jk->ik", t, b) * 1, (gradcheck_a,))


def test_operand_modified_in_place_raises():
    a, b = _pair()
    y = scorch.einsum("ij,jk->ik", a, b)
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y + 0


@pytest.mark.parametrize("write", [".data", "numpy"])
def test_operand_written_around_the_version_counter_raises(write):
    """A write through ``.data`` or a NumPy view leaves the version counter as it was: the operand's fingerprint
    still tells, and the deferred result raises rather than give a value the eager call would not have."""
    a, b = _pair()
    y = scorch.einsum("ij,jk->ik", a, b)
    version = b._version
    if write == ".data":
        b.data[0, 0] += 1.0
    else:
        b.numpy()[-1, -1] -= 1.0
    assert b._version == version
    with pytest.raises(RuntimeError, match="through .data, a NumPy view"):
        y + 0
    a, b = _pair()
    y = scorch.einsum("ij,jk->ik", a, b)     # unchanged operands: the value, as before
    torch.testing.assert_close(y + 0, a @ b)


def test_dense_chain_computes_in_eager_order():
    a, b = _pair()
    y = scorch.einsum("ij,jk->ik", a, b)
    z = scorch.einsum("ik,k->i", y, b[0])
    assert not pending(y) and pending(z)  # y was computed to build z: no chains
    torch.testing.assert_close(z + 0, (a @ b) @ b[0])


def _moe(dtype=torch.float32, B=48, D=6, H=5, N=4):
    torch.manual_seed(1)
    x = torch.randn(B, D, dtype=dtype)
    E = torch.randn(N, D, H, dtype=dtype)
    gates = torch.nn.functional.one_hot(torch.rand(B, N).argmax(1), N)
    return x, E, gates


def test_substituted_into_a_sparse_product():
    x, E, gates = _moe()
    y_experts = scorch.einsum("bnd,ndh->bnh", scorch.rearrange(x, "bd->bnd", n=4), E)
    y = scorch.einsum("bnh,bn->bh", y_experts, gates.to_sparse())
    assert pending(y_experts)  # substituted, never computed
    expect = scorch.einsum("bnh,bn->bh", torch.einsum("bd,ndh->bnh", x, E), gates.to_sparse())
    # dense, as the eager product infers (docs/format-inference.md rule 4: a dense factor over gates projected
    # onto their tokens)
    assert type(y) is torch.Tensor and type(expect) is torch.Tensor
    torch.testing.assert_close(y, expect)
    torch.testing.assert_close(y, torch.einsum("bd,ndh,bn->bh", x, E, gates.float()))
    torch.testing.assert_close(y_experts, torch.einsum("bd,ndh->bnh", x, E))  # still right when used later


def test_sparse_product_with_autograd():
    x, E, gates = _moe(torch.float64)
    x.requires_grad_(True)
    E.requires_grad_(True)
    g = scorch.asformat(gates.double(), "csr")
    g.requires_grad_(True)
    y = scorch.einsum("bnh,bn->bh", scorch.einsum("bd,ndh->bnh", x, E), g)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    xr, Er = x.detach().requires_grad_(True), E.detach().requires_grad_(True)
    gr = gates.double().requires_grad_(True)
    (torch.einsum("bnh,bn->bh", torch.einsum("bd,ndh->bnh", xr, Er), gr) * w).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(E.grad, Er.grad)
    torch.testing.assert_close(g.grad.to_dense(), gr.grad * gates)


def _graph_nodes(fn):
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [g for g, _ in f.next_functions]
    return seen


def test_model_parameters_are_deferred_and_trained_through_the_sparse_product():
    """The experts as an nn.Parameter (a model's weights): the experts' product is deferred all the same, the
    loss's graph reaches the Parameter through the combined sparse product only (no dense product of every
    expert, forward or backward), and the gradient and an optimizer step are torch's."""
    x, E, gates = _moe(torch.float64)
    target = torch.randn(x.shape[0], E.shape[2], dtype=torch.float64)
    W = torch.nn.Parameter(E.clone())
    y_experts = scorch.einsum("bnd,ndh->bnh", scorch.rearrange(x, "bd->bnd", n=4), W)
    assert pending(y_experts)
    y = scorch.einsum("bnh,bn->bh", y_experts, gates.to_sparse())
    assert type(y) is torch.Tensor  # (rule 4: dense)
    loss = torch.nn.functional.mse_loss(y, target)
    assert y_experts.grad_fn not in _graph_nodes(loss.grad_fn)
    opt = torch.optim.SGD([W], lr=0.5)
    loss.backward()
    opt.step()
    Wr = E.clone().requires_grad_(True)
    torch.nn.functional.mse_loss(torch.einsum("bd,ndh,bn->bh", x, Wr, gates.double()), target).backward()
    torch.testing.assert_close(W.grad, Wr.grad)
    torch.testing.assert_close(W.detach(), E - 0.5 * Wr.grad)
    assert pending(y_experts)  # never needed


def test_matmul_with_a_sparse_operand_substitutes():
    a, b = _pair()
    s = scorch.asformat(torch.eye(5, dtype=torch.float64), "csr")
    y = scorch.einsum("ij,jk->ik", a, b)
    r = s @ y
    assert pending(y)
    torch.testing.assert_close(r, a @ b)


def test_auto_mode_defers_only_large_products():
    a, b = _pair()
    with scorch.deferral("auto"):
        assert not pending(scorch.einsum("ij,jk->ik", a, b))
        # (stride-0 operands: no memory; the products are never computed)
        x, w = torch.randn(1, 1).expand(2048, 2048), torch.randn(1, 1).expand(2048, 1024)
        assert not pending(scorch.einsum("ij,jk->ik", x[:1024], w))  # 2^31 multiply-adds: below the threshold
        assert pending(scorch.einsum("ij,jk->ik", x, w))  # 2^32
    with scorch.deferral("off"):
        assert not pending(scorch.einsum("ij,jk->ik", x, w))
    with pytest.raises(ValueError, match="deferral mode"):
        with scorch.deferral("sometimes"):
            pass


def test_issue_program_computes_only_kept_entries(monkeypatch):
    """The issue's program: the combined expression is grouped by expert, so no (token, expert) pair outside the
    gate is computed: the expert product's value is never formed."""
    from scorch.engine import grouped
    calls = []
    evaluate = grouped.evaluate
    monkeypatch.setattr(grouped, "evaluate", lambda *a: calls.append(a[0]) or evaluate(*a))
    x, E, gates = _moe(B=512, D=512, H=512, N=4)  # (experts this wide: grouped; narrower, a kernel on the entries)
    with scorch.deferral("auto"):
        import scorch.deferred as d
        old = d.MIN_WORK
        d.MIN_WORK = 1  # this size is below the automatic threshold
        try:
            x_dispatch = scorch.rearrange(x, "bd->bnd", n=4)
            y_experts = scorch.einsum("bnd,ndh->bnh", x_dispatch, E)
            y = scorch.einsum("bnd,bn->bd", y_experts, gates.to_sparse())
        finally:
            d.MIN_WORK = old
    assert isinstance(y_experts, Deferred) and pending(y_experts)
    assert [g.group for g in calls] == [("n",)]  # one grouped product over the gate's entries
    expect = torch.einsum("bnd,bn->bd", torch.einsum("bd,ndh->bnh", x, E), gates.float())
    # (float32 sums of 512 products of normal numbers, about 20 in size, each rounded in its own order: the
    # compiled grouped kernel's and MKL's differ by some 1e-5, as each does from the float64 sum)
    torch.testing.assert_close(y.to_dense(), expect, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("how", ["data", "inference"])
def test_writes_to_a_transposed_operand_are_seen(how):
    """Only contiguous operands were fingerprinted: ``einsum(x, W.t())`` then ``W.data.mul_(2)`` (or any write
    under ``torch.inference_mode``, where tensors have no version counter) gave the later values, silently."""
    import contextlib
    ctx = torch.inference_mode() if how == "inference" else contextlib.nullcontext()
    with ctx, scorch.deferral("all"):
        x, w = torch.randn(6, 5), torch.randn(4, 5)
        y = scorch.einsum("ij,jk->ik", x, w.t())
        (w.data if how == "data" else w).mul_(2)
        with pytest.raises(RuntimeError, match="written"):
            y + 0
        y = scorch.einsum("ij,jk->ik", x, w.t())  # (untouched operands: the value)
        torch.testing.assert_close(y + 0, x @ w.t())
