"""The C++ text a generated kernel may need besides its own function: vector types and lane sums, bfloat16 and
float16 scalars and vectors, float atomics, a vectorizable ``exp``, heap buffers and a key sort. ``HELPERS`` maps
a name to its text; the renderer (``cpp``) includes a text only where the kernel's source uses its name.
"""
from __future__ import annotations

from ... import loopir as L
from ..target import CPU
from . import amx
from .activations import ACTIVATIONS, EXPF
from .bf16 import PAIR_BASE, PAIR_HALF, pair_dot4, splat
from .expand import expand
from .lane_pick import lane_pick, splat4
from .transpose import TRANSPOSE


def _hsum(name, ctype, lanes, op="sum", vec=None, fname=None):
    """The sum (``op="max"``: the max) of a vector's lanes by halving (a tree: log2(lanes) dependent steps);
    ``vec`` / ``fname``: the vector type and the function's name (``scorch_v{name}``, ``scorch_h{op}``)."""
    lines = [f"static inline {ctype} {fname or f'scorch_h{op}'}({vec or f'scorch_v{name}'} v0) {{"]
    join = (lambda a, b: f"{a} + {b}") if op == "sum" else (lambda a, b: f"({a} > {b} ? {a} : {b})")
    width, k = lanes, 0
    while width > 1:
        half = width // 2
        lo = ", ".join(str(i) for i in range(half))
        hi = ", ".join(str(i) for i in range(half, width))
        t = f"scorch_h{name}_{half}"
        if half > 1:
            lines.append(f"  typedef {ctype} {t} __attribute__((vector_size({half * (4 if name == 'f32' else 8)})));")
            lines.append(f"  const {t} a{k} = __builtin_shufflevector(v{k}, v{k}, {lo}),"
                         f" b{k} = __builtin_shufflevector(v{k}, v{k}, {hi});")
            lines.append(f"  const {t} v{k + 1} = {join(f'a{k}', f'b{k}')};")
        else:
            lines.append(f"  return {join(f'v{k}[0]', f'v{k}[1]')};")
        width, k = half, k + 1
    return "\n".join(lines) + "\n}\n"


def _tsum(name, ctype, lanes):
    """The lane sums of ``lanes`` vectors at once, into ``out[0:lanes]``: a transposed tree. Each level adds
    pairs of vectors after two two-source shuffles that put the first halves of every entry's partial sums in one
    vector and the second halves in the other, halving the partial sums per entry and the vectors: lanes - 1
    adds and twice as many shuffles in all, against about 2 log2(lanes) per vector reduced one by one."""
    vt = f"scorch_v{name}"
    lines = [f"static inline void scorch_tsum(const {vt}* v0, {ctype}* out) {{"]
    count, m, k = lanes, lanes, 0
    while count > 1:
        half = m // 2
        lo = [e * m + j for e in range(lanes // m) for j in range(half)]
        lo = ", ".join(str(i) for i in lo + [lanes + i for i in lo])
        hi = [e * m + j + half for e in range(lanes // m) for j in range(half)]
        hi = ", ".join(str(i) for i in hi + [lanes + i for i in hi])
        lines.append(f"  {vt} v{k + 1}[{count // 2}];")
        lines.append(f"  for (int u = 0; u < {count // 2}; ++u) v{k + 1}[u] ="
                     f" __builtin_shufflevector(v{k}[2 * u], v{k}[2 * u + 1], {lo}) +"
                     f" __builtin_shufflevector(v{k}[2 * u], v{k}[2 * u + 1], {hi});")
        count, m, k = count // 2, half, k + 1
    lines.append(f"  *({vt}u*)out = v{k}[0];")
    return "\n".join(lines) + "\n}\n"


#: bytes of an explicit vector (``For.vector`` loops): the CPU target's (``target.CPU``)
VECTOR_BYTES = CPU.vector_bytes

def _lane_by_lane(vt, pre, t, ctype, nbytes, keep_guard, load_guard) -> str:
    """The portable helpers of ``nbytes``-byte vectors ``vt`` of ``ctype`` (``pre`` + ``keep``, ``gather``,
    ``gathern``, ``loadn``: see ``_gather``), lane by lane; ``keep`` and ``loadn`` only where their guard (a
    preprocessor condition for the machine's own instructions, or None) does not hold."""
    size = 4 if t == "f32" else 8
    lanes, it = nbytes // size, "int32_t" if size == 4 else "int64_t"
    lane = ", ".join(str(u) for u in range(lanes))

    def unless(guard, text):
        return text if guard is None else f"#if !({guard})\n{text}#endif\n"
    ivt = f"{vt[:-3]}i{t}"  # (the lanes' indices: scorch_vif32, scorch_hvif32)
    return unless(keep_guard, f"""typedef {it} {ivt} __attribute__((vector_size({nbytes})));
static inline {vt} {pre}keep({vt} v, int64_t n) {{
  const {ivt} lane = {{{lane}}};
  return (lane < ({it})n) ? v : {vt}{{}};
}}
""") + f"""template <typename I> static inline {vt} {pre}gather(const {ctype}* b, const I* i) {{
  {vt} v;
  for (int u = 0; u < {lanes}; ++u) v[u] = b[i[u]];
  return v;
}}
template <typename I> static inline {vt} {pre}gathern(const {ctype}* b, const I* i, int64_t n) {{
  {vt} v = {{}};
  for (int u = 0; u < {lanes}; ++u) if (u < n) v[u] = b[i[u]];
  return v;
}}
""" + unless(load_guard, f"""static inline {vt} {pre}loadn(const {ctype}* p, int64_t n) {{
  {vt} v = {{}};
  for (int u = 0; u < {lanes}; ++u) if (u < n) v[u] = p[u];
  return v;
}}
""")


def _gather() -> str:
    """Vectors read at computed positions, for a vector loop whose loads are not contiguous (SpMV's ``x[crd[p]]``):
    ``scorch_gather(base, idx)`` the vector of ``base[idx[u]]``; in the last, partial vector of a loop (``n`` lanes
    on) ``scorch_loadn(p, n)`` (a contiguous load), ``scorch_gathern(base, idx, n)`` and ``scorch_keep(v, n)``
    (``v`` with its lanes past ``n`` set to 0). Lanes that are off read no memory. AVX2's gather and masked-load
    instructions where the vectors are 32 bytes, AVX-512's (mask registers) where they are 64, else lane by
    lane."""
    out = ["#ifndef SCORCH_GATHER\n#define SCORCH_GATHER\n"]
    machine = f"(defined(__AVX2__) && {VECTOR_BYTES} == 32) || (defined(__AVX512F__) && defined(__AVX512VL__) && " \
              f"{VECTOR_BYTES} == 64)"
    for t, ctype, size in (("f32", "float", 4), ("f64", "double", 8)):
        out.append(_lane_by_lane(f"scorch_v{t}", "scorch_", t, ctype, VECTOR_BYTES, None, machine))
    # (the same values with AVX2's or AVX-512's instructions: overloads, preferred to the templates for int32
    # positions)
    out.append(f"""#if defined(__AVX2__) && {VECTOR_BYTES} == 32
#include <immintrin.h>
static inline __m256i scorch_mask8(int64_t n) {{
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}}
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {{
  return (scorch_vf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {{
  const __m256i m = scorch_mask8(n);
  return (scorch_vf32)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), b, _mm256_maskload_epi32(i, m),
                                               _mm256_castsi256_ps(m), 4);
}}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {{
  return (scorch_vf32)_mm256_maskload_ps(p, scorch_mask8(n));
}}
// (int16 positions: a weight's narrow coordinates, sign-extended; the lanes that are off read no position)
static inline scorch_vf32 scorch_gather(const float* b, const int16_t* i) {{
  return (scorch_vf32)_mm256_i32gather_ps(b, _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)i)), 4);
}}
static inline scorch_vf32 scorch_gathern(const float* b, const int16_t* i, int64_t n) {{
  int16_t at[8] = {{0, 0, 0, 0, 0, 0, 0, 0}};
  for (int64_t u = 0; u < n && u < 8; ++u) at[u] = i[u];
  return (scorch_vf32)_mm256_mask_i32gather_ps(_mm256_setzero_ps(), b, _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)at)),
                                               _mm256_castsi256_ps(scorch_mask8(n)), 4);
}}
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {{
  return (scorch_vf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {{
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_mask_i32gather_pd(_mm256_setzero_pd(), b, _mm_maskload_epi32(i, m),
                                               _mm256_castsi256_pd(_mm256_cvtepi32_epi64(m)), 8);
}}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {{
  const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32((int)(n < 4 ? n : 4)), _mm_setr_epi32(0, 1, 2, 3));
  return (scorch_vf64)_mm256_maskload_pd(p, _mm256_cvtepi32_epi64(m));
}}
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__) && {VECTOR_BYTES} == 64
#include <immintrin.h>
static inline __mmask16 scorch_kmask16(int64_t n) {{ return (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1); }}
static inline __mmask8 scorch_kmask8(int64_t n) {{ return (__mmask8)(n >= 8 ? 0xFF : (1u << n) - 1); }}
static inline scorch_vf32 scorch_gather(const float* b, const int32_t* i) {{
  return (scorch_vf32)_mm512_i32gather_ps(_mm512_loadu_si512((const void*)i), b, 4);
}}
static inline scorch_vf32 scorch_gathern(const float* b, const int32_t* i, int64_t n) {{
  const __mmask16 m = scorch_kmask16(n);
  return (scorch_vf32)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, _mm512_maskz_loadu_epi32(m, i), b, 4);
}}
static inline scorch_vf32 scorch_loadn(const float* p, int64_t n) {{
  return (scorch_vf32)_mm512_maskz_loadu_ps(scorch_kmask16(n), p);
}}
#ifdef __AVX512BW__
static inline scorch_vf32 scorch_gather(const float* b, const int16_t* i) {{
  return (scorch_vf32)_mm512_i32gather_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)i)), b, 4);
}}
static inline scorch_vf32 scorch_gathern(const float* b, const int16_t* i, int64_t n) {{
  const __mmask16 m = scorch_kmask16(n);
  return (scorch_vf32)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, i)), b, 4);
}}
#endif
static inline scorch_vf64 scorch_gather(const double* b, const int32_t* i) {{
  return (scorch_vf64)_mm512_i32gather_pd(_mm256_loadu_si256((const __m256i*)i), b, 8);
}}
static inline scorch_vf64 scorch_gathern(const double* b, const int32_t* i, int64_t n) {{
  const __mmask8 m = scorch_kmask8(n);
  return (scorch_vf64)_mm512_mask_i32gather_pd(_mm512_setzero_pd(), m, _mm256_maskz_loadu_epi32(m, i), b, 8);
}}
static inline scorch_vf64 scorch_loadn(const double* p, int64_t n) {{
  return (scorch_vf64)_mm512_maskz_loadu_pd(scorch_kmask8(n), p);
}}
#endif
#endif
""")
    return "".join(out)


def _half() -> str:
    """32-byte vectors where the explicit vectors are 64 (``target.sum_lanes``: a row sum's vector):
    ``scorch_hvf32`` / ``scorch_hvf64`` (and ``...u`` at any address), with the helpers of ``_gather`` for them
    (``scorch_hvgather``, ``scorch_hvgathern``, ``scorch_hvloadn``, ``scorch_hvkeep``) and ``scorch_hvhsum``.
    A partial vector's count ``n`` may be 0 or less (no lane on) or more than the lanes (every lane on): a
    ``For.lead`` vector runs whatever the row's length. AVX-512's 256-bit masked instructions where there are
    (``-mavx512vl``), else lane by lane."""
    out = ["#ifndef SCORCH_HALF\n#define SCORCH_HALF\n#include <cstdint>\n"]
    vl = "defined(__AVX512F__) && defined(__AVX512VL__)"
    for t, ctype, size in (("f32", "float", 4), ("f64", "double", 8)):
        vt = f"scorch_hv{t}"
        out.append(f"typedef {ctype} {vt} __attribute__((vector_size(32)));\n"
                   f"typedef {ctype} {vt}u __attribute__((vector_size(32), aligned({size}), may_alias));\n"
                   + _lane_by_lane(vt, "scorch_hv", t, ctype, 32, vl, vl) + _hsum(t, ctype, 32 // size, vec=vt,
                                                                                 fname="scorch_hvhsum"))
    out.append("""#if defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
static inline __mmask8 scorch_hvmask(int64_t n, int lanes) {  // (no branch: a For.lead vector's count varies)
  int64_t c = n < 0 ? 0 : n;
  c = c < lanes ? c : lanes;
#ifdef __BMI2__
  return (__mmask8)_bzhi_u32(0xFFu, (unsigned)c);
#else
  return (__mmask8)((1u << c) - 1);
#endif
}
static inline scorch_hvf32 scorch_hvgather(const float* b, const int32_t* i) {
  return (scorch_hvf32)_mm256_i32gather_ps(b, _mm256_loadu_si256((const __m256i*)i), 4);
}
static inline scorch_hvf32 scorch_hvgathern(const float* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_hvmask(n, 8);
  return (scorch_hvf32)_mm256_mmask_i32gather_ps(_mm256_setzero_ps(), m, _mm256_maskz_loadu_epi32(m, i), b, 4);
}
static inline scorch_hvf32 scorch_hvloadn(const float* p, int64_t n) {
  return (scorch_hvf32)_mm256_maskz_loadu_ps(scorch_hvmask(n, 8), p);
}
static inline scorch_hvf32 scorch_hvkeep(scorch_hvf32 v, int64_t n) {
  return (scorch_hvf32)_mm256_maskz_mov_ps(scorch_hvmask(n, 8), (__m256)v);
}
static inline scorch_hvf64 scorch_hvgather(const double* b, const int32_t* i) {
  return (scorch_hvf64)_mm256_i32gather_pd(b, _mm_loadu_si128((const __m128i*)i), 8);
}
static inline scorch_hvf64 scorch_hvgathern(const double* b, const int32_t* i, int64_t n) {
  const __mmask8 m = scorch_hvmask(n, 4);
  return (scorch_hvf64)_mm256_mmask_i32gather_pd(_mm256_setzero_pd(), m, _mm_maskz_loadu_epi32(m, i), b, 8);
}
static inline scorch_hvf64 scorch_hvloadn(const double* p, int64_t n) {
  return (scorch_hvf64)_mm256_maskz_loadu_pd(scorch_hvmask(n, 4), p);
}
static inline scorch_hvf64 scorch_hvkeep(scorch_hvf64 v, int64_t n) {
  return (scorch_hvf64)_mm256_maskz_mov_pd(scorch_hvmask(n, 4), (__m256d)v);
}
#endif
#endif
""")
    return "".join(out)


#: the 16-bit floats (storage types: loaded into float, rounded to nearest even when stored). bfloat16 is the top
#: half of a float32 (a NaN stays a quiet NaN); float16 is the compiler's ``_Float16``. ``scorch_atomic_add``:
#: an atomic ``+=`` on either, by compare-and-swap of the 16 bits (OpenMP's atomic takes no 16-bit floats).
BF16 = """#ifndef SCORCH_BF16
#define SCORCH_BF16
// the bfloat16 bits (in the low 16 bits) of the float32 bits u: to nearest even, a NaN made quiet; u is a
// uint32_t or a vector of them (the explicit-vector tiles round with the same expression, scorch_bf16_bits)
template <class U> static inline U scorch_bf16_round(U u) {
  return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
struct scorch_bf16 {
  uint16_t bits;
  scorch_bf16() = default;
  explicit scorch_bf16(float f) : bits(round(f)) {}
  static uint16_t round(float f) { return (uint16_t)scorch_bf16_round(__builtin_bit_cast(uint32_t, f)); }
  operator float() const { return __builtin_bit_cast(float, (uint32_t)bits << 16); }
  scorch_bf16& operator=(float f) { bits = round(f); return *this; }
  scorch_bf16& operator+=(float f) { bits = round((float)*this + f); return *this; }
};
#endif
"""
ATOMIC16 = BF16 + """static inline void scorch_atomic_add(scorch_bf16* p, float v) {
  uint16_t* q = (uint16_t*)p;
  uint16_t seen = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    const uint16_t next = scorch_bf16::round(__builtin_bit_cast(float, (uint32_t)seen << 16) + v);
    if (__atomic_compare_exchange_n(q, &seen, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  }
}
static inline void scorch_atomic_add(_Float16* p, float v) {
  uint16_t* q = (uint16_t*)p;
  uint16_t seen = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    const uint16_t next = __builtin_bit_cast(uint16_t, (_Float16)((float)__builtin_bit_cast(_Float16, seen) + v));
    if (__atomic_compare_exchange_n(q, &seen, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  }
}
"""

#: 16-bit floats in explicit vectors: ``scorch_widen(p)`` the float vector of the 16-bit values at ``p``,
#: ``scorch_narrow(p, v)`` the float vector ``v`` rounded into them (bf16 as the scalar struct rounds it)
WIDE16 = f"""#ifndef SCORCH_WIDE16
#define SCORCH_WIDE16
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
typedef uint16_t scorch_vu16 __attribute__((vector_size({VECTOR_BYTES // 2}), aligned(2), may_alias));
typedef uint32_t scorch_vu32 __attribute__((vector_size({VECTOR_BYTES})));
typedef _Float16 scorch_vh16 __attribute__((vector_size({VECTOR_BYTES // 2}), aligned(2), may_alias));
static inline scorch_vf32 scorch_widen(const scorch_bf16* p) {{
  return (scorch_vf32)(__builtin_convertvector(*(const scorch_vu16*)p, scorch_vu32) << 16);
}}
static inline scorch_vf32 scorch_widen(const _Float16* p) {{
#if defined(__F16C__) && {VECTOR_BYTES} == 32
  return (scorch_vf32)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX512F__) && {VECTOR_BYTES} == 64
  return (scorch_vf32)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  return __builtin_convertvector(*(const scorch_vh16*)p, scorch_vf32);  // (GCC converts it lane by lane)
#endif
}}
// the bfloat16 bits of each lane (low 16 bits of its word), rounded as the scalar struct rounds
static inline scorch_vu32 scorch_bf16_bits(scorch_vf32 v) {{ return scorch_bf16_round((scorch_vu32)v); }}
static inline void scorch_narrow(scorch_bf16* p, scorch_vf32 v) {{
  *(scorch_vu16*)p = __builtin_convertvector(scorch_bf16_bits(v), scorch_vu16);
}}
// bfloat16 in lane pairs: two vectors' 16-bit values as one vector of 32-bit words, the even elements in the
// low halves and the odd ones in the high halves, widen with one shift or one mask each (no shuffle); the first
// vector of a pair holds the pair's even elements, the second its odd ones (``lane``: the vector loop's index)
typedef uint32_t scorch_vu32u __attribute__((vector_size({VECTOR_BYTES}), aligned(2), may_alias));
static inline scorch_vf32 scorch_widen_pair(const scorch_bf16* p, int64_t lane) {{
  if ((lane / {VECTOR_BYTES // 4}) & 1) return (scorch_vf32)(*(const scorch_vu32u*)(p - {VECTOR_BYTES // 4}) & 0xffff0000u);
  return (scorch_vf32)(*(const scorch_vu32u*)p << 16);
}}
static inline void scorch_narrow_pair(scorch_bf16* p, scorch_vf32 v, int64_t lane) {{
  const scorch_vu32 r = scorch_bf16_bits(v);
  if ((lane / {VECTOR_BYTES // 4}) & 1) {{
    scorch_vu32u* q = (scorch_vu32u*)(p - {VECTOR_BYTES // 4});
    *q = (*q & 0xffffu) | (r << 16);
  }} else {{
    scorch_vu32u* q = (scorch_vu32u*)p;
    *q = (*q & 0xffff0000u) | r;
  }}
}}
static inline void scorch_narrow(_Float16* p, scorch_vf32 v) {{
#if defined(__F16C__) && {VECTOR_BYTES} == 32
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__AVX512F__) && {VECTOR_BYTES} == 64
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#else
  *(scorch_vh16*)p = __builtin_convertvector(v, scorch_vh16);
#endif
}}
#endif
"""


#: ``loopir.Common`` by a merge without branches (any index types; the GPU's version)
COMMON_MERGE = """template <class I, class J> static inline int64_t scorch_common(const I* a, int64_t na, const J* b, int64_t nb) {
  int64_t i = 0, j = 0, c = 0;
  while (i < na && j < nb) {
    const int64_t x = (int64_t)a[i], y = (int64_t)b[j];
    c += x == y;
    i += x <= y;
    j += y <= x;
  }
  return c;
}
"""
COMMON = "#include <cstdint>\n" + COMMON_MERGE + """#if defined(__AVX2__) && defined(__GNUC__) && __GNUC__ >= 12
typedef int32_t scorch_v8i __attribute__((vector_size(32)));
static inline scorch_v8i scorch_block8(const int32_t* p, int64_t n, int32_t missing) {
  scorch_v8i v;
  if (n >= 8) {
    __builtin_memcpy(&v, p, 32);
    return v;
  }
  const scorch_v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const scorch_v8i on = lane < (int32_t)n;
  v = __builtin_ia32_maskloadd256((const scorch_v8i*)p, on);
  return on ? v : scorch_v8i{} + missing;
}
static inline int64_t scorch_common(const int32_t* a, int64_t na, const int32_t* b, int64_t nb) {
  int64_t i = 0, j = 0;
  scorch_v8i found = {};
  while (i < na && j < nb) {
    const int64_t ra = na - i < 8 ? na - i : 8, rb = nb - j < 8 ? nb - j : 8;
    const scorch_v8i x = scorch_block8(a + i, ra, -1), y = scorch_block8(b + j, rb, -2);
    found -= (x == y) | (x == __builtin_shufflevector(y, y, 1, 2, 3, 4, 5, 6, 7, 0))
           | (x == __builtin_shufflevector(y, y, 2, 3, 4, 5, 6, 7, 0, 1))
           | (x == __builtin_shufflevector(y, y, 3, 4, 5, 6, 7, 0, 1, 2))
           | (x == __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3))
           | (x == __builtin_shufflevector(y, y, 5, 6, 7, 0, 1, 2, 3, 4))
           | (x == __builtin_shufflevector(y, y, 6, 7, 0, 1, 2, 3, 4, 5))
           | (x == __builtin_shufflevector(y, y, 7, 0, 1, 2, 3, 4, 5, 6));
    const int32_t la = a[i + ra - 1], lb = b[j + rb - 1];
    i += la <= lb ? ra : 0;
    j += lb <= la ? rb : 0;
  }
  int64_t c = 0;
  for (int u = 0; u < 8; ++u) c += found[u];
  return c;
}
#endif
"""

# bitmaps of keys (``loopir.SetBit``, ``BitKeys``, ``BitCount``), and the ascending sort of int64 keys
# (``loopir.Sort``), which uses them; each guarded, so that a kernel naming both gets them once
_BITMAP = "#ifndef SCORCH_BITMAP\n#define SCORCH_BITMAP\n" + \
    f"#define SCORCH_BITMAP_MIN_KEYS {L.BITMAP_MIN_KEYS}\n" + """#ifdef __CUDA_ARCH__
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
"""
_SORT = _BITMAP + """#ifndef SCORCH_SORT
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
"""

#: the first row of part k of n, where an nnz-balanced parallel loop splits rows [lo, hi) by rows + positions under
#: them: f(r) = (pos[r] - pos[lo]) + (r - lo) is increasing, and part k starts at the first r in [lo, hi] with
#: f(r) >= total * k / n (total = f(hi)). Searched from the row evenly spread rows would give, by steps doubling
#: away from it, then halving: on a pattern of even rows a few reads of pos near the guess, where a halving search
#: from the whole range read pos ~log2(rows) times, each a cache miss on a call that finds pos out of cache, twice
#: for each of a call's parts (SpMV on the uniform 20k matrix in the benchmark's rounds, by hand: 168-174 us with
#: the whole-range search, 147-153 with this: design notes, stop 37)
FIRST_ROW = """#ifndef SCORCH_FIRST_ROW
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
"""

#: ``scorch_pin(v)``: an empty asm that takes a vector in a register and may change it, so that the compiler cannot
#: take its uses back to the load (a pinned workspace, ``codegen.cpp``); nothing where the machine's registers do
#: not hold a vector of this width (64-byte vectors on an AVX2 CPU, a forced ``SCORCH_VECTOR_BYTES``: the asm's
#: constraint would be impossible) or the CPU is not x86
PIN = f"""#ifndef SCORCH_PIN
#define SCORCH_PIN
#if (defined(__AVX512F__) && {VECTOR_BYTES} == 64) || (defined(__AVX__) && {VECTOR_BYTES} == 32) || \\
    (defined(__SSE2__) && {VECTOR_BYTES} == 16)
#define scorch_pin(v) __asm__("" : "+v"(v))
#else
#define scorch_pin(v) ((void)0)
#endif
#endif
"""

#: helpers that call another: a source naming the first gets the second too (before it, in ``HELPERS``' order)
DEPENDS = {"scorch_gelu": "scorch_expf", "scorch_silu": "scorch_expf"}

HELPERS = {
    "scorch_first_row": FIRST_ROW,
    "scorch_bf16": BF16,
    "scorch_atomic_add": ATOMIC16,
    "scorch_expf": EXPF,
    # (each name finds the same guarded text: ``scorch_gelu`` is in ``scorch_gelu_tanh`` too; after ``scorch_expf``,
    # which ``DEPENDS`` brings in)
    "scorch_gelu": ACTIVATIONS, "scorch_silu": ACTIVATIONS,
    # explicit vectors: ``scorch_vf32`` (aligned, for register tiles) and ``scorch_vf32u`` (any float address)
    "scorch_vf": "".join(
        f"typedef {t} scorch_v{n} __attribute__((vector_size({VECTOR_BYTES})));\n"
        f"typedef {t} scorch_v{n}u __attribute__((vector_size({VECTOR_BYTES}), aligned({b}), may_alias));\n"
        for n, t, b in (("f32", "float", 4), ("f64", "double", 8))) + "".join(
        _hsum(n, t, VECTOR_BYTES // b) + _hsum(n, t, VECTOR_BYTES // b, "max") + _tsum(n, t, VECTOR_BYTES // b)
        for n, t, b in (("f32", "float", 4), ("f64", "double", 8))),
    "scorch_pin": PIN,
    # loads at computed positions and of a partial last vector (after ``scorch_vf``, whose types they use)
    "scorch_hv": _half(),
    "scorch_gather": _gather(), "scorch_loadn": _gather(), "scorch_keep": _gather(),
    # 16-bit floats in explicit vectors (after ``scorch_vf``, whose types they use)
    "scorch_widen": BF16 + WIDE16,
    # a group of columns read through its bitmap word (after ``scorch_vf``)
    "scorch_expand": expand(VECTOR_BYTES, BF16),
    # one of 4 floats a lane, chosen by a byte a lane (``loopir.LanePick``; after ``scorch_vf``)
    "scorch_lane_pick": lane_pick(VECTOR_BYTES),
    # one of a group of 4 floats in every lane (``loopir.Splat``; after ``scorch_vf``)
    "scorch_splat4": splat4(VECTOR_BYTES),
    # a 32-column group of bfloat16 values read through its bitmap word, dotted in pairs with bfloat16 x
    # (``loopir.ExpandPairDot``): a masked load, vpexpandw and vdpbf16ps where the CPU has AVX512-VBMI2 and
    # AVX512-BF16, else lane by lane (the same products, summed in float32)
    "scorch_expand_pair_dot": BF16 + f"""#include <immintrin.h>
static inline scorch_vf32 scorch_expand_pair_dot(scorch_vf32 acc, const scorch_bf16* v, uint32_t bits,
                                                 const scorch_bf16* x) {{
#if defined(__AVX512VBMI2__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && {VECTOR_BYTES} == 64
  const __mmask32 k = (__mmask32)(bits == 0xFFFFFFFFu ? 0xFFFFFFFFu : (1u << __builtin_popcount(bits)) - 1u);
  const __m512i w = _mm512_maskz_expand_epi16((__mmask32)bits, _mm512_maskz_loadu_epi16(k, v));
  return (scorch_vf32)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
#else
  for (int c = 0; c < {2 * (VECTOR_BYTES // 4)}; ++c)
    if (bits >> c & 1u) acc[c / 2] += (float)*v++ * (float)x[c];
  return acc;
#endif
}}
""",
    "scorch_narrow": BF16 + WIDE16,
    "scorch_splat_bf16": BF16 + "#include <cstring>\n" + splat(VECTOR_BYTES),
    # a bfloat16 pair dot added into a float vector (``loopir.PairDot``): AVX512-BF16's ``vdpbf16ps`` where the
    # CPU has it, else each pair widened by a shift and a mask and two multiply-adds (same products, summed in
    # float32)
    "scorch_pair_dot": BF16 + f"""#include <cstring>
#include <immintrin.h>
typedef uint32_t scorch_pdu __attribute__((vector_size({VECTOR_BYTES}), aligned(2), may_alias));
static inline scorch_vf32 scorch_pair_dot(scorch_vf32 acc, const scorch_bf16* x, const scorch_bf16* w) {{
  uint32_t pair;
  std::memcpy(&pair, w, 4);
#if defined(__AVX512BF16__) && {VECTOR_BYTES} == 64
  return (scorch_vf32)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_set1_epi32((int)pair));
#elif defined(__AVX512BF16__) && defined(__AVX512VL__) && {VECTOR_BYTES} == 32
  return (scorch_vf32)_mm256_dpbf16_ps((__m256)acc, (__m256bh)_mm256_loadu_si256((const __m256i*)x), (__m256bh)_mm256_set1_epi32((int)pair));
#else
  const scorch_pdu v = *(const scorch_pdu*)x;
  const float w0 = __builtin_bit_cast(float, pair << 16), w1 = __builtin_bit_cast(float, pair & 0xffff0000u);
  return acc + (scorch_vf32)(v << 16) * w0 + (scorch_vf32)(v & 0xffff0000u) * w1;
#endif
}}
""",
    "scorch_pair_dot4": pair_dot4(VECTOR_BYTES),
    "scorch_pair_half": BF16 + PAIR_HALF,
    "scorch_pair_base": PAIR_BASE,
    # ``c ? a : b`` with both already evaluated, chosen by a bit mask (a compiler keeps a branch for a ternary
    # over floats, mispredicted where ``c`` is a coin toss, as in a merge)
    "scorch_pick": """#include <cstdint>
template <class T> static inline T scorch_pick(bool c, T a, T b) { return c ? a : b; }
template <> inline float scorch_pick<float>(bool c, float a, float b) {
  const uint32_t m = 0u - (uint32_t)c;
  return __builtin_bit_cast(float, (__builtin_bit_cast(uint32_t, a) & m) | (__builtin_bit_cast(uint32_t, b) & ~m));
}
template <> inline double scorch_pick<double>(bool c, double a, double b) {
  const uint64_t m = 0ull - (uint64_t)c;
  return __builtin_bit_cast(double, (__builtin_bit_cast(uint64_t, a) & m) | (__builtin_bit_cast(uint64_t, b) & ~m));
}
""",
    # the size of two sorted lists' intersection (``loopir.Common``): int32 lists a block of 8 of each at a time
    # (every pair compared, the block with the smaller last value replaced; lanes past a list's end hold values
    # no coordinate has, and read no memory), others by a merge without branches
    "scorch_common": COMMON,
    # a zero-filled heap buffer freed at the end of its scope (std::vector's header alone costs ~0.3 s), on a
    # cache line: a panel's vectors (64 bytes at offsets of whole vectors) then never straddle two lines
    "scorch_buf": """#include <cstdint>
#include <cstdlib>
struct scorch_buf {
  void* raw;
  void* p;
  scorch_buf(size_t n, size_t size) : raw(std::calloc((n ? n : 1) * size + 63, 1)),
    p((void*)(((uintptr_t)raw + 63) & ~(uintptr_t)63)) {}
  ~scorch_buf() { std::free(raw); }
};
""",
    # ascending sort of distinct int64 keys, and bitmaps of keys (<algorithm> costs ~0.4 s); a count pass's bitmap
    # rows name the bitmap helpers alone
    "scorch_sort": _SORT,
    "scorch_set_bit": _BITMAP,
    # a block copied transposed (``loopir.Transpose``: ``codegen.transpose``)
    "scorch_transpose": TRANSPOSE,
    # matrix tiles (``loopir.TileConfig``): the CPU's, or the model of them (``codegen.amx``)
    "scorch_amx_tiles": amx.TILES,
    "scorch_amx_model_tiles": amx.MODEL,
}
