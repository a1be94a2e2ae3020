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
template <class I, class J> static inline int64_t scorch_common(const I* a, int64_t na, const J* b, int64_t nb) {
  int64_t i = 0, j = 0, c = 0;
  while (i < na && j < nb) {
    const int64_t x = (int64_t)a[i], y = (int64_t)b[j];
    c += x == y;
    i += x <= y;
    j += y <= x;
  }
  return c;
}
#if defined(__AVX2__) && defined(__GNUC__) && __GNUC__ >= 12
typedef int32_t scorch_v8i __attribute__((vector_size(32)));
static inline scorch_v8i scorch_block8(const int32_t* p, int64_t n, int32_t missing) {
  scorch_v8i v;
  if (n >= 8) {
    __builtin_memcpy(&v, p, 32);
    return v;
  }
  const scorch_v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const scorch_v8i on = lane < (int32_t)n;
  v = __builtin_ia32_maskloadd256((const scorch_v8i*)p, on);
  return on ? v : scorch_v8i{} + missing;
}
static inline int64_t scorch_common(const int32_t* a, int64_t na, const int32_t* b, int64_t nb) {
  int64_t i = 0, j = 0;
  scorch_v8i found = {};
  while (i < na && j < nb) {
    const int64_t ra = na - i < 8 ? na - i : 8, rb = nb - j < 8 ? nb - j : 8;
    const scorch_v8i x = scorch_block8(a + i, ra, -1), y = scorch_block8(b + j, rb, -2);
    found -= (x == y) | (x == __builtin_shufflevector(y, y, 1, 2, 3, 4, 5, 6, 7, 0))
           | (x == __builtin_shufflevector(y, y, 2, 3, 4, 5, 6, 7, 0, 1))
           | (x == __builtin_shufflevector(y, y, 3, 4, 5, 6, 7, 0, 1, 2))
           | (x == __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3))
           | (x == __builtin_shufflevector(y, y, 5, 6, 7, 0, 1, 2, 3, 4))
           | (x == __builtin_shufflevector(y, y, 6, 7, 0, 1, 2, 3, 4, 5))
           | (x == __builtin_shufflevector(y, y, 7, 0, 1, 2, 3, 4, 5, 6));
    const int32_t la = a[i + ra - 1], lb = b[j + rb - 1];
    i += la <= lb ? ra : 0;
    j += lb <= la ? rb : 0;
  }
  int64_t c = 0;
  for (int u = 0; u < 8; ++u) c += found[u];
  return c;
}
#endif

extern "C" void scorch_count(
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
    int64_t* __restrict__ counts,
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
          int64_t q0_1 = ((int64_t)t0_l1_pos[p0_0]);
          const int64_t end0_1 = ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]);
          int64_t q1_1 = ((int64_t)t1_l1_pos[p1_0]);
          const int64_t end1_1 = ((int64_t)t1_l1_pos[(p1_0 + INT64_C(1))]);
          nt += (((end0_1 - q0_1) + (end1_1 - q1_1)) - scorch_common(t0_l1_crd + q0_1, (end0_1) - (q0_1), t1_l1_crd + q1_1, (end1_1) - (q1_1)));
          counts[x0] = nt;
        }
      }
    }
  }
}
extern "C" void scorch_count_packed(const int64_t* a) {
  scorch_count(a[0], a[1], a[2], a[3], a[4], (const int32_t*)(intptr_t)a[5], (const int32_t*)(intptr_t)a[6], a[7], a[8], a[9], (const int32_t*)(intptr_t)a[10], (const int32_t*)(intptr_t)a[11], a[12], a[13], (int64_t*)(intptr_t)a[14], a[15]);
}
