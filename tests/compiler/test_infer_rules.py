"""The output formats documented in docs/format-inference.md."""
import pytest
import torch

import scorch
from scorch.formats import Format

from conftest import is_dense_result

torch.manual_seed(0)
A = torch.randn(6, 5) * (torch.rand(6, 5) < 0.5)
B = torch.randn(6, 5) * (torch.rand(6, 5) < 0.5)
C = torch.randn(5, 4) * (torch.rand(5, 4) < 0.5)
X, Y = torch.randn(5, 3), torch.randn(6, 3)
VEC = Format("(i) -> (i : compressed)")
# one-hot gates of 6 tokens over 4 experts (token 2 has none), expert outputs and weights
G = torch.nn.functional.one_hot(torch.tensor([1, 3, 0, 0, 2, 1]), 4).float()
G[2] = 0
Y3, E3 = torch.randn(6, 4, 3), torch.randn(4, 3, 2)


def s(x, f):
    return scorch.asformat(x, f)


CASES = [
    ("ij,jk->ik", lambda: (s(A, "csr"), X), None, A @ X),
    ("ij,jk->ik", lambda: (s(A, "coo"), X), None, A @ X),
    ("ij,jk->ik", lambda: (s(A, "csc"), X), None, A @ X),
    ("ij,jk->ik", lambda: (s(A, "dcsr"), X), None, A @ X),
    ("ij,j->i", lambda: (s(A, "coo"), X[:, 0]), None, A @ X[:, 0]),
    ("bnd,bn->bd", lambda: (Y3, s(G, "coo")), None, torch.einsum("bnd,bn->bd", Y3, G)),
    ("bd,ndh,bn->bh", lambda: (Y, E3, s(G, "coo")), None, torch.einsum("bd,ndh,bn->bh", Y, E3, G)),
    ("ij,jd->ijd", lambda: (s(A, "coo"), X), Format("(i, j, d) -> (i : compressed, j : compressed, d : dense)"),
     A[:, :, None] * X[None]),
    ("ij,->i", lambda: (s(A, "coo"), torch.tensor(2.)), VEC, 2 * A.sum(1)),
    ("ij,j->i", lambda: (s(A, "dcsr"), X[:, 0]), VEC, A @ X[:, 0]),
    ("ij,ik,jk->ij", lambda: (s(A, "csr"), Y, X), scorch.formats.csr, A * (Y @ X.T)),
    ("ij->ji", lambda: (s(A, "csr"),), scorch.formats.csc, A.T),
    ("ij->i", lambda: (s(A, "dcsr"),), VEC, A.sum(1)),
    ("ij->i", lambda: (s(A, "csr"),), None, A.sum(1)),
    ("ij->j", lambda: (s(A, "csr"),), VEC, A.sum(0)),
    ("ij,ij->ij", lambda: (s(A, "csr"), s(B, "csr")), scorch.formats.csr, A * B),
    ("ij,jk->ik", lambda: (s(A, "csr"), s(C, "csr")), scorch.formats.csr, A @ C),
    ("ij,ij->ij", lambda: (s(A, "bsr(2, 5)"), A), scorch.formats.bsr(2, 5), A * A),
    # a product of sparse operands is sparse whatever their level types (issue 42: these were dense, or dense rows)
    ("ij,kj->ik", lambda: (s(A, "csr"), s(B, "csr")), scorch.formats.csr, A @ B.T),
    ("ji,jk->ik", lambda: (s(A, "csr"), s(B, "csr")), scorch.formats.csr, A.T @ B),
    ("ij,jk->ik", lambda: (s(A, "csc"), s(C, "csc")), scorch.formats.csc, A @ C),
    ("ij,jk->ik", lambda: (s(A, "dcsr"), s(C, "csc")), scorch.formats.dcsr, A @ C),
    ("ij,j->i", lambda: (s(A, "csr"), s(C[:, 0], VEC)), VEC, A @ C[:, 0]),
]


@pytest.mark.parametrize("eq, make, fmt, expected", CASES)
def test_documented_output_formats(eq, make, fmt, expected):
    ops = make()
    r = scorch.einsum(eq, *ops)
    if fmt is None:
        assert is_dense_result(r)
        torch.testing.assert_close(r, expected)
    else:
        assert r.format == fmt
        torch.testing.assert_close(r.to_dense(), expected)


def test_pattern_rules_share_the_drivers_arrays():
    S = s(A, "csr")
    for r in (scorch.einsum("ij,ik,jk->ij", S, Y, X), scorch.einsum("ij->ji", S)):
        assert r.levels[1].crd.data_ptr() == S.levels[1].crd.data_ptr()
    D = s(A, "dcsr")
    assert scorch.einsum("ij->i", D).levels[0].crd.data_ptr() == D.levels[0].crd.data_ptr()


@pytest.mark.parametrize("fa, fb, fmt", [("csr", "csr", scorch.formats.csr), ("csc", "csc", scorch.formats.csc),
                                         ("csr", "csc", None)])
def test_sum_formats(fa, fb, fmt):
    r = s(A, fa) + s(B, fb)
    if fmt is None:
        assert is_dense_result(r)
        torch.testing.assert_close(r, A + B)
    else:
        assert r.format == fmt
        torch.testing.assert_close(r.to_dense(), A + B)


def test_format_argument_overrides():
    r = scorch.einsum("ij,jk->ik", s(A, "csr"), X, format="coo")
    assert r.format == scorch.formats.coo
    torch.testing.assert_close(r.to_dense(), A @ X)
    assert is_dense_result(scorch.einsum("ij,jk->ik", s(A, "csr"), s(C, "csr"), format="dense"))


def test_explain_names_the_rule():
    text = scorch.explain("ij->ji", s(A, "csr"), source=True)
    assert "output:       csc  [rule: the driver's pattern]" in text
    assert "loop order:" in text and "extern \"C\"" in text


def test_explain_names_the_projection_rule():
    text = scorch.explain("ij,jk->ik", s(A, "coo"), X, file=open("/dev/null", "w"))
    assert "rule: dense: a dense factor over a projected pattern" in text
