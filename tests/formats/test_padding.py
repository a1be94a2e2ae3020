"""Padding of a fixed (ELL, n:m) level read off the coordinates (``storage.padding``): a slot repeating the
coordinate before it is padding whatever its value; a stored zero of a real slot is an entry; a segment whose
every slot is at coordinate 0 reads its first slot as padding only where it (and each other value array given)
holds 0."""
import torch

import scorch
from scorch.formats import storage
from scorch.nn.sparsify import masked
from scorch.sparse_tensor import padding_of


def test_ell_padding_by_coordinates():
    mask = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    values = torch.tensor([[0., 2., 0., 0.], [0., 0., 0., 0.], [0., 0., 0., 0.], [0., 0., 5., 0.]])
    s = masked(values, mask, "ell")  # stored zeros at (0, 3), (1, 0), (3, 0) and (3, 3)
    assert s.levels[1].crd.tolist() == [1, 3, 3, 0, 0, 0, 0, 0, 0, 0, 2, 3]
    pad = padding_of(s).reshape(4, 3)
    # row 0: entries at 1 and 3, then padding; row 1: one entry at 0, which holds 0: read as padding (the one
    # case the coordinates cannot tell); row 2: empty; row 3: three entries (two of them zeros)
    assert pad.tolist() == [[False, False, True], [True, True, True], [True, True, True], [False, False, False]]
    # the same slot with another value array on the same index arrays that is not 0 there: an entry
    assert not padding_of(s, s.with_values(torch.ones(s.nnz))).reshape(4, 3)[1, 0]
    assert not storage.padding(s.format, s.shape, s.levels, s.values(), torch.ones(s.nnz)).reshape(4, 3)[1, 0]


def test_nm_stored_zeros_train():
    w = torch.zeros(2, 8)
    mask = torch.tensor([[1, 0, 0, 1, 0, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    p = torch.nn.Parameter(masked(w, mask, "nm(2, 4)"))
    assert int((~padding_of(p)).sum()) == 8  # every kept zero is an entry
    (p @ torch.ones(8, 1)).sum().backward()
    torch.optim.SGD([p], lr=1.0).step()
    assert torch.equal(p.detach().to_dense() != 0, mask)
