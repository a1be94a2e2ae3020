#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif

extern "C" void scorch_kernel(
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    int64_t n0_arg,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n1_arg,
    const float* __restrict__ t0_vals,
    int64_t* __restrict__ counts)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  for (int64_t c0 = t0_l0_lo; c0 < (t0_l0_lo + t0_l0_ext); ++c0) {
    const int64_t p0 = (c0 - t0_l0_lo);
    const int64_t d0 = c0;
    for (int64_t c1 = t0_l1_lo; c1 < (t0_l1_lo + t0_l1_ext); ++c1) {
      const int64_t p1 = ((p0 * t0_l1_ext) + (c1 - t0_l1_lo));
      const int64_t d1 = c1;
      const float v = t0_vals[p1];
      if ((v != 0.0f)) {
        counts[d0] += INT64_C(1);
      }
    }
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel(a[0], a[1], a[2], a[3], a[4], a[5], (const float*)(intptr_t)a[6], (int64_t*)(intptr_t)a[7]);
}
