"""Activations, dropout, comparisons, where / masked_fill, norms and max / min on SparseTensors, against torch on
``x.to_dense()``: zero-preserving maps keep the pattern (padding and positions outside the shape stay 0), maps
with f(0) != 0 give torch's dense result and are counted (``scorch.stats()``), gradients by gradcheck.

Values are multiples of 1/4, so comparisons and ties (max / min indices) are exact.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck

import scorch
import scorch.ops.activation  # noqa: F401  (registers the ops)
from scorch import SparseTensor
from scorch.formats import storage
from scorch.sparse_tensor import IMPLEMENTATIONS

from conftest import assert_matches_dense, quarters as _quarters
from fallback_check import falls_back

FORMATS = ["csr", "csc", "coo", "bsr(2, 2)", "ell", "dia"]
# (shape, density): a general case, 1x1, 0xN, Nx0 and an all-zero matrix
CASES = [((5, 7), 0.5), ((1, 1), 1.0), ((0, 4), 0.5), ((3, 0), 0.5), ((4, 5), 0.0)]
DTYPES = [torch.float32, torch.float64]
INF = math.inf
NAN = math.nan


def quarters(shape, seed, density=0.5, dtype=torch.float32):
    return _quarters(shape, seed, density, dtype)


def sparse(shape, fmt, seed=0, density=0.5, dtype=torch.float32):
    a = quarters(shape, seed, density, dtype)
    s = scorch.asformat(a, fmt)
    assert torch.equal(s.to_dense(), a)
    return s, a


def examples(fmt, edges=True):
    """``(s, a, main)``: the general case in float32 and float64 (``main``), then (``edges``) the 1x1, empty and
    all-zero cases in float32."""
    for dtype in DTYPES:
        yield (*sparse(CASES[0][0], fmt, seed=0, density=CASES[0][1], dtype=dtype), True)
    if edges:
        for k, (shape, density) in enumerate(CASES[1:], 1):
            yield (*sparse(shape, fmt, seed=k, density=density), False)


def uncoalesced(dtype=torch.float32):
    """COO with duplicates: (0, 1) holds 1 - 3 = -2 and (2, 3) holds 0.5 + 0.25; (1, 0) holds 2."""
    idx = torch.tensor([[0, 2, 0, 1, 2], [1, 3, 1, 0, 3]])
    vals = torch.tensor([1.0, 0.5, -3.0, 2.0, 0.25], dtype=dtype)
    s = scorch.sparse_coo_tensor(idx, vals, (3, 4))
    assert s.format.keeps_duplicates
    return s, torch.zeros(3, 4, dtype=dtype).index_put_(tuple(idx), vals, accumulate=True)


def padding_stays_zero(r: SparseTensor, s: SparseTensor):
    """The positions outside the shape and (in a padded format) the padding slots of ``s`` hold 0 in ``r``."""
    assert not r.values()[not_entries(s)].any()


def not_entries(s: SparseTensor) -> torch.Tensor:
    """Which of ``s``'s stored positions are no entry: outside the shape, or padding (a 0 in a padded format);
    remembered on ``s``, as the checks above ask for it once per op."""
    cached = getattr(s, "_test_not_entries", None)
    if cached is None:
        leaf, _, inside = storage.coordinates(s.format, s.shape, s.levels)
        cached = torch.zeros(s.nnz, dtype=torch.bool)
        cached[leaf[~inside]] = True
        if any(lvl.padded for lvl in s.format.level_types):
            cached |= s.values() == 0
        s._test_not_entries = cached
    return cached


def same(fn, s, a):
    """``fn`` on the sparse and on the dense operand: equal results, or the same exception type from both."""
    try:
        expected = fn(a)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            fn(s)
        return None
    got = fn(s)
    if isinstance(expected, tuple):
        assert type(got) is type(expected)
        for g, e in zip(got, expected):
            assert_matches_dense(g, e)
    else:
        assert_matches_dense(got, expected)
    return got


def shares_arrays(r: SparseTensor, s: SparseTensor) -> bool:
    """Whether ``r`` holds ``s``'s index arrays themselves (the same pattern, not a copy)."""
    return len(r.levels) == len(s.levels) and all(x is y for x, y in zip(r.levels, s.levels))


def dense_result(r):
    return type(r) is torch.Tensor and r.layout == torch.strided


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tensors here are tiny: one intra-op thread spares the thread pool's wake-up on every small op (it is the
    larger part of the time otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_stats():
    scorch.reset_stats()
    yield
    scorch.reset_stats()


# --- zero-preserving maps ---------------------------------------------------------------------------------------------

ZERO_PRESERVING = [
    ("leaky_relu", lambda t: F.leaky_relu(t)), ("leaky_relu(0.2)", lambda t: F.leaky_relu(t, 0.2)),
    ("gelu", F.gelu), ("gelu(tanh)", lambda t: F.gelu(t, approximate="tanh")), ("silu", F.silu),
    ("mish", F.mish), ("hardswish", F.hardswish), ("hardtanh", F.hardtanh),
    ("hardtanh(-0.5, 1.5)", lambda t: F.hardtanh(t, -0.5, 1.5)), ("relu6", F.relu6), ("elu", F.elu),
    ("elu(0.5)", lambda t: F.elu(t, alpha=0.5)), ("selu", F.selu), ("celu", lambda t: F.celu(t, 0.7)),
    ("rrelu eval", lambda t: F.rrelu(t, training=False)), ("softshrink", lambda t: F.softshrink(t, 0.3)),
    ("hardshrink", lambda t: F.hardshrink(t, 0.3)), ("Tensor.hardshrink", lambda t: t.hardshrink(0.6)),
    ("tanhshrink", F.tanhshrink), ("softsign", F.softsign), ("threshold", lambda t: F.threshold(t, 0.3, 0.0)),
    ("erf", torch.erf), ("Tensor.erf", lambda t: t.erf()), ("special.erf", torch.special.erf),
    ("erfinv", lambda t: torch.erfinv(t / 4)), ("expm1", torch.expm1), ("Tensor.expm1", lambda t: t.expm1()),
    ("log1p", lambda t: torch.log1p(t / 4)), ("sinh", torch.sinh), ("asinh", torch.asinh),
    ("arcsinh", torch.arcsinh), ("atanh", lambda t: torch.atanh(t / 4)), ("tan", lambda t: torch.tan(t / 2)),
    ("asin", lambda t: torch.asin(t / 4)), ("atan", torch.atan), ("trunc", lambda t: torch.trunc(t * 1.5)),
    ("floor", lambda t: torch.floor(t * 1.5)), ("ceil", lambda t: t.ceil()), ("round", lambda t: torch.round(t * 2)),
    ("round(decimals)", lambda t: torch.round(t / 3, decimals=1)), ("frac", lambda t: torch.frac(t * 1.5)),
    ("fix", lambda t: torch.fix(t * 1.5)), ("deg2rad", torch.deg2rad), ("rad2deg", torch.rad2deg),
    ("nan_to_num", torch.nan_to_num), ("clamp", lambda t: torch.clamp(t, -1, 1)),
    ("clip", lambda t: t.clip(min=-0.5, max=0.75)), ("clamp_max", lambda t: torch.clamp_max(t, 0.5)),
]


def test_zero_preserving_maps_send_zero_to_zero_in_torch():
    for name, fn in ZERO_PRESERVING:
        for dtype in DTYPES:
            assert fn(torch.zeros(3, dtype=dtype)).eq(0).all(), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_preserving_maps_keep_the_pattern(fmt):
    for s, a, main in examples(fmt):
        for name, fn in ZERO_PRESERVING if main else ZERO_PRESERVING[::6]:
            r = fn(s)
            assert isinstance(r, SparseTensor) and r.format == s.format, name
            assert shares_arrays(r, s), name  # the index arrays are shared
            assert_matches_dense(r, fn(a))
            padding_stays_zero(r, s)
    assert scorch.stats()["densified"] == {}


def test_existing_registrations_are_kept():
    for f in (F.relu, torch.relu, torch.tanh, torch.abs, torch.sqrt, torch.Tensor.relu_, torch.Tensor.clamp_):
        assert IMPLEMENTATIONS[f].__module__ != "scorch.ops.activation", f


def test_modules_reach_the_functional_forms():
    s, a = sparse((5, 7), "csr", seed=3)
    sparse_results = [nn.LeakyReLU(0.1), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Hardtanh(), nn.ReLU6(),
                      nn.ELU(), nn.SELU(), nn.CELU(), nn.Mish(), nn.Hardswish(), nn.Softshrink(), nn.Hardshrink(),
                      nn.Tanhshrink(), nn.Softsign(), nn.Threshold(0.1, 0.0), nn.RReLU().eval()]
    for m in sparse_results:
        r = m(s)
        assert isinstance(r, SparseTensor), m
        assert_matches_dense(r, m(a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for m in (nn.Sigmoid(), nn.Softplus(), nn.Softplus(beta=2.0, threshold=1.0), nn.LogSigmoid(),
                  nn.Hardsigmoid(), nn.Threshold(0.1, 2.0)):
            r = m(s)
            assert dense_result(r), m
            assert_matches_dense(r, m(a))


def test_maps_on_uncoalesced_coo_sum_duplicates_first():
    s, a = uncoalesced()
    for name, fn in ZERO_PRESERVING:
        r = fn(s)
        assert isinstance(r, SparseTensor), name
        r.check_invariants()
        assert_matches_dense(r, fn(a))
    r = torch.deg2rad(s)  # linear: the duplicates may stay
    assert shares_arrays(r, s) and r.format.keeps_duplicates
    assert_matches_dense(r, torch.deg2rad(a))


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc", "bsr(2, 2)", "dia"])
def test_inplace_maps_update_the_values(fmt):
    cases = [(lambda t: F.leaky_relu(t, 0.1, inplace=True), lambda t: F.leaky_relu(t, 0.1)),
             (lambda t: F.silu(t, inplace=True), F.silu),
             (lambda t: F.hardtanh(t, -1.0, 0.5, True), lambda t: F.hardtanh(t, -1.0, 0.5)),
             (lambda t: F.relu6(t, inplace=True), F.relu6),
             (lambda t: nn.ELU(inplace=True)(t), F.elu),
             (lambda t: nn.LeakyReLU(0.3, inplace=True)(t), lambda t: F.leaky_relu(t, 0.3)),
             (lambda t: t.erf_(), torch.erf), (lambda t: torch.floor_(t), torch.floor),
             (lambda t: t.expm1_(), torch.expm1), (lambda t: F.threshold(t, 0.3, 0.0, True),
                                                   lambda t: F.threshold(t, 0.3, 0.0))]
    for inplace, ref in cases:
        s, a = sparse((5, 7), fmt, seed=4)
        levels, values = s.levels, s.values()
        r = inplace(s)
        assert r is s and s.levels is levels and s.values() is values
        assert_matches_dense(s, ref(a))
        padding_stays_zero(s, scorch.asformat(a, fmt))


def test_inplace_maps_refuse_what_they_cannot_keep():
    e, a = sparse((5, 7), "ell", seed=5)
    for call in (lambda: F.leaky_relu(e, 0.1, inplace=True), lambda: e.erf_(), lambda: F.silu(e, inplace=True)):
        with pytest.raises(NotImplementedError, match="padded"):
            call()
    assert torch.equal(e.to_dense(), a)
    u, ua = uncoalesced()
    F.gelu(u).erf_()  # the result of gelu is coalesced: fine
    with pytest.raises(NotImplementedError, match="duplicates"):
        u.erf_()
    s, a = sparse((5, 7), "csr", seed=5)
    for call in (lambda: s.sigmoid_(), lambda: F.hardtanh(s, 0.5, 1.0, True), lambda: s.exp_()):
        with pytest.raises(NotImplementedError, match="dense"):
            call()
    assert torch.equal(s.to_dense(), a)  # nothing was changed


# --- maps with f(0) != 0 --------------------------------------------------------------------------------------------

DENSIFYING = [
    ("torch.sigmoid", torch.sigmoid), ("torch.sigmoid", lambda t: t.sigmoid()), ("torch.sigmoid", F.sigmoid),
    ("torch.sigmoid", torch.special.expit), ("torch.exp", torch.exp), ("torch.exp", lambda t: t.exp()),
    ("torch.exp2", torch.exp2), ("torch.cos", torch.cos), ("torch.cosh", torch.cosh),
    ("torch.log", lambda t: torch.log(t.abs())), ("torch.reciprocal", torch.reciprocal),
    ("torch.erfc", torch.erfc), ("torch.nn.functional.softplus", F.softplus),
    ("torch.nn.functional.softplus", lambda t: F.softplus(t, beta=2.0, threshold=1.0)),
    ("torch.nn.functional.logsigmoid", F.logsigmoid), ("torch.nn.functional.hardsigmoid", F.hardsigmoid),
    ("torch.nn.functional.hardtanh", lambda t: F.hardtanh(t, 0.5, 1.0)),
    ("torch.nn.functional.threshold", lambda t: F.threshold(t, 0.3, -1.0)),
    ("torch.clamp", lambda t: torch.clamp(t, min=0.5)),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_maps_that_move_zero_give_torchs_dense_result(fmt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        calls = {}
        for s, a, main in examples(fmt):
            for name, fn in DENSIFYING if main else DENSIFYING[::4]:
                r = fn(s)
                assert dense_result(r), name
                assert_matches_dense(r, fn(a))
                calls[name] = calls.get(name, 0) + 1
    assert scorch.stats()["densified"] == calls
    u, ua = uncoalesced()
    assert_matches_dense(torch.sigmoid(u), torch.sigmoid(ua))  # duplicates summed, as to_dense() sums them


def test_densification_warns_once_per_op_and_counts_every_call():
    s, a = sparse((5, 7), "csr", seed=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.sigmoid(s)
            s.sigmoid()
        torch.exp(s)
        F.softplus(s)
        s > -1
    found = [w for w in caught if issubclass(w.category, scorch.DensifyWarning)]
    assert len(found) == 4, [str(w.message) for w in found]
    assert "torch.sigmoid" in str(found[0].message) and "csr (5, 7)" in str(found[0].message)
    assert found[0].filename == __file__  # points at the caller, not into scorch
    st = scorch.stats()
    assert st == {"densified": {"torch.sigmoid": 6, "torch.exp": 1, "torch.nn.functional.softplus": 1,
                                "torch.gt": 1}, "fallback": {}}
    st["densified"]["torch.exp"] = 100  # a copy
    assert scorch.stats()["densified"]["torch.exp"] == 1
    scorch.reset_stats()
    assert scorch.stats() == {"densified": {}, "fallback": {}}
    with pytest.warns(scorch.DensifyWarning, match="torch.sigmoid"):
        torch.sigmoid(s)  # warned again after a reset
    with warnings.catch_warnings():
        warnings.simplefilter("error", scorch.DensifyWarning)
        torch.sigmoid(s)  # but only once
        torch.erf(s)  # zero-preserving: no warning
    assert scorch.stats() == {"densified": {"torch.sigmoid": 2}, "fallback": {}}
    with scorch.strict(), pytest.raises(scorch.DensifyError, match="torch.sigmoid.*strict"):
        torch.sigmoid(s)  # strict mode: densifying raises
    assert issubclass(scorch.DensifyWarning, UserWarning)


# --- dropout -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_dropout(fmt):
    for s, a, main in examples(fmt):
        assert F.dropout(s, 0.5, training=False) is s
        assert nn.Dropout(0.5).eval()(s) is s
        assert torch.dropout(s, 0.5, False) is s
        for p in (0.0, 0.3, 0.5, 1.0) if main else (0.5,):
            for call in (lambda t: F.dropout(t, p), lambda t: torch.dropout(t, p, True),
                         lambda t: nn.Dropout(p)(t)):
                torch.manual_seed(7)
                r = call(s)
                torch.manual_seed(7)
                expected = torch.dropout(s.values(), p, True)
                assert isinstance(r, SparseTensor) and shares_arrays(r, s)
                assert torch.equal(r.values(), expected)
                padding_stays_zero(r, s)
                d = r.to_dense()
                kept = d != 0
                scale = 1.0 / (1.0 - p) if p < 1 else 0.0
                assert torch.equal(d[kept], (a * scale)[kept])
                if p == 0:
                    assert torch.equal(d, a)
                if p == 1:
                    assert not kept.any()
    s, a = sparse((5, 7), fmt, seed=8)
    values = s.values()
    assert F.dropout(s, 0.5, True, inplace=True) is s and s.values() is values
    assert ((s.to_dense() == 0) | (s.to_dense() == 2 * a)).all()
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(s, 1.5)


def test_dropout_drops_whole_entries_of_uncoalesced_coo():
    s, a = uncoalesced()
    torch.manual_seed(0)
    for _ in range(5):
        d = F.dropout(s, 0.5).to_dense()
        assert ((d == 0) | (d == 2 * a)).all()
    with pytest.raises(NotImplementedError, match="duplicates"):
        F.dropout(s, 0.5, inplace=True)


# --- comparisons ---------------------------------------------------------------------------------------------------

COMPARISONS = [
    (torch.gt, [lambda t, c: t > c, lambda t, c: torch.gt(t, c), lambda t, c: t.gt(c), lambda t, c: torch.greater(t, c),
                lambda t, c: c < t]),
    (torch.lt, [lambda t, c: t < c, lambda t, c: torch.lt(t, c), lambda t, c: t.less(c), lambda t, c: c > t]),
    (torch.ge, [lambda t, c: t >= c, lambda t, c: torch.ge(t, c), lambda t, c: torch.greater_equal(t, c),
                lambda t, c: c <= t]),
    (torch.le, [lambda t, c: t <= c, lambda t, c: torch.le(t, c), lambda t, c: t.less_equal(c)]),
    (torch.eq, [lambda t, c: t == c, lambda t, c: torch.eq(t, c), lambda t, c: t.eq(c), lambda t, c: c == t]),
    (torch.ne, [lambda t, c: t != c, lambda t, c: torch.ne(t, c), lambda t, c: torch.not_equal(t, c),
                lambda t, c: t.ne(c)]),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_comparisons_with_a_scalar(fmt):
    ints = (quarters((5, 7), 9) * 4).long()
    int_case = (scorch.asformat(ints, fmt), ints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for s, a, main in list(examples(fmt)) + [(*int_case, False)]:
            for op, spellings in COMPARISONS:
                for c in (-0.5, 0, 0.25, 1, torch.tensor(0.5)):
                    expected = op(a, c)
                    sparse_result = not bool(op(torch.zeros(()), c))
                    for spell in spellings if main and s.dtype == torch.float32 else spellings[:1]:
                        r = spell(s, c)
                        if sparse_result:
                            assert isinstance(r, SparseTensor) and r.dtype == torch.bool, (op, c)
                            assert r.format == s.format
                            padding_stays_zero(r, s)
                        else:
                            assert dense_result(r), (op, c)
                        assert_matches_dense(r, expected)


def test_comparisons_of_uncoalesced_coo_sum_duplicates_first():
    s, a = uncoalesced()
    for op, _ in COMPARISONS:
        for c in (-1.0, 0.5):
            if not bool(op(torch.zeros(()), c)):
                r = op(s, c)
                r.check_invariants()
                assert_matches_dense(r, op(a, c))


def test_comparisons_with_dense_tensors_fall_back():
    s, a = sparse((5, 7), "csr", seed=10)
    d = quarters((5, 7), 11)
    falls_back(lambda: s > d, lambda: a > d, "Tensor.gt")
    falls_back(lambda: d < s, lambda: d < a, "Tensor.gt")  # a subclass operand: Python asks s.__gt__ first
    assert (s == None) is False  # noqa: E711  (as for dense tensors)
    assert (s != "x") is True
    out = torch.empty(5, 7, dtype=torch.bool)
    falls_back(lambda: torch.gt(s, 0, out=out), lambda: torch.gt(a, 0), "torch.gt")
    assert torch.equal(out, a > 0)


# --- where and masked_fill ------------------------------------------------------------------------------------------

def masks(fmt, shape, seed):
    """A sparse bool mask with stored True and stored False entries, and its dense form."""
    s, a = sparse(shape, fmt, seed=seed, density=0.6)
    m = s > 0  # stored where s is, True where s > 0
    return m, a > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_where_with_a_sparse_mask(fmt):
    for k, (shape, density) in enumerate(CASES):
        m, md = masks(fmt, shape, seed=20 + k)
        x = quarters(shape, 30 + k, density=1.0)
        s2, a2 = sparse(shape, "csr" if shape[0] else "coo", seed=40 + k)
        row = quarters(shape[1:], 50 + k, density=1.0)
        cases = [(lambda c, t: torch.where(c, t, 0.0), x), (lambda c, t: torch.where(c, t, 0), x),
                 (lambda c, t: torch.where(c, t, torch.tensor(0.0)), x), (lambda c, t: t.where(c, 0.0), x),
                 (lambda c, t: torch.where(c, t, 0.0), row), (lambda c, t: torch.where(c, t, 0.0), x.double()),
                 (lambda c, t: torch.where(c, t, 0), (x * 4).long()), (lambda c, t: torch.where(c, t, 0.0),
                                                                       (x * 4).long())]
        for fn, operand in cases:
            r = fn(m, operand)
            assert isinstance(r, SparseTensor) and r.format == m.format
            assert_matches_dense(r, fn(md, operand))
            padding_stays_zero(r, m)
        r = torch.where(m, s2, 0.0)  # a sparse x of another pattern: read at the mask's entries
        assert isinstance(r, SparseTensor) and r.format == m.format
        assert_matches_dense(r, torch.where(md, a2, 0.0))
        for x_scalar in (1.5, 2):
            assert_matches_dense(torch.where(m, x_scalar, 0), torch.where(md, x_scalar, 0))
        got = torch.where(m)
        assert len(got) == 2 and all(torch.equal(g, e) for g, e in zip(got, torch.where(md)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_where_with_a_dense_mask_keeps_the_sparse_pattern(fmt):
    for k, (shape, density) in enumerate(CASES):
        s, a = sparse(shape, fmt, seed=60 + k, density=density)
        md = quarters(shape, 70 + k, density=0.5) != 0
        r = torch.where(md, s, 0.0)
        assert isinstance(r, SparseTensor) and shares_arrays(r, s)
        assert_matches_dense(r, torch.where(md, a, 0.0))
        padding_stays_zero(r, s)
        r = torch.where(md[:1], s, 0)  # a broadcast mask
        assert_matches_dense(r, torch.where(md[:1], a, 0))
    u, ua = uncoalesced()
    md = torch.tensor([[True, True, False, False]] * 3)
    assert_matches_dense(torch.where(md, u, 0.0), torch.where(md, ua, 0.0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_masked_fill(fmt):
    for k, (shape, density) in enumerate(CASES):
        m, md = masks(fmt, shape, seed=80 + k)
        x = quarters(shape, 90 + k, density=1.0)
        for value in (7.5, -1, torch.tensor(2.25)):
            r = x.masked_fill(m, value)
            assert dense_result(r)
            assert_matches_dense(r, x.masked_fill(md, value))
            assert_matches_dense(torch.masked_fill(x, m, value), x.masked_fill(md, value))
            y = x.clone()
            assert y.masked_fill_(m, value) is y
            assert_matches_dense(y, x.masked_fill(md, value))
        xi = (x * 4).long()
        assert_matches_dense(xi.masked_fill(m, 3), xi.masked_fill(md, 3))
        s, a = sparse(shape, fmt, seed=100 + k, density=density)
        for mask, dmask in ((m, md), (md, md), (md[:1], md[:1])):
            r = s.masked_fill(mask, 0)
            assert isinstance(r, SparseTensor) and shares_arrays(r, s)
            assert_matches_dense(r, a.masked_fill(dmask, 0))
            assert_matches_dense(torch.masked_fill(s, mask, 0.0), a.masked_fill(dmask, 0))
        t = s.clone()
        assert t.masked_fill_(m, 0) is t
        assert_matches_dense(t, a.masked_fill(md, 0))
    u, ua = uncoalesced()
    mu = scorch.asformat(torch.tensor([[False, True, False, False], [False] * 4, [False, False, False, True]]),
                         "csr")
    assert_matches_dense(u.masked_fill(mu, 0), ua.masked_fill(mu.to_dense(), 0))


def test_where_and_masked_fill_errors():
    m, md = masks("csr", (5, 7), seed=110)
    s, a = sparse((5, 7), "coo", seed=111)
    x = quarters((5, 7), 112)
    sd = s.to_dense()
    for call, dense in ((lambda: torch.where(m, x, 1.0), lambda: torch.where(md, x, 1.0)),
                        (lambda: torch.where(m, x, x), lambda: torch.where(md, x, x)),
                        (lambda: torch.where(m, 0.0, x), lambda: torch.where(md, 0.0, x)),
                        (lambda: torch.where(md, x, s), lambda: torch.where(md, x, sd)),
                        (lambda: torch.where(m, sd[:1].expand(2, 5, 7), 0.0),
                         lambda: torch.where(md, sd[:1].expand(2, 5, 7), 0.0))):
        falls_back(call, dense, "torch.where")
    falls_back(lambda: s.masked_fill(md, 1.0), lambda: sd.masked_fill(md, 1.0), "Tensor.masked_fill")
    assert_matches_dense(s.masked_fill(m, 1.0), sd.masked_fill(md, 1.0))  # a sparse mask: the union, sparse
    zero = torch.tensor(0.0, requires_grad=True)
    falls_back(lambda: s.masked_fill(md, zero), lambda: sd.masked_fill(md, zero), "Tensor.masked_fill")
    with pytest.raises(NotImplementedError, match="masked_fill_ would write its result into a sparse tensor"):
        s.masked_fill_(m, 1.0)  # a sparse tensor cannot become dense in place
    with pytest.raises(RuntimeError, match="boolean"):
        torch.where(s, x, 0.0)
    with pytest.raises(RuntimeError, match="boolean"):
        x.masked_fill(s, 1.0)
    falls_back(lambda: x[:1].masked_fill(m, 1.0), lambda: x[:1].masked_fill(md, 1.0), "Tensor.masked_fill")


# --- norms ---------------------------------------------------------------------------------------------------------

ORDS = [1, 2, INF, -INF, 0, 3, 0.5, -1]
DIMS = [None, 0, 1, -1, (0, 1), ()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_vector_norms(fmt):
    for s, a, main in examples(fmt):
        for ord in ORDS if main else ORDS[:5]:
            for dim in DIMS if main else DIMS[:3]:
                same(lambda t: torch.linalg.vector_norm(t, ord, dim), s, a)
            if main:
                same(lambda t: torch.linalg.vector_norm(t, ord, (0, 1), keepdim=True), s, a)
                same(lambda t: torch.norm(t, ord, 0, True), s, a)
                same(lambda t: torch.norm(t, ord), s, a)
        if not main:
            continue
        for p in ("fro", 2, 1, INF):
            same(lambda t: t.norm(p), s, a)
            same(lambda t: t.norm(p, dim=1, keepdim=True), s, a)
        same(lambda t: torch.norm(t), s, a)
        same(lambda t: t.norm(), s, a)
        same(lambda t: torch.linalg.vector_norm(t, dtype=torch.float64), s, a)
        same(lambda t: torch.norm(t, 2, 0, dtype=torch.float64), s, a)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matrix_norms(fmt):
    for s, a, main in examples(fmt):
        for ord in (None, "fro", 1, -1, INF, -INF):
            same(lambda t: torch.linalg.norm(t, ord), s, a)
            if not main:
                continue
            same(lambda t: torch.linalg.norm(t, ord, keepdim=True), s, a)
            same(lambda t: torch.linalg.norm(t, ord, (1, 0)), s, a)
            if ord is not None:
                same(lambda t: torch.linalg.matrix_norm(t, ord), s, a)
        for ord in (None, 2, INF, 1) if main else ():
            same(lambda t: torch.linalg.norm(t, ord, dim=1), s, a)
        same(lambda t: torch.norm(t, "fro", (0, 1)), s, a)


def test_norms_of_uncoalesced_and_3d():
    u, ua = uncoalesced()
    for ord in ORDS:
        for dim in (None, 0, 1):
            same(lambda t: torch.linalg.vector_norm(t, ord, dim), u, ua)
    a = quarters((3, 4, 5), 120)
    s = scorch.asformat(a, "coo")
    for ord in (1, 2, INF, -INF):
        for dim in (None, 0, 2, (0, 2), (1, 2), (0, 1, 2)):
            same(lambda t: torch.linalg.vector_norm(t, ord, dim), s, a)
    same(lambda t: torch.linalg.matrix_norm(t, 1, (0, 2)), s, a)
    same(lambda t: torch.linalg.norm(t, 1), s, a)  # torch: 1D or 2D only


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_norms_of_nan_and_inf_entries(fmt, bad):
    """A nan or infinite stored value decides its group's norm as in the dense tensor: nan for every ord but 0
    (which counts it), also where the group has an implicit zero (the negative ords' 0)."""
    a = torch.tensor([[0., -1.5, 0., 1.], [2., 0., 0., bad], [0., 0., 0., 0.], [bad, 3., 1., 2.]])
    s = scorch.asformat(a, fmt)
    for ord in ORDS:
        for dim in (None, 0, 1):
            got, want = torch.linalg.vector_norm(s, ord, dim), torch.linalg.vector_norm(a, ord, dim)
            torch.testing.assert_close(got, want, equal_nan=True, msg=f"ord={ord} dim={dim}")
    for ord in ("fro", 1, -1, INF, -INF):
        torch.testing.assert_close(torch.linalg.matrix_norm(s, ord), torch.linalg.matrix_norm(a, ord),
                                   equal_nan=True)
    torch.testing.assert_close(torch.norm(s), torch.norm(a), equal_nan=True)


def test_norm_errors():
    s, a = sparse((5, 7), "csr", seed=121)
    falls_back(lambda: torch.norm(s, "nuc"), lambda: torch.norm(a, "nuc"), "torch.functional.norm")
    falls_back(lambda: torch.linalg.matrix_norm(s, 2), lambda: torch.linalg.matrix_norm(a, 2),
               "torch.linalg_matrix_norm")
    falls_back(lambda: torch.linalg.norm(s, -2), lambda: torch.linalg.norm(a, -2), "torch.linalg_norm")
    out = torch.empty(())
    falls_back(lambda: torch.linalg.vector_norm(s, out=out), lambda: torch.linalg.vector_norm(a),
               "torch.linalg_vector_norm")
    with pytest.raises(RuntimeError):
        torch.linalg.vector_norm(scorch.asformat((a * 4).long(), "csr"))  # torch: floating point input only
    with pytest.raises(IndexError):
        torch.linalg.vector_norm(s, 2, dim=2)


# --- max, min, argmax, argmin -----------------------------------------------------------------------------------------

EXTREMA = [
    lambda t: torch.max(t, 0), lambda t: torch.max(t, 1), lambda t: torch.min(t, 0), lambda t: torch.min(t, -1),
    lambda t: t.max(1, keepdim=True), lambda t: t.min(dim=0, keepdim=True), lambda t: torch.max(t, dim=1),
    lambda t: torch.max(t), lambda t: torch.min(t), lambda t: t.max(), lambda t: t.min(),
    lambda t: torch.argmax(t), lambda t: torch.argmin(t), lambda t: torch.argmax(t, 0), lambda t: t.argmin(1),
    lambda t: torch.argmax(t, 1, keepdim=True), lambda t: torch.argmin(t, keepdim=True),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_max_min_match_torch_including_ties(fmt):
    for s, a, main in examples(fmt):
        for fn in EXTREMA:
            same(fn, s, a)
    # every kind of tie: implicit and stored zeros, all-negative and all-positive rows, full and empty rows
    a = torch.tensor([[0.0, -1.0, 0.0, -1.0], [0.5, 0.0, 0.5, -2.0], [-1.0, -0.5, -0.5, -1.0], [0.0] * 4,
                      [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, -0.25, 0.0]])
    s = scorch.asformat(a, fmt)
    for fn in EXTREMA:
        same(fn, s, a)
        same(fn, s.T if fmt != "coo" else scorch.asformat(a.T, fmt), a.T)


def test_max_min_with_stored_zeros_nan_and_other_dtypes():
    # csr with explicit stored zeros at (0, 1) and (1, 0)
    s = scorch.sparse_csr_tensor(torch.tensor([0, 2, 4]), torch.tensor([1, 3, 0, 2]),
                                 torch.tensor([0.0, -1.0, 0.0, 2.0]), (2, 4))
    a = s.to_dense()
    for fn in EXTREMA:
        same(fn, s, a)
    a = torch.tensor([[1.0, math.nan, 0.0, math.nan], [-1.0, 0.0, 0.0, 0.0]])
    s = scorch.asformat(a, "csr")
    for fn in EXTREMA[:7]:
        r, e = fn(s), fn(a)
        torch.testing.assert_close(r.values, e.values, equal_nan=True)
        assert torch.equal(r.indices, e.indices)
    assert torch.isnan(torch.max(s))
    for a in ((quarters((4, 5), 130) * 4).long(), quarters((4, 5), 131) > 0):
        s = scorch.asformat(a, "coo")
        for fn in EXTREMA:
            same(fn, s, a)
    u, ua = uncoalesced()
    for fn in EXTREMA:
        same(fn, u, ua)
    a = quarters((3, 4, 5), 132)
    s = scorch.asformat(a, "coo")
    for dim in range(3):
        same(lambda t: torch.max(t, dim), s, a)
        same(lambda t: torch.argmin(t, dim, keepdim=True), s, a)
    falls_back(lambda: torch.max(s, a), lambda: torch.max(a, a), "torch.max")  # elementwise: no sparse rule
    with pytest.raises(IndexError):
        torch.max(s, 3)


# --- gradients -------------------------------------------------------------------------------------------------------

def grad_operand(fmt, seed=140, shape=(4, 5)):
    """A float64 SparseTensor with random (tie-free, nonzero, away from kinks) values, and a leaf for them."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.rand(shape, generator=g) < 0.5
    s = scorch.asformat(pattern.double(), fmt)
    v = (torch.rand(s.nnz, generator=g, dtype=torch.float64) * 1.6 + 0.2) * (
        torch.randint(0, 2, (s.nnz,), generator=g) * 2 - 1)
    return s, v.requires_grad_()


def dense_of(r):
    return r.to_dense() if isinstance(r, SparseTensor) else r


GRAD_FNS = [
    lambda t: F.leaky_relu(t, 0.2), F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu, F.elu, F.mish,
    lambda t: F.hardtanh(t, -1.5, 1.5), lambda t: F.softshrink(t, 0.1), torch.erf, torch.expm1, torch.sinh,
    torch.asinh, lambda t: torch.atanh(t / 4), F.softsign, torch.sigmoid, F.softplus, torch.cos,
    lambda t: torch.linalg.vector_norm(t), lambda t: torch.linalg.vector_norm(t, 1, 0),
    lambda t: torch.linalg.vector_norm(t, INF, 1), lambda t: torch.linalg.vector_norm(t, 3, 1, keepdim=True),
    lambda t: torch.norm(t, dim=0), lambda t: torch.linalg.norm(t, 1), lambda t: torch.linalg.norm(t, -INF),
    lambda t: torch.max(t, 1).values, lambda t: torch.min(t, 0).values, torch.max, torch.min,
    lambda t: t.masked_fill(quarters(tuple(t.shape), 141) > 0, 0),
    lambda t: torch.where(quarters(tuple(t.shape), 142) > 0, t, 0.0),
]


@pytest.mark.parametrize("fmt", ["csr", "coo"])
def test_gradcheck(fmt):
    s, v = grad_operand(fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scorch.DensifyWarning)
        for fn in GRAD_FNS if fmt == "csr" else GRAD_FNS[::3]:
            assert gradcheck(lambda v: dense_of(fn(s.with_values(v))), (v,))
    m = scorch.asformat(quarters((4, 5), 143, density=0.7) > 0, fmt)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    value = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: torch.where(m, x, 0.0).to_dense(), (x,))
    assert gradcheck(lambda x, value: x.masked_fill(m, value), (x, value))
    assert gradcheck(lambda v: torch.where(m, s.with_values(v), 0.0).to_dense(), (v,))
    assert gradcheck(lambda v: s.with_values(v).masked_fill(m, 0).to_dense(), (v,))

    def dropped(v):
        torch.manual_seed(3)
        return F.dropout(s.with_values(v), 0.4).to_dense()
    assert gradcheck(dropped, (v,))


def test_gradients_match_torch_at_ties():
    """torch.max(x) shares the gradient among all the positions holding the maximum (implicit zeros too);
    max(x, dim) sends it to the chosen index."""
    a = torch.tensor([[2.0, 0.0, 2.0, -1.0], [0.0, 0.0, -3.0, 0.0]], dtype=torch.float64)
    for fmt in ("csr", "coo"):
        for fn in (torch.max, lambda t: torch.max(t, 1).values.sum(), lambda t: torch.min(t, 0).values.sum(),
                   lambda t: torch.linalg.vector_norm(t, INF, 1).sum(), torch.min):
            s = scorch.asformat(a, fmt)
            v = s.values().detach().clone().requires_grad_()
            fn(s.with_values(v)).backward()
            d = a.clone().requires_grad_()
            fn(d).backward()
            leaf, dims, _ = storage.coordinates(s.format, s.shape, s.levels)
            assert torch.equal(v.grad[leaf], d.grad[tuple(dims)]), fn
    # stored zeros: (0, 0) ties with the implicit zeros for the maximum; row 1 stores only a zero (its norm is 0,
    # with torch's zero subgradient)
    s = scorch.sparse_csr_tensor(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2]),
                                 torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64), (2, 3))
    d0 = s.to_dense()
    for fn in (torch.max, lambda t: torch.linalg.vector_norm(t, 2, 1).sum(),
               lambda t: torch.linalg.vector_norm(t, 3, 1).sum(), lambda t: torch.norm(t, dim=0).sum()):
        v = s.values().detach().clone().requires_grad_()
        fn(s.with_values(v)).backward()
        d = d0.clone().requires_grad_()
        fn(d).backward()
        assert torch.equal(v.grad, d.grad[tuple(storage.coordinates(s.format, s.shape, s.levels)[1])]), fn
