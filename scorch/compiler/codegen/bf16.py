"""C++ helpers for bfloat16 scalars in vector loops, beside ``prelude``, which includes them (after ``scorch_vf``)."""


def pair_dot4(vector_bytes: int) -> str:
    """``scorch_pair_dot4<U>(acc, x, w4)``: ``scorch_pair_dot(acc, x, w4 + 2 * U)`` (``loopir.PairDot``'s ``lane``)
    with the four pairs at ``w4`` loaded as one 16-byte group into every 128-bit lane and pair ``U`` taken by an
    in-lane shuffle: where four such dots run together (``weights_tiled``), one load for the four pairs, not a
    broadcast load each, where the loop is bound by its loads (a 64-byte panel vector takes both of Zen 4's
    vector load ports). Elsewhere the plain pair dot."""
    return f"""template <int U>
static inline scorch_vf32 scorch_pair_dot4(scorch_vf32 acc, const scorch_bf16* x, const scorch_bf16* w4) {{
#if defined(__AVX512BF16__) && {vector_bytes} == 64
  const __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)w4));
  return (scorch_vf32)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_shuffle_epi32(q, (_MM_PERM_ENUM)(U * 0x55)),
                                       (__m512bh)_mm512_loadu_si512(x));
#elif defined(__AVX512BF16__) && defined(__AVX512VL__) && {vector_bytes} == 32
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)w4));
  return (scorch_vf32)_mm256_dpbf16_ps((__m256)acc, (__m256bh)_mm256_shuffle_epi32(q, U * 0x55),
                                       (__m256bh)_mm256_loadu_si256((const __m256i*)x));
#else
  return scorch_pair_dot(acc, x, w4 + 2 * U);
#endif
}}
"""

#: ``scorch_pair_base(p)``: ``p``, which the compiler may no longer fold into the index of each access from it: a
#: tile's start in a panel (``weights_tiled``), whose accesses ``&panel[2 * tile] + 2 * pair`` g++ otherwise
#: rewrites as ``panel + 4 * (tile + pair)``, an add an access that the loop's dispatch width pays for. An empty
#: asm has no side effects, so it is hoisted out of the loop and shared by the accesses, as the pointer itself.
PAIR_BASE = """template <class T> static inline T* scorch_pair_base(T* p) {
  __asm__("" : "+r"(p));
  return p;
}
"""


#: ``scorch_splat_bf16(p)``: the bfloat16 at ``p`` as a float vector. A ``(float)`` cast of a bfloat16 load times a
#: vector compiles to a 16-bit load into a general register, a shift, a move into a vector register and a
#: broadcast (four instructions, two of them crossing register files); here a 16-bit broadcast straight from
#: memory and a shift of each lane (a bfloat16 is the high half of its float32): in the CSR weight kernels' inner
#: loop (one per stored weight) that made bfloat16 values as fast as float32 ones (``compiler.weights``).
def splat(vector_bytes: int) -> str:
    return f"""#include <immintrin.h>
static inline scorch_vf32 scorch_splat_bf16(const scorch_bf16* p) {{
  short s;
  std::memcpy(&s, p, 2);
#if defined(__AVX512BW__) && {vector_bytes} == 64
  return (scorch_vf32)_mm512_slli_epi32(_mm512_set1_epi16(s), 16);
#elif defined(__AVX2__) && {vector_bytes} == 32
  return (scorch_vf32)_mm256_slli_epi32(_mm256_set1_epi16(s), 16);
#else
  return scorch_vf32{{}} + (float)*p;
#endif
}}
"""


#: ``scorch_pair_half<H>(x)``: ``loopir.PairHalf``, element ``H`` of each bfloat16 pair from ``x`` as a float vector:
#: one load of whole 32-bit pairs, and the low element shifted into the high half (``H`` 0) or the low half masked
#: off (``H`` 1). Vector extensions, so every target with vectors renders it (an integer shift and an and).
PAIR_HALF = """typedef uint32_t scorch_phu __attribute__((vector_size(sizeof(scorch_vf32)), aligned(2), may_alias));
template <int H>
static inline scorch_vf32 scorch_pair_half(const scorch_bf16* x) {
  const scorch_phu v = *(const scorch_phu*)x;
  return (scorch_vf32)(H ? (v & 0xffff0000u) : (v << 16));
}
"""
