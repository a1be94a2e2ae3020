"""Every ``torch.optim`` optimizer on a SparseLinear's SparseTensor weight steps as the same optimizer on a dense
``nn.Linear`` whose gradient is masked to the pattern (what training on a fixed pattern means), with and without
``foreach``; the weight stays a SparseTensor on its pattern. Rprop raises a clear error (its sign array sets the
entries where the gradient is 0 to 1, off the pattern too)."""
import warnings

import pytest
import torch

import scorch

OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "LBFGS"]


def _pair(seed=0):
    torch.manual_seed(seed)
    sparse = scorch.nn.SparseLinear(12, 24, density=0.3)
    dense = torch.nn.Linear(12, 24)
    with torch.no_grad():
        dense.weight.copy_(sparse.weight.to_dense())
        dense.bias.copy_(sparse.bias)
    return sparse, dense, sparse.weight.to_dense() != 0


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_steps_sparse_weight_as_masked_dense(name, foreach):
    sparse, dense, mask = _pair()
    pattern = sparse.weight.levels
    kw = {} if name == "LBFGS" else {"foreach": foreach}
    opt = getattr(torch.optim, name)(sparse.parameters(), lr=0.01, **kw)
    opt_ref = getattr(torch.optim, name)(dense.parameters(), lr=0.01, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(3, 12, generator=g)

        def loss_sparse():
            opt.zero_grad()
            loss = sparse(x).pow(2).sum()
            loss.backward()
            return loss

        def loss_dense():
            opt_ref.zero_grad()
            loss = dense(x).pow(2).sum()
            loss.backward()
            dense.weight.grad *= mask
            return loss
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scorch.DensifyWarning)  # (Adagrad's, Adadelta's dense state)
            opt.step(loss_sparse)
        opt_ref.step(loss_dense)
    assert isinstance(sparse.weight, scorch.SparseTensor) and sparse.weight.levels is pattern
    torch.testing.assert_close(sparse.weight.to_dense(), dense.weight.detach() * mask, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(sparse.bias.detach(), dense.bias.detach(), rtol=1e-4, atol=2e-5)


def test_rprop_says_why_it_cannot_step_a_sparse_weight():
    sparse, _, _ = _pair()
    opt = torch.optim.Rprop(sparse.parameters(), lr=0.01)
    sparse(torch.randn(3, 12)).sum().backward()
    with pytest.raises(NotImplementedError, match="sparse tensor"):
        opt.step()
