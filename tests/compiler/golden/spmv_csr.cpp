#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif
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
#ifndef SCORCH_GATHER
#define SCORCH_GATHER
typedef int32_t scorch_vif32 __attribute__((vector_size(64)));
static inline scorch_vf32 scorch_keep(scorch_vf32 v, int64_t n) {
  const scorch_vif32 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (lane < (int32_t)n) ? v : scorch_vf32{};
}
template <typename I> static inline scorch_vf32 scorch_gather(const float* b, const I* i) {
  scorch_vf32 v;
  for (int u = 0; u < 16; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf32 scorch_gathern(const float* b, const I* i, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
typedef int64_t scorch_vif64 __attribute__((vector_size(64)));
static inline scorch_vf64 scorch_keep(scorch_vf64 v, int64_t n) {
  const scorch_vif64 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane < (int64_t)n) ? v : scorch_vf64{};
}
template <typename I> static inline scorch_vf64 scorch_gather(const double* b, const I* i) {
  scorch_vf64 v;
  for (int u = 0; u < 8; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf64 scorch_gathern(const double* b, const I* i, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
#if defined(__AVX2__) && 64 == 32
#include <immintrin.h>
static inline __m256i scorch_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __m256i m = scorch_mask8(n);
  return (scorch_vf32)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), b, _mm256_maskload_epi32(i, m),
                                               _mm256_castsi256_ps(m), 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm256_maskload_ps(p, scorch_mask8(n));
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_mask_i32gather_pd(_mm256_setzero_pd(), b, _mm_maskload_epi32(i, m),
                                               _mm256_castsi256_pd(_mm256_cvtepi32_epi64(m)), 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_maskload_pd(p, _mm256_cvtepi32_epi64(m));
}
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64
#include <immintrin.h>
static inline __mmask16 scorch_kmask16(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1); }
static inline __mmask8 scorch_kmask8(int64_t n) { return (__mmask8)(n >= 8 ? 0xFF : (1u << n) - 1); }
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm512_i32gather_ps(_mm512_loadu_si512((const void*)i), b, 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __mmask16 m = scorch_kmask16(n);
  return (scorch_vf32)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, _mm512_maskz_loadu_epi32(m, i), b, 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm512_maskz_loadu_ps(scorch_kmask16(n), p);
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm512_i32gather_pd(_mm256_loadu_si256((const __m256i*)i), b, 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_kmask8(n);
  return (scorch_vf64)_mm512_mask_i32gather_pd(_mm512_setzero_pd(), m, _mm256_maskz_loadu_epi32(m, i), b, 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  return (scorch_vf64)_mm512_maskz_loadu_pd(scorch_kmask8(n), p);
}
#endif
#endif
#ifndef SCORCH_GATHER
#define SCORCH_GATHER
typedef int32_t scorch_vif32 __attribute__((vector_size(64)));
static inline scorch_vf32 scorch_keep(scorch_vf32 v, int64_t n) {
  const scorch_vif32 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (lane < (int32_t)n) ? v : scorch_vf32{};
}
template <typename I> static inline scorch_vf32 scorch_gather(const float* b, const I* i) {
  scorch_vf32 v;
  for (int u = 0; u < 16; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf32 scorch_gathern(const float* b, const I* i, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
typedef int64_t scorch_vif64 __attribute__((vector_size(64)));
static inline scorch_vf64 scorch_keep(scorch_vf64 v, int64_t n) {
  const scorch_vif64 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane < (int64_t)n) ? v : scorch_vf64{};
}
template <typename I> static inline scorch_vf64 scorch_gather(const double* b, const I* i) {
  scorch_vf64 v;
  for (int u = 0; u < 8; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf64 scorch_gathern(const double* b, const I* i, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
#if defined(__AVX2__) && 64 == 32
#include <immintrin.h>
static inline __m256i scorch_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __m256i m = scorch_mask8(n);
  return (scorch_vf32)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), b, _mm256_maskload_epi32(i, m),
                                               _mm256_castsi256_ps(m), 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm256_maskload_ps(p, scorch_mask8(n));
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_mask_i32gather_pd(_mm256_setzero_pd(), b, _mm_maskload_epi32(i, m),
                                               _mm256_castsi256_pd(_mm256_cvtepi32_epi64(m)), 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_maskload_pd(p, _mm256_cvtepi32_epi64(m));
}
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64
#include <immintrin.h>
static inline __mmask16 scorch_kmask16(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1); }
static inline __mmask8 scorch_kmask8(int64_t n) { return (__mmask8)(n >= 8 ? 0xFF : (1u << n) - 1); }
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm512_i32gather_ps(_mm512_loadu_si512((const void*)i), b, 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __mmask16 m = scorch_kmask16(n);
  return (scorch_vf32)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, _mm512_maskz_loadu_epi32(m, i), b, 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm512_maskz_loadu_ps(scorch_kmask16(n), p);
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm512_i32gather_pd(_mm256_loadu_si256((const __m256i*)i), b, 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_kmask8(n);
  return (scorch_vf64)_mm512_mask_i32gather_pd(_mm512_setzero_pd(), m, _mm256_maskz_loadu_epi32(m, i), b, 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  return (scorch_vf64)_mm512_maskz_loadu_pd(scorch_kmask8(n), p);
}
#endif
#endif
#ifndef SCORCH_GATHER
#define SCORCH_GATHER
typedef int32_t scorch_vif32 __attribute__((vector_size(64)));
static inline scorch_vf32 scorch_keep(scorch_vf32 v, int64_t n) {
  const scorch_vif32 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (lane < (int32_t)n) ? v : scorch_vf32{};
}
template <typename I> static inline scorch_vf32 scorch_gather(const float* b, const I* i) {
  scorch_vf32 v;
  for (int u = 0; u < 16; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf32 scorch_gathern(const float* b, const I* i, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  scorch_vf32 v = {};
  for (int u = 0; u < 16; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
typedef int64_t scorch_vif64 __attribute__((vector_size(64)));
static inline scorch_vf64 scorch_keep(scorch_vf64 v, int64_t n) {
  const scorch_vif64 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane < (int64_t)n) ? v : scorch_vf64{};
}
template <typename I> static inline scorch_vf64 scorch_gather(const double* b, const I* i) {
  scorch_vf64 v;
  for (int u = 0; u < 8; ++u) v[u] = b[i[u]];
  return v;
}
template <typename I> static inline scorch_vf64 scorch_gathern(const double* b, const I* i, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}
#if !((defined(__AVX2__) && 64 == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64))
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  scorch_vf64 v = {};
  for (int u = 0; u < 8; ++u) if (u < n) v[u] = p[u];
  return v;
}
#endif
#if defined(__AVX2__) && 64 == 32
#include <immintrin.h>
static inline __m256i scorch_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __m256i m = scorch_mask8(n);
  return (scorch_vf32)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), b, _mm256_maskload_epi32(i, m),
                                               _mm256_castsi256_ps(m), 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm256_maskload_ps(p, scorch_mask8(n));
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_mask_i32gather_pd(_mm256_setzero_pd(), b, _mm_maskload_epi32(i, m),
                                               _mm256_castsi256_pd(_mm256_cvtepi32_epi64(m)), 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_maskload_pd(p, _mm256_cvtepi32_epi64(m));
}
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__) && 64 == 64
#include <immintrin.h>
static inline __mmask16 scorch_kmask16(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1); }
static inline __mmask8 scorch_kmask8(int64_t n) { return (__mmask8)(n >= 8 ? 0xFF : (1u << n) - 1); }
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {
  return (scorch_vf32)_mm512_i32gather_ps(_mm512_loadu_si512((const void*)i), b, 4);
}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {
  const __mmask16 m = scorch_kmask16(n);
  return (scorch_vf32)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, _mm512_maskz_loadu_epi32(m, i), b, 4);
}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {
  return (scorch_vf32)_mm512_maskz_loadu_ps(scorch_kmask16(n), p);
}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {
  return (scorch_vf64)_mm512_i32gather_pd(_mm256_loadu_si256((const __m256i*)i), b, 8);
}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_kmask8(n);
  return (scorch_vf64)_mm512_mask_i32gather_pd(_mm512_setzero_pd(), m, _mm256_maskz_loadu_epi32(m, i), b, 8);
}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {
  return (scorch_vf64)_mm512_maskz_loadu_pd(scorch_kmask8(n), p);
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
    int64_t nthreads_arg)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  #pragma omp parallel num_threads(nthreads)
  {
    const int64_t lo_1 = t0_l0_lo, hi_2 = (t0_l0_lo + t0_l0_ext);
    const int64_t parts_4 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
    const int64_t total_5 = ((int64_t)t0_l1_pos[hi_2] - (int64_t)t0_l1_pos[lo_1]) + (hi_2 - lo_1);
    auto first_row = [&](int64_t k) -> int64_t {
      if (k >= parts_4) return hi_2;
      const int64_t target = (int64_t)((__int128)total_5 * k / parts_4);
      int64_t l = lo_1, h = hi_2;
      while (l < h) { int64_t m = l + (h - l) / 2; if (((int64_t)t0_l1_pos[m] - (int64_t)t0_l1_pos[lo_1]) + (m - lo_1) < target) l = m + 1; else h = m; }
      return l;
    };
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t part_3 = 0; part_3 < parts_4; ++part_3) {
      const int64_t r0 = first_row(part_3), r1 = first_row(part_3 + 1);
      for (int64_t c0 = r0; c0 < r1; ++c0) {
        const int64_t p0 = (c0 - t0_l0_lo);
        const int64_t d0 = c0;
        scorch_vf32 vsum[1] = {};
        {
          const int64_t end_6 = ((int64_t)t0_l1_pos[(p0 + INT64_C(1))]);
          int64_t p1 = ((int64_t)t0_l1_pos[p0]);
          for (; p1 + 16 <= end_6; p1 += 16) {
            vsum[INT64_C(0)] += ((*(const scorch_vf32u*)(&t0_vals[p1])) * scorch_gather(t1, &t0_l1_crd[p1]));
          }
          if (p1 < end_6) {
            const int64_t left_7 = end_6 - p1;
            vsum[INT64_C(0)] += scorch_keep((scorch_loadn(&t0_vals[p1], left_7) * scorch_gathern(t1, &t0_l1_crd[p1], left_7)), left_7);
          }
        }
        out[d0] = scorch_hsum(vsum[INT64_C(0)]);
      }
    }
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel(a[0], a[1], (const int32_t*)(intptr_t)a[2], a[3], (const int32_t*)(intptr_t)a[4], a[5], a[6], a[7], (float*)(intptr_t)a[8], (const float*)(intptr_t)a[9], (const float*)(intptr_t)a[10], a[11], a[12]);
}
