"""Shape and indexing ops on SparseTensors (scorch/ops/shape_ops.py), checked against torch's ops on the dense
tensor: reshape/view/flatten/unflatten/squeeze/unsqueeze, cat/stack, index_select, contiguous."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import scorch
import scorch.ops.shape_ops  # noqa: F401  (registers the ops)
from scorch import SparseTensor
from scorch.formats import named, storage

from conftest import assert_matches_dense
from fallback_check import falls_back

F64 = torch.float64
FORMATS_2D = ["csr", "csc", "coo", "dcsr", "bsr(2, 2)", "ell", "dia"]
FORMATS_1D = ["coo", "csf"]
FORMATS_3D = ["csf", "coo"]
SHAPES_2D = [(4, 6), (5, 3), (1, 1), (1, 4), (3, 1), (0, 3), (3, 0)]
SHAPES_1D = [(6,), (1,), (0,)]
SHAPES_3D = [(2, 3, 4), (1, 3, 1), (2, 0, 3)]


def _dense(shape, density=0.5, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g) < density)
    return x.to(dtype)


def _formats(ndim):
    return {1: FORMATS_1D, 2: FORMATS_2D, 3: FORMATS_3D}[ndim]


@st.composite
def sparse_inputs(draw, ndims=(1, 2, 3), dtype=F64):
    """``(dense, sparse)``: a random tensor (all-zero, empty and 1-element ones included) in a random format."""
    ndim = draw(st.sampled_from(ndims))
    shape = draw(st.sampled_from({1: SHAPES_1D, 2: SHAPES_2D, 3: SHAPES_3D}[ndim]))
    fmt = draw(st.sampled_from(_formats(ndim)))
    density = draw(st.sampled_from([0.0, 0.3, 1.0]))
    d = _dense(shape, density, draw(st.integers(0, 2**16)), dtype)
    return d, scorch.asformat(d, fmt)


def _check(result, expected):
    assert type(result) is SparseTensor
    result.check_invariants()
    assert_matches_dense(result, expected)


def _divisor_shapes(numel):
    """Shapes holding ``numel`` elements, with and without -1."""
    out = [(numel,), (-1,), (1, numel), (numel, 1, 1), (-1, 1)]
    for a in range(1, numel + 1):
        if numel % a == 0:
            out += [(a, numel // a), (a, -1), (numel // a, 1, a)]
    if numel == 0:
        out = [(0,), (-1,), (3, 0), (0, 2, 5), (1, 0)]
    return out


# --- reshape family -----------------------------------------------------------------------------------------------

@settings(max_examples=40)
@given(sparse_inputs(), st.data())
def test_reshape_and_view_match_torch(inp, data):
    d, x = inp
    shape = data.draw(st.sampled_from(_divisor_shapes(d.numel())))
    want = d.reshape(shape)
    spelling = data.draw(st.sampled_from(["method", "varargs", "torch", "view", "view_varargs", "kw"]))
    if spelling == "method":
        r = x.reshape(shape)
    elif spelling == "varargs":
        r = x.reshape(*shape)
    elif spelling == "torch":
        r = torch.reshape(x, shape)
    elif spelling == "view":
        r = x.view(torch.Size([n if n >= 0 else want.shape[k] for k, n in enumerate(shape)]))
    elif spelling == "view_varargs":
        r = x.view(*shape)
    else:
        r = torch.reshape(x, shape=shape)
    _check(r, want)
    if tuple(want.shape) != tuple(d.shape):
        assert r.format == named.coo_nd(len(want.shape))


@settings(max_examples=40)
@given(sparse_inputs(), st.data())
def test_flatten_matches_torch(inp, data):
    d, x = inp
    n = d.dim()
    s = data.draw(st.integers(-n, n - 1))
    e = data.draw(st.integers(s % n, n - 1))
    if data.draw(st.booleans()):
        e -= n
    _check(torch.flatten(x, s, e), torch.flatten(d, s, e))
    _check(x.flatten(start_dim=s, end_dim=e), d.flatten(s, e))
    _check(x.flatten(), d.flatten())
    _check(torch.ravel(x), d.ravel())


@settings(max_examples=40)
@given(sparse_inputs(), st.data())
def test_unsqueeze_matches_torch(inp, data):
    d, x = inp
    dim = data.draw(st.integers(-d.dim() - 1, d.dim()))
    _check(x.unsqueeze(dim), d.unsqueeze(dim))
    _check(torch.unsqueeze(x, dim), d.unsqueeze(dim))


@settings(max_examples=40)
@given(sparse_inputs(), st.data())
def test_squeeze_matches_torch(inp, data):
    d, x = inp
    n = d.dim()
    if all(s == 1 for s in d.shape):  # squeezing every dimension leaves a 0-d tensor: see test_errors
        d, x = d.unsqueeze(0).expand(2, *d.shape).contiguous(), torch.stack([x, x])
        n += 1
    dim = data.draw(st.integers(-n, n - 1))
    dims = tuple(data.draw(st.lists(st.integers(-n, n - 1), max_size=n, unique_by=lambda k: k % n)))
    _check(x.squeeze(), d.squeeze())
    _check(x.squeeze(dim), d.squeeze(dim))
    _check(torch.squeeze(x, dims), d.squeeze(dims))


def test_unflatten_and_reshape_as():
    d = _dense((4, 6), seed=3)
    for fmt in FORMATS_2D:
        x = scorch.asformat(d, fmt)
        _check(x.unflatten(1, (2, -1)), d.unflatten(1, (2, -1)))
        _check(torch.unflatten(x, 0, (2, 2)), torch.unflatten(d, 0, (2, 2)))
        _check(x.reshape_as(torch.empty(3, 8)), d.reshape(3, 8))
        _check(x.view_as(torch.empty(24)), d.reshape(24))


def test_same_shape_returns_input_itself():
    x = scorch.asformat(_dense((3, 4)), "csr")
    assert x.reshape(3, 4) is x
    assert x.reshape(-1, 4) is x
    assert x.view(3, 4) is x
    assert x.flatten(1, 1) is x
    assert x.squeeze() is x
    assert x.squeeze(0) is x  # size 3: nothing to squeeze, as torch
    assert x.contiguous() is x
    assert x.is_contiguous()
    y = scorch.asformat(_dense((5,)), "coo")
    assert y.flatten() is y


def test_reshape_keeps_explicit_zeros_and_drops_padding():
    # CSR with an explicit zero: it stays stored
    x = scorch.sparse_csr_tensor(torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1]), torch.tensor([1.0, 0.0, 2.0]),
                                 (2, 3))
    r = x.reshape(3, 2)
    assert r.nnz == 3
    _check(r, x.to_dense().reshape(3, 2))
    # ELL pads short rows, BSR stores blocks past the edge, DIA positions outside the matrix: none carried over
    d = torch.tensor([[1.0, 0, 2, 3, 0], [0, 0, 0, 0, 0], [0, 4, 0, 0, 0]])
    for fmt in ["ell", "bsr(2, 2)", "dia"]:
        x = scorch.asformat(d, fmt)
        r = x.reshape(5, 3)
        _check(r, d.reshape(5, 3))
        leaf, dims, inside = storage.coordinates(x.format, x.shape, x.levels)
        expected = int(inside.sum()) if fmt != "ell" else int((d != 0).sum())
        assert r.nnz == expected, fmt


def test_uncoalesced_input_sums_duplicates():
    i = torch.tensor([[1, 0, 1, 2], [2, 1, 2, 0]])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    x = scorch.sparse_coo_tensor(i, v, (3, 4))
    assert x.format.keeps_duplicates
    d = x.to_dense()
    _check(x.reshape(4, 3), d.reshape(4, 3))
    _check(x.unsqueeze(0), d.unsqueeze(0))
    _check(torch.cat([x, x], 1), torch.cat([d, d], 1))
    _check(torch.stack([x, x]), torch.stack([d, d]))
    idx = torch.tensor([1, 1, 0])
    _check(x.index_select(0, idx), d.index_select(0, idx))
    assert x.reshape(4, 3).nnz == 3


# --- cat / stack ---------------------------------------------------------------------------------------------------

@settings(max_examples=40)
@given(st.data())
def test_cat_matches_torch(data):
    ndim = data.draw(st.sampled_from([1, 2, 3]))
    base = list(data.draw(st.sampled_from({1: SHAPES_1D, 2: SHAPES_2D, 3: SHAPES_3D}[ndim])))
    dim = data.draw(st.integers(-ndim, ndim - 1))
    count = data.draw(st.integers(1, 3))
    dense, sparse = [], []
    for k in range(count):
        shape = list(base)
        shape[dim] = data.draw(st.integers(0, 4))
        dtype = data.draw(st.sampled_from([F64, torch.float32, torch.int64]))
        d = _dense(shape, data.draw(st.sampled_from([0.0, 0.4, 1.0])), k)
        d = (d * 10).to(dtype) if dtype == torch.int64 else d.to(dtype)
        dense.append(d)
        sparse.append(scorch.asformat(d, data.draw(st.sampled_from(_formats(ndim)))))
    spelling = data.draw(st.sampled_from(["cat", "concat", "concatenate"]))
    if spelling == "concatenate":
        r = torch.concatenate(sparse, axis=dim)
    else:
        r = getattr(torch, spelling)(sparse, dim=dim)
    _check(r, torch.cat(dense, dim))


@settings(max_examples=40)
@given(sparse_inputs(), st.data())
def test_stack_matches_torch(inp, data):
    d, x = inp
    dim = data.draw(st.integers(-d.dim() - 1, d.dim()))
    fmts = data.draw(st.lists(st.sampled_from(_formats(d.dim())), min_size=0, max_size=2))
    others = [_dense(d.shape, 0.5, k + 1, torch.float32) for k in range(len(fmts))]
    xs = [x] + [scorch.asformat(o, f) for o, f in zip(others, fmts)]
    _check(torch.stack(xs, dim), torch.stack([d] + others, dim))
    _check(torch.stack(xs, dim=dim), torch.stack([d] + others, dim=dim))


def test_cat_keeps_csr_and_csc():
    a, b = _dense((3, 4), seed=1), _dense((2, 4), seed=2)
    r = torch.cat([scorch.asformat(a, "csr"), scorch.asformat(b, "csr")])
    assert r.format == named.csr
    _check(r, torch.cat([a, b]))
    r = torch.cat([scorch.asformat(a.T, "csc"), scorch.asformat(b.T, "csc"), scorch.asformat(a.T, "csc")], 1)
    assert r.format == named.csc
    _check(r, torch.cat([a.T, b.T, a.T], 1))
    r = torch.cat([scorch.asformat(a, "csr"), scorch.asformat(b, "csc")])
    assert r.format == named.coo
    _check(r, torch.cat([a, b]))
    assert torch.cat([scorch.asformat(a, "csr"), scorch.asformat(a, "csr")], 1).format == named.coo
    # mixed dtypes are promoted on the CSR path too
    r = torch.cat([scorch.asformat(a.float(), "csr"), scorch.asformat((b * 5).long(), "csr")])
    assert r.format == named.csr
    _check(r, torch.cat([a.float(), (b * 5).long()]))


def test_cat_with_torch_sparse_layouts():
    a, b = _dense((3, 4), seed=1), _dense((2, 4), seed=2)
    _check(torch.cat([scorch.asformat(a, "coo"), b.to_sparse_csr()]), torch.cat([a, b]))
    _check(torch.stack([scorch.asformat(a, "ell"), a.to_sparse()], 1), torch.stack([a, a], 1))


# --- index_select --------------------------------------------------------------------------------------------------

@settings(max_examples=50)
@given(sparse_inputs(), st.data())
def test_index_select_matches_torch(inp, data):
    d, x = inp
    dim = data.draw(st.integers(-d.dim(), d.dim() - 1))
    n = d.shape[dim]
    values = data.draw(st.lists(st.integers(0, n - 1), max_size=8)) if n else []
    idx = torch.tensor(values, dtype=data.draw(st.sampled_from([torch.int64, torch.int32])))
    want = d.index_select(dim, idx)
    _check(x.index_select(dim, idx), want)
    _check(torch.index_select(x, dim, idx), want)
    _check(torch.index_select(x, dim=dim, index=idx), want)


def test_index_select_repeats_unordered_and_formats():
    d = _dense((5, 6), seed=4)
    idx = torch.tensor([4, 0, 4, 2, 2, 2, 1])
    for fmt in FORMATS_2D:
        x = scorch.asformat(d, fmt)
        for dim in (0, 1):
            r = x.index_select(dim, idx)
            _check(r, d.index_select(dim, idx))
            keep = (fmt, dim) in (("csr", 0), ("csc", 1))
            assert r.format == (x.format if keep else named.coo), (fmt, dim)
        _check(x.index_select(1, torch.tensor(3)), d.index_select(1, torch.tensor(3)))  # a 0-d index
        _check(x.index_select(0, torch.tensor([], dtype=torch.int64)), d[:0])


def test_index_select_3d_large_index():
    d = _dense((3, 7, 5), 0.3, seed=5)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 7, (200,), generator=g)
    for fmt in FORMATS_3D:
        x = scorch.asformat(d, fmt)
        _check(x.index_select(1, idx), d.index_select(1, idx))
        _check(x.index_select(-1, idx % 5), d.index_select(-1, idx % 5))


# --- gradients --------------------------------------------------------------------------------------------------------

class Sparse:
    """A sparse operand whose real entries' values are gradcheck's input (padding is never perturbed)."""

    def __init__(self, dense, fmt):
        self.x = scorch.asformat(dense, fmt)
        leaf, _, inside = storage.coordinates(self.x.format, self.x.shape, self.x.levels)
        self.leaf = leaf[inside & (self.x.values()[leaf] != 0)]
        self.v = self.x.values()[self.leaf].detach().clone().requires_grad_()

    def __call__(self, v):
        vals = torch.zeros(self.x.values().shape, dtype=v.dtype).index_put((self.leaf,), v)
        return self.x.with_values(vals)


_IDX = torch.tensor([2, 0, 2, 3])
GRAD_CASES = {
    "reshape": lambda s: s.reshape(6, -1),
    "view": lambda s: s.view(2, 3, 4),
    "flatten": lambda s: s.flatten(),
    "unsqueeze": lambda s: s.unsqueeze(1),
    "squeeze": lambda s: s.unsqueeze(0).squeeze(0),
    "cat": lambda s: torch.cat([s, s], 0),
    "cat dim 1": lambda s: torch.cat([s, s], 1),
    "stack": lambda s: torch.stack([s, s], 2),
    "index_select 0": lambda s: s.index_select(0, _IDX),
    "index_select 1": lambda s: s.index_select(1, _IDX),
}


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck(fmt, case):
    x = scorch.asformat(_dense((4, 6), 0.5, seed=7), fmt)
    op = GRAD_CASES[case]
    v = x.values().detach().clone().requires_grad_()
    assert gradcheck(lambda v: op(x.with_values(v)).to_dense(), (v,))


@pytest.mark.parametrize("fmt", ["ell", "dia", "bsr(2, 2)"])
def test_gradcheck_padded_formats_real_entries(fmt):
    a = Sparse(_dense((4, 6), 0.5, seed=8), fmt)
    for case in ("reshape", "cat dim 1", "index_select 1"):
        assert gradcheck(lambda v: GRAD_CASES[case](a(v)).to_dense(), (a.v,)), case


def test_backward_reaches_input_values():
    x = scorch.asformat(_dense((4, 6), 0.5, seed=9), "csr").requires_grad_()
    r = torch.cat([x.reshape(6, 4).index_select(0, torch.tensor([1, 1])).unsqueeze(0)] * 2)
    assert r.requires_grad
    r.values().sum().backward()
    g = torch.zeros(24, dtype=F64)
    g[4:8] = 4.0  # row 1 of the (6, 4) reshape, selected twice, concatenated twice
    assert_matches_dense(x.grad, g.reshape(4, 6) * (x.to_dense() != 0))


# --- errors ------------------------------------------------------------------------------------------------------------

def test_errors():
    x = scorch.asformat(_dense((4, 6)), "csr")
    with pytest.raises(ValueError, match=r"shape \[5, 5\] is invalid for input of size 24"):
        x.reshape(5, 5)
    with pytest.raises(ValueError, match="only one dimension can be inferred"):
        x.reshape(-1, -1)
    with pytest.raises(ValueError, match="invalid shape dimension -2"):
        x.reshape(-2, 12)
    with pytest.raises(ValueError, match="ambiguous"):
        scorch.asformat(torch.zeros(0, 3), "coo").reshape(-1, 0)
    for r in (scorch.asformat(torch.full((1, 1), 2.0), "csr").reshape(()),  # (0-d: a dense scalar, as torch)
              scorch.asformat(torch.full((1, 1), 2.0), "coo").squeeze(),
              scorch.asformat(torch.full((1, 1, 1), 2.0), "csf").squeeze()):
        assert type(r) is torch.Tensor and r.shape == () and float(r) == 2.0
    assert float(scorch.asformat(torch.zeros(1, 1), "csr").squeeze()) == 0.0
    falls_back(lambda: x.view(torch.int32), lambda: x.to_dense().view(torch.int32), "Tensor.view")
    with pytest.raises(IndexError, match=r"unsqueeze: dimension out of range .*\[-3, 2\], but got 3"):
        x.unsqueeze(3)
    with pytest.raises(IndexError, match="squeeze: dimension out of range"):
        x.squeeze(2)
    with pytest.raises(ValueError, match="start_dim"):
        x.flatten(1, 0)
    with pytest.raises(ValueError, match="unflatten"):
        x.unflatten(1, (4, 2))


def test_cat_stack_errors():
    a = scorch.asformat(_dense((3, 4)), "csr")
    b = scorch.asformat(_dense((3, 5)), "coo")
    with pytest.raises(ValueError, match=r"cat: sizes of tensors must match except in dimension 0.*dimension 1"):
        torch.cat([a, b])
    torch.cat([a, b], 1)  # fine along dimension 1
    with pytest.raises(ValueError, match="same number of dimensions"):
        torch.cat([a, scorch.asformat(_dense((3, 4, 1)), "coo")])
    with pytest.raises(IndexError, match="cat: dimension out of range"):
        torch.cat([a, a], 2)
    falls_back(lambda: torch.cat([a, torch.zeros(3, 4)]), lambda: torch.cat([a.to_dense(), torch.zeros(3, 4)]),
               "torch.cat")  # sparse with dense: on the dense form
    falls_back(lambda: torch.stack([torch.zeros(3, 4), a]), lambda: torch.stack([torch.zeros(3, 4), a.to_dense()]),
               "torch.stack")
    with pytest.raises(ValueError, match="stack: expects each tensor to be equal size"):
        torch.stack([a, b])
    with pytest.raises(IndexError, match="stack: dimension out of range"):
        torch.stack([a, a], 3)


def test_index_select_errors():
    x = scorch.asformat(_dense((4, 6)), "coo")
    with pytest.raises(IndexError, match="index 6 is out of range for dimension of size 6"):
        x.index_select(1, torch.tensor([0, 6, 2]))
    with pytest.raises(IndexError, match="index -1 is out of range"):
        x.index_select(0, torch.tensor([-1]))
    with pytest.raises(IndexError, match="index 0 is out of range for dimension of size 0"):
        scorch.asformat(torch.zeros(3, 0), "csr").index_select(1, torch.tensor([0]))
    with pytest.raises(TypeError, match="int32 or int64"):
        x.index_select(0, torch.tensor([1.0]))
    with pytest.raises(IndexError, match="must be a vector"):
        x.index_select(0, torch.tensor([[1]]))
    with pytest.raises(IndexError, match="index_select: dimension out of range"):
        x.index_select(2, torch.tensor([0]))
    with pytest.raises(IndexError, match="index 9 is out of range"):  # CSR fast path checks too
        scorch.asformat(_dense((4, 6)), "csr").index_select(0, torch.tensor([9]))


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell"])
@pytest.mark.parametrize("op", ["S[1].zero_()", "S[:, 0].mul_(2)", "S[0:2].mul_(2)", "S.view(9).mul_(2)",
                                "S[...].add_(S[...])", "S.select(0, 2).neg_()", "rows", "S.chunk(3)[0].mul_(2)",
                                "S.split(1)[2].relu_()"])
def test_in_place_ops_on_copies_of_views_raise(fmt, op):
    """Dense torch gives a view, whose in-place change reaches the tensor; a SparseTensor gives a copy, so the
    change was lost, silently (``S[1].zero_()`` left ``S`` as it was): it raises now, naming the op."""
    s = scorch.asformat(torch.tensor([[1., 0, 2], [0, 3, 0], [4, 0, 5]]), fmt)
    before = s.to_dense().clone()
    run = {"S[1].zero_()": lambda: s[1].zero_(), "S[:, 0].mul_(2)": lambda: s[:, 0].mul_(2),
           "S[0:2].mul_(2)": lambda: s[0:2].mul_(2), "S.view(9).mul_(2)": lambda: s.view(9).mul_(2),
           "S[...].add_(S[...])": lambda: s[...].add_(s[...]), "S.select(0, 2).neg_()": lambda: s.select(0, 2).neg_(),
           "rows": lambda: [r.mul_(2) for r in s], "S.chunk(3)[0].mul_(2)": lambda: s.chunk(3)[0].mul_(2),
           "S.split(1)[2].relu_()": lambda: s.split(1)[2].relu_()}[op]
    with torch.no_grad(), pytest.raises(NotImplementedError, match="copy"):
        run()
    assert torch.equal(s.to_dense(), before)
    r = s[1].clone()  # (a clone is the caller's own tensor)
    r.mul_(2)
    assert torch.equal(r.to_dense(), 2 * before[1])
    s.t().mul_(2)  # (a transposed view shares the values: the change lands)
    assert torch.equal(s.to_dense(), 2 * before)


@pytest.mark.parametrize("shape", [(7, 5), (0, 3), (4, 4)])
@pytest.mark.parametrize("call", [("split", (2,)), ("split", (2, 1)), ("chunk", (3,)), ("chunk", (3, 1)),
                                  ("chunk", (10,)), ("tensor_split", (3,)), ("tensor_split", ([1, 3],)),
                                  ("tensor_split", ([1, 3], 1)), ("split", ([1, 2], 1)),
                                  ("tensor_split", ([3, 1],)), ("tensor_split", ([-2, 9],))])
def test_split_chunk_tensor_split_sparse(shape, call):
    """They ran on the dense form (dense copies); now sparse pieces by ``narrow``, as torch slices them."""
    name, args = call
    if name == "split" and isinstance(args[0], list) and shape[1] != 3:
        args = ([1, shape[1] - 1], 1)
    g = torch.Generator().manual_seed(0)
    d = torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.5)
    want = getattr(d, name)(*args)
    got = getattr(scorch.asformat(d, "csr"), name)(*args)
    assert len(got) == len(want)
    for w, x in zip(want, got):
        assert isinstance(x, scorch.SparseTensor) and x.shape == w.shape and torch.equal(x.to_dense(), w)


def test_item_assignment_into_a_copy_of_a_view_raises():
    """``S[1][0] = 0`` wrote into the copy ``S[1]`` only (dense torch: a view, so into ``S``)."""
    s = scorch.asformat(torch.tensor([[1., 0, 2], [0, 3, 0]]), "csr")
    with pytest.raises(NotImplementedError, match="copy"):
        s[1][1] = 0.0
    assert s.to_dense()[1, 1] == 3.0


def test_mT_mH_adjoint_are_sparse_and_reach_the_tensor():
    """``S.mT`` went to the dense fallback: its dense copy took an in-place change without reaching ``S`` (``S.T``
    was sparse and did)."""
    import warnings
    d = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    for fmt in ("csr", "coo"):
        s = scorch.asformat(d, fmt)
        with warnings.catch_warnings():
            warnings.simplefilter("error", scorch.DensifyWarning)
            for r in (s.mT, s.mH, s.adjoint(), torch.adjoint(s)):
                assert isinstance(r, scorch.SparseTensor)
                torch.testing.assert_close(r.to_dense(), d.mT)
        s.mT.mul_(2)
        torch.testing.assert_close(s.to_dense(), 2 * d)
    b = scorch.asformat(torch.randn(2, 3, 4), "coo")
    torch.testing.assert_close(b.mT.to_dense(), b.to_dense().mT)
    with pytest.raises(RuntimeError, match="only supported on matrices"):
        scorch.asformat(torch.ones(3), "coo").mT


def test_a_view_ops_dense_fallback_says_its_result_is_a_copy():
    import warnings
    s = scorch.asformat(torch.eye(3), "csr")
    scorch.reset_stats()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        s.diagonal()
    assert any("dense copy" in str(w.message) for w in got)


@pytest.mark.parametrize("fmt, shape", [("csr", (4, 5)), ("coo", (4, 5)), ("bsr(2, 2)", (4, 6)), ("ell", (4, 5)),
                                        ("dia", (5, 5)), ("coo", (2, 3, 4)), ("csf", (2, 3, 4)), ("coo", (6,))])
@pytest.mark.parametrize("pad", [(1, 2), (0, 0), (-1, 1), (2, -2), (1, 1, 1, 1), (-1, 0, 0, -1), (0, 3, 2, 0, 1, 1)])
def test_pad_with_zeros_stays_sparse(fmt, shape, pad):
    """``F.pad`` with zeros (g-mlp pads a sparse weight): the entries moved, a negative pad's crop dropped, no fallback."""
    import torch.nn.functional as F
    if len(pad) > 2 * len(shape):
        pytest.skip("more pads than dimensions")
    g = torch.Generator().manual_seed(len(pad))
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * (torch.rand(*shape, generator=g) < 0.5)
    s = scorch.asformat(x, fmt).detach().requires_grad_()
    ref = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        got = F.pad(s, pad)
    want = F.pad(ref, pad)
    assert isinstance(got, SparseTensor)
    torch.testing.assert_close(got.to_dense(), want)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (got.to_dense() * grad).sum().backward()
    (want * grad).sum().backward()
    torch.testing.assert_close(s.grad.to_dense() * (x != 0), ref.grad * (x != 0))


def test_pad_errors_and_dense_results():
    import torch.nn.functional as F
    s = scorch.asformat(torch.eye(3), "coo")
    for pad, match in (((1,), "divisible by 2"), ((1,) * 6, "two times the input dimension"), ((-4, 0), "negative")):
        with pytest.raises(RuntimeError, match=match):
            F.pad(s, pad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for kw in ({"value": 1.0}, {"mode": "reflect"}):  # a dense result: the dense form serves
            got = F.pad(s, (1, 1), **kw)
            assert type(got) is torch.Tensor
            torch.testing.assert_close(got, F.pad(torch.eye(3), (1, 1), **kw))
