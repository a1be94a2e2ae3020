"""The C++ helper of ``loopir.Transpose``, beside ``prelude``, which includes it: a block of a row-major matrix
copied transposed, in square tiles of float32 vectors (AVX-512: 16 x 16 by unpacks and 128-bit lane shuffles;
AVX2: 8 x 8; a 16-bit side converted to and from float32 a tile's row at a time), lane by lane elsewhere (the
edges past whole tiles, targets of narrower vectors). GCC leaves the plain loops of a transpose scalar
("complicated access pattern"): in the sparse-weight Linear kernels (``compiler.weights``), packing the input and
storing the result took as long as the products of a 10%-dense 768 x 768 weight at 1024 tokens."""
from ..target import CPU

def _tile(lanes: int, last: str) -> str:
    """``scorch_transpose_tile(d, s, ds, ss)``, a ``lanes`` x ``lanes`` float32 tile: pairs of rows interleaved
    (unpack), then pairs of pairs (shuffle), in every 128-bit lane; ``last`` moves the 128-bit lanes to their rows
    and stores them."""
    v, p = ("__m512", "_mm512") if lanes == 16 else ("__m256", "_mm256")
    return f"""static inline void scorch_transpose_tile(float* __restrict__ d, const float* __restrict__ s, int64_t ds,
                                         int64_t ss) {{
  {v} r[{lanes}], t[{lanes}];
  for (int i = 0; i < {lanes}; ++i) r[i] = {p}_loadu_ps(s + i * ss);
  for (int i = 0; i < {lanes}; i += 2) {{
    t[i] = {p}_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = {p}_unpackhi_ps(r[i], r[i + 1]);
  }}
  for (int i = 0; i < {lanes}; i += 4) {{
    r[i] = {p}_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = {p}_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = {p}_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = {p}_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }}
{last}}}
"""


#: AVX-512: the four 128-bit lanes of 4 rows 4 apart gathered in two rounds of ``vshuff32x4``
_AVX512 = _tile(16, """  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(d + i * ds, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(d + (i + 8) * ds, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
  }
""")
#: AVX: the two 128-bit lanes of rows 4 apart swapped (``vperm2f128``)
_AVX2 = _tile(8, """  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(d + i * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(d + (i + 4) * ds, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
""")


def transpose(vector_bytes: int) -> str:
    """The text of ``scorch_transpose(dst, src, rows, cols, ds, ss)``: ``dst[j * ds + i] = src[i * ss + j]`` for
    ``i < rows``, ``j < cols``, converted to ``dst``'s type through float, for a target of ``vector_bytes`` vectors
    (the tile by the compiler's ISA macros too: a target forced wider than the CPU compiles the narrower tile).
    A 16-bit side goes through float32 tiles, converted a row at a time (loops the compiler vectorizes)."""
    out = []
    tiles = [t for t in (("defined(__AVX512F__)", 16, _AVX512), ("defined(__AVX__)", 8, _AVX2))
             if vector_bytes >= 4 * t[1]]
    for k, (macro, b, text) in enumerate(tiles):
        out += [f"#{'el' if k else ''}if {macro}", "#include <immintrin.h>", text.rstrip("\n"),
                f"#define SCORCH_TRANSPOSE_TILE {b}"]
    out += ["#endif"] if tiles else []
    out += ["#include <type_traits>",
            "template <class D, class S>",
            "static inline void scorch_transpose(D* __restrict__ d, const S* __restrict__ s, int64_t rows,"
            " int64_t cols, int64_t ds, int64_t ss) {",
            "  int64_t i0 = 0;",
            "#ifdef SCORCH_TRANSPOSE_TILE",
            "  constexpr int64_t B = SCORCH_TRANSPOSE_TILE;",
            "  constexpr bool f32 = std::is_same<D, float>::value && std::is_same<S, float>::value;",
            "  float a[B * B], b[B * B];",
            "  for (; i0 + B <= rows; i0 += B) {",
            "    int64_t j0 = 0;",
            "    for (; j0 + B <= cols; j0 += B) {",
            "      if constexpr (f32) {",
            "        scorch_transpose_tile((float*)(d + j0 * ds + i0), (const float*)(s + i0 * ss + j0), ds, ss);",
            "      } else {",
            "        if constexpr (std::is_same<S, float>::value) {  // (a float source: its tile as it is)",
            "          scorch_transpose_tile(b, (const float*)(s + i0 * ss + j0), B, ss);",
            "        } else {",
            "          for (int64_t i = 0; i < B; ++i)",
            "            for (int64_t j = 0; j < B; ++j) a[i * B + j] = (float)s[(i0 + i) * ss + j0 + j];",
            "          scorch_transpose_tile(b, a, B, B);",
            "        }",
            "        for (int64_t j = 0; j < B; ++j)",
            "          for (int64_t i = 0; i < B; ++i) d[(j0 + j) * ds + i0 + i] = (D)b[j * B + i];",
            "      }",
            "    }",
            "    for (; j0 < cols; ++j0)",
            "      for (int64_t i = i0; i < i0 + B; ++i) d[j0 * ds + i] = (D)(float)s[i * ss + j0];",
            "  }",
            "#endif",
            "  for (int64_t j = 0; j < cols; ++j)",
            "    for (int64_t i = i0; i < rows; ++i) d[j * ds + i] = (D)(float)s[i * ss + j];",
            "}"]
    return "\n".join(out) + "\n"


#: the helper for the CPU target's vectors (``target.CPU``)
TRANSPOSE = transpose(CPU.vector_bytes)
