"""Outputs whose assembly would need an unreasonably large dense workspace are refused with a clear error,
not attempted (hash workspaces are not implemented yet)."""
import pytest
import torch

import scorch


def test_dense_workspace_assembly_is_bounded():
    s = scorch.asformat(torch.eye(3000), "coo")
    with pytest.raises(NotImplementedError, match="dense workspace of .* MiB"):
        scorch.einsum("ij,kl->ijkl", s, torch.ones(200, 200))


def test_row_workspace_is_bounded():
    n = 2**40
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (n,))
    b = scorch.sparse_coo_tensor(torch.tensor([[5, 7]]), torch.tensor([3.0, 4.0]), (n,))
    with pytest.raises(NotImplementedError, match="hash workspaces"):
        a + b


def test_small_sparse_vectors_still_add():
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (10,))
    b = scorch.sparse_coo_tensor(torch.tensor([[5, 7]]), torch.tensor([3.0, 4.0]), (10,))
    r = a + b
    assert isinstance(r, scorch.SparseTensor)
    torch.testing.assert_close(r.to_dense(), a.to_dense() + b.to_dense())
