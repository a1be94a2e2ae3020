"""The grouped product's compiled kernels: one matrix product per group of a sorted sparse operand, the gathers
of the groups' rows fused into the packing of the products' operands, and the gate weights and the placement of
the rows fused into their stores.

A mixture of experts with sparse gates, ``y[r, h] = sum_e v[e] x[rows[e], d] W[g(e), d, h]`` over the gate's
entries ``e`` sorted by expert ``g``, is a product per expert of its gathered tokens with ``W[g]``. Run as torch
calls (``engine/grouped.py``'s reference path) it is a gather of ``x``'s rows into a buffer, a BLAS call per
expert into a second buffer, the weights applied, and a gather or scatter into ``y``: each a pass over memory,
and each a parallel region whose threads meet at its end. Here the whole product is one parallel region over
tasks of one group's block of rows:

- ``pack``: the block's rows of ``x`` gathered straight from ``x`` into panels of ``MR`` rows interleaved along
  ``d`` (``ap[t][k][r]``), so that the micro-kernel broadcasts one scalar per row and step;
- ``tile``: the register-blocked micro-kernel, ``MR`` rows x ``NV`` vectors of columns of accumulators (24 of
  AVX-512's 32 registers; 12 of AVX2's 16), over the whole reduction, reading ``W[g]``'s rows in place (a
  column tile past ``h``'s end is read from a zero-padded copy);
- ``store``: the tile weighted by ``v`` and written to ``y``'s rows (each named once: top-1 gates), and
  unweighted to the sorted product ``p`` where the backward needs it (the gate values' gradient).

The weight gradient ``dW[g] = X_g^T (v dY_g)`` is the same micro-kernel with the roles of the panels exchanged:
``x``'s rows gathered as the transposed left operand, ``v dY``'s rows gathered into the right one, over blocks
of the group's entries (accumulated into ``dW[g]``), and the gate values' gradient ``dot(dY[rows[e]], p[e])``
in the same call. Measured (AMD EPYC Zen 4, one thread, 4096 tokens, 16 experts, 512 x 512): the forward at
90-93 GFLOP/s with its gathers and stores, against 81-86 for the gather and the per-expert MKL products alone
and 70-77 for the per-expert loop (``index_select``, ``mm``, ``index_add_``); the core's FMA peak is 117.

float32 only (other dtypes take the torch path); the source is rendered for the machine's vector width
(``target.native_vector_bytes``) and built once (``runtime``).
"""
from __future__ import annotations

import ctypes

from . import runtime
from .target import native_vector_bytes

#: rows of a micro-kernel tile (the broadcast operand)
MR = 6
#: rows of the right operand ahead of the micro-kernel's step that it asks the cache for (its rows lie a row of
#: ``W`` apart, so the hardware's stream prefetcher runs behind): 8 rows, 92 -> 95-97 GFLOP/s (4: 95, 12: 93, 16
#: and 24: 91-92; one thread, AMD Zen 4, 4096 x 512 x 512 over 16 experts)
PREFETCH_ROWS = 8
#: floats of the packed left operand a task keeps (its block of rows x the reduction): 768 KiB, in the L2 cache
#: beside the right operand's column tile
PANEL_FLOATS = 196608

_SOURCE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#define LANES @LANES@
#define MR @MR@
#define NV @NV@
#define NR (NV * LANES)
#define PREFETCH @PREFETCH@
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4)));

static inline int64_t up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// acc[r][v] = sum_k ap[k * MR + r] * b[k * ldb + v * LANES + lane]
static inline void tile(int64_t kc, const float* __restrict ap, const float* __restrict b, int64_t ldb,
                        vf acc[MR][NV]) {
  #pragma GCC unroll 16
  for (int r = 0; r < MR; r++)
    #pragma GCC unroll 8
    for (int v = 0; v < NV; v++) acc[r][v] = (vf){};
  for (int64_t k = 0; k < kc; k++) {
    vf bv[NV];
    #pragma GCC unroll 8
    for (int v = 0; v < NV; v++) bv[v] = *(const vfu*)(b + v * LANES);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
      vf a = ap[r] - (vf){};  // (a broadcast: x - 0 is exact, so GCC drops the subtraction; 0 + x is not)
      #pragma GCC unroll 8
      for (int v = 0; v < NV; v++) acc[r][v] += a * bv[v];
    }
    #pragma GCC unroll 8
    for (int l = 0; l < NR * 4 / 64; l++) __builtin_prefetch(b + PREFETCH * ldb + l * 16);
    ap += MR;
    b += ldb;
  }
}

// out[0:n] = acc (times s), added to what is there when add; n <= NR columns
static inline void put(float* __restrict out, const vf* acc, float s, int64_t n, int add) {
  if (n == NR && !add) {
    #pragma GCC unroll 8
    for (int v = 0; v < NV; v++) *(vfu*)(out + v * LANES) = acc[v] * s;
    return;
  }
  float t[NR] __attribute__((aligned(64)));
  for (int v = 0; v < NV; v++) *(vf*)(t + v * LANES) = acc[v] * s;
  if (add) for (int64_t c = 0; c < n; c++) out[c] += t[c];
  else for (int64_t c = 0; c < n; c++) out[c] = t[c];
}

// the tasks: (group, first entry, entries) blocks of at most mc entries of each group
static int64_t blocks(int64_t groups, const int64_t* starts, int64_t mc, int64_t* task) {
  int64_t n = 0;
  for (int64_t g = 0; g < groups; g++)
    for (int64_t lo = starts[g]; lo < starts[g + 1]; lo += mc) {
      if (task) { task[3 * n] = g; task[3 * n + 1] = lo; task[3 * n + 2] = starts[g + 1] - lo < mc ? starts[g + 1] - lo : mc; }
      n++;
    }
  return n;
}

// y[rows[e], :] = v[e] * (x[rows[e], :] @ w[g]) for the entries e of group g (y may be null: rows named twice),
// p[e, :] = the product (times v[e] when scale_p; p may be null)
extern "C" void scorch_grouped_forward(int64_t groups, const int64_t* starts, const int64_t* rows,
                                       const float* vals, const float* x, const float* w, int64_t d, int64_t h,
                                       float* y, float* p, int64_t scale_p, int64_t mc, int64_t nthreads) {
  mc = up(mc, MR);
  int64_t ntask = blocks(groups, starts, mc, 0);
  int64_t* task = (int64_t*)malloc(sizeof(int64_t) * 3 * (ntask + 1));
  blocks(groups, starts, mc, task);
  int64_t tail = h % NR, hfull = h - tail;
  #pragma omp parallel num_threads(nthreads)
  {
    float* ap = (float*)aligned_alloc(64, sizeof(float) * up(mc * d, 16) + 64);
    float* bt = tail ? (float*)aligned_alloc(64, sizeof(float) * up(d * NR, 16) + 64) : 0;
    int64_t tail_of = -1;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < ntask; q++) {
      int64_t g = task[3 * q], lo = task[3 * q + 1], m = task[3 * q + 2], tiles = (m + MR - 1) / MR;
      const float* wg = w + g * d * h;
      for (int64_t t = 0; t < tiles; t++)  // pack: the rows gathered, MR at a time interleaved along d
        for (int r = 0; r < MR; r++) {
          float* dst = ap + t * MR * d + r;
          int64_t i = t * MR + r;
          if (i < m) {
            const float* src = x + rows[lo + i] * d;
            for (int64_t k = 0; k < d; k++) dst[k * MR] = src[k];
          } else {
            for (int64_t k = 0; k < d; k++) dst[k * MR] = 0.0f;
          }
        }
      if (tail && tail_of != g) {  // the last column tile, zero-padded to NR
        for (int64_t k = 0; k < d; k++) {
          memcpy(bt + k * NR, wg + k * h + hfull, sizeof(float) * tail);
          memset(bt + k * NR + tail, 0, sizeof(float) * (NR - tail));
        }
        tail_of = g;
      }
      for (int64_t j = 0; j < h; j += NR) {
        int64_t n = h - j < NR ? h - j : NR;
        const float* b = n == NR ? wg + j : bt;
        int64_t ldb = n == NR ? h : NR;
        for (int64_t t = 0; t < tiles; t++) {
          vf acc[MR][NV];
          tile(d, ap + t * MR * d, b, ldb, acc);
          for (int r = 0; r < MR && t * MR + r < m; r++) {
            int64_t e = lo + t * MR + r;
            if (y) put(y + rows[e] * h + j, acc[r], vals[e], n, 0);
            if (p) put(p + e * h + j, acc[r], scale_p ? vals[e] : 1.0f, n, 0);
          }
        }
      }
    }
    free(ap);
    if (bt) free(bt);
  }
  free(task);
}

// gw[g] = sum_{e in g} x[rows[e], :]^T (v[e] dy[rows[e], :]) (zero for a group without entries), over blocks of
// at most mc entries (the first stored, the others added); gv[e] = dot(dy[rows[e], :], p[e, :]) (gv may be null)
extern "C" void scorch_grouped_weight_grad(int64_t groups, const int64_t* starts, const int64_t* rows,
                                           const float* vals, const float* x, const float* dy, const float* p,
                                           int64_t d, int64_t h, float* gw, float* gv, int64_t mc, int64_t db,
                                           int64_t nthreads) {
  int64_t entries = starts[groups];
  if (gv) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t e = 0; e < entries; e++) {
      const float* a = dy + rows[e] * h;
      const float* b = p + e * h;
      float s = 0.0f;
      #pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < h; c++) s += a[c] * b[c];
      gv[e] = s;
    }
  }
  db = up(db, MR);
  int64_t dblocks = (d + db - 1) / db, hp = up(h, NR);
  #pragma omp parallel num_threads(nthreads)
  {
    float* ap = (float*)aligned_alloc(64, sizeof(float) * up(mc * db, 16) + 64);
    float* bp = (float*)aligned_alloc(64, sizeof(float) * up(mc * hp, 16) + 64);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < groups * dblocks; q++) {
      int64_t g = q / dblocks, d0 = q % dblocks * db, dn = d - d0 < db ? d - d0 : db, tiles = (dn + MR - 1) / MR;
      float* out = gw + g * d * h;
      if (starts[g] == starts[g + 1]) {
        for (int64_t i = d0; i < d0 + dn; i++) memset(out + i * h, 0, sizeof(float) * h);
        continue;
      }
      for (int64_t lo = starts[g]; lo < starts[g + 1]; lo += mc) {
        int64_t m = starts[g + 1] - lo < mc ? starts[g + 1] - lo : mc;
        int add = lo != starts[g];
        for (int64_t k = 0; k < m; k++) {  // pack: v dy's rows (zero-padded to hp), and x's rows by MR columns
          const float* src = dy + rows[lo + k] * h;
          float s = vals[lo + k];
          float* dst = bp + k * hp;
          for (int64_t c = 0; c < h; c++) dst[c] = s * src[c];
          for (int64_t c = h; c < hp; c++) dst[c] = 0.0f;
          const float* xr = x + rows[lo + k] * d + d0;
          for (int64_t t = 0; t < tiles; t++)
            for (int r = 0; r < MR; r++)
              ap[t * MR * m + k * MR + r] = t * MR + r < dn ? xr[t * MR + r] : 0.0f;
        }
        for (int64_t j = 0; j < h; j += NR) {
          int64_t n = h - j < NR ? h - j : NR;
          for (int64_t t = 0; t < tiles; t++) {
            vf acc[MR][NV];
            tile(m, ap + t * MR * m, bp + j, hp, acc);
            for (int r = 0; r < MR && t * MR + r < dn; r++)
              put(out + (d0 + t * MR + r) * h + j, acc[r], 1.0f, n, add);
          }
        }
      }
    }
    free(ap);
    free(bp);
  }
}
"""

_kernels: dict = {}


def vectors() -> tuple:
    """``(lanes, nv)``: float32 lanes per machine vector and vectors per tile row (``MR`` x ``nv`` accumulators,
    with ``nv`` loads and a broadcast, fit the register file: 32 vector registers with AVX-512, 16 otherwise)."""
    width = native_vector_bytes()
    return width // 4, 4 if width == 64 else 2


def source() -> str:
    lanes, nv = vectors()
    return _SOURCE.replace("@LANES@", str(lanes)).replace("@MR@", str(MR)).replace("@NV@", str(nv)) \
        .replace("@PREFETCH@", str(PREFETCH_ROWS))


def kernel(name: str):
    """The compiled ``scorch_grouped_forward`` or ``scorch_grouped_weight_grad`` (every argument a pointer or
    an int64), built on first use."""
    k = _kernels.get(name)
    if k is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        args = {"forward": [i, p, p, p, p, p, i, i, p, p, i, i, i],
                "weight_grad": [i, p, p, p, p, p, p, i, i, p, p, i, i, i]}[name]
        k = _kernels[name] = runtime.load(source(), f"scorch_grouped_{name}", args)
    return k


def row_block(entries: int, width: int, threads: int) -> int:
    """The forward's entries per task: enough tasks for the threads to balance (four each), each block's packed
    rows (``width`` floats a row) within ``PANEL_FLOATS``, at least eight tiles."""
    per_task = -(-entries // max(1, 4 * threads))
    return max(8 * MR, min(-(-per_task // MR) * MR, PANEL_FLOATS // max(1, width) // MR * MR))


def grad_blocks(groups: int, entries: int, d: int, h: int, threads: int) -> tuple:
    """``(mc, db)`` of the weight gradient: ``db`` rows of ``dW[g]`` per task (the groups split so that there are
    four tasks a thread), and up to ``mc`` entries reduced at a time (the packed rows of ``x`` and of ``v dY``
    within twice ``PANEL_FLOATS``)."""
    split = max(1, -(-4 * threads // max(1, groups)))
    db = max(8 * MR, -(-(-(-d // split)) // MR) * MR)
    lanes, nv = vectors()
    hp = -(-h // (lanes * nv)) * lanes * nv
    mc = max(MR, min(max(entries, 1), 2 * PANEL_FLOATS // (min(db, d) + hp)))
    return mc, db
