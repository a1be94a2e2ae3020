"""The compiler's test matrix: einsum expressions with exactly one sparse operand, crossed with every format
that applies, against ``torch.einsum`` on the dense tensors.

Every (expression, format) pair is one test; hypothesis draws the sparse operand's shape (0 rows, 0 columns,
1x1 included), its density (all-zero and fully dense included) and the values. Each pair runs with one
(value dtype, index dtype) combination, rotated over the pairs so that every format and every expression meets
several combinations; ``test_matrix_all_dtypes`` (slow) runs the full cross. Values are multiples of 1/4 and
small integers, so every sum is exact and a mismatch is a real one.

Index letters that the sparse operand does not have (``k`` in SpMM) get the fixed extent ``EXTRA``: the
compiler specializes on the innermost dense extent, so a fixed one keeps the number of kernels (and the cold
compile time) at about one per test; ``test_other_dense_extents`` varies it.

Sparse results are checked for their format against the inference rules (``scorch/compiler/infer.py``,
``docs/format-inference.md``), for shared index arrays where the rules say the driver's pattern is kept, and
for their storage invariants.

Also here: ``test_interp_agrees_with_cpp`` (small inputs through the loop-IR interpreter, which bounds-checks
every access, against the C++ kernel), ``test_parallel_agrees`` (4 threads), ``test_strided_dense_operands``,
and bad input (``test_bad_input_raises_clearly`` and the tests after it).

Most tests run kernels on one thread (``_one_thread``) and all kernels are compiled ahead on every core
(``_compile_ahead``); both only to keep the run short on a small machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import scorch
from scorch import Format, SparseTensor
from scorch import engine

from conftest import assert_matches_dense, compile_ahead, plain_test_job

EXTRA = 3  # extent of every index letter the sparse operand does not have

FORMATS_2D = [
    "coo", "csr", "csc", "dcsr", "dcsc", "ell", "dia", "bsr(2, 3)", "bsc(2, 2)", "dense",
    "(i, j) -> (j - i : compressed, i : dense)",
    "(i, j) -> (j - i : compressed, j : dense)",
    "(i, j) -> (i + j : compressed, i : dense)",
    "(i, j) -> (i + j : compressed, j : dense)",
]
FORMATS_3D = ["csf", "coo", "dense", "(i, j, k) -> (k : dense, i : compressed, j : compressed)"]

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
COMBOS = [(F32, I32), (F64, I64), (I64, I32), (F32, I64), (F64, I32), (I64, I64)]


@dataclass(frozen=True)
class Case:
    eq: str          # the equation passed to einsum
    sparse: int      # which operand is sparse
    inputs: tuple    # index letters of every operand, ellipsis written out
    out: str         # output letters, ellipsis written out
    square: bool     # the sparse operand must be square (repeated index)

    @property
    def sletters(self) -> str:
        return self.inputs[self.sparse]

    def __str__(self):
        return self.eq


def C(eq, sparse=0, full=None, square=False) -> Case:
    """A case; ``full`` is the equation with ellipsis and implicit output written out (for shapes)."""
    full = (full or eq).replace(" ", "")
    lhs, out = full.split("->")
    return Case(eq, sparse, tuple(lhs.split(",")), out, square)


CASES_2D = [
    C("ij,j->i"),                      # SpMV
    C("ij,jk->ik"),                    # SpMM
    C("ki,ij->kj", sparse=1),          # dense x sparse
    C("ij,ik,jk->ij"),                 # SDDMM
    C("ij->i"),                        # row sums
    C("ij->j"),                        # column sums
    C("ij->"),                         # total sum
    C("ij->ji"),                       # transpose
    C("ij->ij"),                       # copy
    C("ij,ij->ij"),                    # elementwise with dense
    C("ij,j->ij"),                     # broadcasting a vector along rows
    C("ij,i->ij"),                     # broadcasting a vector along columns
    C("ij,k->ijk"),                    # outer product
    C("k,ij->ijk", sparse=1),          # outer product, sparse second
    C("ij,jk,kl->il"),                 # 3-operand chain, sparse first
    C("ij,->ij"),                      # 0-d dense operand
    C("ij,->"),                        # 0-d dense operand, reduced
    C("ij,i->j"),                      # x^T A
    C("ij,i,j->"),                     # bilinear form
    C("ij,kj->ik"),                    # A B^T
    C("ij,jk->ki"),                    # transposed product
    C("ij,ij->"),                      # Frobenius inner product
    C("ij,ji->ij"),                    # times a transposed dense
    C("ij,ij->ji"),                    # elementwise, transposed out
    C("ij,jk->ijk"),                   # no reduction, 3-d output
    C("ij,ji->"),                      # trace of a product
    C("ij,j", full="ij,j->i"),         # implicit output
    C("i j , j k -> i k", full="ij,jk->ik"),  # spaces
]
CASES_SQUARE = [
    C("ii->i", square=True),           # diagonal
    C("ii->", square=True),            # trace
    C("ii,i->i", square=True),         # diagonal times a vector
]
CASES_3D = [
    C("ijk,jr,kr->ir"),                # MTTKRP
    C("ijk,k->ij"),                    # TTV
    C("ijk,kl->ijl"),                  # TTM
    C("ijk->ik"),
    C("ijk->ij"),
    C("ijk->j"),
    C("ijk->"),
    C("ijk->kij"),                     # permutations
    C("ijk->jik"),
    C("ijk,ijk->ijk"),
    C("...ij,...jk->...ik", full="bij,bjk->bik"),   # ellipsis (batched matmul)
    C("...ij,j->...i", full="bij,j->bi"),
    C("bij,bjk->bik"),
]

MATRIX = []
for _fi, _f in enumerate(FORMATS_2D):
    for _ci, _c in enumerate(CASES_2D + CASES_SQUARE):
        MATRIX.append((_c, _f) + COMBOS[(_ci + _fi) % len(COMBOS)])
for _fi, _f in enumerate(FORMATS_3D):
    for _ci, _c in enumerate(CASES_3D):
        MATRIX.append((_c, _f) + COMBOS[(_ci + _fi) % len(COMBOS)])
PAIRS = [(c, f) for c, f, _, _ in MATRIX]


def _dt(d):
    return str(d).replace("torch.", "")


def _matrix_id(p):
    c, f, dt, it = p
    return f"{c.eq}|{f}|{_dt(dt)}|idx-{_dt(it)}"


MATRIX_IDS = [_matrix_id(p) for p in MATRIX]


# --- inputs ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """What hypothesis draws: three extents (the sparse operand uses the first ``ndim``; square ones the first
    twice), the fraction of nonzeros (0: all zero, 1: fully dense) and a seed for the values."""
    dims: tuple
    density: float
    seed: int


specs = st.builds(Spec, st.tuples(*[st.integers(0, 6)] * 3), st.sampled_from([0.0, 0.3, 0.7, 1.0]),
                  st.integers(0, 2 ** 16))

# Edge cases every matrix test runs, on top of the random ones.
EDGES = [
    Spec((0, 4, 3), 0.5, 1),    # 0 rows
    Spec((3, 0, 2), 0.5, 2),    # 0 columns (3-d: 0 in the middle)
    Spec((1, 1, 1), 1.0, 3),    # 1x1, stored
    Spec((5, 7, 3), 0.0, 4),    # all zero
    Spec((4, 6, 2), 1.0, 5),    # fully dense; bsr(2, 3) and bsc(2, 2) blocks divide 4 x 6
    Spec((5, 7, 3), 0.6, 6),    # partial blocks
]


def with_edges(f):
    for e in reversed(EDGES):
        f = example(spec=e)(f)
    return f


def sparse_shape(case: Case, spec: Spec, cap3=4) -> tuple:
    n = len(case.sletters)
    if case.square:
        return (spec.dims[0],) * 2
    if n == 3:
        return tuple(min(d, cap3) for d in spec.dims)  # keep 3-d tensors small
    return tuple(spec.dims[:n])


def values(shape, dtype, gen, density=1.0, lo=1, hi=8):
    """Multiples of 1/4 (floats) or integers with magnitude in [lo, hi], a ``density`` fraction nonzero."""
    mag = torch.randint(lo, hi + 1, shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    keep = torch.rand(shape, generator=gen) < density
    x = mag * sign * keep
    return x.to(dtype) / 4 if dtype.is_floating_point else x.to(dtype)


def build(case: Case, fmt: str, dtype, itype, spec: Spec, extra=EXTRA, cap3=4):
    """(operands for scorch, dense operands for torch, the sparse operand's dense tensor)."""
    gen = torch.Generator().manual_seed(spec.seed)
    shape = sparse_shape(case, spec, cap3)
    sizes = dict(zip(case.sletters, shape))
    dense_s = values(shape, dtype, gen, spec.density)
    ops, dense_ops = [], []
    for k, letters in enumerate(case.inputs):
        if k == case.sparse:
            s = scorch.asformat(dense_s, fmt, index_dtype=itype)
            assert torch.equal(s.to_dense(), dense_s)
            ops.append(s)
            dense_ops.append(dense_s)
        else:
            x = values(tuple(sizes.get(c, extra) for c in letters), dtype, gen, lo=0, hi=4)
            ops.append(x)
            dense_ops.append(x)
    return ops, dense_ops, dense_s


# --- the format oracle ------------------------------------------------------------------------------------------

def sparse_letters(fmt: Format, letters: str) -> set:
    """The index letters under a non-full level of ``fmt`` (where its pattern restricts the nonzeros)."""
    return {letters[d] for e, lvl in fmt.levels if not lvl.full for d in e.dims()}


def renamed(fmt: Format, src: str, out: str) -> Format:
    """``fmt`` of an operand indexed by ``src``, as the format of a result indexed by ``out`` (a permutation
    of ``src``): the same levels, with dimension ``d`` renamed to the result's dimension of letter ``src[d]``."""
    names = "ijk"
    head, body = str(fmt).split("->", 1)
    mapping = {names[d]: names[out.index(c)] for d, c in enumerate(src)}
    body = re.sub(r"\b[ijk]\b", lambda m: mapping[m.group(0)], body)
    return Format("(" + ", ".join(names[:len(out)]) + ") ->" + body)


#: result formats the inference rules document (infer.py, docs/format-inference.md), for (equation, format)
DOCUMENTED = {
    ("ij->ji", "csr"): "csc",
    ("ij->ji", "csc"): "csr",
    ("ij->ji", "dcsr"): "dcsc",
    ("ij->ji", "dcsc"): "dcsr",
    ("ij->i", "dcsr"): "(i) -> (i : compressed)",
    ("ij->j", "dcsc"): "(i) -> (i : compressed)",
    ("ij->i", "csr"): None,         # dense
    ("ij->j", "csr"): "(i) -> (i : compressed)",
    ("ij,jk->ik", "csr"): None,
    ("ij,jk->ik", "coo"): None,     # rule 4: a dense factor over a projected pattern
    ("ij,jk->ik", "csc"): None,
    ("ij,j->i", "dcsr"): "(i) -> (i : compressed)",  # rule 3 comes first: the driver's level 0
    ("ij,ik,jk->ij", "csr"): "csr",
    ("ijk->ij", "csf"): "(i, j) -> (i : compressed, j : compressed)",
}


def check_format(case: Case, fmt: str, s: SparseTensor, result):
    """The result's kind and format as the inference rules say, and its storage invariants."""
    out, src = case.out, case.sletters
    expect_sparse = bool(sparse_letters(s.format, src) & set(out))
    # rule 4: a dense operand with an index, and the output sums over a sparse operand's index (the pattern is
    # projected): dense, unless rule 3 keeps a prefix of the driver's levels (sharing its first level)
    projected = any(j != case.sparse and case.inputs[j] for j in range(len(case.inputs))) and \
        not set(src) <= set(out)
    if projected and isinstance(result, SparseTensor):
        assert s.levels[0].crd is not None and result.levels[0].crd.data_ptr() == s.levels[0].crd.data_ptr(), \
            f"rule 4: a dense factor over a projected pattern is dense, unless rule 3; got {result.format}"
    else:
        assert isinstance(result, SparseTensor) == (expect_sparse and not projected), \
            (f"rules 1 and 4: the output is sparse iff an output index is sparse and the pattern is not projected"
             f" by a dense factor; got {type(result).__name__}"
             f"{' ' + str(result.format) if isinstance(result, SparseTensor) else ''}")
    if (case.eq, fmt) in DOCUMENTED:
        want = DOCUMENTED[(case.eq, fmt)]
        if want is None:
            assert not isinstance(result, SparseTensor)
        else:
            assert isinstance(result, SparseTensor) and result.format == scorch.formats.resolve(want, len(out)), \
                (str(result.format) if isinstance(result, SparseTensor) else "dense", want)
    if not isinstance(result, SparseTensor):
        assert type(result) is torch.Tensor and result.layout == torch.strided
        return
    assert result.format.ndim == len(out)
    result.check_invariants()
    if len(set(src)) == len(src) and sorted(out) == sorted(src):
        # rule 2: the output indices are exactly the sparse operand's, which is a factor: its pattern, its
        # levels (permuted dimensions), its index arrays
        want = renamed(s.format, src, out)
        assert result.format == want, (str(result.format), str(want))
        for k, (a, b) in enumerate(zip(result.levels, s.levels)):
            for name in ("pos", "crd"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None), (k, name)
                assert x is None or x.data_ptr() == y.data_ptr(), f"level {k} {name} is not shared"


def dense_einsum(eq, *ops):
    """torch.einsum, in the operands' dtype: torch returns int64 for some int32 einsums (those it computes as a
    ``sum``: ``"ii->"``, ``"ij,->"``) and int32 for others (``"ij,jk->ik"``); scorch keeps the operands' dtype.
    The values here are small, so the cast is exact."""
    out = torch.einsum(eq, *ops)
    return out.to(ops[0].dtype) if ops[0].dtype == torch.int32 else out


def run_case(case, fmt, dtype, itype, spec):
    ops, dense_ops, _ = build(case, fmt, dtype, itype, spec)
    expected = dense_einsum(case.eq, *dense_ops)
    result = scorch.einsum(case.eq, *ops)
    assert_matches_dense(result, expected)
    check_format(case, fmt, ops[case.sparse], result)
    return ops, result


# --- threads -------------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _one_thread():
    """Kernels run with ``torch.get_num_threads()`` threads. Most tests here use one: scorch's OpenMP runtime
    and torch's spin against each other on a small machine and a tiny kernel then costs milliseconds, not
    microseconds. ``test_parallel_agrees`` runs the parallel paths."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- parallel first compiles --------------------------------------------------------------------------------------

def matrix_jobs(run, plain=True):
    """``compile_ahead``'s job per test: one small einsum per (case, format, dtypes) of the matrix, run by
    ``run(case, operands)``; other tests' own bodies where ``plain``."""
    seen = set()

    def job_for(item):
        cs = getattr(item, "callspec", None)
        if cs is not None and "itype" in cs.params:
            p = tuple(cs.params[k] for k in ("case", "fmt", "dtype", "itype"))
            if p in seen:
                return None
            seen.add(p)
            return lambda: run(p[0], build(*p, spec=Spec((3, 4, 2), 0.5, 0))[0])
        return plain_test_job(item) if plain else None
    return job_for


@pytest.fixture(scope="module", autouse=True)
def _compile_ahead(request):
    compile_ahead(request, matrix_jobs(lambda case, ops: scorch.einsum(case.eq, *ops)))


# --- the matrix ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,fmt,dtype,itype", MATRIX, ids=MATRIX_IDS)
@settings(max_examples=3)
@with_edges
@given(spec=specs)
def test_matrix(case, fmt, dtype, itype, spec):
    run_case(case, fmt, dtype, itype, spec)


def test_matrix_covers_the_brief():
    eqs = {c.eq for c, _ in PAIRS}
    assert len(eqs) >= 30
    for f in FORMATS_2D:
        combos = {(d, i) for c, ff, d, i in MATRIX if ff == f}
        assert combos == set(COMBOS), f  # every format meets every dtype/index combination
    for c in CASES_2D + CASES_SQUARE + CASES_3D:
        assert {d for cc, _, d, _ in MATRIX if cc == c} >= {F32, F64}, c.eq
        assert {i for cc, _, _, i in MATRIX if cc == c} == {I32, I64}, c.eq


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", PAIRS, ids=[f"{c.eq}|{f}" for c, f in PAIRS])
@settings(max_examples=30)
@given(spec=specs, combo=st.sampled_from(COMBOS + [(I32, I32), (I32, I64)]))
def test_matrix_all_dtypes(case, fmt, spec, combo):
    run_case(case, fmt, *combo, spec)


# --- the interpreter as the oracle --------------------------------------------------------------------------------

small_specs = st.builds(Spec, st.tuples(*[st.integers(0, 4)] * 3), st.sampled_from([0.0, 0.5, 1.0]),
                        st.integers(0, 2 ** 16))


@pytest.mark.parametrize("case,fmt,dtype,itype", MATRIX, ids=MATRIX_IDS)
@settings(max_examples=1)
@example(spec=Spec((3, 5, 2), 0.6, 11))
@given(spec=small_specs)
def test_interp_agrees_with_cpp(case, fmt, dtype, itype, spec):
    """The loop-IR interpreter (bounds-checked, the reference semantics) and the C++ kernel agree, and both
    agree with torch."""
    ops, dense_ops, _ = build(case, fmt, dtype, itype, spec)
    cpp = engine.einsum(case.eq, *ops, backend="cpp")
    ref = engine.einsum(case.eq, *ops, backend="interp")
    assert type(ref) is type(cpp)
    if isinstance(cpp, SparseTensor):
        assert ref.format == cpp.format
        ref.check_invariants()
        assert torch.equal(ref.values(), cpp.values())
        for a, b in zip(ref.levels, cpp.levels):
            for name in ("pos", "crd"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    assert_matches_dense(ref, dense_einsum(case.eq, *dense_ops))
    assert_matches_dense(cpp, ref.to_dense() if isinstance(ref, SparseTensor) else ref)


# --- parallel loops --------------------------------------------------------------------------------------------------

PARALLEL_SPECS = [Spec((0, 5, 3), 0.5, 91),     # no rows for the threads
                  Spec((3, 1, 2), 1.0, 92),     # fewer rows than threads
                  Spec((41, 23, 6), 0.3, 93)]   # uneven split, some empty rows


@pytest.mark.parametrize("case,fmt,dtype,itype", MATRIX, ids=MATRIX_IDS)
def test_parallel_agrees(case, fmt, dtype, itype):
    """With 4 threads (more than this machine's cores, more than some inputs' rows) the parallel loops
    partition correctly: the result equals torch's, as with one thread."""
    torch.set_num_threads(4)
    for spec in PARALLEL_SPECS:
        ops, dense_ops, _ = build(case, fmt, dtype, itype, spec, cap3=12)
        result = scorch.einsum(case.eq, *ops)
        assert_matches_dense(result, dense_einsum(case.eq, *dense_ops))
        check_format(case, fmt, ops[case.sparse], result)


# --- strided dense operands -------------------------------------------------------------------------------------

def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (every last-dimension step 2 elements apart)."""
    if x.dim() == 0:
        return x
    y = torch.stack([x, torch.full_like(x, 99)], -1)[..., 0]
    assert torch.equal(y, x) and (x.numel() < 2 or not y.is_contiguous())
    return y


STRIDED_FORMATS = ["csr", "coo", "dia", "bsr(2, 3)", "(i, j) -> (i + j : compressed, j : dense)", "csf"]
STRIDED = [p for p in MATRIX if p[1] in STRIDED_FORMATS and len(p[0].inputs) > 1]


@pytest.mark.parametrize("case,fmt,dtype,itype", STRIDED, ids=[_matrix_id(p) for p in STRIDED])
def test_strided_dense_operands(case, fmt, dtype, itype):
    """Dense operands that are non-contiguous views give the same results as contiguous ones, on the first
    call and on repeated calls (which may take a cached fast path)."""
    ops, dense_ops, _ = build(case, fmt, dtype, itype, Spec((5, 7, 3), 0.6, 95))
    expected = torch.einsum(case.eq, *dense_ops)
    views = [x if k == case.sparse else strided(x) for k, x in enumerate(ops)]
    for label, args in (("contiguous", ops), ("strided", views), ("strided again", views),
                        ("contiguous again", ops), ("strided a third time", views)):
        result = scorch.einsum(case.eq, *args)
        try:
            assert_matches_dense(result, expected)
        except AssertionError as e:
            raise AssertionError(f"{label} call: {e}") from None


# --- more shapes ---------------------------------------------------------------------------------------------

EXTRA_CASES = [C("ij,jk->ik"), C("ki,ij->kj", sparse=1), C("ij,ik,jk->ij"), C("ij,k->ijk"), C("ijk,jr,kr->ir")]


@pytest.mark.parametrize("fmt", ["csr", "coo", "dia", "bsr(2, 3)", "(i, j) -> (i + j : compressed, j : dense)"])
@pytest.mark.parametrize("case", EXTRA_CASES[:4], ids=str)
@pytest.mark.parametrize("extra", [0, 1, 1500])
def test_other_dense_extents(case, fmt, extra):
    """The dense-only index at extent 0 (no loop), 1 and past the specialization limit (a run-time extent)."""
    spec = Spec((5, 7, 3), 0.5, 21)
    ops, dense_ops, _ = build(case, fmt, F64, I32, spec, extra=extra)
    result = scorch.einsum(case.eq, *ops)
    assert_matches_dense(result, torch.einsum(case.eq, *dense_ops))
    check_format(case, fmt, ops[case.sparse], result)


@pytest.mark.parametrize("fmt", FORMATS_3D)
@pytest.mark.parametrize("extra", [0, 1])
def test_mttkrp_rank_extents(fmt, extra):
    case = EXTRA_CASES[4]
    ops, dense_ops, _ = build(case, fmt, F32, I64, Spec((4, 3, 5), 0.5, 22), extra=extra)
    assert_matches_dense(scorch.einsum(case.eq, *ops), torch.einsum(case.eq, *dense_ops))


@pytest.mark.parametrize("fmt", ["csr", "coo", "ell", "dia", "bsc(2, 2)", "(i, j) -> (j - i : compressed, j : dense)"])
@pytest.mark.parametrize("eq,dshape", [("ij,ij->ij", (1, 7)), ("ij,ij->ij", (5, 1)), ("ij,ij->ij", (1, 1)),
                                       ("ij,jk->ik", (1, 3))])
def test_dense_operand_broadcasts(fmt, eq, dshape):
    """A dense operand of extent 1 along an index broadcasts, as in torch.einsum."""
    gen = torch.Generator().manual_seed(31)
    a = values((5, 7), F64, gen, 0.5)
    x = values(dshape, F64, gen)
    s = scorch.asformat(a, fmt)
    result = scorch.einsum(eq, s, x)
    assert_matches_dense(result, torch.einsum(eq, a, x))
    check_format(C(eq), fmt, s, result)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "ell", "dia", "bsr(2, 3)",
                                 "(i, j) -> (i + j : compressed, i : dense)"])
@pytest.mark.parametrize("eq", ["ij,jk->ik", "ij->", "ij,ik,jk->ij"])
def test_float64_is_computed_in_float64(fmt, eq):
    """Random (not exactly representable) values: a float64 result must be accurate to float64, not float32."""
    gen = torch.Generator().manual_seed(41)
    a = torch.randn(6, 9, generator=gen, dtype=F64) * (torch.rand(6, 9, generator=gen) < 0.5)
    case = C(eq)
    sizes = {"i": 6, "j": 9}
    dense = [torch.randn(tuple(sizes.get(c, EXTRA) for c in t), generator=gen, dtype=F64) for t in case.inputs[1:]]
    result = scorch.einsum(eq, scorch.asformat(a, fmt), *dense)
    got = result.to_dense() if isinstance(result, SparseTensor) else result
    torch.testing.assert_close(got, torch.einsum(eq, a, *dense), rtol=1e-12, atol=1e-12)


REQUESTED = ["csr", "coo", "csc", "dcsc", "ell", "dia", "bsr(2, 2)", "bsc(2, 3)",
             "(i, j) -> (i + j : compressed, j : dense)", "dense"]


@pytest.mark.parametrize("fmt", ["csr", "coo", "dia", "ell", "bsr(2, 3)"])
@pytest.mark.parametrize("eq", ["ij,jk->ik", "ij->ji", "ij,ij->ij"])
def test_requested_output_format(fmt, eq):
    """``format=`` overrides inference: the result has that format and the right values."""
    gen = torch.Generator().manual_seed(51)
    a = values((5, 7), F32, gen, 0.4)
    case = C(eq)
    sizes = {"i": 5, "j": 7}
    dense = [values(tuple(sizes.get(c, EXTRA) for c in t), F32, gen) for t in case.inputs[1:]]
    if eq == "ij,ij->ij":
        dense = [a]
    s = scorch.asformat(a, fmt)
    expected = torch.einsum(eq, a, *dense)
    for want in REQUESTED:
        r = scorch.einsum(eq, s, *dense, format=want)
        assert_matches_dense(r, expected)
        if want == "dense":
            assert type(r) is torch.Tensor
        else:
            assert isinstance(r, SparseTensor) and r.format == scorch.formats.resolve(want, 2), want
            r.check_invariants()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_torch_sparse_layout_operands():
    """torch's own sparse layouts are einsum operands too (viewed as SparseTensors without copying)."""
    gen = torch.Generator().manual_seed(61)
    a = values((4, 6), F32, gen, 0.5)
    x = values((6, 2), F32, gen)
    for t in (a.to_sparse_coo(), a.to_sparse_csr(), a.to_sparse_csc(), a.to_sparse_bsr((2, 3)),
              a.to_sparse_bsc((2, 2))):
        assert_matches_dense(scorch.einsum("ij,jk->ik", t, x), a @ x)
        assert_matches_dense(scorch.einsum("ij,j->i", t, x[:, 0]), a @ x[:, 0])


ONE_D = [("i,i->", 0), ("i,ij->j", 0), ("i->i", 0), ("i->", 0), ("i,j->ij", 0), ("j,i->ij", 1), ("i,i->i", 0)]


@pytest.mark.parametrize("fmt", ["coo", "csf", "dense", "(i) -> (i : compressed)"])
@pytest.mark.parametrize("eq,sp", ONE_D, ids=[e for e, _ in ONE_D])
def test_one_dimensional_sparse(fmt, eq, sp):
    gen = torch.Generator().manual_seed(98)
    v = values((6,), F64, gen, 0.5)
    lhs = eq.split("->")[0].split(",")
    sizes = {lhs[sp]: 6}
    dense = [v if k == sp else values(tuple(sizes.get(c, EXTRA) for c in t), F64, gen) for k, t in enumerate(lhs)]
    ops = [scorch.asformat(v, fmt) if k == sp else x for k, x in enumerate(dense)]
    result = scorch.einsum(eq, *ops)
    assert_matches_dense(result, torch.einsum(eq, *dense))
    if isinstance(result, SparseTensor):
        result.check_invariants()


@pytest.mark.parametrize("sdt,ddt,want", [(I64, F32, F32), (F32, I64, F32), (F32, F64, F64), (I32, I64, I64),
                                          (F64, F32, F64)])
def test_dtype_promotion(sdt, ddt, want):
    """Mixed operand dtypes promote as torch promotes (torch.einsum itself refuses mixed dtypes)."""
    gen = torch.Generator().manual_seed(99)
    a = (values((4, 5), F64, gen, 0.5) * 4).to(sdt)
    x = (values((5, 3), F64, gen) * 4).to(ddt)
    for eq, xs in (("ij,jk->ik", x), ("ij,j->i", x[:, 0].contiguous()), ("ij,ij->ij", (a * 2).to(ddt))):
        r = scorch.einsum(eq, scorch.asformat(a, "csr"), xs)
        assert r.dtype == want
        assert_matches_dense(r, torch.einsum(eq, a.to(want), xs.to(want)))


UNCOALESCED_CASES = [C("ij,jk->ik"), C("ij,j->i"), C("ki,ij->kj", sparse=1), C("ij,ik,jk->ij"), C("ij->ji"),
                     C("ij->i"), C("ij->j"), C("ij->"), C("ij,ij->ij"), C("ij,j->ij"), C("ii->i", square=True)]


@pytest.mark.parametrize("case", UNCOALESCED_CASES, ids=str)
def test_uncoalesced_coo_operand(case):
    """torch's uncoalesced COO (duplicates, unsorted) as the sparse operand: duplicates add up, as in torch."""
    n = 4 if case.square else 5
    idx = torch.tensor([[2, 0, 2, 3, 0, 1, 2], [1, 0, 1, 3, 0, 2, 1]])
    vals = torch.tensor([1.0, -2.0, 3.0, 4.0, 5.0, -0.5, 0.25], dtype=F64)
    t = torch.sparse_coo_tensor(idx, vals, (4, n))
    s = scorch.sparse_coo_tensor(idx, vals, (4, n))
    assert scorch.formats.named.short_name(s.format) == "coo (uncoalesced)"
    a = t.to_dense()
    sizes = dict(zip(case.sletters, a.shape))
    gen = torch.Generator().manual_seed(97)
    dense = [values(tuple(sizes.get(c, EXTRA) for c in letters), F64, gen) for letters in case.inputs]
    ops = [s if k == case.sparse else x for k, x in enumerate(dense)]
    dense[case.sparse] = a
    result = scorch.einsum(case.eq, *ops)
    assert_matches_dense(result, torch.einsum(case.eq, *dense))
    if isinstance(result, SparseTensor):
        result.check_invariants()


# --- bad input ---------------------------------------------------------------------------------------------------

def _s(shape=(3, 4), fmt="csr", dtype=F32):
    gen = torch.Generator().manual_seed(71)
    return scorch.asformat(values(shape, F64, gen, 0.5).to(dtype), fmt)


BAD = [
    # shape mismatches
    ("ij,j->i", lambda: (_s(), torch.ones(5)), ValueError, "size"),
    ("ij,jk->ik", lambda: (_s(), torch.ones(5, 2)), ValueError, "size"),
    ("ki,ij->kj", lambda: (torch.ones(2, 5), _s()), ValueError, "size"),
    ("ij,ij->ij", lambda: (_s(), torch.ones(3, 5)), ValueError, "size"),
    ("ii->i", lambda: (_s(),), ValueError, "size"),                     # a repeated index over unequal extents
    ("ijk,jr,kr->ir", lambda: (_s((2, 3, 4), "csf"), torch.ones(3, 2), torch.ones(5, 2)), ValueError, "size"),
    # operand count
    ("ij,j->i", lambda: (_s(),), ValueError, "operand"),
    ("ij->i", lambda: (_s(), torch.ones(4)), ValueError, "operand"),
    ("ij,j,k->i", lambda: (_s(), torch.ones(4)), ValueError, "operand"),
    # bad characters and grammar
    ("ij;j->i", lambda: (_s(), torch.ones(4)), ValueError, ";"),
    ("ij,j->i;", lambda: (_s(), torch.ones(4)), ValueError, ";"),
    ("i1,j->i", lambda: (_s(), torch.ones(4)), ValueError, "1"),
    ("ij->i->j", lambda: (_s(),), ValueError, "->"),
    ("i-j->i", lambda: (_s(),), ValueError, "-"),
    ("ij>i", lambda: (_s(),), ValueError, ">"),
    ("i.j->i", lambda: (_s(),), ValueError, "ellipsis"),
    ("......ij->ij", lambda: (_s(),), ValueError, "ellipsis"),
    ("ij->......", lambda: (_s(),), ValueError, "ellipsis"),
    # output indices
    ("ij->ii", lambda: (_s(),), ValueError, "repeated"),
    ("ij,j->ii", lambda: (_s(), torch.ones(4)), ValueError, "repeated"),
    ("ij->k", lambda: (_s(),), ValueError, "does not appear"),
    ("ij->iK", lambda: (_s(),), ValueError, "does not appear"),
    # index count against the operand's dimensions
    ("ijk->i", lambda: (_s(),), ValueError, "dimensions"),
    ("i->i", lambda: (_s(),), ValueError, "dimensions"),
    ("...ijk->i", lambda: (_s(),), ValueError, "dimensions"),
    # types
    (7, lambda: (_s(),), TypeError, "string"),
    ("ij,jk->ik", lambda: (_s(), [[1.0]] * 4), TypeError, "list"),
    ("ij,jk->ik", lambda: (_s(), "x"), TypeError, "str"),
    # unsupported value dtypes
    # (bfloat16 and float16 are kernel dtypes: tests/ops/test_half.py)
    ("ij->ji", lambda: (_s(dtype=torch.bool),), TypeError, "bool"),  # ("ij->i" sums: int64, as torch)
    ("ij,j->i", lambda: (_s(dtype=torch.bool), torch.ones(4, dtype=torch.bool)), TypeError, "bool"),
    ("ij,ij->ij", lambda: (_s(dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)), TypeError, "bool"),
    ("ij->ji", lambda: (_s(dtype=torch.int8),), TypeError, "int8"),
    ("ij,j->i", lambda: (_s(), torch.ones(4, dtype=torch.complex64)), TypeError, "complex"),
]


@pytest.mark.parametrize("eq,make,exc,words", BAD, ids=[f"{b[0]!r}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_clearly(eq, make, exc, words):
    ops = make()
    with pytest.raises(exc) as info:
        scorch.einsum(eq, *ops)
    assert words.lower() in str(info.value).lower(), str(info.value)


def test_bad_requested_format():
    s = _s()
    with pytest.raises(ValueError, match="unknown format"):
        scorch.einsum("ij,jk->ik", s, torch.ones(4, 2), format="cssr")
    with pytest.raises(ValueError, match="2-d|for 1-d|tensor is"):
        scorch.einsum("ij,j->i", s, torch.ones(4), format="csr")  # a 2-d format for a 1-d result


@pytest.mark.parametrize("fmt", ["csr", "coo", "dia"])
def test_broadcasting_the_sparse_operand_is_refused(fmt):
    """A sparse operand of extent 1 where the index is larger is a documented limit."""
    s = _s((1, 4), fmt)
    with pytest.raises(NotImplementedError, match="einsum") as info:
        scorch.einsum("ij,ij->ij", s, torch.ones(3, 4))
    assert "broadcast" in str(info.value)


TWO_SPARSE = [("ij,jk->ik", (3, 4), (4, 2)), ("ij,ij->ij", (3, 4), (3, 4)), ("ij,j->i", (3, 4), (4,)),
              ("ij,jk,kl->il", (3, 4), (4, 2))]


@pytest.mark.parametrize("eq,sa,sb", TWO_SPARSE, ids=[t[0] for t in TWO_SPARSE])
@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("coo", "csc"), ("dia", "ell")])
def test_two_sparse_operands(eq, sa, sb, fa, fb):
    """Two or more sparse operands: NotImplementedError naming the op until co-iteration lands (being built
    concurrently); once it does, the right answer. Never a crash, a wrong result or another exception."""
    gen = torch.Generator().manual_seed(81)
    a, b = values(sa, F64, gen, 0.5), values(sb, F64, gen, 0.5)
    ops = [scorch.asformat(a, fa), scorch.asformat(b, fb if len(sb) == 2 else "coo")]
    dense = [a, b]
    if eq.count(",") == 2:
        c = values((2, 3), F64, gen)
        ops.append(c)
        dense.append(c)
    try:
        result = scorch.einsum(eq, *ops)
    except NotImplementedError as e:
        assert "einsum" in str(e) and "sparse" in str(e), str(e)
        return
    assert_matches_dense(result, torch.einsum(eq, *dense))
    if isinstance(result, SparseTensor):
        result.check_invariants()
