"""Every einsum expression of numpy's and opt_einsum's own test lists, with each operand in turn sparse in every
format its rank allows, against dense ``torch.einsum``: values, and the gradients of every operand.

The expressions are read from the installed packages' test files at collection time (numpy's
``_core/tests/test_einsum.py``: the equation of every ``einsum``/``optimize_compare`` call; opt_einsum's
``tests/test_contract.py``: its ``tests`` list), not copied here. Every index letter gets a fixed small extent
(``SIZES``), an ellipsis one dimension of extent 2. An expression torch itself rejects with these shapes is
skipped, with torch's reason, once scorch is seen to raise a Python exception for it too.

The full cross (``test_cross_full``, slow) runs every (expression, sparse operand, format) once with random
values at half density and once with an edge case rotated over the cross: the sparse operand all zero, fully
dense, one of its letters of extent 1, or of extent 0. The default run takes a seeded sample of it
(``test_cross_sample``) and the reproducers of issue 17 (the tests after it).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import io
import pathlib
import random
import re

import pytest
import torch

import scorch
from scorch.sparse_tensor import pattern_ones

from conftest import assert_matches_dense, compile_ahead, plain_test_job, quarters
from test_einsum_matrix import _one_thread  # noqa: F401  (kernels on one thread, as the matrix runs them)

FORMATS = {1: ["coo"], 2: ["coo", "csr", "csc", "dcsr", "bsr(2, 2)", "dia", "ell"]}
FORMATS_ND = ["coo", "csf"]  # 3-d and more
VARIANTS = ("zero", "full", "one", "empty")  # the edge cases rotated over the full cross
ELLIPSIS = 2  # the extent of the one dimension an ellipsis stands for
SAMPLE = 40   # cases of the default run
#: every index letter's extent: small (the longest expressions have ten letters), not all equal (a transposition
#: mistake shows), the same in every expression (kernels specialize on extents: fewer of them to compile)
SIZES = {c: (2, 3, 4)[k % 3] for k, c in enumerate("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")}


# --- the expression lists ---------------------------------------------------------------------------------------

def _package_file(package, *candidates):
    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for rel in candidates:
            path = pathlib.Path(root, rel)
            if path.is_file():
                return path
    return None


def _numpy_equations(path):
    """The equation (first argument, a string) of every einsum call of numpy's einsum tests."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("einsum", "einsum_fn", "einsum_path", "optimize_compare"):
                found.append((node.lineno, node.args[0].value))
    return [eq for _, eq in sorted(found)]


def _opt_einsum_equations(path):
    """opt_einsum's module-level ``tests`` list of equations."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "tests" for t in node.targets):
            return [eq for eq in ast.literal_eval(node.value) if isinstance(eq, str)]
    return []


@functools.lru_cache(maxsize=None)
def equations():
    """``{source: [equation, ...]}``: each package's list, in file order, each equation once."""
    np_file = _package_file("numpy", "_core/tests/test_einsum.py", "core/tests/test_einsum.py")
    oe_file = _package_file("opt_einsum", "tests/test_contract.py")
    return {source: list(dict.fromkeys(read(path) if path is not None else []))
            for source, path, read in (("numpy", np_file, _numpy_equations),
                                       ("opt_einsum", oe_file, _opt_einsum_equations))}


def terms(eq):
    """The operands' index strings, ellipsis kept as ``.``: ``"...ij, jk"`` -> ``[".ij", "jk"]``."""
    return [t.replace("...", ".") for t in eq.replace(" ", "").split("->")[0].split(",")]


def cross():
    """Every (equation, sparse operand, format) of the lists."""
    out = []
    for eq in dict.fromkeys(eq for eqs in equations().values() for eq in eqs):  # (the lists overlap)
        for k, t in enumerate(terms(eq)):
            for fmt in FORMATS.get(len(t), FORMATS_ND if len(t) > 2 else []):
                out.append((eq, k, fmt))
    return out


def _id(p):
    eq, k, fmt, variant = p
    return f"{eq}|T{k}:{fmt}|{variant}"


def full_cross():
    """The cross, each triple with random values and with one edge case (rotated over the triples)."""
    return [c + (v,) for n, c in enumerate(cross()) for v in ("random", VARIANTS[n % len(VARIANTS)])]


def sample():
    """A seeded sample of the full cross (the same every run)."""
    everything = full_cross()
    return random.Random(17).sample(everything, min(SAMPLE, len(everything)))


# --- one case --------------------------------------------------------------------------------------------------

def shapes(eq, k, variant):
    """Every operand's shape: ``SIZES``, an ellipsis ``ELLIPSIS``; for ``one``/``empty`` the sparse operand's
    first letter has extent 1/0 in every operand."""
    sizes = dict(SIZES)
    letters = [c for c in terms(eq)[k] if c != "."]
    if variant in ("one", "empty") and letters:
        sizes[letters[0]] = 1 if variant == "one" else 0
    return [tuple(ELLIPSIS if c == "." else sizes[c] for c in t) for t in terms(eq)]


def inputs(eq, k, variant, seed, dtype=torch.float64):
    """Dense operands: multiples of 1/4 (exact sums), the sparse one at half density, all zero or full."""
    dense = []
    for j, shape in enumerate(shapes(eq, k, variant)):
        density = 1.0 if j != k else {"zero": 0.0, "full": 1.0}.get(variant, 0.5)
        dense.append(quarters(shape, seed + j, density, dtype))
    return dense


def stored(s):
    """The stored positions of ``s`` (padding not), as a dense 0/1 mask: where a sparse leaf has a gradient."""
    return s.with_values(pattern_ones(s, s.dtype)).to_dense()


def check_case(eq, k, fmt, variant, seed=0):
    """``scorch.einsum(eq)`` with operand ``k`` in ``fmt``, values and gradients, against dense torch."""
    check(eq, inputs(eq, k, variant, seed), {k: fmt}, seed)


def check(eq, dense, formats, seed=0):
    """``scorch.einsum(eq)`` of the ``dense`` operands, operand ``k`` stored in ``formats[k]``, against
    ``torch.einsum``: the result, and the gradients of every operand (a sparse one's on its stored positions,
    in its format). Where torch rejects the expression, scorch must raise too (the test is then skipped)."""
    ref = [x.clone().requires_grad_() for x in dense]
    try:
        expected = torch.einsum(eq, *ref)
    except RuntimeError as e:
        with pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError)):
            scorch.einsum(eq, *[scorch.asformat(x, formats[j]) if j in formats else x for j, x in enumerate(dense)])
        pytest.skip(f"torch.einsum rejects {eq!r} with shapes {[tuple(x.shape) for x in dense]}: {e}")
    ops = []
    for j, x in enumerate(dense):
        if j in formats:
            s = scorch.asformat(x, formats[j])
            assert torch.equal(s.to_dense(), x)
            ops.append(s.requires_grad_())
        else:
            ops.append(x.clone().requires_grad_())
    result = scorch.einsum(eq, *ops)
    assert_matches_dense(result, expected.detach())
    weight = quarters(tuple(expected.shape), seed + 99, 1.0, expected.dtype)
    (expected * weight).sum().backward()
    # (the loss by einsum too: a sparse result without entries is still differentiable there)
    scorch.einsum("...,...->", result, weight).backward()
    for j, (x, r) in enumerate(zip(ops, ref)):
        if j in formats:
            assert isinstance(x.grad, scorch.SparseTensor) and x.grad.format == x.format, f"T{j}: {x.grad!r}"
            assert_matches_dense(x.grad, r.grad * stored(x))
        else:
            assert_matches_dense(x.grad, r.grad)


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead(request):
    compile_ahead(request, plain_test_job)


# --- the lists -----------------------------------------------------------------------------------------------------

def test_lists_are_read():
    """Both packages' lists are found and parsed (a layout change in either would otherwise empty the cross)."""
    lists = equations()
    assert len(lists["numpy"]) >= 100, lists["numpy"]
    assert len(lists["opt_einsum"]) >= 60, lists["opt_einsum"]
    everything = lists["numpy"] + lists["opt_einsum"]
    for eq in ("ii->i", "aab,fa,df,ecc->bde", "bb,ff,be->e", "...ii->...i", "acdf,jbje,gihb,hfac,gfac,gifabc,hfac"):
        assert eq in everything
    assert all(re.fullmatch(r"[A-Za-z., \->]*", eq) for eq in everything)


@pytest.mark.parametrize("eq,k,fmt,variant", sample(), ids=[_id(p) for p in sample()])
def test_cross_sample(eq, k, fmt, variant):
    check_case(eq, k, fmt, variant)


@pytest.mark.slow
@pytest.mark.parametrize("eq,k,fmt,variant", full_cross(), ids=[_id(p) for p in full_cross()])
def test_cross_full(eq, k, fmt, variant):
    check_case(eq, k, fmt, variant)


# --- issue 17's reproducers --------------------------------------------------------------------------------------

def _q(*shape, seed=1, density=0.6):
    return quarters(shape, seed, density, torch.float64)


def test_letter_repeated_in_a_dense_operand():
    """``"cc"`` is the diagonal, summed once: [12, 24, 0] (the kernel nested two loops over c: [36, 72, 0])."""
    s = scorch.asformat(torch.tensor([1., 2., 0.]), "coo")
    r = scorch.einsum("a,cc->a", s, torch.arange(9.).reshape(3, 3))
    assert_matches_dense(r, torch.tensor([12., 24., 0.]))
    check("a,cc->a", [torch.tensor([1., 2., 0.], dtype=torch.float64), _q(3, 3)], {0: "coo"})


@pytest.mark.parametrize("eq,shapes,formats", [
    ("ab,cc->ab", [(3, 4), (5, 5)], {0: "csr"}),
    ("ab,bcc,cd->ad", [(3, 4), (4, 5, 5), (5, 6)], {0: "csr"}),
    ("ab,bcc,cd->ad", [(3, 4), (4, 5, 5), (5, 6)], {0: "coo"}),
    ("dd,fb,cdb->cf", [(3, 3), (4, 5), (6, 3, 5)], {0: "coo"}),
    ("bb,ff,be->e", [(3, 3), (4, 4), (3, 5)], {2: "csf"}),
    ("ab,bcc,cd->ad", [(3, 4), (4, 5, 5), (5, 6)], {1: "csf"}),
    ("dd,fb,cdb->cf", [(3, 3), (4, 5), (6, 3, 5)], {2: "coo"}),
], ids=lambda p: str(p) if isinstance(p, str) else None)
def test_repeated_letters_in_chains(eq, shapes, formats):
    """Repeated letters beside sparse operands: wrong values or internal errors (a level repeating another's
    coordinate, a non-invertible map, an intermediate with a repeated output letter) before."""
    check(eq, [_q(*sh, seed=n) for n, sh in enumerate(shapes)], formats)


@pytest.mark.parametrize("eq,shape,fmt", [
    ("ii,ij->j", (3, 3), "csr"), ("ii->i", (4, 4), "dia"), ("ii->", (4, 4), "bsr(2, 2)"),
    ("ii,i->i", (3, 3), "ell"), ("iji->ij", (3, 2, 3), "coo"), ("bcb,bb->c", (3, 4, 3), "csf"),
    ("iii->i", (3, 3, 3), "csf"), ("ii->i", (0, 0), "csr"), ("ii->i", (1, 1), "coo"),
])
def test_gradient_through_a_sparse_diagonal(eq, shape, fmt):
    """The gradient of a sparse operand indexed with a repeated letter: on its stored diagonal entries, zero on
    its other entries, in its own format (backward raised before)."""
    others = [_q(*(shape[0] if c in "ib" else 2 for c in t), seed=5) for t in eq.split("->")[0].split(",")[1:]]
    check(eq, [_q(*shape, density=0.7)] + others, {0: fmt})


def test_dense_diagonal_beside_a_sparse_operand_is_differentiable():
    check("ii,ij->ij", [_q(3, 3, density=1.0), _q(3, 4)], {1: "csr"})
    check("jj,ij,kk->i", [_q(4, 4, density=1.0), _q(3, 4), _q(2, 2, density=1.0)], {1: "csc"})


def test_repeated_letter_sizes_must_agree():
    s = scorch.asformat(_q(2, 3), "csr")
    with pytest.raises(ValueError, match="'i' is repeated in operand 0"):
        scorch.einsum("ii->i", s)
    with pytest.raises(ValueError, match="'j' is repeated in operand 1"):
        scorch.einsum("i,jj->i", scorch.asformat(_q(3), "coo"), _q(1, 3))


def test_kernels_never_see_a_repeated_letter():
    """The diagonal is taken in one place (einsum); a kernel asked for a repeated letter refuses."""
    from scorch import engine
    with pytest.raises(ValueError, match="repeats a letter"):
        engine.run((("i", "i"),), ("i",), [scorch.asformat(_q(3, 3), "csr")])


FIRST_CSC = ["csr", "coo", "dia", "ell", "bsr(2, 2)", "csc"]


@pytest.mark.parametrize("second", FIRST_CSC)
def test_discordant_formats(second):
    """A CSC operand with row-major ones: no loop order follows every operand, so the compiler transposes some
    ("no loop order is concordant" before)."""
    A = [_q(4, 6, seed=n) for n in range(3)]
    check("ij,ij,ij->ij", A, {0: "csc", 1: second, 2: "csr"})
    check("ij,ji,jk->ik", [A[0], _q(6, 4), _q(6, 3)], {0: "csc", 1: second})


def test_sparse_mixes_in_any_formats():
    """More sparse mixes, values only (each one a few kernels)."""
    for fa, fb, fc in [("csc", "csr", "csr"), ("csc", "coo", "dia"), ("csc", "ell", "bsr(2, 2)"), ("csr", "csc", "csc"),
                       ("dia", "csc", "coo")]:
        A = [_q(4, 6, seed=n) for n in range(3)]
        ops = [scorch.asformat(a, f) for a, f in zip(A, (fa, fb, fc))]
        assert_matches_dense(scorch.einsum("ij,ij,ij->ij", *ops), A[0] * A[1] * A[2])
        assert_matches_dense(scorch.einsum("ij,ij->", ops[0], ops[1]), (A[0] * A[1]).sum())


def test_the_smaller_operand_is_transposed():
    """Which operand is converted is chosen by cost (its nnz), not by its position."""
    big, small = _q(40, 40, density=0.9), _q(40, 40, seed=2, density=0.05)
    for a, b, moved in ((big, small, "T1"), (small, big, "T0")):
        text = scorch.explain("ij,ij->ij", scorch.asformat(a, "csc"), scorch.asformat(b, "csr"), file=io.StringIO())
        line = next(x for x in text.splitlines() if x.startswith("reformat:"))
        assert line.split()[1] == moved, text[:400]
        assert_matches_dense(scorch.einsum("ij,ij->ij", scorch.asformat(a, "csc"), scorch.asformat(b, "csr")), a * b)


def test_result_entries_keep_their_gradient_when_zero():
    """A sparse result assembled through a dense workspace keeps the entries its operands' patterns produce even
    where they are 0 (a stored zero of a block), so their gradient reaches the operands."""
    x = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    y = torch.tensor([[0.0, -1.0, 0.0, 0.0], [-2.0, 0.5, 1.0, -1.5]], dtype=torch.float64)  # bsr(2, 2): zeros stored
    z = _q(3, 4, density=1.0)
    check("x,yx,zx->xzy", [x, y, z], {1: "bsr(2, 2)"})


def test_requested_format_of_dense_operands():
    """``format=`` with only dense operands gives that format (it raised before)."""
    a, b = _q(3, 4), _q(4, 5)
    r = scorch.einsum("ij,jk->ik", a, b, format="csr")
    assert isinstance(r, scorch.SparseTensor) and r.format == scorch.formats.resolve("csr", 2)
    assert_matches_dense(r, a @ b)


def test_repeated_letters_under_deferral():
    """Inside ``scorch.deferral("all")`` (as in ``scorch.compile``) a product whose operand repeats a letter is
    computed, not deferred: the deferral's backward would meet the repeated letter."""
    with scorch.deferral("all"):
        check("ii,ij->j", [_q(3, 3), _q(3, 4)], {0: "csr"})
        check("ij,jj->i", [_q(3, 4), _q(4, 4)], {0: "csr"})


def _two_of_four(x):
    """``x`` with the two largest magnitudes of every group of four columns kept (storable as nm(2, 4))."""
    g = x.reshape(x.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.abs().topk(2, dim=-1).indices, True)
    return (g * keep).reshape(x.shape)


@pytest.mark.parametrize("fa,fb", [
    ("ell", "dia"), ("nm(2, 4)", "bsr(2, 2)"), ("(i, j) -> (i + j : compressed, j : dense)", "coo"),
    ("csr", "coo"), ("coo", "coo"), ("bsc(2, 2)", "nm(2, 4)"), ("dcsc", "ell"),
])
def test_two_sparse_operands_in_other_formats(fa, fb):
    """Products of two sparse operands in formats beyond the lists' (padded, blocked, anti-diagonal): values and
    gradients. A result in a padded format read its entries that are 0 as padding and lost their gradient (an
    ELL result times a zero inside DIA's band); a COO result of a co-iteration was assembled from int32
    coordinates and raised."""
    a, b = _two_of_four(_q(4, 8, seed=3)), _two_of_four(_q(4, 8, seed=4, density=0.8))
    check("ij,ij->ij", [a, b], {0: fa, 1: fb})
    check("ij,kj->ik", [a, b], {0: fa, 1: fb})


def test_requested_coo_of_a_sparse_product():
    a, b = _q(4, 6, seed=1), _q(6, 5, seed=2)
    r = scorch.einsum("ij,jk->ik", scorch.asformat(a, "coo"), scorch.asformat(b, "coo"), format="coo")
    assert r.format == scorch.formats.resolve("coo", 2)
    assert_matches_dense(r, a @ b)


def test_diagonal_of_a_dense_format_stored_in_another_order():
    """A dense-format operand whose values are not row-major (levels in another order than the dimensions)
    takes its diagonal through the entries, not by reading the values as the row-major tensor."""
    x = torch.arange(18.).reshape(3, 3, 2)
    S = scorch.asformat(x, "(i, j, k) -> (k : dense, i : dense, j : dense)")
    assert_matches_dense(scorch.einsum("iik->ik", S), torch.einsum("iik->ik", x))
    assert_matches_dense(scorch.einsum("iik->ik", scorch.asformat(x, "dense")), torch.einsum("iik->ik", x))
