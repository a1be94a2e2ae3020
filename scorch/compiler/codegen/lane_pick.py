"""The C++ helpers of ``loopir.LanePick`` and ``loopir.Splat``, for ``prelude``: ``lane_pick`` and ``splat4`` give
their text for a vector width (``vector_bytes``: the machine's), after ``scorch_vf32``."""
from __future__ import annotations


def lane_pick(vector_bytes: int) -> str:
    """``scorch_lane_pick<S>(x, sel)``: lane ``l`` of the vector is ``x[(sel[l] >> S) & 3]``. With AVX2 (or
    AVX-512 at 64 bytes) one broadcast of ``x[0 .. 3]`` into each 16-byte half and ``vpermilps`` by the lanes'
    bytes widened and shifted (the permute reads the low 2 bits of each lane); else lane by lane. The bytes are
    read whole: a vector's lanes of them."""
    lanes = vector_bytes // 4
    return f"""#ifndef SCORCH_LANE_PICK
#define SCORCH_LANE_PICK
#include <cstdint>
#include <immintrin.h>
template <int S> static inline scorch_vf32 scorch_lane_pick(const float* x, const int8_t* sel) {{
#if defined(__AVX2__) && {vector_bytes} == 32
  const __m256i i = _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)sel)), S);
  return (scorch_vf32)_mm256_permutevar_ps(_mm256_broadcast_ps((const __m128*)x), i);
#elif defined(__AVX512F__) && {vector_bytes} == 64
  const __m512i i = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sel)), S);
  return (scorch_vf32)_mm512_permutevar_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(x)), i);
#else
  scorch_vf32 v;
  for (int l = 0; l < {lanes}; ++l) v[l] = x[((uint8_t)sel[l] >> S) & 3];
  return v;
#endif
}}
#endif
"""


def splat4(vector_bytes: int) -> str:
    """``scorch_splat4<U>(x)``: ``x[U]`` in every lane. With AVX2 (32-byte vectors) ``x[0 .. 3]`` loaded as one
    16-byte group (g++ shares the load among the four calls of one group), value ``U`` moved to the group's first
    lane by an in-lane shuffle and broadcast from there: shuffles instead of a broadcast load each, where a CSR
    row's loop is bound by its vector loads. Elsewhere the plain broadcast of ``x[U]``."""
    return f"""#ifndef SCORCH_SPLAT4
#define SCORCH_SPLAT4
#include <immintrin.h>
template <int U> static inline scorch_vf32 scorch_splat4(const float* x) {{
#if defined(__AVX2__) && {vector_bytes} == 32
  const __m128 g = _mm_loadu_ps(x);
  const __m128 u = U == 0 ? g : U == 1 ? _mm_movehdup_ps(g) : U == 2 ? _mm_movehl_ps(g, g) : _mm_shuffle_ps(g, g, 3);
  return (scorch_vf32)_mm256_broadcastss_ps(u);
#else
  return scorch_vf32{{}} + x[U];
#endif
}}
#endif
"""
