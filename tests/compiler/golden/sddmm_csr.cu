#include <cstdint>
#include <cmath>
#ifdef SCORCH_EMULATE
/* CUDA on the CPU, for tests without a GPU: blocks run one after another, the threads of a block as OpenMP
   threads. Blocks are one warp, so a warp shuffle is a block barrier; atomics are OpenMP atomics. */
#include <cstdlib>
#include <mutex>
#include <omp.h>
struct scorch_dim3 { unsigned x, y, z; };
static thread_local scorch_dim3 threadIdx, blockIdx;
static scorch_dim3 blockDim, gridDim;
typedef void* cudaStream_t;
typedef int cudaError_t;
#define __global__
#define __device__
#define __forceinline__ inline
template <class T> static T __shfl_xor_sync(unsigned, T v, int mask) {
  static T slot[32];
  slot[threadIdx.x] = v;
  _Pragma("omp barrier")
  const T r = slot[threadIdx.x ^ mask];
  _Pragma("omp barrier")
  return r;
}
template <class T> static inline void scorch_atomic_add(T* p, T v) {
  _Pragma("omp atomic")
  *p += v;
}
template <class T> static inline void scorch_atomic_max(T* p, T v) {
  _Pragma("omp critical(scorch_atomic)")
  { if (v > *p) *p = v; }
}
template <class T> static inline void scorch_atomic_min(T* p, T v) {
  _Pragma("omp critical(scorch_atomic)")
  { if (v < *p) *p = v; }
}
static int scorch_launch_error = 0;
static std::mutex scorch_launch_lock;  /* launches from several host threads take turns (shared grid state) */
#define SCORCH_LAUNCH(kernel, grid, block, stream, ...) do { \
    std::lock_guard<std::mutex> scorch_guard(scorch_launch_lock); \
    gridDim = scorch_dim3{(unsigned)(grid), 1, 1}; blockDim = scorch_dim3{(unsigned)(block), 1, 1}; \
    for (unsigned scorch_b = 0; scorch_b < gridDim.x; ++scorch_b) { \
      _Pragma("omp parallel num_threads(blockDim.x)") \
      { \
        if ((unsigned)omp_get_num_threads() != blockDim.x) { _Pragma("omp atomic write") scorch_launch_error = 1; } \
        else { threadIdx = scorch_dim3{(unsigned)omp_get_thread_num(), 0, 0}; \
               blockIdx = scorch_dim3{scorch_b, 0, 0}; kernel(__VA_ARGS__); } \
      } \
    } } while (0)
static inline int scorch_sms(cudaStream_t) { return 1; }
static inline cudaError_t scorch_scratch_alloc(char** p, int64_t bytes, cudaStream_t) {
  *p = (char*)std::malloc(bytes > 0 ? (size_t)bytes : 1);
  return *p ? 0 : 2;
}
static inline void scorch_scratch_free(char* p, cudaStream_t) { std::free(p); }
static inline cudaError_t scorch_last_error() { const int e = scorch_launch_error; scorch_launch_error = 0; return e; }
static inline const char* scorch_error_string(int e) {
  return e == 1 ? "the emulator got fewer OpenMP threads than a block has" : e == 2 ? "out of memory" : "no error";
}
#define SCORCH_EMULATED 1
#else
#define SCORCH_EMULATED 0
#define SCORCH_LAUNCH(kernel, grid, block, stream, ...) \
    kernel<<<(unsigned)(grid), (unsigned)(block), 0, (stream)>>>(__VA_ARGS__)
static __device__ __forceinline__ void scorch_atomic_add(float* p, float v) { atomicAdd(p, v); }
static __device__ __forceinline__ void scorch_atomic_add(double* p, double v) { atomicAdd(p, v); }
static __device__ __forceinline__ void scorch_atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
static __device__ __forceinline__ void scorch_atomic_add(int64_t* p, int64_t v) {
  atomicAdd((unsigned long long*)p, (unsigned long long)v);  /* two's complement: the same bits */
}
static __device__ __forceinline__ void scorch_atomic_max(int32_t* p, int32_t v) { atomicMax(p, v); }
static __device__ __forceinline__ void scorch_atomic_max(int64_t* p, int64_t v) { atomicMax((long long*)p, (long long)v); }
static __device__ __forceinline__ void scorch_atomic_min(int32_t* p, int32_t v) { atomicMin(p, v); }
static __device__ __forceinline__ void scorch_atomic_min(int64_t* p, int64_t v) { atomicMin((long long*)p, (long long)v); }
template <class T, class B, class C> static __device__ void scorch_atomic_cas(T* p, T v, C better) {
  B* q = (B*)p;
  B old = *q, seen;
  do {
    seen = old;
    T cur; memcpy(&cur, &seen, sizeof(T));
    if (!better(v, cur)) return;
    B want; memcpy(&want, &v, sizeof(T));
    old = atomicCAS(q, seen, want);
  } while (old != seen);
}
struct scorch_gt { template <class T> __device__ bool operator()(T a, T b) const { return a > b; } };
struct scorch_lt { template <class T> __device__ bool operator()(T a, T b) const { return a < b; } };
static __device__ __forceinline__ void scorch_atomic_max(float* p, float v) { scorch_atomic_cas<float, unsigned int>(p, v, scorch_gt()); }
static __device__ __forceinline__ void scorch_atomic_max(double* p, double v) { scorch_atomic_cas<double, unsigned long long>(p, v, scorch_gt()); }
static __device__ __forceinline__ void scorch_atomic_min(float* p, float v) { scorch_atomic_cas<float, unsigned int>(p, v, scorch_lt()); }
static __device__ __forceinline__ void scorch_atomic_min(double* p, double v) { scorch_atomic_cas<double, unsigned long long>(p, v, scorch_lt()); }
static int scorch_sms(cudaStream_t) {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 1;
  return n > 0 ? n : 1;
}
static inline cudaError_t scorch_scratch_alloc(char** p, int64_t bytes, cudaStream_t s) {
  return cudaMallocAsync((void**)p, (size_t)(bytes > 0 ? bytes : 1), s);
}
static inline void scorch_scratch_free(char* p, cudaStream_t s) { cudaFreeAsync(p, s); }
static inline cudaError_t scorch_last_error() { return cudaGetLastError(); }
static inline const char* scorch_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }
#endif
template <class T> static __device__ __forceinline__ T scorch_warp_add(T v) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
template <class T> static __device__ __forceinline__ T scorch_warp_max(T v) {
  for (int m = 16; m > 0; m >>= 1) { const T o = __shfl_xor_sync(0xffffffffu, v, m); v = o > v ? o : v; }
  return v;
}
template <class T> static __device__ __forceinline__ T scorch_warp_min(T v) {
  for (int m = 16; m > 0; m >>= 1) { const T o = __shfl_xor_sync(0xffffffffu, v, m); v = o < v ? o : v; }
  return v;
}
/* The first row of worker k of nw when rows [lo, hi) are split by rows + positions under them:
   f(r) = (pos[r] - pos[lo]) + (r - lo) is increasing, and worker k starts where f reaches total * k / nw. */
template <class P> static __device__ int64_t scorch_first_row(const P* pos, int64_t lo, int64_t hi, int64_t total,
                                                            int64_t k, int64_t nw) {
  if (k >= nw) return hi;
  const int64_t target = (total / nw) * k + (total % nw) * k / nw;  /* floor(total * k / nw), no overflow */
  int64_t l = lo, h = hi;
  while (l < h) {
    const int64_t m = l + (h - l) / 2;
    if (((int64_t)pos[m] - (int64_t)pos[lo]) + (m - lo) < target) l = m + 1; else h = m;
  }
  return l;
}
#ifndef SCORCH_BITMAP
#define SCORCH_BITMAP
#define SCORCH_BITMAP_MIN_KEYS 32
#ifdef __CUDA_ARCH__
#define SCORCH_CTZ64(x) (__ffsll((long long)(x)) - 1)
#define SCORCH_POPC64(x) __popcll(x)
#else
#define SCORCH_CTZ64(x) __builtin_ctzll(x)
#define SCORCH_POPC64(x) __builtin_popcountll(x)
#endif
// a bitmap of keys in an int64 array: scorch_set_bit marks one; scorch_bit_keys writes the marked keys of
// bits[0:words] ascending into keys (room for cap) and zeroes the words, returning their number. Each word's
// first 4 keys are written whatever its count (an emptied word reads as bit 63: its ctz is defined), the rest,
// rare, by a loop: a loop over every word's bits missed its exit about once a word (SpGEMM's fill on the uniform
// 20k matrix, 2 threads: 92-99 -> 76-77 ms); a write past the word's keys lands below cap and is overwritten by
// the next keys; scorch_bit_count returns the number of marked keys and zeroes the words
static __device__ void scorch_set_bit(int64_t* bits, int64_t k) {
  ((uint64_t*)bits)[k >> 6] |= (uint64_t)1 << (k & 63);
}
static __device__ int64_t scorch_bit_keys(int64_t* bits, int64_t words, int64_t* keys, int64_t cap) {
  int64_t t = 0;
  for (int64_t k = 0; k < words; ++k) {
    uint64_t x = (uint64_t)bits[k];
    bits[k] = 0;
    const int64_t base = k << 6, c = SCORCH_POPC64(x);
    int64_t u = t;
    if (t + 4 <= cap) {
      for (; u < t + 4; ++u) {
        keys[u] = base + SCORCH_CTZ64(x | ((uint64_t)1 << 63));
        x &= x - 1;
      }
    }
    for (; x; x &= x - 1) keys[u++] = base + SCORCH_CTZ64(x);
    t += c;
  }
  return t;
}
static __device__ int64_t scorch_bit_count(int64_t* bits, int64_t words) {
  int64_t t = 0;
  for (int64_t k = 0; k < words; ++k) {
    t += SCORCH_POPC64((uint64_t)bits[k]);
    bits[k] = 0;
  }
  return t;
}
#endif
#ifndef SCORCH_SORT
#define SCORCH_SORT
static __device__ void scorch_sort(int64_t* a, int64_t n, int64_t bound, int64_t* scratch) {
  // distinct keys in [0, bound): insertion sort for short runs; where they are dense (a bit per key of the range
  // fits in n words: the scratch) a bitmap read in order; else a least-significant-digit radix sort by bytes
  if (n > SCORCH_BITMAP_MIN_KEYS && n * 64 >= bound) {
    const int64_t words = (bound + 63) >> 6;
    for (int64_t k = 0; k < words; ++k) scratch[k] = 0;
    for (int64_t k = 0; k < n; ++k) scorch_set_bit(scratch, a[k]);
    scorch_bit_keys(scratch, words, a, n);
    return;
  }
  if (n <= 32) {
    for (int64_t k = 1; k < n; ++k) {
      const int64_t v = a[k];
      int64_t q = k - 1;
      while (q >= 0 && a[q] > v) { a[q + 1] = a[q]; --q; }
      a[q + 1] = v;
    }
    return;
  }
  int64_t* src = a;
  int64_t* dst = scratch;
  for (int shift = 0; shift < 63 && (bound - 1) >> shift; shift += 8) {
    int64_t count[257] = {0};
    for (int64_t k = 0; k < n; ++k) ++count[((src[k] >> shift) & 255) + 1];
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (int64_t k = 0; k < n; ++k) dst[count[(src[k] >> shift) & 255]++] = src[k];
    int64_t* t = src; src = dst; dst = t;
  }
  if (src != a) for (int64_t k = 0; k < n; ++k) a[k] = src[k];
}
static __device__ inline bool scorch_is_sorted(const int64_t* a, int64_t n) {
  for (int64_t k = 1; k < n; ++k) if (a[k] < a[k - 1]) return false;
  return true;
}
#endif
template <class I, class J> static __device__ inline int64_t scorch_common(const I* a, int64_t na, const J* b, int64_t nb) {
  int64_t i = 0, j = 0, c = 0;
  while (i < na && j < nb) {
    const int64_t x = (int64_t)a[i], y = (int64_t)b[j];
    c += x == y;
    i += x <= y;
    j += y <= x;
  }
  return c;
}

extern "C" __global__ void scorch_kernel_dev(
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
    const float* __restrict__ t2,
    int64_t t2_s0_arg,
    int64_t nthreads_arg,
    char* __restrict__ scorch_scratch,
    int64_t scorch_stride)
{
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
  const int64_t t2_s0 = (int64_t)t2_s0_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  const int64_t scorch_tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t scorch_nthreads = (int64_t)gridDim.x * blockDim.x;
  const int64_t scorch_worker = scorch_tid / 32, scorch_nworkers = scorch_nthreads / 32;
  const int64_t scorch_lane = threadIdx.x % 32;
  const int64_t lo_1 = t0_l0_lo, hi_2 = (t0_l0_lo + t0_l0_ext);
  const int64_t total_3 = ((int64_t)t0_l1_pos[hi_2] - (int64_t)t0_l1_pos[lo_1]) + (hi_2 - lo_1);
  const int64_t scorch_r0 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_3, scorch_worker, scorch_nworkers);
  const int64_t scorch_r1 = scorch_first_row(t0_l1_pos, lo_1, hi_2, total_3, scorch_worker + 1, scorch_nworkers);
  for (int64_t c0 = scorch_r0; c0 < scorch_r1; ++c0) {
    const int64_t p0 = (c0 - t0_l0_lo);
    const int64_t d0 = c0;
    for (int64_t p1 = ((int64_t)t0_l1_pos[p0]); p1 < ((int64_t)t0_l1_pos[(p0 + INT64_C(1))]); ++p1) {
      float acc = 0.0f;
      const int64_t c1 = ((int64_t)t0_l1_crd[p1]);
      const int64_t d1 = c1;
      {
        const float keep_4 = acc;
        acc = 0.0f;
        #pragma unroll
        for (int64_t x2 = (INT64_C(0)) + ((scorch_lane - (INT64_C(0))) & 31); x2 < (INT64_C(4)); x2 += 32) {
          acc += ((t0_vals[p1] * t1[((d0 * INT64_C(4)) + x2)]) * t2[((d1 * INT64_C(4)) + x2)]);
        }
        acc = keep_4 + scorch_warp_add(acc);
      }
      if (scorch_lane == 0) {
        out[p1] = acc;
      }
    }
  }
}

extern "C" int scorch_kernel(
    int64_t t0_l0_lo_arg,
    int64_t t0_l0_ext_arg,
    const int32_t* t0_l1_pos,
    int64_t n0_arg,
    const int32_t* t0_l1_crd,
    int64_t t0_l1_lo_arg,
    int64_t t0_l1_ext_arg,
    int64_t n1_arg,
    float* out,
    const float* t0_vals,
    const float* t1,
    int64_t t1_s0_arg,
    const float* t2,
    int64_t t2_s0_arg,
    int64_t nthreads_arg,
    void* scorch_stream_arg)
{
  cudaStream_t scorch_stream = (cudaStream_t)scorch_stream_arg;
  const int64_t t0_l0_lo = (int64_t)t0_l0_lo_arg;
  const int64_t t0_l0_ext = (int64_t)t0_l0_ext_arg;
  const int64_t n0 = (int64_t)n0_arg;
  const int64_t t0_l1_lo = (int64_t)t0_l1_lo_arg;
  const int64_t t0_l1_ext = (int64_t)t0_l1_ext_arg;
  const int64_t n1 = (int64_t)n1_arg;
  const int64_t t1_s0 = (int64_t)t1_s0_arg;
  const int64_t t2_s0 = (int64_t)t2_s0_arg;
  const int64_t nthreads = (int64_t)nthreads_arg;
  const int64_t scorch_stride_ = 0;
  int64_t scorch_block = SCORCH_EMULATED ? 32 : 256;
  int64_t scorch_grid = SCORCH_EMULATED ? 3 : (int64_t)scorch_sms(scorch_stream) * 8;
  char* scorch_scratch = nullptr;
  SCORCH_LAUNCH(scorch_kernel_dev, scorch_grid, scorch_block, scorch_stream, t0_l0_lo_arg, t0_l0_ext_arg, t0_l1_pos, n0_arg, t0_l1_crd, t0_l1_lo_arg, t0_l1_ext_arg, n1_arg, out, t0_vals, t1, t1_s0_arg, t2, t2_s0_arg, nthreads_arg, scorch_scratch, scorch_stride_);
  return (int)scorch_last_error();
}

extern "C" const char* scorch_kernel_error(int e) { return scorch_error_string(e); }
