"""The attention backward's products with the transposed pattern, ``dv = P^T g`` and ``dk = dS^T q``, in one pass
over the pattern in its own row order: each stored entry ``(i, j)`` adds ``P[i, j] * g[i, :]`` to ``dv[j, :]`` and
``dS[i, j] * q[i, :]`` to ``dk[j, :]``.

Why not the general lowering: a product with ``P^T`` runs on the transposed pattern, so each of the two needed its
values gathered into the transposed order first (a permutation of the half-million values of the sparse
transformer's pattern, each call, as ``dS`` is new each step), then a pass of its own: about two thirds of the
compiled attention backward. Here the rows ``g[i, :]`` and ``q[i, :]`` are read once per row, the values in their
stored order, and no transposed copy is made. With several threads each thread adds into a buffer of its own (a
column ``j`` may be reached from any row), summed after: ``(threads - 1)`` extra ``columns x width`` buffers, small
next to the pattern (the caller falls back to the general products for very wide outputs)."""
from __future__ import annotations

import ctypes

import torch

from . import runtime

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
template <typename T, typename I>
static void kv_grad(const I* __restrict__ pos, const I* __restrict__ crd, int64_t rows, int64_t cols,
                    const T* __restrict__ p, const T* __restrict__ ds, const T* __restrict__ g,
                    const T* __restrict__ q, T* __restrict__ dv, T* __restrict__ dk, int64_t wv, int64_t wk,
                    int64_t nthreads) {
  // dv and dk arrive zeroed; threads after the first add into buffers of their own, summed into them after
  const int64_t width = wv + wk;
  std::vector<T> extra(nthreads > 1 ? (size_t)(nthreads - 1) * cols * width : 0);
  #pragma omp parallel num_threads(nthreads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    T* __restrict__ bv = t == 0 ? dv : extra.data() + (size_t)(t - 1) * cols * width;
    T* __restrict__ bk = t == 0 ? dk : bv + (size_t)cols * wv;
    const int64_t lo = pos[0] + (pos[rows] - pos[0]) * t / n, hi = pos[0] + (pos[rows] - pos[0]) * (t + 1) / n;
    // rows split by their entries (balanced for uneven rows): the first row whose end passes lo
    int64_t i = 0;
    { int64_t a = 0, b = rows; while (a < b) { int64_t m = (a + b) / 2; if (pos[m + 1] <= lo) a = m + 1; else b = m; } i = a; }
    for (; i < rows && pos[i] < hi; ++i) {
      const int64_t s = pos[i] > lo ? pos[i] : lo, e = pos[i + 1] < hi ? pos[i + 1] : hi;
      const T* __restrict__ gi = g + i * wv;
      const T* __restrict__ qi = q + i * wk;
      for (int64_t k = s; k < e; ++k) {
        const int64_t j = crd[k];
        const T a = p[k], b = ds[k];
        T* __restrict__ ov = bv + j * wv;
        T* __restrict__ ok = bk + j * wk;
        #pragma omp simd
        for (int64_t c = 0; c < wv; ++c) ov[c] += a * gi[c];
        #pragma omp simd
        for (int64_t c = 0; c < wk; ++c) ok[c] += b * qi[c];
      }
    }
    if (n > 1) {
      #pragma omp barrier
      #pragma omp for schedule(static)
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t u = 1; u < n; ++u) {
          const T* ev = extra.data() + (size_t)(u - 1) * cols * width;
          const T* ek = ev + (size_t)cols * wv;
          for (int64_t c = 0; c < wv; ++c) dv[j * wv + c] += ev[j * wv + c];
          for (int64_t c = 0; c < wk; ++c) dk[j * wk + c] += ek[j * wk + c];
        }
      }
    }
  }
}
extern "C" void scorch_kv_grad(const void* pos, const void* crd, int64_t index_size, int64_t rows, int64_t cols,
                               const void* p, const void* ds, const void* g, const void* q, void* dv, void* dk,
                               int64_t wv, int64_t wk, int64_t itemsize, int64_t nthreads) {
  #define KV(T, I) kv_grad((const I*)pos, (const I*)crd, rows, cols, (const T*)p, (const T*)ds, (const T*)g, \
                           (const T*)q, (T*)dv, (T*)dk, wv, wk, nthreads)
  if (index_size == 4) { if (itemsize == 8) KV(double, int32_t); else KV(float, int32_t); }
  else { if (itemsize == 8) KV(double, int64_t); else KV(float, int64_t); }
  #undef KV
}
"""
_kernel = None
#: the most bytes of per-thread buffers a call makes before the caller's general products serve instead
BUFFER_BYTES = 1 << 28


def applies(pos, crd, p, g, q) -> bool:
    """Whether ``kv_grad`` takes these operands: CPU, float32 or float64 values and 2-d rows of one dtype,
    int32/int64 index arrays of one type."""
    return all(x.device.type == "cpu" for x in (pos, crd, p, g, q)) and p.dtype in (torch.float32, torch.float64) \
        and g.dtype == q.dtype == p.dtype and g.dim() == q.dim() == 2 and p.dim() == 1 and \
        pos.dtype == crd.dtype and pos.dtype in (torch.int32, torch.int64)


def kv_grad(pos, crd, cols: int, p, ds, g, q):
    """``(dv, dk)``: ``P^T g`` and ``dS^T q`` for the row-compressed pattern ``(pos, crd)`` with ``cols`` columns,
    values ``p`` and ``ds`` in its stored order, rows ``g`` and ``q`` (``applies`` must hold). None where the
    threads' buffers would exceed ``BUFFER_BYTES``."""
    global _kernel
    threads = torch.get_num_threads()
    wv, wk = g.shape[1], q.shape[1]
    if (threads - 1) * cols * (wv + wk) * p.element_size() > BUFFER_BYTES:
        return None
    if _kernel is None:
        _kernel = runtime.load(_SOURCE, "scorch_kv_grad", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 +
                               [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4)
    pos, crd, p, ds, g, q = (x.contiguous() for x in (pos, crd, p, ds, g, q))
    dv = torch.zeros(cols, wv, dtype=p.dtype)
    dk = torch.zeros(cols, wk, dtype=p.dtype)
    _kernel(pos.data_ptr(), crd.data_ptr(), pos.element_size(), pos.numel() - 1, cols, p.data_ptr(), ds.data_ptr(),
            g.data_ptr(), q.data_ptr(), dv.data_ptr(), dk.data_ptr(), wv, wk, p.element_size(), threads)
    return dv, dk
