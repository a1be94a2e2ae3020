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
#include <cstdint>
template <class T> static inline T scorch_pick(bool c, T a, T b) { return c ? a : b; }
template <> inline float scorch_pick<float>(bool c, float a, float b) {
  const uint32_t m = 0u - (uint32_t)c;
  return __builtin_bit_cast(float, (__builtin_bit_cast(uint32_t, a) & m) | (__builtin_bit_cast(uint32_t, b) & ~m));
}
template <> inline double scorch_pick<double>(bool c, double a, double b) {
  const uint64_t m = 0ull - (uint64_t)c;
  return __builtin_bit_cast(double, (__builtin_bit_cast(uint64_t, a) & m) | (__builtin_bit_cast(uint64_t, b) & ~m));
}

extern "C" void scorch_fill(
    int64_t n1_arg,
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    int64_t t1_l0_lo_arg,
    int64_t t1_l0_ext_arg,
    const int32_t* __restrict__ t0_l1_pos,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n0_arg,
    const int32_t* __restrict__ t1_l1_pos,
    const int32_t* __restrict__ t1_l1_crd,
    int64_t t1_l1_lo_arg,
    int64_t t1_l1_ext_arg,
    const float* __restrict__ t0_vals,
    const float* __restrict__ t1_vals,
    int32_t* __restrict__ out_crd,
    float* __restrict__ out,
    const int64_t* __restrict__ row_ptr,
    int64_t nthreads_arg)
{
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t t1_l0_lo = (int64_t)t1_l0_lo_arg;
  const int64_t t1_l0_ext = (int64_t)t1_l0_ext_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t1_l1_lo = (int64_t)t1_l1_lo_arg;
  const int64_t t1_l1_ext = (int64_t)t1_l1_ext_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  {
    int64_t next_6 = 0;
    #pragma omp parallel num_threads(nthreads)
    {
      const int64_t lo_1 = INT64_C(0), hi_2 = n0;
      const int64_t parts_4 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
      const int64_t total_5 = ((int64_t)t0_l1_pos[hi_2] - (int64_t)t0_l1_pos[lo_1]) + (hi_2 - lo_1);
      for (;;) {
        int64_t part_3;
        #pragma omp atomic capture
        part_3 = next_6++;
        if (part_3 >= parts_4) break;
        const int64_t r0 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_5, part_3, parts_4), r1 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_5, part_3 + 1, parts_4);
        for (int64_t x0 = r0; x0 < r1; ++x0) {
          const int64_t p0_0 = (x0 - t0_l0_lo);
          const int64_t p1_0 = (x0 - t1_l0_lo);
          int64_t nt = INT64_C(0);
          const int64_t base = row_ptr[x0];
          if ((row_ptr[x0] < row_ptr[(x0 + INT64_C(1))])) {
            int64_t q0_1 = ((int64_t)t0_l1_pos[p0_0]);
            const int64_t end0_1 = ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]);
            int64_t q1_1 = ((int64_t)t1_l1_pos[p1_0]);
            const int64_t end1_1 = ((int64_t)t1_l1_pos[(p1_0 + INT64_C(1))]);
            while (((q0_1 < end0_1) && (q1_1 < end1_1))) {
              const int64_t cc0_1 = ((int64_t)t0_l1_crd[q0_1]);
              const int64_t cc1_1 = ((int64_t)t1_l1_crd[q1_1]);
              const int64_t x1 = ((int64_t)(cc0_1) < (int64_t)(cc1_1) ? (int64_t)(cc0_1) : (int64_t)(cc1_1));
              const bool f0_1 = (cc0_1 == x1);
              const bool f1_1 = (cc1_1 == x1);
              if ((f0_1 || f1_1)) {
                out_crd[(base + nt)] = x1;
                out[(base + nt)] = (scorch_pick<float>(f0_1, t0_vals[q0_1], 0.0f) + scorch_pick<float>(f1_1, t1_vals[q1_1], 0.0f));
                nt += INT64_C(1);
              }
              q0_1 += ((int64_t)f0_1);
              q1_1 += ((int64_t)f1_1);
            }
            while ((q0_1 < end0_1)) {
              const int64_t x1 = ((int64_t)t0_l1_crd[q0_1]);
              out_crd[(base + nt)] = x1;
              out[(base + nt)] = (t0_vals[q0_1] + (false ? t1_vals[q1_1] : 0.0f));
              nt += INT64_C(1);
              q0_1 += INT64_C(1);
            }
            while ((q1_1 < end1_1)) {
              const int64_t x1 = ((int64_t)t1_l1_crd[q1_1]);
              out_crd[(base + nt)] = x1;
              out[(base + nt)] = ((false ? t0_vals[q0_1] : 0.0f) + t1_vals[q1_1]);
              nt += INT64_C(1);
              q1_1 += INT64_C(1);
            }
          }
        }
      }
    }
  }
}
extern "C" void scorch_fill_packed(const int64_t* a) {
  scorch_fill(a[0], a[1], a[2], a[3], a[4], (const int32_t*)(intptr_t)a[5], (const int32_t*)(intptr_t)a[6], a[7], a[8], a[9], (const int32_t*)(intptr_t)a[10], (const int32_t*)(intptr_t)a[11], a[12], a[13], (const float*)(intptr_t)a[14], (const float*)(intptr_t)a[15], (int32_t*)(intptr_t)a[16], (float*)(intptr_t)a[17], (const int64_t*)(intptr_t)a[18], a[19]);
}
