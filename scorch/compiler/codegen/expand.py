"""The C++ helpers of a weight row read through its bitmap (``loopir.Expand``), for ``prelude``: ``expand`` gives
their text for a vector width (``vector_bytes``: the machine's), after the bfloat16 type's text (``bf16``:
``prelude.BF16``)."""
from __future__ import annotations


def expand(vector_bytes: int, bf16: str) -> str:
    """A group of 16 columns read through its bitmap word (``loopir.Expand``): ``scorch_expand(v, bits, lane0)``,
    the vector of lanes ``lane0 ..`` of the group, ``v`` its first stored value (float or bfloat16), each set bit
    taking the next value and the others 0; ``scorch_expand1`` one lane. A masked load of the group's values (it
    reads no memory past them) and AVX-512's ``vexpandps``; on AVX2 an 8-lane permute from a table (the lane
    each value goes to, by the mask), its load whole where ``scorch_expand``'s ``end`` (the values' end) is a
    vector's values or more away (``loopir.Expand.end``), else masked (floats) or value by value (bfloat16:
    through two registers: an array filled in a loop became a call to ``memcpy``, which kept the row's
    accumulators on the stack); ``scorch_expand_whole`` always whole (``loopir.Expand.whole``: the caller has made
    sure the values are there, so no test of the end a group); else lane by lane."""
    lanes = vector_bytes // 4  # (at most 16: a word's bits)

    def rank(m, u):
        """Lane ``u``'s value's rank among the lanes set in the 8-bit mask ``m``, or None where ``u`` is off."""
        return bin(m & ((1 << u) - 1)).count("1") if m >> u & 1 else None
    # (AVX2: per mask, each lane's byte: its rank, or 0x80 where the lane is off, so that the sign-extended byte
    #  both picks the value (``vpermps`` reads the low 3 bits) and zeroes the lane (``vblendvps`` reads the sign))
    table = ", ".join(hex(sum((0x80 if rank(m, u) is None else rank(m, u)) << (8 * u) for u in range(8))) + "ull"
                      for m in range(256))
    # (bfloat16 on AVX2: per mask, a byte shuffle of the group's 8 values (16 bytes, in both halves of a 32-byte
    #  vector) into float32 lanes: lane u's bytes 0x80 0x80 2k 2k+1 (its value, the k-th, as a float's top half)
    #  or all 0x80 (zero): expand, zero and widen in one ``vpshufb``)
    def ctl(m, u):
        k = rank(m, u)
        return [0x80] * 4 if k is None else [0x80, 0x80, 2 * k, 2 * k + 1]
    shuffles = ",\n".join("{" + ", ".join(str(b) for u in range(8) for b in ctl(m, u)) + "}" for m in range(256))
    return bf16 + f"""#ifndef SCORCH_EXPAND
#define SCORCH_EXPAND
#include <cstdint>
#include <immintrin.h>
template <typename T> static inline float scorch_expand1(const T* v, uint32_t bits, int64_t lane) {{
  const uint32_t b = bits & 0xFFFFu;
  return (b >> lane & 1u) ? (float)v[__builtin_popcount(b & ((1u << lane) - 1u))] : 0.0f;
}}
template <typename T> static inline scorch_vf32 scorch_expand_at(const T* v, uint32_t m) {{
  scorch_vf32 out = {{}};
  for (int u = 0; u < {lanes}; ++u) if (m >> u & 1u) out[u] = (float)*v++;
  return out;
}}
#if defined(__AVX512F__) && {vector_bytes} == 64
static inline scorch_vf32 scorch_expand_at(const float* v, uint32_t m) {{
  const __mmask16 k = (__mmask16)((1u << __builtin_popcount(m)) - 1u);
  return (scorch_vf32)_mm512_maskz_expand_ps((__mmask16)m, _mm512_maskz_loadu_ps(k, v));
}}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
static inline scorch_vf32 scorch_expand_at(const scorch_bf16* v, uint32_t m) {{
  const __mmask16 k = (__mmask16)((1u << __builtin_popcount(m)) - 1u);
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, v)), 16);
  return (scorch_vf32)_mm512_maskz_expand_ps((__mmask16)m, _mm512_castsi512_ps(w));
}}
#endif
#elif defined(__AVX2__) && {vector_bytes} == 32
static const uint64_t scorch_expand_lanes[256] = {{{table}}};
static inline __m256 scorch_expand_place(__m256 w, uint32_t m) {{
  const __m256i to = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)&scorch_expand_lanes[m]));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(w, to), _mm256_setzero_ps(), _mm256_castsi256_ps(to));
}}
static inline scorch_vf32 scorch_expand_at(const float* v, uint32_t m) {{
  const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(__builtin_popcount(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return (scorch_vf32)scorch_expand_place(_mm256_maskload_ps(v, k), m);
}}
static inline scorch_vf32 scorch_expand_at(const scorch_bf16* v, uint32_t m) {{
  uint64_t h[2] = {{0, 0}};  // (in two registers: an array filled in a loop became a call to memcpy, and the
  for (int u = 0, n = __builtin_popcount(m); u < n; ++u)  // call kept the row's accumulators on the stack)
    h[u >> 2] |= (uint64_t)v[u].bits << (16 * (u & 3));
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_set_epi64x((long long)h[1], (long long)h[0])), 16);
  return (scorch_vf32)scorch_expand_place(_mm256_castsi256_ps(w), m);
}}
static inline scorch_vf32 scorch_expand_whole_at(const float* v, uint32_t m) {{
  return (scorch_vf32)scorch_expand_place(_mm256_loadu_ps(v), m);
}}
alignas(32) static const uint8_t scorch_expand_bf16_bytes[256][32] = {{
{shuffles}}};
static inline scorch_vf32 scorch_expand_whole_at(const scorch_bf16* v, uint32_t m) {{
  const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)v));
  const __m256i to = _mm256_load_si256((const __m256i*)scorch_expand_bf16_bytes[m]);
  return (scorch_vf32)_mm256_castsi256_ps(_mm256_shuffle_epi8(w, to));
}}
// (float and bfloat16: whole where 8 values or more are left before ``end``)
template <typename T> static inline scorch_vf32 scorch_expand_at(const T* v, uint32_t m, const T* end) {{
  if (end - v < 8) return scorch_expand_at(v, m);
  return scorch_expand_whole_at(v, m);
}}
#define SCORCH_EXPAND_WHOLE
#endif
#ifndef SCORCH_EXPAND_WHOLE
template <typename T> static inline scorch_vf32 scorch_expand_at(const T* v, uint32_t m, const T*) {{
  return scorch_expand_at(v, m);
}}
#endif
template <typename T> static inline scorch_vf32 scorch_expand_whole_at(const T* v, uint32_t m) {{
  return scorch_expand_at(v, m);
}}
template <typename T> static inline const T* scorch_expand_from(const T* v, uint32_t bits, int64_t lane0) {{
  return v + __builtin_popcount(bits & 0xFFFFu & ((1u << lane0) - 1u));
}}
// (two overloads, not a defaulted end: a test of end in the group's loop cost ~8% at one bfloat16 token)
template <typename T> static inline scorch_vf32 scorch_expand(const T* v, uint32_t bits, int64_t lane0) {{
  return scorch_expand_at(scorch_expand_from(v, bits, lane0), ((bits & 0xFFFFu) >> lane0) & {hex((1 << lanes) - 1)}u);
}}
// (a vector's values there to read whole, the caller has made sure: ``loopir.Expand.whole``)
template <typename T> static inline scorch_vf32 scorch_expand_whole(const T* v, uint32_t bits, int64_t lane0) {{
  return scorch_expand_whole_at(scorch_expand_from(v, bits, lane0), ((bits & 0xFFFFu) >> lane0) & {hex((1 << lanes) - 1)}u);
}}
template <typename T> static inline scorch_vf32 scorch_expand(const T* v, uint32_t bits, int64_t lane0, const T* end) {{
  return scorch_expand_at(scorch_expand_from(v, bits, lane0), ((bits & 0xFFFFu) >> lane0) & {hex((1 << lanes) - 1)}u,
                          end);
}}
#endif
"""
