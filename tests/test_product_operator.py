"""``S @ X`` and ``X @ S`` in C (``engine.direct.operators``): after the first product kept, SparseTensor's
``__matmul__`` / ``__rmatmul__`` test in C what ``engine.kept_product`` tests in Python and take the kept call
exactly where the Python operator would; every other product goes to the Python operator, with its result."""
import contextlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scorch
from scorch.engine import direct, evaluate
from scorch.ops import linalg
from scorch.sparse_tensor import SparseTensor

needs_direct = pytest.mark.skipif(direct.function(wait=True) is None, reason="no direct call here (Python.h missing?)")


@pytest.fixture(autouse=True)
def _eager_products():
    """(Under ``SCORCH_DEFER=all`` products defer instead of taking a kept call: these run in the default mode.
    The in-memory caches start empty, so that what these tests count does not hang on what a long test process
    kept before.)"""
    scorch.clear_caches()
    with scorch.deferred.deferral("auto"):
        yield


def _case(seed=7, fmt="csr", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(9, 7, generator=g) * (torch.rand(9, 7, generator=g) < 0.4)).to(dtype)
    return d, scorch.asformat(d, fmt)


def _installed():
    return type(SparseTensor.__dict__["__matmul__"]).__name__ == "instancemethod"


def _counted(fn):
    """``fn()``'s result and how the C operators took it: (kept calls, products handed to Python)."""
    before = direct.operator_counts()
    r = fn()
    after = direct.operator_counts()
    return r, (after[0] - before[0], after[1] - before[1])


def _check(s, other, left, reference, ctx=contextlib.nullcontext):
    """One product through the operator, inside ``ctx()``: it takes the kept call exactly where
    ``kept_product`` gives one (and the deferral mode is not "all"), and its result is ``reference``."""
    with ctx():
        expected = bool(evaluate.kept_product(s, other, left)) and scorch.deferred.mode() != "all"
        r, counts = _counted(lambda: s @ other if left else other @ s)
    r = r.compute() if isinstance(r, scorch.deferred.Deferred) else r
    r = r.to_dense() if isinstance(r, SparseTensor) or r.layout != torch.strided else r
    torch.testing.assert_close(r, reference)
    assert counts == ((1, 0) if expected else (0, 1)), (counts, expected)
    return expected


def _warm(s, other, left=True, reps=3):
    for _ in range(reps):
        s @ other if left else other @ s
    assert _installed()


@needs_direct
@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_operators_take_the_kept_call_where_python_would(fmt, dtype):
    d, s = _case(fmt=fmt, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 5, generator=g, dtype=dtype), torch.randn(4, 9, generator=g, dtype=dtype)
    v, u = x[:, 0].contiguous(), w[0].contiguous()
    for other, left in ((x, True), (w, False), (v, True), (u, False)):
        _warm(s, other, left)
        ref = d @ other if left else other @ d
        taken = _check(s, other, left, ref)
        assert taken == bool(evaluate.kept_product(s, other, left))
    if fmt == "csr":  # (a format with a kept prepared call: the C operator serves it)
        assert _check(s, x, True, d @ x)


@needs_direct
def test_operators_hand_every_other_product_to_python():
    """The operand kinds and states ``kept_product`` refuses: each goes to the Python operator and is right."""
    d, s = _case()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5, generator=g)
    _warm(s, x)
    assert _check(s, x, True, d @ x)
    xt = torch.randn(5, 7, generator=g).t()
    assert not _check(s, xt, True, d @ xt)                      # not contiguous
    x64 = x.double()
    assert not _check(s, x64, True, d.double() @ x64)           # another dtype (no kept entry)
    xp = torch.nn.Parameter(x.clone())
    with torch.no_grad():
        assert not _check(s, xp, True, d @ x)                   # a Parameter: not a plain tensor
    assert not _check(s, x.to_sparse_csr(), True, d @ x)        # a torch sparse operand
    x3 = torch.randn(2, 7, 5, generator=g)
    assert not _check(s, x3, True, d @ x3)                      # a batch (no kept entry)
    xg = x.clone().requires_grad_(True)
    assert not _check(s, xg, True, d @ x)                       # a gradient to record
    assert _check(s, xg, True, d @ x, torch.no_grad)            # ... not under no_grad
    assert not _check(s, x, True, d @ x, scorch.engine.structural_results)
    assert not _check(s, x, True, d @ x, lambda: scorch.engine.cpu_backend("interp"))
    assert not _check(s, x, True, d @ x, lambda: scorch.deferred.deferral("all"))
    with torch.autocast("cpu", dtype=torch.bfloat16):          # autocast: the product casts its operands
        assert not evaluate.kept_product(s, x, True)
        r, counts = _counted(lambda: s @ x)
    assert r.dtype == torch.bfloat16 and counts == (0, 1)
    torch.testing.assert_close(r.float(), d @ x, atol=0.1, rtol=0.05)
    _warm(s, x)  # (a call in those modes may keep its own call in place of the one kept before)
    assert _check(s, x, True, d @ x)
    sg = scorch.asformat(d, "csr").requires_grad_(True)         # values that record a gradient
    with torch.no_grad():                                       # (kept by a product under no_grad)
        _warm(sg, x)
    assert not _check(sg, x, True, d @ x)
    assert _check(sg, x, True, d @ x, torch.no_grad)
    scorch.clear_caches()                                       # the caches emptied: the kept call is stale
    assert not _check(s, x, True, d @ x)
    _warm(s, x)
    d2 = torch.randn(9, 7, generator=g) * (torch.rand(9, 7, generator=g) < 0.6)
    s.copy_(scorch.asformat(d2, "coo"))                         # another pattern, in place
    _check(s, x, True, d2 @ x)
    s.values().mul_(2)                                          # values changed in place: read at each call
    _warm(s, x)
    assert _check(s, x, True, 2 * d2 @ x)


@needs_direct
def test_operators_raise_as_the_python_operator_does():
    d, s = _case()
    x = torch.randn(7, 5)
    _warm(s, x)
    for bad in ("text", None, torch.randn(6, 5)):
        with pytest.raises(Exception) as c_error:
            s @ bad
        with pytest.raises(Exception) as py_error:
            linalg._operator(s, bad)
        assert type(c_error.value) is type(py_error.value)
    with pytest.raises(TypeError, match="one other operand"):
        s.__matmul__()
    with pytest.raises(TypeError, match="one other operand"):
        s.__matmul__(x, x)
    torch.testing.assert_close(s.__matmul__(x), d @ x)
    torch.testing.assert_close(s.__rmatmul__(torch.ones(3, 9)), torch.ones(3, 9) @ d)


@needs_direct
def test_operators_under_torch_compile():
    """torch.compile traces ``@`` through the Python operator (the C one hands it over while compiling)."""
    d, s = _case()
    x, w = torch.randn(7, 5), torch.randn(4, 9)
    _warm(s, x)
    fn = torch.compile(lambda s, x, w: (s @ x).relu().sum() + (w @ s).sum(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(s, x, w), (d @ x).relu().sum() + (w @ d).sum())



@needs_direct
@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 9), n=st.integers(0, 9), k=st.sampled_from([None, 1, 17]),
       density=st.sampled_from([0.0, 0.3, 1.0]), left=st.booleans(), fmt=st.sampled_from(["csr", "coo", "csc"]),
       dtype=st.sampled_from([torch.float32, torch.float64]), index_dtype=st.sampled_from([torch.int32, torch.int64]),
       seed=st.integers(0, 2**16))
def test_operators_match_dense_on_random_operands(m, n, k, density, left, fmt, dtype, index_dtype, seed):
    """Random shapes (empty and 1-element among them), densities, formats, dtypes, index widths, vectors and
    matrices, from either side: each of four repeated products equals dense torch's, and the C operator takes
    the kept call exactly where ``kept_product`` gives one."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(m, n, generator=g) * (torch.rand(m, n, generator=g) < density)).to(dtype)
    s = scorch.asformat(d, fmt, index_dtype=index_dtype)
    inner = n if left else m
    shape = (inner,) if k is None else ((inner, k) if left else (k, inner))
    other = torch.randn(shape, generator=g, dtype=dtype)
    ref = d @ other if left else other @ d
    for _ in range(4):
        if _installed():
            _check(s, other, left, ref)
        else:
            torch.testing.assert_close(s @ other if left else other @ s, ref)


def test_operators_replaced_by_the_user_stay():
    """A wrapper put on ``SparseTensor.__matmul__`` before the first product is not replaced by the C form."""
    code = ("import torch, scorch\nfrom scorch.sparse_tensor import SparseTensor\nseen = []\n"
            "inner = SparseTensor.__matmul__\n"
            "SparseTensor.__matmul__ = lambda s, o: seen.append(1) or inner(s, o)\n"
            "d = torch.randn(9, 7) * (torch.rand(9, 7) < 0.4)\ns = scorch.asformat(d, 'csr')\nx = torch.randn(7, 3)\n"
            "for _ in range(3): torch.testing.assert_close(s @ x, d @ x)\nprint(len(seen))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
