
#include <cstdint>
#include <cstring>
// A 64-bit fingerprint of n bytes. Each block of BLOCK bytes runs 8 lanes of h = (h ^ word) * P (P odd: a step is
// a bijection of h for a given word and of the word for a given h, so one changed word always changes its
// lane's end state); a block's lanes are mixed into one value, and the blocks' values, each mixed with its
// index, are summed (any order: the threads' parts add up the same).
static inline uint64_t mix(uint64_t x) {
  x ^= x >> 33; x *= UINT64_C(0xff51afd7ed558ccd); x ^= x >> 33; x *= UINT64_C(0xc4ceb9fe1a85ec53);
  return x ^ (x >> 33);
}
extern "C" uint64_t scorch_fingerprint(const void* data, int64_t n, int64_t nthreads) {
  const int64_t BLOCK = 1 << 16, blocks = (n + BLOCK - 1) / BLOCK;
  const unsigned char* base = (const unsigned char*)data;
  uint64_t total = (uint64_t)n;
  #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : total)
  for (int64_t b = 0; b < blocks; ++b) {
    const unsigned char* p = base + b * BLOCK;
    const int64_t len = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK, words = len / 64 * 8;
    uint64_t h[8];
    for (int l = 0; l < 8; ++l) h[l] = UINT64_C(0x9e3779b97f4a7c15) * (uint64_t)(l + 1);
    for (int64_t w = 0; w < words; w += 8) {
      uint64_t v[8];
      std::memcpy(v, p + w * 8, 64);
      for (int l = 0; l < 8; ++l) h[l] = (h[l] ^ v[l]) * UINT64_C(0x100000001b3);
    }
    for (int64_t k = words * 8; k < len; ++k)  // the block's last bytes (fewer than 64)
      h[k % 8] = (h[k % 8] ^ p[k]) * UINT64_C(0x100000001b3);
    uint64_t f = (uint64_t)b;
    for (int l = 0; l < 8; ++l) f = mix(f ^ h[l]);
    total += f;
  }
  return total;
}
