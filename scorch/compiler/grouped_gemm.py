"""The grouped product's compiled kernels: one matrix product per group of a sorted sparse operand, the gathers
of the groups' rows fused into the products' operand reads, and the gate weights and the placement of the rows
fused into their stores.

A mixture of experts with sparse gates, ``y[r, h] = sum_e v[e] x[rows[e], d] W[g(e), d, h]`` over the gate's
entries ``e`` sorted by expert ``g``, is a product per expert of its gathered tokens with ``W[g]``. Run as torch
calls (``engine/grouped.py``'s torch path) it is a gather of ``x``'s rows into a buffer, a BLAS call per expert
into a second buffer, the weights applied, and a gather or scatter into ``y``: each a pass over memory, and each a
parallel region whose threads meet at its end. Here the whole product is one parallel region over tasks of one
group's block of rows:

- ``tile``: the register-blocked micro-kernel, ``MR`` rows x ``NV`` vectors of columns of accumulators (24 of
  AVX-512's 32 registers; 12 of AVX2's 16) over the whole reduction, one broadcast per row and step; its left
  operand's ``MR`` rows are read where they lie in ``x`` (``InPlace``: the gather costs no copy) and its right
  operand's rows at a stride in ``W[g]`` (``Strided``; a column tile past ``h``'s end from a zero-padded copy),
  ``PREFETCH_ROWS`` rows ahead asked for;
- ``put``: the tile weighted by ``v`` and written to ``y``'s rows (each named once: top-1 gates), and unweighted
  to the sorted product ``p`` where the backward needs it (the gate values' gradient).

The weight gradient ``dW[g] = (v X_g)^T dY_g`` is the same micro-kernel with the roles exchanged: ``x``'s rows,
weighted, packed ``MR`` columns at a time (``Packed``: the broadcast operand, read along the entries), and
``dY``'s rows read in place through one pointer per entry (``Rows``), over blocks of the group's entries
(accumulated into ``dW[g]``), the gate values' gradient ``dot(dY[rows[e]], p[e])`` in the same call. The
entries are sorted by group by a counting sort (``_ROUTE_SOURCE``), which also says whether each row is named
once.

Measured (AMD EPYC Zen 4, one thread, 4096 tokens, 16 experts, 512 x 512, thread CPU time; the core's FMA peak
is 117 GFLOP/s): the forward with its gathers and stores at 99-103 GFLOP/s, against 82-84 for the gather and the
per-expert MKL products alone and 70-77 for the per-expert loop (``index_select``, ``mm``, ``index_add_``);
the weight gradient at 95-96 against 75-78 for the gathers and MKL's products.

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
#: floats of a task's rows of the left operand (its block of rows x the reduction): 768 KiB, kept in the L2 cache
#: from one column tile to the next (the forward), or packed (the weight gradient)
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

// the right operand's rows: at a stride (a matrix), or one pointer a row (gathered rows, in place)
struct Strided {
  const float* b;
  int64_t ldb;
  const float* row(int64_t k) const { return b + k * ldb; }
};
struct Rows {
  const float* const* at;  // (PREFETCH rows past the last valid: the prefetches read them)
  int64_t j;
  const float* row(int64_t k) const { return at[k] + j; }
};

// the left operand: packed (MR values a step, interleaved), or MR rows read in place
struct Packed {
  const float* ap;
  float at(int r, int64_t k) const { return ap[k * MR + r]; }
};
struct InPlace {
  const float* x[MR];
  float at(int r, int64_t k) const { return x[r][k]; }
};

// acc[r][v] = sum_k a.at(r, k) * b.row(k)[v * LANES + lane]
template <class A, class B>
static inline void tile(int64_t kc, A a, B b, vf acc[MR][NV]) {
  #pragma GCC unroll 16
  for (int r = 0; r < MR; r++)
    #pragma GCC unroll 8
    for (int v = 0; v < NV; v++) acc[r][v] = (vf){};
  for (int64_t k = 0; k < kc; k++) {
    const float* bk = b.row(k);
    vf bv[NV];
    #pragma GCC unroll 8
    for (int v = 0; v < NV; v++) bv[v] = *(const vfu*)(bk + v * LANES);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
      vf ar = a.at(r, k) - (vf){};  // (a broadcast: x - 0 is exact, so GCC drops the subtraction; 0 + x is not)
      #pragma GCC unroll 8
      for (int v = 0; v < NV; v++) acc[r][v] += ar * bv[v];
    }
    const float* ahead = b.row(k + PREFETCH);
    #pragma GCC unroll 8
    for (int l = 0; l < NR * 4 / 64; l++) __builtin_prefetch(ahead + l * 16);
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
      if (task) {
        task[3 * n] = g; task[3 * n + 1] = lo; task[3 * n + 2] = starts[g + 1] - lo < mc ? starts[g + 1] - lo : mc;
      }
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
    float* bt = tail ? (float*)aligned_alloc(64, sizeof(float) * up(d * NR, 16) + 64) : 0;
    int64_t tail_of = -1;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t q = 0; q < ntask; q++) {
      int64_t g = task[3 * q], lo = task[3 * q + 1], m = task[3 * q + 2], tiles = (m + MR - 1) / MR;
      const float* wg = w + g * d * h;
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
          InPlace a;  // (a partial tile's missing rows repeat its last: computed, not stored)
          for (int r = 0; r < MR; r++) a.x[r] = x + rows[lo + (t * MR + r < m ? t * MR + r : m - 1)] * d;
          vf acc[MR][NV];
          tile(d, a, Strided{b, ldb}, acc);
          for (int r = 0; r < MR && t * MR + r < m; r++) {
            int64_t e = lo + t * MR + r;
            if (y) put(y + rows[e] * h + j, acc[r], vals[e], n, 0);
            if (p) put(p + e * h + j, acc[r], scale_p ? vals[e] : 1.0f, n, 0);
          }
        }
      }
    }
    if (bt) free(bt);
  }
  free(task);
}

// gw[g] = sum_{e in g} (v[e] x[rows[e], :])^T dy[rows[e], :] (zero for a group without entries), over blocks
// of at most mc entries (the first stored, the others added), dy's rows read in place (the last column tile from
// a zero-padded copy); gv[e] = dot(dy[rows[e], :], p[e, :]) (gv may be null), or with p_at_rows (p the
// forward's result y, each row named once) dot(dy[rows[e], :], y[rows[e], :]) / v[e]
extern "C" void scorch_grouped_weight_grad(int64_t groups, const int64_t* starts, const int64_t* rows,
                                           const float* vals, const float* x, const float* dy, const float* p,
                                           int64_t p_at_rows, int64_t d, int64_t h, float* gw, float* gv,
                                           int64_t mc, int64_t db, int64_t nthreads) {
  int64_t entries = starts[groups];
  if (gv) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t e = 0; e < entries; e++) {
      const float* a = dy + rows[e] * h;
      const float* b = p + (p_at_rows ? rows[e] : e) * h;
      float s = 0.0f;
      #pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < h; c++) s += a[c] * b[c];
      gv[e] = p_at_rows ? s / vals[e] : s;
    }
  }
  db = up(db, MR);
  int64_t dblocks = (d + db - 1) / db, tail = h % NR, hfull = h - tail;
  #pragma omp parallel num_threads(nthreads)
  {
    float* ap = (float*)aligned_alloc(64, sizeof(float) * up(mc * db, 16) + 64);
    float* bt = tail ? (float*)aligned_alloc(64, sizeof(float) * up(mc * NR, 16) + 64) : 0;
    const float** at = (const float**)malloc(sizeof(float*) * (mc + PREFETCH));
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
        for (int64_t k = 0; k < m + PREFETCH; k++) at[k] = dy + rows[lo + (k < m ? k : m - 1)] * h;
        for (int64_t t = 0; t < tiles; t++) {  // pack: x's rows weighted, MR of its columns at a time
          float* dst = ap + t * MR * m;
          int64_t c0 = d0 + t * MR, cn = dn - t * MR < MR ? dn - t * MR : MR;
          for (int64_t k = 0; k < m; k++) {
            const float* xr = x + rows[lo + k] * d + c0;
            float s = vals[lo + k];
            if (cn == MR) {
              #pragma GCC unroll 16
              for (int r = 0; r < MR; r++) dst[k * MR + r] = s * xr[r];
            } else {
              for (int r = 0; r < MR; r++) dst[k * MR + r] = r < cn ? s * xr[r] : 0.0f;
            }
          }
        }
        if (tail)
          for (int64_t k = 0; k < m; k++) {
            memcpy(bt + k * NR, at[k] + hfull, sizeof(float) * tail);
            memset(bt + k * NR + tail, 0, sizeof(float) * (NR - tail));
          }
        for (int64_t j = 0; j < h; j += NR) {
          int64_t n = h - j < NR ? h - j : NR;
          for (int64_t t = 0; t < tiles; t++) {
            vf acc[MR][NV];
            if (n == NR) tile(m, Packed{ap + t * MR * m}, Rows{at, j}, acc);
            else tile(m, Packed{ap + t * MR * m}, Strided{bt, NR}, acc);
            for (int r = 0; r < MR && t * MR + r < dn; r++)
              put(out + (d0 + t * MR + r) * h + j, acc[r], 1.0f, n, add);
          }
        }
      }
    }
    free(ap);
    if (bt) free(bt);
    free(at);
  }
}
"""

_ROUTE_SOURCE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
// The m entries (group key[e], row row[e]) sorted by group, stably: starts[g] the first entry of group g (and
// starts[groups] = m), rows_out and order the sorted rows and the entries' permutation. Returns 1 where each of
// the n rows is named exactly once, 0 otherwise, and -1 - key for a key outside [0, groups).
extern "C" int64_t scorch_grouped_route(int64_t m, const int64_t* key, const int64_t* row, int64_t groups,
                                        int64_t n, int64_t* starts, int64_t* rows_out, int64_t* order) {
  memset(starts, 0, sizeof(int64_t) * (groups + 1));
  for (int64_t e = 0; e < m; e++) {
    if (key[e] < 0 || key[e] >= groups) return -1 - key[e];
    starts[key[e] + 1]++;
  }
  for (int64_t g = 0; g < groups; g++) starts[g + 1] += starts[g];
  int64_t* next = (int64_t*)malloc(sizeof(int64_t) * (groups + 1));
  memcpy(next, starts, sizeof(int64_t) * (groups + 1));
  for (int64_t e = 0; e < m; e++) {
    int64_t at = next[key[e]]++;
    order[at] = e;
    rows_out[at] = row[e];
  }
  free(next);
  if (m != n) return 0;
  unsigned char* seen = (unsigned char*)calloc(n > 0 ? n : 1, 1);
  int64_t once = 1;
  for (int64_t e = 0; e < m && once; e++) {
    if (row[e] < 0 || row[e] >= n || seen[row[e]]) once = 0;
    else seen[row[e]] = 1;
  }
  free(seen);
  return once;
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
    """The compiled ``scorch_grouped_forward``, ``scorch_grouped_weight_grad`` or ``scorch_grouped_route``
    (every argument a pointer or an int64), built on first use."""
    k = _kernels.get(name)
    if k is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        args = {"forward": [i, p, p, p, p, p, i, i, p, p, i, i, i],
                "weight_grad": [i, p, p, p, p, p, p, i, i, i, p, p, i, i, i],
                "route": [i, p, p, i, i, p, p, p]}[name]
        k = _kernels[name] = runtime.load(_ROUTE_SOURCE if name == "route" else source(),
                                          f"scorch_grouped_{name}", args, i if name == "route" else None)
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
