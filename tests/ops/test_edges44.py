"""A new user's edges (issue 44): meta tensors, complex values, products of mixed dtypes, and the sparse rules
of ``F.normalize``, division by a dense tensor, ``masked_fill`` with a sparse mask, and the visible dense result
of ``sigmoid``. Each against dense torch."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import scorch

from conftest import assert_matches_dense
from fallback_check import falls_back

pytestmark = [pytest.mark.filterwarnings("ignore:.*Sparse invariant checks are implicitly disabled"),
              pytest.mark.filterwarnings("ignore:.*support is in beta state")]

FORMATS = ["csr", "coo", "csc", "bsr(1, 2)", "ell", "dia"]


def _matrix(shape=(5, 6), seed=0, dtype=torch.float32, density=0.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[torch.rand(shape, generator=g) >= density] = 0
    return x.to(dtype)


def _no_fallback():
    """A context in which a dense fallback or densification is an error."""
    return scorch.strict()


# --- meta ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2, 2)", "ell"])
def test_a_dense_meta_tensor_has_no_pattern(fmt):
    with pytest.raises(NotImplementedError, match="meta"):
        scorch.asformat(torch.empty(4, 4, device="meta"), fmt)


def test_meta_sparse_tensors_from_meta_arrays():
    """The meta SparseTensor that can exist: its arrays given (nnz known), as torch's own constructors allow."""
    meta = lambda t: t.to("meta")  # noqa: E731
    s = scorch.sparse_csr_tensor(meta(torch.tensor([0, 1, 1, 2])), meta(torch.tensor([0, 3])),
                                 torch.ones(2, device="meta"), (3, 4))
    assert s.device.type == "meta" and s.shape == (3, 4) and s.nnz == 2
    t = scorch.asformat(torch.eye(3), "csr").to("meta")
    assert t.device.type == "meta" and t.nnz == 3


# --- complex -----------------------------------------------------------------------------------------------------

C = torch.tensor([[1 + 2j, 0], [0, 3 - 1j]], dtype=torch.complex64)


@pytest.mark.parametrize("make", [
    lambda: scorch.asformat(C, "csr"),
    lambda: scorch.asformat(C.to(torch.complex128), "coo"),
    lambda: scorch.asformat(C.to_sparse_csr(), "csr"),
    lambda: scorch.from_torch(C.to_sparse()),
    lambda: scorch.from_torch(C.to_sparse_csc()),
    lambda: scorch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1j, 2.0]), (2, 2)),
    lambda: scorch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1j, 2.0]), (2, 2)),
    lambda: scorch.asformat(C.real, "csr").to(torch.complex128),
], ids=["dense", "dense128", "torch-csr", "torch-coo", "torch-csc", "coo-ctor", "csr-ctor", "to"])
def test_complex_values_are_refused_at_construction(make):
    with pytest.raises(TypeError, match="complex"):
        make()


def test_ops_with_a_complex_result_run_dense():
    """An op whose result would be a complex SparseTensor runs on the dense form, as any op without a sparse
    rule: torch's complex result, warned (naming complex values) and counted."""
    d = _matrix()
    s = scorch.asformat(d, "csr")
    falls_back(lambda: s.cfloat(), lambda: d.cfloat(), "Tensor.cfloat")
    falls_back(lambda: s * 1j, lambda: d * 1j, "Tensor.mul")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.cdouble()
    assert any("complex values" in str(w.message) for w in caught)


def test_torch_complex_sparse_tensors_stay_torchs():
    """A torch sparse tensor with complex values that torch itself handles is left to torch under the alias."""
    x = torch.ones(2, 3, dtype=torch.complex64)
    got = scorch.mm(C.to_sparse_csr(), x)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, C @ x)


# --- mixed dtypes: scorch's products promote (torch refuses) -------------------------------------------------------

PAIRS = [(torch.bfloat16, torch.float32), (torch.float32, torch.float64), (torch.float32, torch.bfloat16),
         (torch.int64, torch.float32), (torch.float16, torch.float32)]
PRODUCTS = {
    "@": lambda a, x: a @ x,
    "mm": torch.mm,
    "addmm": lambda a, x: torch.addmm(torch.ones(a.shape[0], x.shape[1], dtype=x.dtype), a, x),
    "einsum": lambda a, x: torch.einsum("ij,jk->ik", a, x),
    "linear": lambda a, x: F.linear(x.T, a),
    "mv": lambda a, x: a @ x[:, 0],
    "rmatmul": lambda a, x: x.T @ a.T,
}


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(1, 2)"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("op", list(PRODUCTS))
def test_products_of_mixed_dtypes_promote(fmt, pair, op):
    """The documented difference (docs/sparse-api.md): the promoted dtype, where torch raises for mixed dtypes;
    the values are torch's product of the operands cast to that dtype."""
    a = _matrix((4, 6)).mul(4).round().to(pair[0])
    x = _matrix((6, 3), seed=1, density=1.0).mul(4).round().to(pair[1])
    fn = PRODUCTS[op]
    with pytest.raises(RuntimeError):
        fn(a, x)  # dense torch refuses (the reason the difference is documented)
    want = torch.promote_types(*pair)
    with _no_fallback():
        got = fn(scorch.asformat(a, fmt), x)
    assert got.dtype == want
    expected = fn(a.to(want), x.to(want))
    if want == torch.bfloat16 or pair[0] in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    else:
        assert_matches_dense(got, expected)


# --- F.normalize and division by a dense tensor --------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("p,dim", [(2, 1), (1, 0), (float("inf"), -1), (3, 1), (0.5, 0), (2, (0, 1))])
def test_normalize_keeps_the_pattern(fmt, p, dim):
    d = _matrix()
    d[2] = 0  # an empty row: its norm is clamped to eps, 0 / eps stays 0
    s = scorch.asformat(d, fmt)
    with _no_fallback():
        got = F.normalize(s, p=p, dim=dim)
    assert isinstance(got, scorch.SparseTensor) and got.format == s.format
    torch.testing.assert_close(got.to_dense(), F.normalize(d, p=p, dim=dim))  # (norms sum in another order)


def _pattern(s):
    """Where ``s`` stores a value (a block format stores the zeros inside its blocks too)."""
    return s.detach().with_values(torch.ones_like(s.values())).to_dense() != 0


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(1, 2)"])
def test_normalize_gradient_matches_dense(fmt):
    d = _matrix(dtype=torch.float64)
    s = scorch.asformat(d, fmt).requires_grad_()
    w = torch.randn(5, 6, dtype=torch.float64)
    (F.normalize(s, dim=1) * w).sum().backward()
    dense = d.clone().requires_grad_()
    (F.normalize(dense, dim=1) * w).sum().backward()
    assert isinstance(s.grad, scorch.SparseTensor)
    torch.testing.assert_close(s.grad.to_dense(), dense.grad * _pattern(s))


def test_normalize_with_a_nan_value_runs_dense():
    """A nan value makes its row's norm nan, and torch's 0 / nan at the row's implicit zeros is nan."""
    d = _matrix()
    d[1, d[1].nonzero()[0, 0]] = float("nan")
    s = scorch.asformat(d, "csr")
    got = falls_back(lambda: F.normalize(s, dim=1).nan_to_num(7.0), lambda: F.normalize(d, dim=1).nan_to_num(7.0),
                     "torch.nn.functional.normalize")
    assert (got[1] == 7.0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_division_by_a_dense_tensor_without_zeros_keeps_the_pattern(fmt):
    d = _matrix()
    s = scorch.asformat(d, fmt)
    for b in (torch.rand(5, 1) + 0.5, torch.rand(6) - 2.0, torch.full((5, 6), float("inf"))):
        with _no_fallback():
            got = s / b
        assert isinstance(got, scorch.SparseTensor) and got.format == s.format
        torch.testing.assert_close(got.to_dense(), d / b, rtol=0, atol=0)
    ints = scorch.asformat((d * 10).round().to(torch.int64), fmt)
    b = torch.tensor([3, -2, 4, 5, -7, 2])
    for mode in (None, "floor", "trunc"):
        assert_matches_dense(torch.div(ints, b, rounding_mode=mode), torch.div(ints.to_dense(), b, rounding_mode=mode))


def test_division_broadcasting_and_gradient():
    d = _matrix((1, 6), density=0.6, dtype=torch.float64)
    s = scorch.asformat(d, "csr").requires_grad_()
    b = (torch.rand(4, 6, dtype=torch.float64) + 0.5).requires_grad_()
    got = s / b  # s broadcast to (4, 6)
    assert isinstance(got, scorch.SparseTensor)
    w = torch.randn(4, 6, dtype=torch.float64)
    (got.to_dense() * w).sum().backward()
    dd, bb = d.clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((dd / bb) * w).sum().backward()
    torch.testing.assert_close(got.to_dense(), (d / b).detach())
    torch.testing.assert_close(s.grad.to_dense(), dd.grad * (d != 0))
    torch.testing.assert_close(b.grad, bb.grad)


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_division_by_a_tensor_holding_zero_or_nan_runs_dense(bad):
    d = _matrix()
    b = torch.rand(5, 6) + 0.5
    b[0, 0] = bad
    s = scorch.asformat(d, "csr")
    falls_back(lambda: (s / b).nan_to_num(7.0), lambda: (d / b).nan_to_num(7.0), "Tensor.div")


def test_a_dense_tensor_expanded_as_a_sparse_one():
    s = scorch.asformat(_matrix(), "csr")
    b = torch.rand(5, 1)
    got = b.expand_as(s)
    assert type(got) is torch.Tensor and got.shape == s.shape and got.data_ptr() == b.data_ptr()


@settings(max_examples=30)
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), seed=st.integers(0, 999), p=st.sampled_from([1, 2, 3, 4.5]),
       dim=st.sampled_from([0, 1, -1]), fmt=st.sampled_from(["csr", "coo", "csc", "ell"]),
       eps=st.sampled_from([1e-12, 0.5]))
def test_normalize_against_dense(rows, cols, seed, p, dim, fmt, eps):
    d = _matrix((rows, cols), seed=seed, dtype=torch.float64)
    got = F.normalize(scorch.asformat(d, fmt), p=p, dim=dim, eps=eps)
    torch.testing.assert_close(got.to_dense(), F.normalize(d, p=p, dim=dim, eps=eps))


# --- sigmoid: dense by nature, visibly ----------------------------------------------------------------------------

def test_sigmoid_is_dense_visibly():
    """sigmoid(0) = 0.5: the result is dense, computed on the dense form, warned, counted as densified, and an
    error in strict mode, as every map with f(0) != 0."""
    d = _matrix()
    s = scorch.asformat(d, "csr")
    for call in (lambda: s.sigmoid(), lambda: torch.sigmoid(s), lambda: F.sigmoid(s)):
        scorch.reset_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call()
        assert any(issubclass(w.category, scorch.DensifyWarning) and "sigmoid" in str(w.message) for w in caught)
        assert scorch.stats()["densified"] == {"torch.sigmoid": 1}
        assert_matches_dense(got, torch.sigmoid(d))
        with scorch.strict(), pytest.raises(scorch.DensifyError, match="sigmoid"):
            call()


# --- masked_fill ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("value", [2.5, float("nan"), float("-inf"), torch.tensor(-3.0)], ids=str)
def test_masked_fill_by_a_sparse_mask_gives_the_union(fmt, value):
    d = _matrix()
    m = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.6
    s = scorch.asformat(d, fmt)
    for mask_fmt in ("csr", "coo"):
        with _no_fallback():
            got = s.masked_fill(scorch.asformat(m, mask_fmt), value)
        assert isinstance(got, scorch.SparseTensor) and got.format == s.format
        torch.testing.assert_close(got.to_dense(), d.masked_fill(m, value), rtol=0, atol=0, equal_nan=True)


def test_masked_fill_union_keeps_explicit_zeros_and_integer_values():
    d = torch.tensor([[0, 5, 0], [7, 0, 0]])
    s = scorch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([0, 5, 7]), (2, 3)).coalesce()
    m = torch.tensor([[False, True, False], [False, False, True]])
    got = torch.masked_fill(s, scorch.asformat(m, "coo"), 9)
    assert got.dtype == torch.int64
    assert_matches_dense(got, d.masked_fill(m, 9))
    assert got.values().numel() == 4  # the explicit zero at (0, 0), (0, 1) filled, (1, 0), (1, 2) new


def test_masked_fill_union_gradient():
    d = _matrix(dtype=torch.float64)
    m = torch.rand(5, 6, generator=torch.Generator().manual_seed(4)) > 0.5
    s = scorch.asformat(d, "csr").requires_grad_()
    v = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64)
    (s.masked_fill(scorch.asformat(m, "csr"), v).to_dense() * w).sum().backward()
    dd, vv = d.clone().requires_grad_(), v.detach().clone().requires_grad_()
    (dd.masked_fill(m, vv) * w).sum().backward()
    torch.testing.assert_close(s.grad.to_dense(), dd.grad * (d != 0))
    torch.testing.assert_close(v.grad, vv.grad)


def test_masked_fill_with_a_dense_mask_and_a_nonzero_value_is_dense():
    """A dense mask selects implicit zeros anywhere: the result is dense (the counted fallback); value 0 keeps
    the pattern (``test_masked_fill`` elsewhere)."""
    d = _matrix()
    m = torch.rand(5, 6, generator=torch.Generator().manual_seed(5)) > 0.5
    s = scorch.asformat(d, "csr")
    falls_back(lambda: s.masked_fill(m, 1.0), lambda: d.masked_fill(m, 1.0), "Tensor.masked_fill")
    with pytest.raises(NotImplementedError, match="in place"):
        s.masked_fill_(scorch.asformat(m, "csr"), 1.0)


@settings(max_examples=30)
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), seed=st.integers(0, 999),
       fmt=st.sampled_from(["csr", "coo", "csc", "bsr(1, 2)", "ell"]), mask_fmt=st.sampled_from(["csr", "coo"]),
       value=st.sampled_from([1.0, -2.5, float("inf")]))
def test_masked_fill_union_against_dense(rows, cols, seed, fmt, mask_fmt, value):
    d = _matrix((rows, cols), seed=seed)
    m = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed + 1)) > 0.5
    got = scorch.asformat(d, fmt).masked_fill(scorch.asformat(m, mask_fmt), value)
    assert isinstance(got, scorch.SparseTensor)
    torch.testing.assert_close(got.to_dense(), d.masked_fill(m, value), rtol=0, atol=0)
