"""Padding of a fixed (ELL, n:m) level read off the coordinates (``storage.padding``): a slot repeating the
coordinate before it is padding whatever its value; a stored zero of a real slot is an entry; a segment whose
every slot is at coordinate 0 reads its first slot as padding only where it (and each other value array given)
holds 0."""
import warnings

import pytest
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


def _pruned(x, fmt):
    if not fmt.startswith("nm"):
        return x
    n, m = map(int, fmt[3:-1].split(","))
    g = x.reshape(x.shape[0], -1, m)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.abs().topk(n, dim=-1).indices, True)
    return (g * keep).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)", "nm(1, 2)"])
@pytest.mark.parametrize("seed", range(6))
def test_padding_meets_no_inf_or_nan(fmt, seed):
    # padding is not an entry: an inf or nan where a padded slot points (the segment's last coordinate, or 0
    # in an empty segment) must not reach the result as 0 * inf = nan; the same tensor in CSR is the reference
    g = torch.Generator().manual_seed(seed)
    m, n = 6, 8
    x = _pruned(torch.randn(m, n, generator=g) * (torch.rand(m, n, generator=g) < 0.3), fmt)
    x[1] = 0  # an empty segment: its padding is at coordinate 0
    s, ref = scorch.asformat(x, fmt), scorch.asformat(x, "csr")
    X = torch.randn(n, 3, generator=g)
    X[0, 0], X[int(torch.randint(1, n, (1,), generator=g)), 1] = float("nan") if seed % 2 else float("inf"), float("inf")
    Y = torch.randn(3, m, generator=g)
    Y[:, 0] = float("inf")
    D = torch.randn(m, n, generator=g)
    D[:, 0] = float("nan")
    A, B = torch.randn(m, 4, generator=g), torch.randn(4, n, generator=g)
    B[:, 0] = float("inf")
    calls = {"S @ X": lambda t: t @ X, "S @ v": lambda t: t @ X[:, 0], "Y @ S": lambda t: Y @ t,
             "S * D": lambda t: (t * D).to_dense(), "einsum": lambda t: scorch.einsum("ij,jk->ik", t, X),
             "sampled_addmm": lambda t: torch.sparse.sampled_addmm(t, A, B).to_dense()}
    for name, f in calls.items():
        got, want = f(s), f(ref)
        assert torch.allclose(got, want, equal_nan=True, atol=1e-6), (name, got, want)


@pytest.mark.parametrize("fmt", ["ell", "nm(2, 4)"])
def test_zeros_like_keeps_the_padding_its_source_reads(fmt):
    # a row whose one entry is at coordinate 0: its zeros (optimizer state) read alone would make that slot
    # padding; Adadelta's ``acc_delta.addcmul_(delta, delta)`` then raised that delta is nonzero off the pattern
    x = torch.zeros(3, 8)
    x[0, 0], x[1, 1], x[1, 4], x[2, 0] = 1.0, 2.0, 3.0, 4.0
    s = scorch.asformat(x, fmt)
    z = torch.zeros_like(s)
    assert torch.equal(padding_of(z), padding_of(s))
    assert not torch.equal(storage.padding(z.format, z.shape, z.levels, z.values()), padding_of(s))  # (alone)
    w = torch.nn.Parameter(scorch.asformat(x, fmt))
    opt = torch.optim.Adadelta([w], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for _ in range(2):
            opt.zero_grad()
            (w @ torch.ones(8)).pow(2).sum().backward()
            opt.step()
    assert torch.equal(w.detach().to_dense() != 0, x != 0)
