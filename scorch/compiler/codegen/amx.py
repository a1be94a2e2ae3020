"""Matrix tiles (Intel AMX) for ``loopir.TileConfig`` / ``loopir.TileRow``: the C++ a kernel includes, in two forms
with the same names.

``TILES`` runs the CPU's instructions, written as inline assembly (``ldtilecfg``, ``tileloadd``, ``tdpbf16ps``,
``tilestored``, ``tilerelease``) rather than through the compiler's intrinsics: those need the function compiled
for the AMX target (``-march=native`` gives it only on a CPU that has AMX, and a kernel must compile anywhere), and
GCC 12's ``tileloadd`` and ``ldtilecfg`` do not tell the compiler that they read memory (a store into the buffer or
the configuration before them could be moved after them or dropped); every statement here has a memory clobber.

``MODEL`` is a scalar model of the same instructions for tests on any CPU (``TileConfig.mode == "model"``): eight
thread-local tiles of 16 rows x 64 bytes, the configuration parsed as the CPU parses it (palette 1, each tile's
bytes a row at offset 16 + 2 i and rows at 48 + i), loads and stores of ``rows`` x ``colsb`` bytes at the given
stride (lanes past them zero), and ``tdpbf16ps`` as Intel's pseudo-code states it
(``C.row[m].fp32[n] += A.row[m].bf16[2k + j] * B.row[k].bf16[2n + j]``), after checking the shapes the CPU checks
(a fault there: the model aborts with a message). A kernel whose tiles are misconfigured fails its tests here.

Tile numbers: the sums in tiles ``0 .. tiles - 1`` (16 rows each), the block's values in ``tiles``, the rows of
``a`` they multiply alternately in ``tiles + 1`` and ``tiles + 2`` (so that one load need not wait for the product
before it): at most 4 result tiles.
"""
from __future__ import annotations

#: result tiles of a ``TileRow`` at most (of the CPU's 8: one holds the block's values, two the rows of ``a``)
MAX_TILES = 4

_CONFIG = """struct scorch_amx_tiles {
  scorch_amx_tiles(int cols, int depth, int tiles) {
    alignas(64) unsigned char cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < tiles + 3; ++t) {
      const int colsb = t <= tiles ? 4 * cols : 4 * depth;  // (sums and values: cols pairs; rows of a: depth)
      cfg[16 + 2 * t] = (unsigned char)colsb;
      cfg[16 + 2 * t + 1] = (unsigned char)(colsb >> 8);
      cfg[48 + t] = (unsigned char)(t == tiles ? depth : 16);
    }
    SCORCH_TILE_CONFIG(cfg);
  }
  ~scorch_amx_tiles() { SCORCH_TILE_RELEASE(); }
};
"""

TILES = """#ifndef SCORCH_AMX
#define SCORCH_AMX
#define SCORCH_TILE_CONFIG(cfg) __asm__ volatile("ldtilecfg (%0)" :: "r"(cfg) : "memory")
#define SCORCH_TILE_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define SCORCH_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::: "memory")
#define SCORCH_TILE_LOAD(t, base, stride) \\
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t :: "r"((const void*)(base)), "r"((long)(stride)) : "memory")
#define SCORCH_TILE_STORE(t, base, stride) \\
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" :: "r"((void*)(base)), "r"((long)(stride)) : "memory")
#define SCORCH_TILE_DPBF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
""" + _CONFIG + "#endif\n"

MODEL = """#ifndef SCORCH_AMX
#define SCORCH_AMX
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
struct scorch_amx_model_state {
  int palette = 0;
  int rows[8] = {}, colsb[8] = {};
  alignas(64) unsigned char tile[8][16][64] = {};
};
static thread_local scorch_amx_model_state scorch_amx_model_now;
static inline void scorch_amx_model_fault(const char* what) {
  std::fprintf(stderr, "scorch: AMX model: %s\\n", what);
  std::abort();
}
static inline void scorch_amx_model_config(const unsigned char* cfg) {
  scorch_amx_model_state& s = scorch_amx_model_now;
  if (cfg[0] != 1 || cfg[1] != 0) scorch_amx_model_fault("ldtilecfg: palette must be 1, start row 0");
  for (int i = 2; i < 16; ++i) if (cfg[i]) scorch_amx_model_fault("ldtilecfg: reserved bytes 2-15 set");
  for (int i = 32; i < 48; ++i) if (cfg[i]) scorch_amx_model_fault("ldtilecfg: reserved bytes 32-47 set");
  for (int i = 56; i < 64; ++i) if (cfg[i]) scorch_amx_model_fault("ldtilecfg: reserved bytes 56-63 set");
  for (int t = 0; t < 8; ++t) {
    s.colsb[t] = cfg[16 + 2 * t] | (cfg[17 + 2 * t] << 8);
    s.rows[t] = cfg[48 + t];
    if (s.rows[t] > 16 || s.colsb[t] > 64 || (s.rows[t] == 0) != (s.colsb[t] == 0))
      scorch_amx_model_fault("ldtilecfg: a tile of more than 16 rows or 64 bytes, or half configured");
  }
  s.palette = 1;
  std::memset(s.tile, 0, sizeof s.tile);
}
static inline scorch_amx_model_state& scorch_amx_model_used(int t) {
  scorch_amx_model_state& s = scorch_amx_model_now;
  if (!s.palette) scorch_amx_model_fault("a tile instruction without a configuration");
  if (!s.rows[t]) scorch_amx_model_fault("a tile that is not configured");
  return s;
}
static inline void scorch_amx_model_zero(int t) {
  std::memset(scorch_amx_model_used(t).tile[t], 0, 16 * 64);
}
static inline void scorch_amx_model_load(int t, const void* base, long stride) {
  scorch_amx_model_state& s = scorch_amx_model_used(t);
  std::memset(s.tile[t], 0, 16 * 64);
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.tile[t][r], (const unsigned char*)base + r * stride, (size_t)s.colsb[t]);
}
static inline void scorch_amx_model_store(int t, void* base, long stride) {
  scorch_amx_model_state& s = scorch_amx_model_used(t);
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy((unsigned char*)base + r * stride, s.tile[t][r], (size_t)s.colsb[t]);
}
static inline float scorch_amx_model_bf16(const unsigned char* p) {
  const uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline void scorch_amx_model_dp(int c, int a, int b) {
  scorch_amx_model_state& s = scorch_amx_model_used(c);
  scorch_amx_model_used(a);
  scorch_amx_model_used(b);
  if (c == a || c == b || a == b) scorch_amx_model_fault("tdpbf16ps: the same tile twice");
  if (s.rows[a] != s.rows[c] || s.colsb[a] / 4 != s.rows[b] || s.colsb[b] != s.colsb[c] || s.colsb[a] % 4 ||
      s.colsb[c] % 4)
    scorch_amx_model_fault("tdpbf16ps: the tiles' shapes do not fit");
  for (int m = 0; m < s.rows[c]; ++m)
    for (int k = 0; k < s.colsb[a] / 4; ++k)
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, &s.tile[c][m][4 * n], 4);
        acc += scorch_amx_model_bf16(&s.tile[a][m][4 * k]) * scorch_amx_model_bf16(&s.tile[b][k][4 * n]);
        acc += scorch_amx_model_bf16(&s.tile[a][m][4 * k + 2]) * scorch_amx_model_bf16(&s.tile[b][k][4 * n + 2]);
        std::memcpy(&s.tile[c][m][4 * n], &acc, 4);
      }
}
#define SCORCH_TILE_CONFIG(cfg) scorch_amx_model_config(cfg)
#define SCORCH_TILE_RELEASE() (scorch_amx_model_now.palette = 0)
#define SCORCH_TILE_ZERO(t) scorch_amx_model_zero(t)
#define SCORCH_TILE_LOAD(t, base, stride) scorch_amx_model_load(t, base, stride)
#define SCORCH_TILE_STORE(t, base, stride) scorch_amx_model_store(t, base, stride)
#define SCORCH_TILE_DPBF16(c, a, b) scorch_amx_model_dp(c, a, b)
""" + _CONFIG + "typedef scorch_amx_tiles scorch_amx_model_tiles;\n#endif\n"


def config(cols: int, depth: int, tiles: int, mode: str, guard: str) -> str:
    """The declaration that sets up the tiles until the end of the enclosing C++ block (``loopir.TileConfig``)."""
    if not (1 <= cols <= 16 and 1 <= depth <= 16 and 1 <= tiles <= MAX_TILES) or mode not in ("tiles", "model"):
        raise ValueError(f"tiles of 16 rows x {cols} columns, {depth} pairs deep, {tiles} of them ({mode}): not AMX's")
    # (the helper's name says which form the kernel includes: ``prelude.HELPERS``)
    return f"scorch_amx_{'model_' if mode == 'model' else ''}tiles {guard}({cols}, {depth}, {tiles});"


def row(lo: str, hi: str, var: str, a_ptr: str, a_stride: str, b_ptr: str, cols: int, c_ptr: str, c_stride: int,
        tiles: int, pad: str) -> list:
    """``loopir.TileRow`` in C++: the sums zeroed; per block its values (``b_ptr``) loaded once, each 16 rows of
    ``a`` (``a_ptr``, rows ``a_stride`` elements apart) loaded and multiplied into their sums; then the sums stored
    (``c_ptr``, rows ``c_stride`` floats apart). Pointers to the block's first element, C++ expressions of
    ``var``."""
    values = tiles
    out = [f"{pad}SCORCH_TILE_ZERO({t});" for t in range(tiles)]
    out.append(f"{pad}const long a_bytes = 2 * (long)({a_stride});")
    out.append(f"{pad}for (int64_t {var} = {lo}; {var} < {hi}; ++{var}) {{")
    out.append(f"{pad}  SCORCH_TILE_LOAD({values}, {b_ptr}, {4 * cols});")
    for t in range(tiles):
        rows = f"({a_ptr}) + {16 * t} * ({a_stride})" if t else a_ptr
        out.append(f"{pad}  SCORCH_TILE_LOAD({values + 1 + t % 2}, {rows}, a_bytes);")
        out.append(f"{pad}  SCORCH_TILE_DPBF16({t}, {values + 1 + t % 2}, {values});")
    out.append(f"{pad}}}")
    out += [f"{pad}SCORCH_TILE_STORE({t}, ({c_ptr}) + {16 * t * c_stride}, {4 * c_stride});" for t in range(tiles)]
    return out
