// Hand-written CSR x dense SpMM, the yardstick for scorch's generated kernel (Y = A @ X, A: m x n CSR with
// int32 indices, X: n x K row-major, Y: m x K row-major, all float32). K is fixed at compile time: the
// Python side prepends `#define BENCH_K <K>` before this file. Every variant writes each output row once (no
// zero-fill needed) and splits the rows between threads so each gets about the same rows + nonzeros, which
// keeps a power-law graph's 12k-nonzero rows from landing on one thread with a static split.
//
// Variants (extern "C", same signature):
//   spmm_simd     a float[K] accumulator per row, `#pragma omp simd` loops; the compiler picks the width.
//                 Under GCC 12's plain -O3 (loop unroll-and-jam on) this turns into gathers, see spmm_gen_acc
//                 below; with -fno-loop-unroll-and-jam (in scorch's flags since) it is competitive
//   spmm_vec16    GCC vector extensions, K/16 zmm accumulators held in registers across the row
//   spmm_vec16_u2 the same, two nonzeros per step into two accumulator sets (breaks the FMA dependency chain
//                 for small K), summed at the end of the row
//   spmm_vec16_pf vec16_u2 plus a software prefetch of the X row DIST nonzeros ahead
//   spmm_vec8_u2  256-bit vectors (AVX2 width; avoids AVX-512 frequency drops on some parts)
// The vector variants exist where the vector width divides K. After them come ablation variants that mimic
// the generated kernel (see the end of the file).
#include <cstdint>
#include <cstring>
#include <omp.h>

#ifndef BENCH_K
#error "define BENCH_K (the dense width) before including this file"
#endif
constexpr int K = BENCH_K;

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

template <typename V>
static inline V loadu(const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
template <typename V>
static inline void storeu(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }

// Rows [r0, r1) of thread t out of nt, weighing each row by 1 + its nonzeros.
static inline void row_range(const int32_t* pos, int64_t m, int64_t t, int64_t nt, int64_t& r0, int64_t& r1) {
  const int64_t total = (int64_t)pos[m] + m;
  auto first = [&](int64_t k) -> int64_t {
    if (k >= nt) return m;
    const int64_t target = total * k / nt;
    int64_t lo = 0, hi = m;
    while (lo < hi) { int64_t mid = (lo + hi) / 2; if ((int64_t)pos[mid] + mid < target) lo = mid + 1; else hi = mid; }
    return lo;
  };
  r0 = first(t); r1 = first(t + 1);
}

// Calls row(i) for every row, split between nthreads threads by row_range.
template <typename Row>
static inline void parallel_rows(const int32_t* pos, int64_t m, int64_t nthreads, Row row) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    row_range(pos, m, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t i = r0; i < r1; ++i) row(i);
  }
}

static inline void row_simd(int64_t i, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,
                            const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y) {
  float acc[K];
#pragma omp simd
  for (int k = 0; k < K; ++k) acc[k] = 0.0f;
  for (int32_t p = pos[i]; p < pos[i + 1]; ++p) {
    const float a = val[p];
    const float* __restrict__ xr = x + (int64_t)crd[p] * K;
#pragma omp simd
    for (int k = 0; k < K; ++k) acc[k] += a * xr[k];
  }
#pragma omp simd
  for (int k = 0; k < K; ++k) y[i * K + k] = acc[k];
}

extern "C" void spmm_simd(int64_t m, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,
                          const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y,
                          int64_t nthreads) {
  parallel_rows(pos, m, nthreads, [=](int64_t i) { row_simd(i, pos, crd, val, x, y); });
}

template <typename V, int UNROLL, int DIST>
static inline void row_vec(int64_t i, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,
                           const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y) {
  constexpr int W = sizeof(V) / sizeof(float);
  constexpr int NV = K / W;
  V acc[UNROLL][NV];
  for (int u = 0; u < UNROLL; ++u)
    for (int v = 0; v < NV; ++v) acc[u][v] = V{};
  int32_t p = pos[i];
  const int32_t end = pos[i + 1];
  for (; p + UNROLL <= end; p += UNROLL) {
    for (int u = 0; u < UNROLL; ++u) {
      if (DIST > 0 && p + u + DIST < end) __builtin_prefetch(x + (int64_t)crd[p + u + DIST] * K, 0, 3);
      const float* __restrict__ xr = x + (int64_t)crd[p + u] * K;
      const float a = val[p + u];
      for (int v = 0; v < NV; ++v) acc[u][v] += a * loadu<V>(xr + v * W);
    }
  }
  for (; p < end; ++p) {
    const float* __restrict__ xr = x + (int64_t)crd[p] * K;
    const float a = val[p];
    for (int v = 0; v < NV; ++v) acc[0][v] += a * loadu<V>(xr + v * W);
  }
  for (int u = 1; u < UNROLL; ++u)
    for (int v = 0; v < NV; ++v) acc[0][v] += acc[u][v];
  for (int v = 0; v < NV; ++v) storeu<V>(y + i * K + v * W, acc[0][v]);
}

#define BENCH_VARIANT(NAME, V, UNROLL, DIST)                                                              \
  extern "C" void NAME(int64_t m, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,       \
                       const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y, \
                       int64_t nthreads) {                                                               \
    parallel_rows(pos, m, nthreads, [=](int64_t i) { row_vec<V, UNROLL, DIST>(i, pos, crd, val, x, y); }); \
  }

#if BENCH_K % 16 == 0
BENCH_VARIANT(spmm_vec16, v16, 1, 0)
BENCH_VARIANT(spmm_vec16_u2, v16, 2, 0)
BENCH_VARIANT(spmm_vec16_pf, v16, 2, 16)
#endif
#if BENCH_K % 8 == 0
BENCH_VARIANT(spmm_vec8_u2, v8, 2, 0)
#endif

// --- Ablation: the loops scorch generates, then one change at a time. Not candidates for the yardstick; they
// show what each difference between the generated kernel and the hand kernel costs. Like the generated code
// (and unlike the variants above), the loops sit directly in the OpenMP region. hand.py also builds these with
// 512-bit vectors allowed and with GCC's loop unroll-and-jam pass off.

// As generated: out[i, :] += val * X[j, :] for every nonzero (the output row is read and written per nonzero),
// except that the row is zeroed here instead of by a separate torch.zeros pass over the whole output.
extern "C" void spmm_gen_rmw(int64_t m, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,
                             const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y,
                             int64_t nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    row_range(pos, m, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t k = 0; k < K; ++k) y[i * K + k] = 0.0f;
      for (int64_t p = (int64_t)pos[i]; p < (int64_t)pos[i + 1]; ++p) {
        const int64_t j = (int64_t)crd[p];
        for (int64_t k = 0; k < K; ++k) y[i * K + k] += val[p] * x[j * K + k];
      }
    }
  }
}

// The same loop with the row accumulated in a local array and stored once (a row workspace, as scorch now
// emits). At -O3 GCC 12's unroll-and-jam fuses two nonzeros' iterations of the p loop and the vectorizer then
// loads the second nonzero's X row with gathers (vgatherqps), keeping the accumulators on the stack; with
// -fno-loop-unroll-and-jam the loads are contiguous again.
extern "C" void spmm_gen_acc(int64_t m, const int32_t* __restrict__ pos, const int32_t* __restrict__ crd,
                             const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y,
                             int64_t nthreads) {
#pragma omp parallel num_threads(nthreads)
  {
    int64_t r0, r1;
    row_range(pos, m, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t i = r0; i < r1; ++i) {
      float acc[K] = {};
      for (int64_t p = (int64_t)pos[i]; p < (int64_t)pos[i + 1]; ++p) {
        const int64_t j = (int64_t)crd[p];
        for (int64_t k = 0; k < K; ++k) acc[k] += val[p] * x[j * K + k];
      }
      for (int64_t k = 0; k < K; ++k) y[i * K + k] = acc[k];
    }
  }
}
