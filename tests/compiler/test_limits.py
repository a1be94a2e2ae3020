"""Outputs whose assembly would need an unreasonably large dense workspace: a one-operand output assembled from a
dense array is refused with a clear error; several sparse operands' outputs take a hash workspace instead
(tests/compiler/test_hash_workspace.py)."""
import pytest
import torch

import scorch


def test_dense_workspace_assembly_is_bounded():
    s = scorch.asformat(torch.eye(3000), "coo")
    with pytest.raises(NotImplementedError, match="dense workspace of .* MiB"):
        scorch.einsum("ij,kl->ijkl", s, torch.ones(200, 200))


def test_wide_rows_take_a_hash_workspace():
    n = 2**40
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (n,))
    b = scorch.sparse_coo_tensor(torch.tensor([[5, 7]]), torch.tensor([3.0, 4.0]), (n,))
    r = a + b
    assert torch.equal(r.indices(), torch.tensor([[0, 5, 7]])) and torch.equal(r.values(), torch.tensor([1.0, 5.0, 4.0]))


def test_small_sparse_vectors_still_add():
    a = scorch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (10,))
    b = scorch.sparse_coo_tensor(torch.tensor([[5, 7]]), torch.tensor([3.0, 4.0]), (10,))
    r = a + b
    assert isinstance(r, scorch.SparseTensor)
    torch.testing.assert_close(r.to_dense(), a.to_dense() + b.to_dense())
