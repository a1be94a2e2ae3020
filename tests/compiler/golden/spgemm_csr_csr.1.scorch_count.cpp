#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif
#include <cstdlib>
struct scorch_buf {
  void* p;
  scorch_buf(size_t n, size_t size) : p(std::calloc(n ? n : 1, size)) {}
  ~scorch_buf() { std::free(p); }
};

extern "C" void scorch_count(
    int64_t n1_arg,
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    const int32_t* __restrict__ t0_l1_pos,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n0_arg,
    int64_t t1_l0_lo_arg,
    int64_t t1_l0_ext_arg,
    const int32_t* __restrict__ t1_l1_pos,
    const int32_t* __restrict__ t1_l1_crd,
    int64_t t1_l1_lo_arg,
    int64_t t1_l1_ext_arg,
    const float* __restrict__ t0_vals,
    const float* __restrict__ t1_vals,
    int64_t* __restrict__ counts,
    int64_t nthreads_arg)
{
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t1_l0_lo = (int64_t)t1_l0_lo_arg;
  const int64_t t1_l0_ext = (int64_t)t1_l0_ext_arg;
  const int64_t t1_l1_lo = (int64_t)t1_l1_lo_arg;
  const int64_t t1_l1_ext = (int64_t)t1_l1_ext_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  #pragma omp parallel num_threads(nthreads)
  {
    scorch_buf buf_1((size_t)(n1), sizeof(bool));
    bool* __restrict__ mark = static_cast<bool*>(buf_1.p);
    scorch_buf buf_2((size_t)(n1), sizeof(int64_t));
    int64_t* __restrict__ touched = static_cast<int64_t*>(buf_2.p);
    const int64_t lo_3 = INT64_C(0), hi_4 = n0;
    const int64_t parts_6 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
    const int64_t total_7 = ((int64_t)t0_l1_pos[hi_4] - (int64_t)t0_l1_pos[lo_3]) + (hi_4 - lo_3);
    auto first_row = [&](int64_t k) -> int64_t {
      if (k >= parts_6) return hi_4;
      const int64_t target = (int64_t)((__int128)total_7 * k / parts_6);
      int64_t l = lo_3, h = hi_4;
      while (l < h) { int64_t m = l + (h - l) / 2; if (((int64_t)t0_l1_pos[m] - (int64_t)t0_l1_pos[lo_3]) + (m - lo_3) < target) l = m + 1; else h = m; }
      return l;
    };
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t part_5 = 0; part_5 < parts_6; ++part_5) {
      const int64_t r0 = first_row(part_5), r1 = first_row(part_5 + 1);
      for (int64_t x0 = r0; x0 < r1; ++x0) {
        const int64_t p0_0 = (x0 - t0_l0_lo);
        int64_t nt = INT64_C(0);
        for (int64_t q0_1 = ((int64_t)t0_l1_pos[p0_0]); q0_1 < ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]); ++q0_1) {
          const int64_t x2 = ((int64_t)t0_l1_crd[q0_1]);
          const int64_t p1_0 = (x2 - t1_l0_lo);
          for (int64_t q1_1 = ((int64_t)t1_l1_pos[p1_0]); q1_1 < ((int64_t)t1_l1_pos[(p1_0 + INT64_C(1))]); ++q1_1) {
            const int64_t x1 = ((int64_t)t1_l1_crd[q1_1]);
            const int64_t w = x1;
            if ((!mark[w])) {
              mark[w] = true;
              touched[nt] = w;
              nt += INT64_C(1);
            }
          }
        }
        counts[x0] = nt;
        for (int64_t t = INT64_C(0); t < nt; ++t) {
          mark[touched[t]] = false;
        }
      }
    }
  }
}
extern "C" void scorch_count_packed(const int64_t* a) {
  scorch_count(a[0], a[1], a[2], (const int32_t*)(intptr_t)a[3], (const int32_t*)(intptr_t)a[4], a[5], a[6], a[7], a[8], a[9], (const int32_t*)(intptr_t)a[10], (const int32_t*)(intptr_t)a[11], a[12], a[13], (const float*)(intptr_t)a[14], (const float*)(intptr_t)a[15], (int64_t*)(intptr_t)a[16], a[17]);
}
