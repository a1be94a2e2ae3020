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
#include <cstdlib>
struct scorch_buf {
  void* raw;
  void* p;
  scorch_buf(size_t n, size_t size) : raw(std::calloc((n ? n : 1) * size + 63, 1)),
    p((void*)(((uintptr_t)raw + 63) & ~(uintptr_t)63)) {}
  ~scorch_buf() { std::free(raw); }
};
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
static void scorch_set_bit(int64_t* bits, int64_t k) {
  ((uint64_t*)bits)[k >> 6] |= (uint64_t)1 << (k & 63);
}
static int64_t scorch_bit_keys(int64_t* bits, int64_t words, int64_t* keys, int64_t cap) {
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
static int64_t scorch_bit_count(int64_t* bits, int64_t words) {
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
static void scorch_sort(int64_t* a, int64_t n, int64_t bound, int64_t* scratch) {
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
static inline bool scorch_is_sorted(const int64_t* a, int64_t n) {
  for (int64_t k = 1; k < n; ++k) if (a[k] < a[k - 1]) return false;
  return true;
}
#endif
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
static void scorch_set_bit(int64_t* bits, int64_t k) {
  ((uint64_t*)bits)[k >> 6] |= (uint64_t)1 << (k & 63);
}
static int64_t scorch_bit_keys(int64_t* bits, int64_t words, int64_t* keys, int64_t cap) {
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
static int64_t scorch_bit_count(int64_t* bits, int64_t words) {
  int64_t t = 0;
  for (int64_t k = 0; k < words; ++k) {
    t += SCORCH_POPC64((uint64_t)bits[k]);
    bits[k] = 0;
  }
  return t;
}
#endif

extern "C" void scorch_fill(
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
    const float* __restrict__ t1_vals,
    const float* __restrict__ t0_vals,
    const int64_t* __restrict__ row_ptr,
    int32_t* __restrict__ out_crd,
    float* __restrict__ out,
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
  {
    int64_t next_11 = 0;
    #pragma omp parallel num_threads(nthreads)
    {
      scorch_buf buf_1((size_t)(n1), sizeof(bool));
      bool* __restrict__ mark = static_cast<bool*>(buf_1.p);
      scorch_buf buf_2((size_t)(n1), sizeof(int64_t));
      int64_t* __restrict__ touched = static_cast<int64_t*>(buf_2.p);
      scorch_buf buf_3((size_t)(n1), sizeof(float));
      float* __restrict__ ws = static_cast<float*>(buf_3.p);
      scorch_buf buf_4((size_t)(n1), sizeof(int64_t));
      int64_t* __restrict__ sort_tmp = static_cast<int64_t*>(buf_4.p);
      scorch_buf buf_5((size_t)(((n1 + INT64_C(63)) / INT64_C(64))), sizeof(int64_t));
      int64_t* __restrict__ bits = static_cast<int64_t*>(buf_5.p);
      const int64_t lo_6 = INT64_C(0), hi_7 = n0;
      const int64_t parts_9 = omp_get_num_threads() > 1 ? omp_get_num_threads() * 8 : 1;
      const int64_t total_10 = ((int64_t)t0_l1_pos[hi_7] - (int64_t)t0_l1_pos[lo_6]) + (hi_7 - lo_6);
      for (;;) {
        int64_t part_8;
        #pragma omp atomic capture
        part_8 = next_11++;
        if (part_8 >= parts_9) break;
        const int64_t r0 = scorch_first_row(t0_l1_pos, lo_6, hi_7, total_10, part_8, parts_9), r1 = scorch_first_row(t0_l1_pos, lo_6, hi_7, total_10, part_8 + 1, parts_9);
        for (int64_t x0 = r0; x0 < r1; ++x0) {
          const int64_t p0_0 = (x0 - t0_l0_lo);
          int64_t nt = INT64_C(0);
          if ((((row_ptr[(x0 + INT64_C(1))] - row_ptr[x0]) > INT64_C(32)) && (((row_ptr[(x0 + INT64_C(1))] - row_ptr[x0]) * INT64_C(128)) >= n1))) {
            for (int64_t q0_1 = ((int64_t)t0_l1_pos[p0_0]); q0_1 < ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]); ++q0_1) {
              const int64_t x2 = ((int64_t)t0_l1_crd[q0_1]);
              const int64_t p1_0 = (x2 - t1_l0_lo);
              if (((q0_1 + INT64_C(2)) < ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]))) {
                const int64_t x2_ahead = ((int64_t)t0_l1_crd[(q0_1 + INT64_C(2))]);
                __builtin_prefetch(&t1_l1_crd[((int64_t)t1_l1_pos[(x2_ahead - t1_l0_lo)])]);
                __builtin_prefetch(&t1_vals[((int64_t)t1_l1_pos[(x2_ahead - t1_l0_lo)])]);
              }
              for (int64_t q1_1 = ((int64_t)t1_l1_pos[p1_0]); q1_1 < ((int64_t)t1_l1_pos[(p1_0 + INT64_C(1))]); ++q1_1) {
                const int64_t x1 = ((int64_t)t1_l1_crd[q1_1]);
                const int64_t w = x1;
                scorch_set_bit(bits, w);
                ws[w] += (t0_vals[q0_1] * t1_vals[q1_1]);
              }
            }
            nt = scorch_bit_keys(bits, ((n1 + INT64_C(63)) / INT64_C(64)), touched, n1);
            const int64_t base = row_ptr[x0];
            for (int64_t t = INT64_C(0); t < nt; ++t) {
              const int64_t w = touched[t];
              out_crd[(base + t)] = w;
              out[(base + t)] = ws[w];
              ws[w] = 0.0f;
            }
          } else {
            for (int64_t q0_1 = ((int64_t)t0_l1_pos[p0_0]); q0_1 < ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]); ++q0_1) {
              const int64_t x2 = ((int64_t)t0_l1_crd[q0_1]);
              const int64_t p1_0 = (x2 - t1_l0_lo);
              if (((q0_1 + INT64_C(2)) < ((int64_t)t0_l1_pos[(p0_0 + INT64_C(1))]))) {
                const int64_t x2_ahead = ((int64_t)t0_l1_crd[(q0_1 + INT64_C(2))]);
                __builtin_prefetch(&t1_l1_crd[((int64_t)t1_l1_pos[(x2_ahead - t1_l0_lo)])]);
                __builtin_prefetch(&t1_vals[((int64_t)t1_l1_pos[(x2_ahead - t1_l0_lo)])]);
              }
              for (int64_t q1_1 = ((int64_t)t1_l1_pos[p1_0]); q1_1 < ((int64_t)t1_l1_pos[(p1_0 + INT64_C(1))]); ++q1_1) {
                const int64_t x1 = ((int64_t)t1_l1_crd[q1_1]);
                const int64_t w = x1;
                if ((!mark[w])) {
                  mark[w] = true;
                  touched[nt] = w;
                  nt += INT64_C(1);
                }
                ws[w] += (t0_vals[q0_1] * t1_vals[q1_1]);
              }
            }
            if (!scorch_is_sorted(touched + INT64_C(0), (nt) - (INT64_C(0)))) scorch_sort(touched + INT64_C(0), (nt) - (INT64_C(0)), n1, sort_tmp);
            const int64_t base = row_ptr[x0];
            for (int64_t t = INT64_C(0); t < nt; ++t) {
              const int64_t w = touched[t];
              out_crd[(base + t)] = w;
              out[(base + t)] = ws[w];
              ws[w] = 0.0f;
              mark[w] = false;
            }
          }
        }
      }
    }
  }
}
extern "C" void scorch_fill_packed(const int64_t* a) {
  scorch_fill(a[0], a[1], a[2], (const int32_t*)(intptr_t)a[3], (const int32_t*)(intptr_t)a[4], a[5], a[6], a[7], a[8], a[9], (const int32_t*)(intptr_t)a[10], (const int32_t*)(intptr_t)a[11], a[12], a[13], (const float*)(intptr_t)a[14], (const float*)(intptr_t)a[15], (const int64_t*)(intptr_t)a[16], (int32_t*)(intptr_t)a[17], (float*)(intptr_t)a[18], a[19]);
}
