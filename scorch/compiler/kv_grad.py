"""The attention backward's products with the transposed pattern, ``dv = P^T g`` and ``dk = dS^T q``, in one pass:
column ``j`` of the pattern gives ``dv[j, :] = sum_i P[i, j] g[i, :]`` and ``dk[j, :] = sum_i dS[i, j] q[i, :]``,
both from the same entries.

Why not the general lowering: a product with ``P^T`` runs on the transposed pattern, so each of the two had its
values gathered into the transposed order first (a permutation of the half-million values of the sparse
transformer's pattern, each call, as ``dS`` is new each step), then a pass of its own: about two thirds of the
compiled attention backward. Here the values are read where they are, through the transposed pattern's entries'
positions in the row order (``transpose``: made once per pattern by the caller and kept), the rows ``g[i, :]``
and ``q[i, :]`` are read once per entry for both products, and each thread owns whole output rows (columns of the
pattern): no per-thread buffers to sum, no barrier (this machine's threads are often shared, and a thread waiting
at a barrier for a descheduled one spins)."""
from __future__ import annotations

import ctypes

import torch

from . import runtime

_SOURCE = r"""
#include <cstdint>
#include <omp.h>
// the first c in [0, n] with a[c] >= x (a nondecreasing)
template <typename I> static int64_t lower(const I* a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) { const int64_t m = (lo + hi) / 2; if ((int64_t)a[m] < x) lo = m + 1; else hi = m; }
  return lo;
}
// W > 0: both widths W, known here (accumulators in registers); 0: the runtime widths wv, wk
template <typename T, typename I, int W>
static void kv_grad(const I* __restrict__ cpos, const I* __restrict__ erow, const I* __restrict__ eperm,
                    int64_t cols, const T* __restrict__ p, const T* __restrict__ ds, const T* __restrict__ g,
                    const T* __restrict__ q, T* __restrict__ dv, T* __restrict__ dk, int64_t wv_, int64_t wk_,
                    int64_t nthreads) {
  const int64_t wv = W > 0 ? W : wv_, wk = W > 0 ? W : wk_;
  const int64_t total = (int64_t)cpos[cols] - (int64_t)cpos[0];
  int64_t next = 0;
  #pragma omp parallel num_threads(nthreads)
  {
    // the columns in parts of about equal entries, taken in turn (a thread held up does not hold up the others)
    const int64_t parts = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
    for (;;) {
      int64_t part;
      #pragma omp atomic capture
      part = next++;
      if (part >= parts) break;
      const int64_t c0 = part == 0 ? 0 : lower(cpos, cols, cpos[0] + total * part / parts);
      const int64_t c1 = part == parts - 1 ? cols : lower(cpos, cols, cpos[0] + total * (part + 1) / parts);
      for (int64_t j = c0; j < c1; ++j) {
        T av[W > 0 ? W : 1], ak[W > 0 ? W : 1];
        T* __restrict__ ov = W > 0 ? av : dv + j * wv;
        T* __restrict__ ok = W > 0 ? ak : dk + j * wk;
        for (int64_t c = 0; c < wv; ++c) ov[c] = 0;
        for (int64_t c = 0; c < wk; ++c) ok[c] = 0;
        for (int64_t e = cpos[j]; e < (int64_t)cpos[j + 1]; ++e) {
          const int64_t i = erow[e], k = eperm[e];
          const T a = p[k], b = ds[k];
          const T* __restrict__ gi = g + i * wv;
          const T* __restrict__ qi = q + i * wk;
          #pragma omp simd
          for (int64_t c = 0; c < wv; ++c) ov[c] += a * gi[c];
          #pragma omp simd
          for (int64_t c = 0; c < wk; ++c) ok[c] += b * qi[c];
        }
        if (W > 0) {
          for (int64_t c = 0; c < wv; ++c) dv[j * wv + c] = ov[c];
          for (int64_t c = 0; c < wk; ++c) dk[j * wk + c] = ok[c];
        }
      }
    }
  }
}
extern "C" void scorch_kv_grad(const void* cpos, const void* erow, const void* eperm, int64_t index_size,
                               int64_t cols, const void* p, const void* ds, const void* g, const void* q, void* dv,
                               void* dk, int64_t wv, int64_t wk, int64_t itemsize, int64_t nthreads) {
  #define KW(T, I, W) kv_grad<T, I, W>((const I*)cpos, (const I*)erow, (const I*)eperm, cols, (const T*)p, \
                                       (const T*)ds, (const T*)g, (const T*)q, (T*)dv, (T*)dk, wv, wk, nthreads)
  #define KV(T, I) do { if (wv == wk && wv == 16) KW(T, I, 16); else if (wv == wk && wv == 32) KW(T, I, 32); \
                        else if (wv == wk && wv == 64) KW(T, I, 64); else KW(T, I, 0); } while (0)
  if (index_size == 4) { if (itemsize == 8) KV(double, int32_t); else KV(float, int32_t); }
  else { if (itemsize == 8) KV(double, int64_t); else KV(float, int64_t); }
  #undef KV
  #undef KW
}
"""
_kernel = None


def applies(pos, crd, p, g, q) -> bool:
    """Whether ``kv_grad`` takes these operands: CPU, float32 or float64 values and 2-d rows of one dtype,
    int32/int64 index arrays of one type."""
    return all(x.device.type == "cpu" for x in (pos, crd, p, g, q)) and p.dtype in (torch.float32, torch.float64) \
        and g.dtype == q.dtype == p.dtype and g.dim() == q.dim() == 2 and p.dim() == 1 and \
        pos.dtype == crd.dtype and pos.dtype in (torch.int32, torch.int64)


def transpose(pos, crd, cols: int):
    """``(cpos, erow, eperm)``: the row-compressed pattern ``(pos, crd)`` by columns (``cpos`` the columns' entry
    pointers; per entry in column order its row ``erow`` and its position ``eperm`` in the row order), int32
    where the entries and rows fit (half the bytes read per entry), else int64. Rows in order within a column (a
    stable sort), so sums run in eager's order."""
    perm = torch.argsort(crd, stable=True)
    cpos = torch.zeros(cols + 1, dtype=torch.int64)
    cpos[1:] = torch.bincount(crd, minlength=cols).cumsum(0)
    rows = torch.repeat_interleave(torch.arange(pos.numel() - 1), pos.diff().long())
    small = crd.numel() < 2 ** 31 and pos.numel() < 2 ** 31
    return tuple(x.to(torch.int32 if small else torch.int64).contiguous() for x in (cpos, rows[perm], perm))


def kv_grad(transposed, p, ds, g, q):
    """``(dv, dk)``: ``P^T g`` and ``dS^T q`` for the pattern whose ``transpose`` is ``transposed``, values ``p``
    and ``ds`` in its row order, rows ``g`` and ``q`` (``applies`` must hold)."""
    global _kernel
    if _kernel is None:
        _kernel = runtime.load(_SOURCE, "scorch_kv_grad", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 +
                               [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4)
    cpos, erow, eperm = transposed
    p, ds, g, q = (x.contiguous() for x in (p, ds, g, q))
    cols = cpos.numel() - 1
    dv = torch.empty(cols, g.shape[1], dtype=p.dtype)
    dk = torch.empty(cols, q.shape[1], dtype=p.dtype)
    _kernel(cpos.data_ptr(), erow.data_ptr(), eperm.data_ptr(), cpos.element_size(), cols, p.data_ptr(),
            ds.data_ptr(), g.data_ptr(), q.data_ptr(), dv.data_ptr(), dk.data_ptr(), g.shape[1], q.shape[1],
            p.element_size(), torch.get_num_threads())
    return dv, dk
