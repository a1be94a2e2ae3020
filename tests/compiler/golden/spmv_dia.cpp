#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif

extern "C" void scorch_kernel(
    const int32_t* __restrict__ t0_l0_pos,
    const int32_t* __restrict__ t0_l0_crd,
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n0_arg,
    int64_t n1_arg,
    float* __restrict__ out,
    const float* __restrict__ t0_vals,
    const float* __restrict__ t1,
    int64_t t1_s0_arg)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
  for (int64_t p0 = ((int64_t)t0_l0_pos[INT64_C(0)]); p0 < ((int64_t)t0_l0_pos[INT64_C(1)]); ++p0) {
    const int64_t c0 = ((int64_t)t0_l0_crd[p0]);
    for (int64_t c1 = t0_l1_lo; c1 < (t0_l1_lo + t0_l1_ext); ++c1) {
      const int64_t p1 = ((p0 * t0_l1_ext) + (c1 - t0_l1_lo));
      const int64_t d0 = c1;
      const int64_t d1 = (c0 + d0);
      if (((d1 >= INT64_C(0)) && (d1 < n1))) {
        out[d0] += (t0_vals[p1] * t1[d1]);
      }
    }
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel((const int32_t*)(intptr_t)a[0], (const int32_t*)(intptr_t)a[1], a[2], a[3], a[4], a[5], a[6], a[7], (float*)(intptr_t)a[8], (const float*)(intptr_t)a[9], (const float*)(intptr_t)a[10], a[11]);
}
