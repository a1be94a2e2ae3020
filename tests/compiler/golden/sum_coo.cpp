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
    int64_t n0_arg,
    const int32_t* __restrict__ t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n1_arg,
    float* __restrict__ out,
    const float* __restrict__ t0_vals)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  for (int64_t p0 = ((int64_t)t0_l0_pos[INT64_C(0)]); p0 < ((int64_t)t0_l0_pos[INT64_C(1)]); ++p0) {
    const int64_t c0 = ((int64_t)t0_l0_crd[p0]);
    const int64_t d0 = c0;
    const int64_t p1 = p0;
    const int64_t c1 = ((int64_t)t0_l1_crd[p1]);
    const int64_t d1 = c1;
    out[d0] += t0_vals[p1];
  }
}
extern "C" void scorch_kernel_packed(const int64_t* a) {
  scorch_kernel((const int32_t*)(intptr_t)a[0], (const int32_t*)(intptr_t)a[1], a[2], a[3], a[4], (const int32_t*)(intptr_t)a[5], a[6], a[7], a[8], (float*)(intptr_t)a[9], (const float*)(intptr_t)a[10]);
}
