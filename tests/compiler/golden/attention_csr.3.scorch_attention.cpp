#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif
#include <cmath>
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
#include <cstdint>
#include <cmath>
static inline float scorch_expf(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365478515625f;
  const float c = x < lo ? lo : (x > hi ? hi : x);
  const float n = __builtin_floorf(c * 1.44269504088896341f + 0.5f);
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float scale = __builtin_bit_cast(float, (int32_t)((int32_t)n + 127) << 23);
  float y = (p * r * r + r + 1.0f) * scale;
  y = x < lo ? 0.0f : y;
  y = x > hi ? INFINITY : y;
  return x != x ? x : y;
}
typedef float scorch_vf32 __attribute__((vector_size(64)));
typedef float scorch_vf32u __attribute__((vector_size(64), aligned(4), may_alias));
typedef double scorch_vf64 __attribute__((vector_size(64)));
typedef double scorch_vf64u __attribute__((vector_size(64), aligned(8), may_alias));
static inline float scorch_hsum(scorch_vf32 v0) {
  typedef float scorch_hf32_8 __attribute__((vector_size(32)));
  const scorch_hf32_8 a0 = __builtin_shufflevector(v0, v0, 0, 1, 2, 3, 4, 5, 6, 7), b0 = __builtin_shufflevector(v0, v0, 8, 9, 10, 11, 12, 13, 14, 15);
  const scorch_hf32_8 v1 = a0 + b0;
  typedef float scorch_hf32_4 __attribute__((vector_size(16)));
  const scorch_hf32_4 a1 = __builtin_shufflevector(v1, v1, 0, 1, 2, 3), b1 = __builtin_shufflevector(v1, v1, 4, 5, 6, 7);
  const scorch_hf32_4 v2 = a1 + b1;
  typedef float scorch_hf32_2 __attribute__((vector_size(8)));
  const scorch_hf32_2 a2 = __builtin_shufflevector(v2, v2, 0, 1), b2 = __builtin_shufflevector(v2, v2, 2, 3);
  const scorch_hf32_2 v3 = a2 + b2;
  return v3[0] + v3[1];
}
static inline float scorch_hmax(scorch_vf32 v0) {
  typedef float scorch_hf32_8 __attribute__((vector_size(32)));
  const scorch_hf32_8 a0 = __builtin_shufflevector(v0, v0, 0, 1, 2, 3, 4, 5, 6, 7), b0 = __builtin_shufflevector(v0, v0, 8, 9, 10, 11, 12, 13, 14, 15);
  const scorch_hf32_8 v1 = (a0 > b0 ? a0 : b0);
  typedef float scorch_hf32_4 __attribute__((vector_size(16)));
  const scorch_hf32_4 a1 = __builtin_shufflevector(v1, v1, 0, 1, 2, 3), b1 = __builtin_shufflevector(v1, v1, 4, 5, 6, 7);
  const scorch_hf32_4 v2 = (a1 > b1 ? a1 : b1);
  typedef float scorch_hf32_2 __attribute__((vector_size(8)));
  const scorch_hf32_2 a2 = __builtin_shufflevector(v2, v2, 0, 1), b2 = __builtin_shufflevector(v2, v2, 2, 3);
  const scorch_hf32_2 v3 = (a2 > b2 ? a2 : b2);
  return (v3[0] > v3[1] ? v3[0] : v3[1]);
}
static inline void scorch_tsum(const scorch_vf32* v0, float* out) {
  scorch_vf32 v1[8];
  for (int u = 0; u < 8; ++u) v1[u] = __builtin_shufflevector(v0[2 * u], v0[2 * u + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + __builtin_shufflevector(v0[2 * u], v0[2 * u + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  scorch_vf32 v2[4];
  for (int u = 0; u < 4; ++u) v2[u] = __builtin_shufflevector(v1[2 * u], v1[2 * u + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + __builtin_shufflevector(v1[2 * u], v1[2 * u + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  scorch_vf32 v3[2];
  for (int u = 0; u < 2; ++u) v3[u] = __builtin_shufflevector(v2[2 * u], v2[2 * u + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + __builtin_shufflevector(v2[2 * u], v2[2 * u + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  scorch_vf32 v4[1];
  for (int u = 0; u < 1; ++u) v4[u] = __builtin_shufflevector(v3[2 * u], v3[2 * u + 1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + __builtin_shufflevector(v3[2 * u], v3[2 * u + 1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  *(scorch_vf32u*)out = v4[0];
}
static inline double scorch_hsum(scorch_vf64 v0) {
  typedef double scorch_hf64_4 __attribute__((vector_size(32)));
  const scorch_hf64_4 a0 = __builtin_shufflevector(v0, v0, 0, 1, 2, 3), b0 = __builtin_shufflevector(v0, v0, 4, 5, 6, 7);
  const scorch_hf64_4 v1 = a0 + b0;
  typedef double scorch_hf64_2 __attribute__((vector_size(16)));
  const scorch_hf64_2 a1 = __builtin_shufflevector(v1, v1, 0, 1), b1 = __builtin_shufflevector(v1, v1, 2, 3);
  const scorch_hf64_2 v2 = a1 + b1;
  return v2[0] + v2[1];
}
static inline double scorch_hmax(scorch_vf64 v0) {
  typedef double scorch_hf64_4 __attribute__((vector_size(32)));
  const scorch_hf64_4 a0 = __builtin_shufflevector(v0, v0, 0, 1, 2, 3), b0 = __builtin_shufflevector(v0, v0, 4, 5, 6, 7);
  const scorch_hf64_4 v1 = (a0 > b0 ? a0 : b0);
  typedef double scorch_hf64_2 __attribute__((vector_size(16)));
  const scorch_hf64_2 a1 = __builtin_shufflevector(v1, v1, 0, 1), b1 = __builtin_shufflevector(v1, v1, 2, 3);
  const scorch_hf64_2 v2 = (a1 > b1 ? a1 : b1);
  return (v2[0] > v2[1] ? v2[0] : v2[1]);
}
static inline void scorch_tsum(const scorch_vf64* v0, double* out) {
  scorch_vf64 v1[4];
  for (int u = 0; u < 4; ++u) v1[u] = __builtin_shufflevector(v0[2 * u], v0[2 * u + 1], 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(v0[2 * u], v0[2 * u + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  scorch_vf64 v2[2];
  for (int u = 0; u < 2; ++u) v2[u] = __builtin_shufflevector(v1[2 * u], v1[2 * u + 1], 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(v1[2 * u], v1[2 * u + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  scorch_vf64 v3[1];
  for (int u = 0; u < 1; ++u) v3[u] = __builtin_shufflevector(v2[2 * u], v2[2 * u + 1], 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(v2[2 * u], v2[2 * u + 1], 1, 3, 5, 7, 9, 11, 13, 15);
  *(scorch_vf64u*)out = v3[0];
}
#include <cstdint>
#include <cstdlib>
struct scorch_buf {
  void* raw;
  void* p;
  scorch_buf(size_t n, size_t size) : raw(std::calloc((n ? n : 1) * size + 63, 1)),
    p((void*)(((uintptr_t)raw + 63) & ~(uintptr_t)63)) {}
  ~scorch_buf() { std::free(raw); }
};

extern "C" void scorch_attention(
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    const int32_t* __restrict__ t0_l1_pos,
    int64_t f0_n0_arg,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t f0_n1_arg,
    const float* __restrict__ f0_t1,
    int64_t f0_t1_s0_arg,
    const float* __restrict__ f0_t2,
    int64_t f0_t2_s0_arg,
    int64_t nthreads_arg,
    int64_t f2_n0_arg,
    int64_t f2_n2_arg,
    float* __restrict__ out,
    const float* __restrict__ f2_t1,
    int64_t f2_t1_s0_arg,
    double scale_arg,
    int64_t longest_arg)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t f0_n0 = (int64_t)f0_n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t f0_n1 = (int64_t)f0_n1_arg;
  const int64_t f0_t1_s0 = (int64_t)f0_t1_s0_arg;
  const int64_t f0_t2_s0 = (int64_t)f0_t2_s0_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  const int64_t f2_n0 = (int64_t)f2_n0_arg;
  const int64_t f2_n2 = (int64_t)f2_n2_arg;
  const int64_t f2_t1_s0 = (int64_t)f2_t1_s0_arg;
  const float scale = (float)scale_arg;
  const int64_t longest = (int64_t)longest_arg;
  {
    int64_t next_8 = 0;
    #pragma omp parallel num_threads(nthreads)
    {
      scorch_buf buf_1((size_t)(longest), sizeof(float));
      float* __restrict__ scores_row = static_cast<float*>(buf_1.p);
      scorch_buf buf_2((size_t)(longest), sizeof(float));
      float* __restrict__ probs_row = static_cast<float*>(buf_2.p);
      const int64_t lo_3 = t0_l0_lo, hi_4 = (t0_l0_lo + t0_l0_ext);
      const int64_t parts_6 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
      const int64_t total_7 = ((int64_t)t0_l1_pos[hi_4] - (int64_t)t0_l1_pos[lo_3]) + (hi_4 - lo_3);
      for (;;) {
        int64_t part_5;
        #pragma omp atomic capture
        part_5 = next_8++;
        if (part_5 >= parts_6) break;
        const int64_t r0 = scorch_first_row(t0_l1_pos, lo_3, hi_4, total_7, part_5, parts_6), r1 = scorch_first_row(t0_l1_pos, lo_3, hi_4, total_7, part_5 + 1, parts_6);
        for (int64_t row = r0; row < r1; ++row) {
          const int64_t row_base = ((int64_t)t0_l1_pos[(row - t0_l0_lo)]);
          scorch_vf32 smax[1];
          for (int64_t w_9 = 0; w_9 < 1; ++w_9) smax[w_9] = scorch_vf32{} + -INFINITY;
          const int64_t p0_f0 = (row - t0_l0_lo);
          const int64_t d0_f0 = row;
          for (int64_t p1_f0 = ((int64_t)t0_l1_pos[p0_f0]); p1_f0 < ((int64_t)t0_l1_pos[(p0_f0 + INT64_C(1))]); ++p1_f0) {
            float acc_f0 = 0.0f;
            const int64_t c1_f0 = ((int64_t)t0_l1_crd[p1_f0]);
            const int64_t d1_f0 = c1_f0;
            #pragma omp simd reduction(+:acc_f0)
            for (int64_t x2_f0 = INT64_C(0); x2_f0 < INT64_C(4); ++x2_f0) {
              acc_f0 += ((1.0f * f0_t1[((d0_f0 * INT64_C(4)) + x2_f0)]) * f0_t2[((d1_f0 * INT64_C(4)) + x2_f0)]);
            }
            scores_row[(p1_f0 - row_base)] = (acc_f0 * scale);
            { const scorch_vf32 u_ = scorch_vf32{} + ((acc_f0 * scale)); smax[INT64_C(0)] = u_ > smax[INT64_C(0)] ? u_ : smax[INT64_C(0)]; }
          }
          const int64_t p0_f1 = (row - t0_l0_lo);
          const int64_t lo_f1 = ((int64_t)t0_l1_pos[p0_f1]);
          const int64_t hi_f1 = ((int64_t)t0_l1_pos[(p0_f1 + INT64_C(1))]);
          float inv_f1 = 0.0f;
          if ((lo_f1 < hi_f1)) {
            float peak_f1 = scorch_hmax(smax[INT64_C(0)]);
            if ((!(peak_f1 > -INFINITY))) {
              peak_f1 = 0.0f;
            }
            float total_f1 = 0.0f;
            #pragma omp simd reduction(+:total_f1)
            for (int64_t p_f1 = lo_f1; p_f1 < hi_f1; ++p_f1) {
              const float e_f1 = scorch_expf((scores_row[(p_f1 - row_base)] - peak_f1));
              probs_row[(p_f1 - row_base)] = e_f1;
              total_f1 += e_f1;
            }
            inv_f1 = (1.0f / total_f1);
          }
          const int64_t p0_f2 = (row - t0_l0_lo);
          const int64_t d0_f2 = row;
          float wrow_f2[4];
          for (int64_t w_10 = 0; w_10 < 4; ++w_10) wrow_f2[w_10] = 0.0f;
          for (int64_t p1_f2 = ((int64_t)t0_l1_pos[p0_f2]); p1_f2 < ((int64_t)t0_l1_pos[(p0_f2 + INT64_C(1))]); ++p1_f2) {
            const int64_t c1_f2 = ((int64_t)t0_l1_crd[p1_f2]);
            const int64_t d1_f2 = c1_f2;
            #pragma omp simd
            for (int64_t x1_f2 = INT64_C(0); x1_f2 < INT64_C(4); ++x1_f2) {
              wrow_f2[x1_f2] += (probs_row[(p1_f2 - row_base)] * f2_t1[((d1_f2 * INT64_C(4)) + x1_f2)]);
            }
          }
          #pragma omp simd
          for (int64_t x1_f2 = INT64_C(0); x1_f2 < INT64_C(4); ++x1_f2) {
            out[((d0_f2 * INT64_C(4)) + x1_f2)] = (wrow_f2[x1_f2] * inv_f1);
          }
        }
      }
    }
  }
}
extern "C" void scorch_attention_packed(const int64_t* a) {
  scorch_attention(a[0], a[1], (const int32_t*)(intptr_t)a[2], a[3], (const int32_t*)(intptr_t)a[4], a[5], a[6], a[7], (const float*)(intptr_t)a[8], a[9], (const float*)(intptr_t)a[10], a[11], a[12], a[13], a[14], (float*)(intptr_t)a[15], (const float*)(intptr_t)a[16], a[17], __builtin_bit_cast(double, a[18]), a[19]);
}
