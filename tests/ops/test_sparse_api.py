"""torch's sparse-tensor API on SparseTensors: coalesce, index accessors, to_sparse*, sparse softmax."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import scorch
from scorch.formats import storage

FORMATS = ["csr", "csc", "coo", "dcsr", "bsr(2, 1)", "ell", "dia"]


def _matrix(shape, seed, density=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * (torch.rand(shape, generator=g) < density)


def _stored(s):
    """A dense bool mask of the entries s stores (padding excluded)."""
    leaf, dims, inside = storage.coordinates(s.format, s.shape, s.levels)
    keep = inside
    if any(lvl.padded for lvl in s.format.level_types):
        keep = keep & (s.values()[leaf] != 0)
    mask = torch.zeros(tuple(s.shape), dtype=torch.bool)
    mask[tuple(dims[:, keep])] = True
    return mask


def _masked_softmax(d, mask, dim, log=False):
    x = d.masked_fill(~mask, float("-inf"))
    r = (torch.log_softmax if log else torch.softmax)(x, dim)
    return torch.where(mask, r, torch.zeros((), dtype=d.dtype)).nan_to_num(0.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(6, 5), (1, 1), (0, 4), (4, 3)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_matches_masked_dense_softmax(fmt, shape, dim):
    d = _matrix(shape, 1)
    s = scorch.asformat(d, fmt)
    mask = _stored(s)
    for fn, log in ((torch.sparse.softmax, False), (F.softmax, False), (torch.sparse.log_softmax, True),
                    (F.log_softmax, True)):
        r = fn(s, dim)
        assert isinstance(r, scorch.SparseTensor) and r.format == s.format
        torch.testing.assert_close(r.to_dense(), _masked_softmax(d, mask, dim, log))


def test_softmax_matches_torch_sparse_softmax_on_coo():
    d = _matrix((7, 6), 2)
    t = d.to_sparse()
    s = scorch.from_torch(t)
    for dim in (0, 1):
        torch.testing.assert_close(torch.sparse.softmax(s, dim).to_dense(), torch.sparse.softmax(t, dim).to_dense())
        torch.testing.assert_close(s.softmax(dim).to_dense(), torch.sparse.softmax(t, dim).to_dense())


def test_softmax_of_uncoalesced_coo_sums_duplicates_first():
    i = torch.tensor([[0, 0, 1, 0], [1, 1, 2, 3]])
    v = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=torch.float64)
    s = scorch.sparse_coo_tensor(i, v, (2, 4))
    t = torch.sparse_coo_tensor(i, v, (2, 4))
    torch.testing.assert_close(torch.sparse.softmax(s, 1).to_dense(), torch.sparse.softmax(t, 1).to_dense())


def test_softmax_3d_and_gradients():
    d = _matrix((3, 4, 5), 3)
    s = scorch.asformat(d, "csf")
    for dim in range(3):
        torch.testing.assert_close(torch.sparse.softmax(s, dim).to_dense(),
                                   torch.sparse.softmax(d.to_sparse(), dim).to_dense())
    c = scorch.asformat(_matrix((5, 4), 4), "csr")
    v = c.values().detach().clone().requires_grad_()
    assert gradcheck(lambda v: torch.sparse.softmax(c.with_values(v), 1).to_dense(), (v,))
    assert gradcheck(lambda v: F.log_softmax(c.with_values(v), 0).to_dense(), (v,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_16_bit_rounds_once_on_the_generic_path(dtype, log):
    """A softmax over a COO tensor's columns (no row segments: the generic path) on 16-bit values: computed in
    float32 and rounded once, so within an ulp of the exact result; 16-bit sums of a column's 300 exponentials
    were further off."""
    g = torch.Generator().manual_seed(5)
    d = torch.randn(300, 4, generator=g).to(dtype)
    s = scorch.asformat(d, "coo")
    r = (torch.sparse.log_softmax if log else torch.sparse.softmax)(s, 0).to_dense()
    exact = (torch.log_softmax if log else torch.softmax)(d.double(), 0)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert r.dtype == dtype and ((r.double() - exact).abs() <= ulp).all()


def test_softmax_errors():
    s = scorch.asformat(_matrix((3, 3), 5), "csr")
    with pytest.raises(IndexError, match="out of range"):
        torch.sparse.softmax(s, 2)
    with pytest.raises(TypeError, match="floating point"):
        torch.sparse.softmax(scorch.asformat(torch.eye(3, dtype=torch.int64), "csr"), 1)


def test_coalesce_and_indices():
    i = torch.tensor([[1, 0, 1], [2, 1, 2]])
    s = scorch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    assert not s.is_coalesced()
    c = s.coalesce()
    assert c.is_coalesced() and c.nnz == 2
    torch.testing.assert_close(c.indices(), torch.tensor([[0, 1], [1, 2]]))
    torch.testing.assert_close(c.values(), torch.tensor([2.0, 4.0]))
    csr = scorch.asformat(c, "csr")
    assert csr.coalesce() is csr
    torch.testing.assert_close(csr.crow_indices().long(), torch.tensor([0, 1, 2]))
    torch.testing.assert_close(csr.col_indices().long(), torch.tensor([1, 2]))
    csc = scorch.asformat(c, "csc")
    torch.testing.assert_close(csc.ccol_indices().long(), torch.tensor([0, 0, 1, 2]))
    torch.testing.assert_close(csc.row_indices().long(), torch.tensor([0, 1]))
    with pytest.raises(NotImplementedError, match="COO"):
        csr.indices()
    with pytest.raises(NotImplementedError, match="csr"):
        csc.crow_indices()


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_sparse_methods(fmt):
    d = _matrix((6, 4), 6)
    s = scorch.asformat(d, fmt)
    for r, name in ((s.to_sparse(), "coo"), (s.to_sparse_coo(), "coo"), (s.to_sparse_csr(), "csr"),
                    (s.to_sparse_csc(), "csc"), (s.to_sparse_bsr((2, 2)), "bsr(2, 2)"),
                    (s.to_sparse_bsc((3, 1)), "bsc(3, 1)"), (s.to_sparse(layout=torch.sparse_csr), "csr")):
        assert isinstance(r, scorch.SparseTensor)
        assert r.format == scorch.asformat(d, name).format
        torch.testing.assert_close(r.to_dense(), d)
    with pytest.raises(ValueError, match="blocksize"):
        s.to_sparse(layout=torch.sparse_bsr)


def test_index_accessors_give_int64_as_torch_layouts_do():
    """Code built on ``crow_indices()`` / ``col_indices()`` expects int64 (torch's default): PyG's GATConv on a
    scorch CSR (int32 arrays) got wrong gradients, through torch's CPU gather with an expanded int32 index."""
    d = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    csr, csc = scorch.asformat(d, "csr"), scorch.asformat(d, "csc")
    assert csr.levels[1].crd.dtype == torch.int32
    for a in (csr.crow_indices(), csr.col_indices(), csc.ccol_indices(), csc.row_indices()):
        assert a.dtype == torch.int64
    torch.testing.assert_close(csr.col_indices(), torch.tensor([1, 0, 2]))
    wide = scorch.asformat(d, "csr", index_dtype=torch.int64)
    assert wide.col_indices().data_ptr() == wide.levels[1].crd.data_ptr()  # (shared where stored as int64)


def test_pyg_gatconv_gradients_on_a_scorch_adjacency():
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    n = 15
    a = ((torch.rand(n, n) < 0.2) | (torch.rand(n, n) < 0.2).t()).float()
    a.fill_diagonal_(0)
    x = torch.randn(n, 6)
    conv = pyg.GATConv(6, 4, add_self_loops=False)

    def grads(adj):
        conv.zero_grad()
        xg = x.clone().requires_grad_(True)
        out = conv(xg, adj)
        out.pow(2).sum().backward()
        return out.detach(), xg.grad, conv.lin.weight.grad.clone()

    ref = grads(a.nonzero().t())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = grads(scorch.asformat(a.t().contiguous(), "csr"))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["csr", "coo"])
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_sparse_mm_with_reduce(fmt, reduce):
    """``torch.sparse.mm(S, X, reduce)`` raised (PyG's SAGEConv with mean aggregation stopped)."""
    g = torch.Generator().manual_seed(0)
    d = torch.randn(5, 4, generator=g) * (torch.rand(5, 4, generator=g) < 0.5)
    x = torch.randn(4, 3, generator=g)
    s = scorch.asformat(d, fmt).requires_grad_()
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    t = d.to_sparse_csr().requires_grad_()
    got = torch.sparse.mm(s, xs, reduce)
    want = torch.sparse.mm(t, xt, reduce)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(xs.grad, xt.grad)
    torch.testing.assert_close(s.grad.to_dense(), t.grad.to_dense())
    torch.testing.assert_close(torch.sparse.mm(s.detach(), x, reduce=reduce), want.detach())


@pytest.mark.parametrize("fmt", ["coo", "csr", "ell"])
def test_sparse_mask_takes_values_on_the_masks_pattern(fmt):
    """``D.sparse_mask(S)`` (torch's docstring example) raised from the dense fallback (torch refuses a dense
    mask); values and the gradient of ``D`` at the mask's entries."""
    d = torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]], requires_grad=True)
    m = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    s = scorch.asformat(m, fmt)
    r = d.sparse_mask(s)
    assert isinstance(r, scorch.SparseTensor)
    torch.testing.assert_close(r.to_dense(), (d * (m != 0)).detach())
    r.values().sum().backward()
    torch.testing.assert_close(d.grad, (m != 0).float())
    torch.testing.assert_close(s.sparse_mask(scorch.asformat(m * (m > 1), fmt)).to_dense(), m * (m > 1))
    with pytest.raises(ValueError, match="shape"):
        torch.ones(3, 3).sparse_mask(s)


def test_coo_only_products_smm_hspmm_sspaddmm():
    """torch's COO-only products with a sparse result raised from the dense fallback (torch refuses dense
    operands): torch's own kernel on the COO form."""
    m = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    y = torch.arange(6.0).reshape(3, 2)
    for fmt in ("coo", "csr"):
        s = scorch.asformat(m, fmt)
        for r in (torch.smm(s, y), s.smm(y), torch.hspmm(s, y)):
            assert isinstance(r, scorch.SparseTensor)
            torch.testing.assert_close(r.to_dense(), m @ y)
        z = torch.ones(3, 3)
        r = torch.sspaddmm(scorch.asformat(torch.eye(2, 3), fmt), s, torch.ones(3, 3), beta=0.5, alpha=2.0)
        torch.testing.assert_close(r.to_dense(), 0.5 * torch.eye(2, 3) + 2.0 * (m @ z))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_sparse_sum_over_a_dimension_keeps_integer_dtypes(dtype):
    """``torch.sparse.sum(x, dim)`` keeps an integer / bool input's dtype (scorch gave int64 sums)."""
    d = torch.tensor([[1, 0, 2], [0, 1, 0]]).to(dtype)
    t = d.to_sparse()
    s = scorch.from_torch(t)
    for dim in (0, 1):
        want = torch.sparse.sum(t, dim).to_dense()
        got = torch.sparse.sum(s, dim)
        got = got.to_dense() if isinstance(got, scorch.SparseTensor) else got
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_coalesce_keeps_a_hybrid_coos_dense_dimensions():
    """torch's docs example: ``sparse_coo_tensor(i, v, (2, 3, 2)).coalesce()`` with values of shape (3, 2) made the
    dense dimension a sparse one (sparse_dim 3, dense_dim 0; ``indices()`` 3 rows); ``indices()`` of a hybrid COO
    raised."""
    i, v = [[0, 1, 1], [2, 0, 2]], [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
    t = torch.sparse_coo_tensor(i, v, (2, 3, 2)).coalesce()
    for s in (scorch.sparse_coo_tensor(i, v, (2, 3, 2)).coalesce(), scorch.from_torch(t)):
        assert (s.sparse_dim(), s.dense_dim()) == (2, 1)
        assert torch.equal(s.indices(), t.indices())
        torch.testing.assert_close(s.to_dense(), t.to_dense())
