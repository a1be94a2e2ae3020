"""Sparsifiers: the masks they compute (exact counts, the right entries, deterministic ties), their argument
checks, user-defined sparsifiers, and the SparseTensor ``sparsify`` builds (values exact, pattern = mask)."""
import pytest
import torch

import scorch
from scorch.nn import NM, BlockFraction, KeepAll, RandomFraction, ScalarFraction, ScalarThreshold, Sparsifier
from scorch.nn.sparsify import masked


def _w(shape=(8, 12), seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_keep_all_keeps_every_entry_even_zeros():
    w = _w()
    w[0, :3] = 0
    assert KeepAll().mask(w).all()
    s = KeepAll().sparsify(w, "csr")
    assert s.nnz == w.numel() and torch.equal(s.to_dense(), w)


def test_scalar_threshold_keeps_larger_magnitudes():
    w = _w()
    assert torch.equal(ScalarThreshold(0.5).mask(w), w.abs() > 0.5)
    w[1, 1] = 0
    assert ScalarThreshold(0).mask(w).sum() == w.numel() - 1


@pytest.mark.parametrize("sparsity, kept", [(0.9, 10), (0.5, 50), (0.0, 100), (1.0, 0), (0.333, 67)])
def test_scalar_fraction_is_the_fraction_removed_with_an_exact_count(sparsity, kept):
    w = _w((10, 10))
    m = ScalarFraction(sparsity).mask(w)
    assert int(m.sum()) == kept
    if 0 < kept < 100:  # the kept ones are the largest magnitudes
        assert w.abs()[m].min() >= w.abs()[~m].max()


def test_scalar_fraction_breaks_ties_towards_the_lower_index():
    w = torch.ones(3, 4)
    m = ScalarFraction(0.5).mask(w)
    assert torch.equal(m.reshape(-1), torch.arange(12) < 6)


def test_random_fraction_exact_count_reproducible_and_new_per_call():
    w = _w((16, 16))
    a, b = RandomFraction(0.75, seed=3), RandomFraction(0.75, seed=3)
    m1, m2 = a.mask(w), a.mask(w)
    assert int(m1.sum()) == int(m2.sum()) == 64
    assert not torch.equal(m1, m2)  # each call draws a new pattern
    assert torch.equal(b.mask(w), m1) and torch.equal(b.mask(w), m2)  # the same seed, the same sequence
    g = torch.Generator().manual_seed(3)
    assert torch.equal(RandomFraction(0.75, generator=g).mask(w), m1)


def test_block_fraction_keeps_whole_blocks_by_norm():
    w = torch.zeros(8, 8, dtype=torch.float64)
    w[0:4, 4:8] = 1.0    # L2 = 4: kept
    w[4:8, 0:4] = 0.1    # L2 = 0.4
    w[4, 4] = 3.0        # L2 = 3: kept
    m = BlockFraction(0.5, (4, 4)).mask(w)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[0:4, 4:8] = expected[4:8, 4:8] = True
    assert torch.equal(m, expected)
    w[4:8, 0:4] = 0.25   # L1 = 4 beats the single 3.0 (L1 = 3), L2 = 1 does not
    assert torch.equal(BlockFraction(0.5, (4, 4)).mask(w), expected)
    m1 = BlockFraction(0.5, (4, 4), norm="l1").mask(w)
    assert m1[4:8, 0:4].all() and not m1[4:8, 4:8].any()


def test_block_fraction_partial_edge_blocks():
    w = _w((10, 7))
    m = BlockFraction(0.5, (4, 4)).mask(w)  # 3 x 2 blocks, the last row and column of blocks partial
    blocks = torch.nn.functional.pad(m, (0, 1, 0, 2)).reshape(3, 4, 2, 4).transpose(1, 2)
    kept = blocks.any(-1).any(-1)
    assert int(kept.sum()) == 3
    for r in range(3):
        for c in range(2):
            rows, cols = slice(4 * r, min(4 * r + 4, 10)), slice(4 * c, min(4 * c + 4, 7))
            assert bool(m[rows, cols].all()) == bool(kept[r, c])  # all or nothing within a block


def test_nm_keeps_the_n_largest_in_each_group():
    w = _w((6, 16))
    m = NM(2, 4).mask(w)
    groups, mg = w.abs().reshape(-1, 4), m.reshape(-1, 4)
    assert (mg.sum(1) == 2).all()
    assert (groups[mg].reshape(-1, 2).min(1).values >= groups[~mg].reshape(-1, 2).max(1).values).all()
    m0 = NM(1, 3, dim=0).mask(_w((6, 5)))
    assert (m0.reshape(2, 3, 5).sum(1) == 1).all()


@pytest.mark.parametrize("make, match", [
    (lambda: ScalarFraction(1.5), "sparsity"), (lambda: ScalarFraction(-0.1), "sparsity"),
    (lambda: ScalarFraction("0.5"), "sparsity"), (lambda: RandomFraction(2), "sparsity"),
    (lambda: BlockFraction(0.5, (0, 4)), "positive"), (lambda: BlockFraction(0.5, 4), "pair"),
    (lambda: BlockFraction(0.5, (4, 4), norm="max"), "norm"), (lambda: NM(3, 2), "n <= m"),
    (lambda: NM(1, 0), "m > 0"), (lambda: ScalarThreshold(float("nan")), "threshold"),
    (lambda: RandomFraction(0.5, seed=1, generator=torch.Generator()), "not both"),
])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        NM(2, 4).mask(_w((4, 6)))
    with pytest.raises(ValueError, match="2-d"):
        BlockFraction(0.5, (2, 2)).mask(_w((8,)))


class TopRow(Sparsifier):
    """A user-defined sparsifier: keeps the first row."""

    def mask(self, w):
        m = torch.zeros(w.shape, dtype=torch.bool)
        m[0] = True
        return m


def test_a_user_sparsifier_overrides_mask():
    w = _w((4, 5))
    assert torch.equal(TopRow()(w)[1:], torch.zeros(3, 5, dtype=w.dtype)) and torch.equal(TopRow()(w)[0], w[0])
    s = TopRow().sparsify(w, "coo")
    assert isinstance(s, scorch.SparseTensor) and s.nnz == 5 and torch.equal(s.to_dense()[0], w[0])


def test_a_bad_user_mask_is_refused():
    class Floats(Sparsifier):
        def mask(self, w):
            return torch.ones_like(w)

    class Wrong(Sparsifier):
        def mask(self, w):
            return torch.ones(2, dtype=torch.bool)

    with pytest.raises(TypeError, match="bool"):
        Floats()(_w())
    with pytest.raises(ValueError, match="shape"):
        Wrong().sparsify(_w(), "csr")
    with pytest.raises(NotImplementedError, match="override mask"):
        Sparsifier().mask(_w())


def test_call_is_the_dense_masked_tensor_and_differentiable():
    w = _w().requires_grad_()
    out = ScalarFraction(0.5)(w)
    m = ScalarFraction(0.5).mask(w.detach())
    assert torch.equal(out.detach(), w.detach() * m)
    out.sum().backward()
    assert torch.equal(w.grad, m.to(w.dtype))


FORMATS = ["csr", "coo", "csc", "dcsr", "ell", "dia", "dense", "bsr(4, 4)", "bsr(3, 5)",
           "(i, j) -> (i / 4 : dense, j / 4 : fixed, i % 4 : compressed(nonunique), j % 4 : singleton)"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_sparsify_stores_exactly_the_kept_values(fmt):
    w = _w()
    w[0, 0] = 0.0
    m = ScalarFraction(0.6).mask(w)
    m[0, 0] = True  # a kept zero
    s = masked(w, m, fmt)
    assert s.format == scorch.formats.resolve(fmt, 2)
    assert torch.equal(s.to_dense(), w * m)
    stored = s.values() != 0
    if s.format.padded:  # a kept zero cannot be told from padding: it is dropped
        assert int(stored.sum()) == int(m.sum()) - 1
    elif fmt in ("csr", "coo", "csc", "dcsr"):  # the pattern is the mask, explicit zero included
        assert s.nnz == int(m.sum())


def test_sparsify_detaches_and_masked_keeps_the_graph():
    w = _w().requires_grad_()
    m = NM(1, 4).mask(w.detach())
    assert not ScalarFraction(0.5).sparsify(w, "csr").requires_grad
    s = masked(w, m, "csr")
    (s.values() * 2).sum().backward()
    assert torch.equal(w.grad, 2 * m.to(w.dtype))


def test_sparsify_of_a_sparse_tensor_uses_its_dense_values():
    w = _w()
    s = ScalarFraction(0.5).sparsify(scorch.asformat(w, "coo"), "csr")
    assert torch.equal(s.to_dense(), ScalarFraction(0.5)(w))


def test_nm_sparsifier_stores_nm_by_default():
    """``NM(n, m)`` along a weight's last dimension with no format set stores ``nm(n, m)``, as docs/training.md says (it
    stored CSR); an explicit format, or n:m along another dimension, keeps its own."""
    import scorch
    from scorch.formats.named import short_name
    torch.manual_seed(0)
    for sparsifier, fmt, want in ((scorch.nn.NM(2, 4), None, "nm(2, 4)"), (scorch.nn.NM(2, 4), "csr", "csr"),
                                  (scorch.nn.NM(1, 2, dim=0), None, "csr")):
        lin = torch.nn.Linear(8, 4)
        ref = lin.weight.detach().clone()
        sel = scorch.schedule(lin)
        sel["weight"].sparsify(sparsifier)
        if fmt:
            sel["weight"].set_format(fmt)
        assert short_name(sel["weight"].formats["weight"]) == want  # (the preview agrees with apply)
        sel.apply()
        assert lin.weight.format.name == want
        torch.testing.assert_close(lin.weight.detach().to_dense(), ref * sparsifier.mask(ref))
