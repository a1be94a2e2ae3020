"""``loopir.Common`` (the size of two sorted lists' intersection) and the count passes that use it: the C++
helper (blocks of 8 for int32 lists, a merge otherwise) against numpy on random lists of every length around the
block size, the interpreter's version, and sparse + sparse / sparse * sparse whose count pass it computes."""
import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import scorch
from scorch import loopir as L
from scorch.compiler import runtime
from scorch.compiler.codegen.prelude import HELPERS

SOURCE = HELPERS["scorch_common"] + """
extern "C" int64_t common32(const int32_t* a, int64_t na, const int32_t* b, int64_t nb) {
  return scorch_common(a, na, b, nb);
}
extern "C" int64_t common64(const int64_t* a, int64_t na, const int32_t* b, int64_t nb) {
  return scorch_common(a, na, b, nb);
}
"""
ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]


@pytest.fixture(scope="module")
def kernels():
    return (runtime.load(SOURCE, "common32", ARGS, ctypes.c_int64),
            runtime.load(SOURCE, "common64", ARGS, ctypes.c_int64))


def _sorted(rng, n, universe):
    return np.sort(rng.choice(universe, size=min(n, universe), replace=False))


@pytest.mark.parametrize("universe", [20, 60, 100000])
def test_common_matches_numpy_at_every_length_near_the_block(kernels, universe):
    rng = np.random.default_rng(universe)
    c32, c64 = kernels
    for size_a in range(0, 26):
        for size_b in (0, 1, 7, 8, 9, 16, 17, 25, 40):
            a = _sorted(rng, size_a, universe).astype(np.int32)
            b = _sorted(rng, size_b, universe).astype(np.int32)
            na, nb = a.size, b.size
            want = np.intersect1d(a, b).size
            # (the lists sit inside longer arrays: the helper must read only its ranges)
            pa = np.concatenate([a, np.full(9, a[-1] if na else 0, np.int32)])
            pb = np.concatenate([b, np.full(9, b[-1] if nb else 0, np.int32)])
            assert c32(pa.ctypes.data, na, pb.ctypes.data, nb) == want, (na, nb)
            a64 = np.ascontiguousarray(a, dtype=np.int64)
            assert c64(a64.ctypes.data, na, pb.ctypes.data, nb) == want, (na, nb)


def test_common_counts_zero_coordinates_and_equal_lists(kernels):
    c32, _ = kernels
    a = np.arange(0, 30, dtype=np.int32)
    assert c32(a.ctypes.data, 30, a.ctypes.data, 30) == 30
    z = np.zeros(1, np.int32)
    assert c32(z.ctypes.data, 1, a.ctypes.data, 30) == 1
    assert c32(z.ctypes.data, 0, a.ctypes.data, 30) == 0


def test_interpreter_common():
    from scorch.compiler.interp import _Interp
    it = _Interp({"a": np.array([1, 3, 5, 9], np.int64), "b": np.array([0, 3, 4, 9, 11], np.int64)})
    e = L.Common("a", L.Const(0), L.Const(4), "b", L.Const(1), L.Const(5))
    assert it.expr(e, {}) == 2
    with pytest.raises(IndexError):
        it.expr(L.Common("a", L.Const(0), L.Const(6), "b", L.Const(0), L.Const(1)), {})


def _csr(dense, index_dtype):
    c = dense.to_sparse_csr()
    return scorch.sparse_csr_tensor(c.crow_indices().to(index_dtype), c.col_indices().to(index_dtype), c.values(),
                                    dense.shape)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 6), cols=st.integers(0, 70), da=st.floats(0, 1), db=st.floats(0, 1),
       seed=st.integers(0, 2**16), wide=st.booleans())
def test_add_and_mul_patterns_match_dense(rows, cols, da, db, seed, wide):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < da)
    b = torch.randn(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < db)
    idx = torch.int64 if wide else torch.int32
    sa, sb = _csr(a, idx), _csr(b, idx)
    s, p = sa + sb, sa * sb
    union = (a != 0) | (b != 0)
    both = (a != 0) & (b != 0)
    assert s._vals.numel() == int(union.sum()) and p._vals.numel() == int(both.sum())
    torch.testing.assert_close(s.to_dense(), a + b)
    torch.testing.assert_close(p.to_dense(), a * b)
