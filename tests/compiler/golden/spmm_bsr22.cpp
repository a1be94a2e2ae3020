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

extern "C" void scorch_kernel(
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    const int32_t* __restrict__ t0_l1_pos,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n0_arg,
    int64_t n2_arg,
    float* __restrict__ out,
    const float* __restrict__ t0_vals,
    const float* __restrict__ t1,
    int64_t t1_s0_arg,
    int64_t nthreads_arg)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t n2 = (int64_t)n2_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
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
          for (int64_t p1 = ((int64_t)t0_l1_pos[p0]); p1 < ((int64_t)t0_l1_pos[(p0 + INT64_C(1))]); ++p1) {
            const int64_t c1 = ((int64_t)t0_l1_crd[p1]);
            for (int64_t c2 = INT64_C(0); c2 < INT64_C(2); ++c2) {
              const int64_t p2 = ((p1 * INT64_C(2)) + c2);
              const int64_t d0 = ((c0 * INT64_C(2)) + c2);
              if ((d0 < n0)) {
                float wrow[4];
                for (int64_t w_7 = 0; w_7 < 4; ++w_7) wrow[w_7] = 0.0f;
                for (int64_t c3 = INT64_C(0); c3 < INT64_C(2); ++c3) {
                  const int64_t p3 = ((p2 * INT64_C(2)) + c3);
                  const int64_t d1 = ((c1 * INT64_C(2)) + c3);
                  if ((d1 < n2)) {
                    #pragma omp simd
                    for (int64_t x1 = INT64_C(0); x1 < INT64_C(4); ++x1) {
                      wrow[x1] += (t0_vals[p3] * t1[((d1 * INT64_C(4)) + x1)]);
                    }
                  }
                }
                #pragma omp simd
                for (int64_t x1 = INT64_C(0); x1 < INT64_C(4); ++x1) {
                  out[((d0 * INT64_C(4)) + x1)] += wrow[x1];
                }
              }
            }
          }
        }
      }
    }
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel(a[0], a[1], (const int32_t*)(intptr_t)a[2], (const int32_t*)(intptr_t)a[3], a[4], a[5], a[6], a[7], (float*)(intptr_t)a[8], (const float*)(intptr_t)a[9], (const float*)(intptr_t)a[10], a[11], a[12]);
}
