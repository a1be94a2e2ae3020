#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif
#ifndef SCORCH_FIRST_ROW
#define SCORCH_FIRST_ROW
#include <cstdint>
template <class P> static inline int64_t scorch_first_row(const P* pos, int64_t lo, int64_t hi, int64_t total,
                                                          int64_t k, int64_t n) {
  if (k >= n) return hi;
  const int64_t target = (int64_t)((__int128)total * k / n), base = (int64_t)pos[lo];
  auto f = [&](int64_t r) -> int64_t { return ((int64_t)pos[r] - base) + (r - lo); };
  const int64_t g = lo + (int64_t)((__int128)(hi - lo) * k / n);
  int64_t l = g, h = g, step = 1;
  if (f(g) < target) {  // above g (f(hi) = total >= target)
    l = h = g + 1;
    while (h < hi && f(h) < target) { l = h + 1; h = hi - h > step ? h + step : hi; step *= 2; }
  } else {  // at g or below
    while (l > lo && f(l - 1) >= target) { h = l - 1; l = l - lo > step ? l - step : lo; step *= 2; }
  }
  while (l < h) { const int64_t m = l + (h - l) / 2; if (f(m) < target) l = m + 1; else h = m; }
  return l;
}
#endif
#ifndef SCORCH_HALF
#define SCORCH_HALF
#include <cstdint>
typedef float scorch_hvf32 __attribute__((vector_size(32)));
typedef float scorch_hvf32u __attribute__((vector_size(32), aligned(4), may_alias));
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
typedef int32_t scorch_hvif32 __attribute__((vector_size(32)));
static inline scorch_hvf32 scorch_hvkeep(scorch_hvf32 v, int64_t n) {
  const scorch_hvif32 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane < (int32_t)n) ? v : scorch_hvf32{};
}
#endif
template <typename I> static inline scorch_hvf32 scorch_hvgather(const float* b, const I* i) {
  scorch_hvf32 v;
  for (int u = 0; u < 8; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_hvf32 scorch_hvgathern(const float* b, const I* i, int64_t n) {
  scorch_hvf32 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
static inline scorch_hvf32 scorch_hvloadn(const float* p, int64_t n) {
  scorch_hvf32 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
static inline float scorch_hvhsum(scorch_hvf32 v0) {
  typedef float scorch_hf32_4 __attribute__((vector_size(16)));
  const scorch_hf32_4 a0 = __builtin_shufflevector(v0, v0, 0, 1, 2, 3), b0 = __builtin_shufflevector(v0, v0, 4, 5, 6, 7);
  const scorch_hf32_4 v1 = a0 + b0;
  typedef float scorch_hf32_2 __attribute__((vector_size(8)));
  const scorch_hf32_2 a1 = __builtin_shufflevector(v1, v1, 0, 1), b1 = __builtin_shufflevector(v1, v1, 2, 3);
  const scorch_hf32_2 v2 = a1 + b1;
  return v2[0] + v2[1];
}
typedef double scorch_hvf64 __attribute__((vector_size(32)));
typedef double scorch_hvf64u __attribute__((vector_size(32), aligned(8), may_alias));
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
typedef int64_t scorch_hvif64 __attribute__((vector_size(32)));
static inline scorch_hvf64 scorch_hvkeep(scorch_hvf64 v, int64_t n) {
  const scorch_hvif64 lane = {0, 1, 2, 3};
  return (lane < (int64_t)n) ? v : scorch_hvf64{};
}
#endif
template <typename I> static inline scorch_hvf64 scorch_hvgather(const double* b, const I* i) {
  scorch_hvf64 v;
  for (int u = 0; u < 4; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_hvf64 scorch_hvgathern(const double* b, const I* i, int64_t n) {
  scorch_hvf64 v = {};
  for (int u = 0; u < 4; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !(defined(__AVX512F__) && defined(__AVX512VL__))
static inline scorch_hvf64 scorch_hvloadn(const double* p, int64_t n) {
  scorch_hvf64 v = {};
  for (int u = 0; u < 4; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
static inline double scorch_hvhsum(scorch_hvf64 v0) {
  typedef double scorch_hf64_2 __attribute__((vector_size(16)));
  const scorch_hf64_2 a0 = __builtin_shufflevector(v0, v0, 0, 1), b0 = __builtin_shufflevector(v0, v0, 2, 3);
  const scorch_hf64_2 v1 = a0 + b0;
  return v1[0] + v1[1];
}
#if defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
static inline __mmask8 scorch_hvmask(int64_t n, int lanes) {  // (no branch: a For.lead vector's count varies)
  int64_t c = n < 0 ? 0 : n;
  c = c < lanes ? c : lanes;
#ifdef __BMI2__
  return (__mmask8)_bzhi_u32(0xFFu, (unsigned)c);
#else
  return (__mmask8)((1u << c) - 1);
#endif
}
static inline scorch_hvf32 scorch_hvgather(const float* b, const int32_t* i) {
  return (scorch_hvf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}
static inline scorch_hvf32 scorch_hvgathern(const float* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_hvmask(n, 8);
  return (scorch_hvf32)_mm256_mmask_i32gather_ps(_mm256_setzero_ps(), m, _mm256_maskz_loadu_epi32(m, i), b, 4);
}
static inline scorch_hvf32 scorch_hvloadn(const float* p, int64_t n) {
  return (scorch_hvf32)_mm256_maskz_loadu_ps(scorch_hvmask(n, 8), p);
}
static inline scorch_hvf32 scorch_hvkeep(scorch_hvf32 v, int64_t n) {
  return (scorch_hvf32)_mm256_maskz_mov_ps(scorch_hvmask(n, 8), (__m256)v);
}
static inline scorch_hvf64 scorch_hvgather(const double* b, const int32_t* i) {
  return (scorch_hvf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}
static inline scorch_hvf64 scorch_hvgathern(const double* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_hvmask(n, 4);
  return (scorch_hvf64)_mm256_mmask_i32gather_pd(_mm256_setzero_pd(), m, _mm_maskz_loadu_epi32(m, i), b, 8);
}
static inline scorch_hvf64 scorch_hvloadn(const double* p, int64_t n) {
  return (scorch_hvf64)_mm256_maskz_loadu_pd(scorch_hvmask(n, 4), p);
}
static inline scorch_hvf64 scorch_hvkeep(scorch_hvf64 v, int64_t n) {
  return (scorch_hvf64)_mm256_maskz_mov_pd(scorch_hvmask(n, 4), (__m256d)v);
}
#endif
#endif

extern "C" void scorch_kernel(
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    const int32_t* __restrict__ t0_l1_pos,
    int64_t n0_arg,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n1_arg,
    float* __restrict__ out,
    const float* __restrict__ t0_vals,
    const float* __restrict__ t1,
    int64_t t1_s0_arg,
    int64_t t0_l1_mean_arg,
    int64_t nthreads_arg)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
  const int64_t t0_l1_mean = (int64_t)t0_l1_mean_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  {
    int64_t next_6 = 0;
    #pragma omp parallel num_threads(nthreads)
    {
      const int64_t lo_1 = t0_l0_lo, hi_2 = (t0_l0_lo + t0_l0_ext);
      const int64_t parts_4 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
      const int64_t total_5 = ((int64_t)t0_l1_pos[hi_2] - (int64_t)t0_l1_pos[lo_1]) + (hi_2 - lo_1);
      for (;;) {
        int64_t part_3;
        #pragma omp atomic capture
        part_3 = next_6++;
        if (part_3 >= parts_4) break;
        const int64_t r0 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_5, part_3, parts_4), r1 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_5, part_3 + 1, parts_4);
        for (int64_t c0 = r0; c0 < r1; ++c0) {
          const int64_t p0 = (c0 - t0_l0_lo);
          const int64_t d0 = c0;
          scorch_hvf32 vsum[1] = {};
          {
            const int64_t end_7 = ((int64_t)t0_l1_pos[(p0 + INT64_C(1))]);
            int64_t p1 = ((int64_t)t0_l1_pos[p0]);
            const int64_t lead_9 = (t0_l1_mean + 7) / 8;
            {
              const int64_t left_8 = end_7 - p1;
              vsum[INT64_C(0)] += scorch_hvkeep((scorch_hvloadn(&t0_vals[p1], left_8) * scorch_hvgathern(t1, &t0_l1_crd[p1], left_8)), left_8);
            }
            p1 += 8;
            if (lead_9 >= 2) {
              {
                const int64_t left_8 = end_7 - p1;
                vsum[INT64_C(0)] += scorch_hvkeep((scorch_hvloadn(&t0_vals[p1], left_8) * scorch_hvgathern(t1, &t0_l1_crd[p1], left_8)), left_8);
              }
              p1 += 8;
              if (lead_9 >= 3) {
                {
                  const int64_t left_8 = end_7 - p1;
                  vsum[INT64_C(0)] += scorch_hvkeep((scorch_hvloadn(&t0_vals[p1], left_8) * scorch_hvgathern(t1, &t0_l1_crd[p1], left_8)), left_8);
                }
                p1 += 8;
              }
            }
            for (; p1 + 8 <= end_7; p1 += 8) {
              vsum[INT64_C(0)] += ((*(const scorch_hvf32u*)(&t0_vals[p1])) * scorch_hvgather(t1, &t0_l1_crd[p1]));
            }
            if (p1 < end_7) {
              const int64_t left_8 = end_7 - p1;
              vsum[INT64_C(0)] += scorch_hvkeep((scorch_hvloadn(&t0_vals[p1], left_8) * scorch_hvgathern(t1, &t0_l1_crd[p1], left_8)), left_8);
            }
          }
          out[d0] = scorch_hvhsum(vsum[INT64_C(0)]);
        }
      }
    }
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel(a[0], a[1], (const int32_t*)(intptr_t)a[2], a[3], (const int32_t*)(intptr_t)a[4], a[5], a[6], a[7], (float*)(intptr_t)a[8], (const float*)(intptr_t)a[9], (const float*)(intptr_t)a[10], a[11], a[12], a[13]);
}
