"""``scorch_first_row`` (``codegen.prelude.FIRST_ROW``): where an nnz-balanced parallel loop's part k of n starts.
Compiled as the kernels include it and compared, for every part, with the definition: the first row r of
[lo, hi] with (pos[r] - pos[lo]) + (r - lo) >= floor(total * k / n), found by a scan; on patterns of even,
empty, single heavy, power-law and random rows, sub-ranges, int32 and int64 positions, n from 1 to past the rows."""
import ctypes

import numpy as np
import pytest

from scorch.compiler import runtime
from scorch.compiler.codegen.prelude import FIRST_ROW

HARNESS = FIRST_ROW + """
template <class P> static int64_t fill(const P* pos, int64_t lo, int64_t hi, int64_t n, int64_t* out) {
  const int64_t total = ((int64_t)pos[hi] - (int64_t)pos[lo]) + (hi - lo);
  for (int64_t k = 0; k <= n + 1; ++k) out[k] = scorch_first_row(pos, lo, hi, total, k, n);
  return total;
}
extern "C" int64_t first_rows_i32(const int32_t* pos, int64_t lo, int64_t hi, int64_t n, int64_t* out) {
  return fill(pos, lo, hi, n, out);
}
extern "C" int64_t first_rows_i64(const int64_t* pos, int64_t lo, int64_t hi, int64_t n, int64_t* out) {
  return fill(pos, lo, hi, n, out);
}
"""

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def _expected(pos, lo, hi, n):
    f = (pos[lo:hi + 1].astype(np.int64) - int(pos[lo])) + np.arange(hi - lo + 1)
    total = int(f[-1])
    rows = []
    for k in range(n + 2):
        if k >= n:
            rows.append(hi)
            continue
        target = total * k // n
        rows.append(lo + int(np.argmax(f >= target)))  # (f[-1] = total >= target: a row always qualifies)
    return rows


def _patterns(rng):
    yield "even", np.full(1000, 20)
    yield "empty rows", np.zeros(300, dtype=np.int64)
    yield "one row", np.array([7])
    yield "no rows", np.zeros(0, dtype=np.int64)
    yield "one heavy first", np.r_[5000, np.zeros(499, dtype=np.int64)]
    yield "one heavy last", np.r_[np.zeros(499, dtype=np.int64), 5000]
    yield "one heavy middle", np.r_[np.ones(250, dtype=np.int64), 10000, np.ones(249, dtype=np.int64)]
    yield "power law", np.minimum(12000, (2000 * (1 + np.arange(3000)) ** -0.8).astype(np.int64))[rng.permutation(3000)]
    yield "random", rng.integers(0, 40, 777)
    yield "blocks", np.repeat([0, 100, 0, 3], 64)


@pytest.mark.parametrize("width", [32, 64])
def test_first_rows_match_the_definition(width):
    fns = {32: runtime.load(HARNESS, "first_rows_i32", _ARGS, ctypes.c_int64).fn,
           64: runtime.load(HARNESS, "first_rows_i64", _ARGS, ctypes.c_int64).fn}
    rng = np.random.default_rng(5)
    checked = 0
    for name, lengths in _patterns(rng):
        pos = np.r_[0, np.cumsum(lengths)].astype(np.int32 if width == 32 else np.int64)
        m = len(lengths)
        ranges = {(0, m), (m // 3, m), (0, m // 2), (m // 4, m // 4)}
        for lo, hi in ranges:
            for n in sorted({1, 2, 3, 7, 16, 64, m + 3}):
                out = np.zeros(n + 2, dtype=np.int64)
                fns[width](pos.ctypes.data, lo, hi, n, out.ctypes.data)
                assert out.tolist() == _expected(pos, lo, hi, n), (name, lo, hi, n)
                checked += 1
    assert checked > 100
