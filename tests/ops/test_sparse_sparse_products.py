"""A product of two sparse operands is sparse, whatever their formats (issue 42): every ordered pair of the named
2-d formats and torch's own sparse layouts, as ``A @ B``, ``A @ B.t()`` and ``A.t() @ B``, through ``@``,
``torch.mm``, ``torch.matmul``, ``torch.sparse.mm`` and the einsum spelling of each, gives a sparse result equal to
dense torch's. (``A @ A.t()`` of a CSR matrix used to come back as a dense tensor, silently.)"""
import io
import operator

import pytest
import torch

import scorch
from scorch import SparseTensor

FORMATS = ["coo", "csr", "csc", "dcsr", "dcsc", "bsr(2, 2)", "ell", "torch_csr", "torch_coo"]
# the einsum spelling of each product and the shapes of its operands as stored (A is 6 x 4 or its transpose)
VARIANTS = {"A @ B": ("ij,jk->ik", (6, 4), (4, 8)),
            "A @ B.t()": ("ij,kj->ik", (6, 4), (8, 4)),
            "A.t() @ B": ("ji,jk->ik", (4, 6), (4, 8))}
SPELLINGS = {"@": operator.matmul, "torch.mm": scorch.mm, "torch.matmul": scorch.matmul,
             "torch.sparse.mm": scorch.sparse.mm}
TORCH_LAYOUTS = {"torch_csr": torch.Tensor.to_sparse_csr, "torch_coo": torch.Tensor.to_sparse}


def _matrix(shape, seed, density=0.4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)


def _as(d, fmt):
    return TORCH_LAYOUTS[fmt](d) if fmt in TORCH_LAYOUTS else scorch.asformat(d, fmt)


def _views(variant, a, b):
    return (a.t() if variant == "A.t() @ B" else a), (b.t() if variant == "A @ B.t()" else b)


def _is_sparse(r):
    # a torch layout where both operands were torch's own (torch.mm of two torch CSR tensors is torch's call)
    return type(r) is SparseTensor or (isinstance(r, torch.Tensor) and r.layout != torch.strided)


def _products(variant, fa, fb, A, B):
    """``{spelling: result}`` of the product ``variant`` of A and B in every spelling."""
    eq = VARIANTS[variant][0]
    results = {f"einsum {eq!r}": scorch.einsum(eq, A, B)}
    a, b = _views(variant, A, B)
    for name, fn in SPELLINGS.items():
        if name == "@" and fa in TORCH_LAYOUTS and fb in TORCH_LAYOUTS:
            continue  # torch's own operator on two torch tensors: scorch is not called
        results[name] = fn(a, b)
    return results


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fb", FORMATS)
@pytest.mark.parametrize("fa", FORMATS)
def test_sparse_times_sparse_is_sparse(fa, fb, variant):
    _, sa, sb = VARIANTS[variant]
    da, db = _matrix(sa, 1), _matrix(sb, 2)
    expected = torch.einsum(VARIANTS[variant][0], da, db)
    for name, r in _products(variant, fa, fb, _as(da, fa), _as(db, fb)).items():
        assert _is_sparse(r), f"{fa} x {fb}, {variant} via {name}: a dense {type(r).__name__}"
        assert r.shape == expected.shape
        torch.testing.assert_close(r.to_dense(), expected, msg=lambda m: f"{fa} x {fb}, {variant} via {name}: {m}")


@pytest.mark.parametrize("shapes, zero", [(((0, 4), (4, 8)), False), (((6, 0), (0, 8)), False),
                                          (((6, 4), (4, 0)), False), (((1, 1), (1, 1)), False),
                                          (((6, 4), (4, 8)), True)], ids=["empty-rows", "empty-inner", "empty-cols",
                                                                           "1x1", "all-zero"])
@pytest.mark.parametrize("fa, fb", [(f, f) for f in FORMATS] + [("csr", "csc"), ("ell", "dcsc")])
def test_degenerate_shapes(fa, fb, shapes, zero):
    da = _matrix(shapes[0], 3) * (0 if zero else 1)
    db = _matrix(shapes[1], 4, density=0.8)
    A, B = _as(da, fa), _as(db, fb)
    for variant, left, right in [("A @ B", da, db), ("A @ B.t()", da, db.t()), ("A.t() @ B", da.t(), db)]:
        # the same product of the same matrices, with the operands stored as the variant's einsum reads them
        B_ = _as(db.t().contiguous(), fb) if variant == "A @ B.t()" else B
        A_ = _as(da.t().contiguous(), fa) if variant == "A.t() @ B" else A
        for name, r in _products(variant, fa, fb, A_, B_).items():
            assert _is_sparse(r), f"{fa} x {fb} {shapes}, {variant} via {name}: dense"
            torch.testing.assert_close(r.to_dense(), da @ db)


def _pattern(S):
    """1 at the stored entries of S (a block format's stored zeros included, ELL's padding not), 0 elsewhere."""
    C = scorch.asformat(S.detach(), "coo")
    return C.with_values(torch.ones_like(C.values())).to_dense()


@pytest.mark.parametrize("fa, fb, variant", [("csr", "csr", "A @ B.t()"), ("csr", "csc", "A @ B"),
                                             ("coo", "dcsr", "A.t() @ B"), ("bsr(2, 2)", "ell", "A @ B.t()")])
def test_gradients_on_both_patterns(fa, fb, variant):
    eq, sa, sb = VARIANTS[variant]
    da, db = _matrix(sa, 5, 0.5), _matrix(sb, 6, 0.5)
    A, B = scorch.asformat(da, fa).requires_grad_(), scorch.asformat(db, fb).requires_grad_()
    a, b = _views(variant, A, B)
    r = a @ b
    assert type(r) is SparseTensor
    w = torch.randn(r.shape, generator=torch.Generator().manual_seed(7))
    (r.to_dense() * w).sum().backward()
    ea, eb = da.clone().requires_grad_(), db.clone().requires_grad_()
    (torch.einsum(eq, ea, eb) * w).sum().backward()
    assert type(A.grad) is SparseTensor and A.grad.format == A.format
    assert type(B.grad) is SparseTensor and B.grad.format == B.format
    torch.testing.assert_close(A.grad.to_dense(), ea.grad * _pattern(A))
    torch.testing.assert_close(B.grad.to_dense(), eb.grad * _pattern(B))


def test_the_gram_matrix_is_a_row_by_row_product():
    """``A @ A.t()`` of CSR: CSR, computed row by row through the stored entries (A.t() converted to CSR), not by
    an inner product over every pair of rows."""
    d = _matrix((40, 30), 8, 0.1)
    A = scorch.asformat(d, "csr")
    text = scorch.explain("ij,kj->ik", A, A, file=io.StringIO())
    assert "output:       csr  [rule: a product of sparse operands]" in text
    assert "loop order:   i -> j -> k" in text
    assert "T1 converted to" in text
    r = A @ A.t()
    assert r.format == scorch.formats.csr
    torch.testing.assert_close(r.to_dense(), d @ d.t())


def test_the_transposed_gram_matrix_is_a_row_by_row_product():
    """``A.t() @ A`` of CSR: CSR (its rows are A's columns), with A.t() converted to CSR so that the first loop
    gives the output's rows, not an outer product over the summed index (one serial row holding the whole output)."""
    d = _matrix((40, 30), 12, 0.1)
    A = scorch.asformat(d, "csr")
    text = scorch.explain("ji,jk->ik", A, A, file=io.StringIO())
    assert "output:       csr  [rule: a product of sparse operands]" in text
    assert "loop order:   i -> j -> k" in text and "T0 converted to" in text
    assert "parallel:     the outermost loop" in text
    r = A.t() @ A
    assert r.format == scorch.formats.csr
    torch.testing.assert_close(r.to_dense(), d.t() @ d)


def test_a_product_of_column_major_operands_is_column_major():
    d1, d2 = _matrix((6, 4), 9), _matrix((4, 8), 10)
    r = scorch.asformat(d1, "csc") @ scorch.asformat(d2, "csc")
    assert r.format == scorch.formats.csc
    torch.testing.assert_close(r.to_dense(), d1 @ d2)


def test_a_dense_operand_keeps_the_dense_result():
    """SpMM is unchanged: sparse x dense is dense, as torch's is."""
    d = _matrix((6, 4), 11)
    x = torch.randn(4, 3)
    for f in ("csr", "csc", "coo", "dcsr"):
        r = scorch.asformat(d, f) @ x
        assert not isinstance(r, scorch.SparseTensor) and r.layout == torch.strided  # (a Deferred under deferral)
        torch.testing.assert_close(r, d @ x)
