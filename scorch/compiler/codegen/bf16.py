"""C++ helpers for bfloat16 scalars in vector loops, beside ``prelude``, which includes them (after ``scorch_vf``)."""

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
