"""Loop IR -> CUDA source: the kernels ``cpp`` renders for the CPU, rendered on the GPU mapping that the pass
``compiler.mapping`` chose for the kernel (``map_to_gpu``: serial, thread or warp workers, lane loops, workspaces).

How the renderer carries a ``Mapping`` out:

* Workers of the parallel loop: ``static`` loops deal their iterations out grid-stride; ``nnz`` loops give each
  worker one contiguous range of rows holding an equal share of rows + stored entries (a merge-path split at
  row granularity), so a few long rows do not serialize one worker.
* Warp workers: consecutive iterations of a lane loop go to consecutive lanes (coalesced loads of the dense
  operand), scalar sums over that loop are combined by warp shuffles, the rest of the body runs on every lane
  alike (its loads are broadcasts), and stores outside the lane loops are done by lane 0.
* Per-worker workspaces (``Alloc``) are slices of one scratch buffer that the launcher allocates, zero-filled
  where the IR declares them; the number of workers is capped so that the scratch stays small.
* Write conflicts use atomics only where the IR marks a store atomic; a kernel without a parallel loop runs
  on one thread (the dispatcher transposes such operands first where it pays, as with many CPU threads).
* 16-bit values (``bf16``, ``f16``) are storage types, as in C++: loads widen to float, arithmetic and warp
  sums are float, a store rounds once to nearest even (``HALF``: ``__nv_bfloat16`` and ``__half`` on the GPU,
  the C++ backend's ``scorch_bf16`` and ``_Float16`` in the emulation, so that both round alike).

The translation unit holds the ``__global__`` kernel and an ``extern "C"`` host launcher with the CPU kernels'
ABI (arrays as pointers, integers ``int64_t``, floats ``double``) plus the CUDA stream, returning a
``cudaError_t``: the runtime loads it through ctypes as it loads CPU kernels. Compiled by a C++ compiler with
``-DSCORCH_EMULATE`` instead of by ``nvcc``, the same source runs on the CPU (blocks one after another, a
block's threads as OpenMP threads, one warp per block so that shuffles are barriers): that is how the mapping
is tested on machines without a GPU.
"""
from __future__ import annotations

import ctypes

from ... import loopir as L
from ..mapping import Mapping
from . import cpp, prelude
from .cpp import ident

#: the C name of each loop-IR type: the C++ backend's, but float16 is ``scorch_f16`` (``HALF``: ``__half`` on the
#: GPU, ``_Float16`` in the emulation) and bfloat16's ``scorch_bf16`` is ``__nv_bfloat16`` on the GPU
CTYPE = {**cpp.CTYPE, "f16": "scorch_f16"}

WARP = 32
#: threads per block on a GPU (8 warps), and blocks per multiprocessor (2048 resident threads on sm_80/sm_90)
BLOCK = 256
BLOCKS_PER_SM = 8
#: the most scratch the per-worker workspaces may take (bytes): fewer workers run when they would take more
SCRATCH_BYTES = 256 << 20
#: emulation: blocks of one warp, a few of them (enough for grid-stride loops and empty workers to be exercised)
EMULATED_GRID = 3

PRELUDE = r"""#include <cstdint>
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
"""

#: 16-bit floats, after ``PRELUDE`` in the units of kernels that have them: ``scorch_f32(x)`` widens,
#: ``scorch_to_bf16(f)`` / ``scorch_to_f16(f)`` round a float to nearest even (a NaN stays a NaN),
#: ``scorch_atomic_add(p, f)`` adds a float to a 16-bit value by compare-and-swap of its 16 bits, rounding the
#: sum once. The emulation uses the C++ backend's types and atomics (``prelude.ATOMIC16``): the same rounding.
HALF = r"""#ifdef SCORCH_EMULATE
""" + prelude.ATOMIC16 + r"""typedef _Float16 scorch_f16;
static inline float scorch_f32(scorch_bf16 x) { return (float)x; }
static inline float scorch_f32(scorch_f16 x) { return (float)x; }
static inline scorch_bf16 scorch_to_bf16(float f) { return scorch_bf16(f); }
static inline scorch_f16 scorch_to_f16(float f) { return (scorch_f16)f; }
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat16 scorch_bf16;
typedef __half scorch_f16;
static __device__ __forceinline__ float scorch_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float scorch_f32(__half x) { return __half2float(x); }
static __device__ __forceinline__ __nv_bfloat16 scorch_to_bf16(float f) { return __float2bfloat16_rn(f); }
static __device__ __forceinline__ __half scorch_to_f16(float f) { return __float2half_rn(f); }
/* (the rounding by the type of a value, for the CAS loop below) */
static __device__ __forceinline__ __nv_bfloat16 scorch_round(__nv_bfloat16, float f) { return scorch_to_bf16(f); }
static __device__ __forceinline__ __half scorch_round(__half, float f) { return scorch_to_f16(f); }
template <class T> static __device__ void scorch_atomic_add16(T* p, float v) {
  unsigned short* q = (unsigned short*)p;
  unsigned short old = *q, seen, want;
  do {
    seen = old;
    T cur; memcpy(&cur, &seen, 2);
    const T next = scorch_round(cur, scorch_f32(cur) + v);
    memcpy(&want, &next, 2);
    old = atomicCAS(q, seen, want);
  } while (old != seen);
}
static __device__ __forceinline__ void scorch_atomic_add(__nv_bfloat16* p, float v) { scorch_atomic_add16(p, v); }
static __device__ __forceinline__ void scorch_atomic_add(__half* p, float v) { scorch_atomic_add16(p, v); }
#endif
"""


def argtypes(kernel: L.Kernel) -> list:
    """The launcher's ctypes signature: the kernel's (``cpp.argtypes``) and the stream."""
    return cpp.argtypes(kernel) + [ctypes.c_void_p]


def generate(kernel: L.Kernel, mapping: Mapping, prelude: bool = True, symbol: str = "") -> str:
    """The translation unit of ``kernel`` on its GPU ``mapping`` (``mapping.map_to_gpu(kernel)``): prelude,
    ``__global__`` kernel ``<name>_dev`` and host launcher ``<name>`` (``symbol`` if given). Without ``prelude``
    (and the helpers), several kernels of distinct symbols concatenate behind one ``PRELUDE + HELPERS`` into one
    unit, as the compile check does (``PRELUDE + HALF + HELPERS`` where some have 16-bit values)."""
    name = ident(symbol or kernel.name)
    params, casts = cpp.signature(kernel, ctype=CTYPE)
    em = _Emitter(mapping, kernel, name)
    body = em.kernel_body(casts)
    dev_params = params + ["char* __restrict__ scorch_scratch", "int64_t scorch_stride"]
    names = [ident(p.name) + ("" if p.kind == "array" else "_arg") for p in kernel.params]
    half = HALF if any(p.type in L.NARROW for p in kernel.params) else ""
    src = [PRELUDE + half + HELPERS] if prelude else []
    src += [f'extern "C" __global__ void {name}_dev(\n    ' + ",\n    ".join(dev_params) + ")\n{", *body, "}", ""]
    host_params = [p.replace(" __restrict__", "") for p in params] + ["void* scorch_stream_arg"]
    src += [f'extern "C" int {name}(\n    ' + ",\n    ".join(host_params) + ")\n{",
            "  cudaStream_t scorch_stream = (cudaStream_t)scorch_stream_arg;",
            *casts, *em.launcher(names), "}", "",
            f'extern "C" const char* {name}_error(int e) {{ return scorch_error_string(e); }}', ""]
    return "\n".join(src)


#: device versions of the C++ helpers (the per-row radix sort of sparse output assembly, the size of two sorted
#: lists' intersection)
HELPERS = prelude.HELPERS["scorch_sort"].replace("static void", "static __device__ void").replace(
    "static int64_t", "static __device__ int64_t").replace(
    "static inline bool", "static __device__ inline bool") + prelude.COMMON_MERGE.replace(
    "static inline", "static __device__ inline")


class _Emitter(cpp._Emitter):
    """The C++ emitter with CUDA's statements: vector loops and tiles as plain code, lanes, workers, scratch."""

    def __init__(self, mapping: Mapping, kernel: L.Kernel, name: str):
        super().__init__(threads=False)
        self.m = mapping
        self.body = kernel.body
        self.kernel_name = name
        self.kernel_params = kernel.params
        self.decl_types = {s.var.name: s.var.type for s in L.walk(kernel.body) if isinstance(s, (L.Decl, L.Let))}
        self.compressed = mapping.compressed
        self.in_lane = False
        # the 16-bit arrays (name -> type): loaded through scorch_f32, stored through scorch_to_<type>
        self.narrow = {p.name: p.type for p in kernel.params if p.type in L.NARROW}
        self.narrow.update({s.name: s.type for s in L.walk(kernel.body)
                            if isinstance(s, (L.LocalArray, L.Alloc)) and s.type in L.NARROW})

    # --- the kernel's body --------------------------------------------------------------------------------
    def kernel_body(self, casts):
        m, out = self.m, list(casts)
        out += ["  const int64_t scorch_tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;",
                "  const int64_t scorch_nthreads = (int64_t)gridDim.x * blockDim.x;"]
        if m.mode == "warp":
            out += ["  const int64_t scorch_worker = scorch_tid / 32, scorch_nworkers = scorch_nthreads / 32;",
                    "  const int64_t scorch_lane = threadIdx.x % 32;"]
        else:
            out += ["  const int64_t scorch_worker = scorch_tid, scorch_nworkers = scorch_nthreads;"]
        if m.mode == "serial":
            return out + ["  if (scorch_tid != 0) return;"] + self.block(self.body, 1)
        for s in m.prologue:
            out += self.stmt(s, 1)
        loop = m.loop
        if loop.parallel.setup is not None:
            out += self.block(loop.parallel.setup, 1)
        v, lo, hi = ident(loop.var.name), self.expr(loop.lo), self.expr(loop.hi)
        if loop.parallel.kind == "static":
            out += [f"  for (int64_t {v} = ({lo}) + scorch_worker; {v} < ({hi}); {v} += scorch_nworkers) {{"]
        elif loop.parallel.kind == "nnz":
            pos = ident(loop.parallel.pos)
            a, b, tot = self.fresh("lo"), self.fresh("hi"), self.fresh("total")
            out += [f"  const int64_t {a} = {lo}, {b} = {hi};",
                    f"  const int64_t {tot} = ((int64_t){pos}[{b}] - (int64_t){pos}[{a}]) + ({b} - {a});",
                    f"  const int64_t scorch_r0 = scorch_first_row({pos}, {a}, {b}, {tot}, scorch_worker,"
                    " scorch_nworkers);",
                    f"  const int64_t scorch_r1 = scorch_first_row({pos}, {a}, {b}, {tot}, scorch_worker + 1,"
                    " scorch_nworkers);",
                    f"  for (int64_t {v} = scorch_r0; {v} < scorch_r1; ++{v}) {{"]
        else:
            raise ValueError(f"unknown parallel kind {loop.parallel.kind!r}")
        return out + self.block(loop.body, 2) + ["  }"]

    # --- statements -------------------------------------------------------------------------------------------
    def stmt(self, s, d):
        pad = "  " * d
        if isinstance(s, L.Store) and self.m.mode == "warp" and not self.in_lane:
            return [f"{pad}if (scorch_lane == 0) {{"] + self._store(s, d + 1) + [f"{pad}}}"]
        if isinstance(s, L.Store):
            return self._store(s, d)
        if isinstance(s, (L.Let, L.Decl)) and s.var.type in L.NARROW:
            raise ValueError(f"a 16-bit scalar {s.var.name}: arithmetic is done in float32")
        if isinstance(s, L.LocalArray):
            n, t = ident(s.name), CTYPE[s.type]
            size = -(-int(s.size) // WARP) if s.name in self.compressed else int(s.size)
            i = self.fresh("w")
            return [f"{pad}{t} {n}[{size}];",
                    f"{pad}for (int64_t {i} = 0; {i} < {size}; ++{i}) {n}[{i}] = {self.expr(s.init)};"]
        if isinstance(s, L.Alloc):
            n, t = ident(s.name), CTYPE[s.type]
            k = next(i for i, a in enumerate(self.m.allocs) if a is s)
            i = self.fresh("z")
            return [f"{pad}{t}* __restrict__ {n} = ({t}*)(scorch_scratch + scorch_worker * scorch_stride + "
                    f"{self._offset(k)});",
                    f"{pad}for (int64_t {i} = 0; {i} < (int64_t)({self.expr(s.size)}); ++{i}) {n}[{i}] = {t}();"]
        if isinstance(s, L.For):
            return self.loop(s, d)
        if isinstance(s, L.Prefetch):
            return []  # (a CPU cache hint)
        if isinstance(s, L.Transpose):
            return self.stmt(s.loops(), d)
        return super().stmt(s, d)

    def _store(self, s, d):
        pad = "  " * d
        target = f"{ident(s.array)}[{self.index(s.array, s.index)}]"
        value = self.expr(s.value)
        if s.array in self.narrow:
            return [pad + self._narrow_store(s, target, value)]
        if s.atomic:
            if s.op not in ("add", "max", "min"):
                raise ValueError(f"an atomic store must add, max or min, not {s.op!r}")
            return [f"{pad}scorch_atomic_{s.op}(&{target}, ({CTYPE[self._type(s.array)]})({value}));"]
        return [f"{pad}{self.update(target, s.op, value)};"]

    def _narrow_store(self, s, target, value):
        """A store into a 16-bit array: the float value rounded once (an update reads the stored value as float;
        an atomic add is a compare-and-swap loop, ``HALF``)."""
        t, vt = self.narrow[s.array], s.value.type
        if s.op is None and vt == t and not s.atomic:
            return f"{target} = {value};"  # (a copy)
        f = f"scorch_f32({value})" if vt in L.NARROW else value if vt == "f32" else f"(float)({value})"
        if s.atomic:
            if s.op != "add":
                raise ValueError(f"an atomic {s.op} into the 16-bit array {s.array}")
            return f"scorch_atomic_add(&{target}, {f});"
        if s.op is None:
            return f"{target} = scorch_to_{t}({f});"
        if s.op == "add":
            return f"{target} = scorch_to_{t}(scorch_f32({target}) + {f});"
        if s.op in ("max", "min"):
            return (f"{{ const float u_ = {f}; if (u_ {'>' if s.op == 'max' else '<'} scorch_f32({target}))"
                    f" {target} = scorch_to_{t}(u_); }}")
        raise ValueError(f"unknown update {s.op!r}")

    def _type(self, array):
        for p in self.kernel_params:
            if p.name == array:
                return p.type
        return "f64"

    def index(self, array, index):
        if array in self.compressed:
            return f"({self.expr(index)}) >> 5"
        return self.expr(index)

    def loop(self, s, d):
        pad, v = "  " * d, ident(s.var.name)
        lo, hi = self.expr(s.lo), self.expr(s.hi)
        unroll = isinstance(s.lo, L.Const) and isinstance(s.hi, L.Const) and int(s.hi.value) - int(s.lo.value) <= 1024
        if id(s) in self.m.lane_loops:
            out, saved = [f"{pad}{{"], []
            for op, name in s.reductions:
                t = CTYPE[self.decl_types[name]]
                keep = self.fresh("keep")
                saved.append((op, name, keep))
                out += [f"{pad}  const {t} {keep} = {ident(name)};",
                        f"{pad}  {ident(name)} = {self._identity(op, self.decl_types[name])};"]
            self.in_lane = True
            try:
                body = self.block(s.body, d + 2)
            finally:
                self.in_lane = False
            out += ([f"{pad}  #pragma unroll"] if unroll else []) + [
                f"{pad}  for (int64_t {v} = ({lo}) + ((scorch_lane - ({lo})) & 31); {v} < ({hi}); {v} += 32) {{"] + \
                body + [f"{pad}  }}"]
            for op, name, keep in saved:
                n = ident(name)
                combined = f"scorch_warp_{op}({n})"
                out.append(f"{pad}  {n} = " + (f"{keep} + {combined};" if op == "add" else
                                                f"({keep} {'>' if op == 'max' else '<'} {combined} ? {keep} :"
                                                f" {combined});"))
            return out + [f"{pad}}}"]
        if s.parallel is not None:
            # a parallel loop where the mapping runs one thread: its setup once, its iterations in order
            setup = s.parallel.setup or L.Block(())
            return [f"{pad}{{"] + self.block(setup, d + 1) + self.loop(L.For(s.var, s.lo, s.hi, s.body), d + 1) \
                + [f"{pad}}}"]
        head = [f"{pad}#pragma unroll"] if (s.unroll or s.vector) and unroll else []
        return head + [f"{pad}for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{"] + self.block(s.body, d + 1) + \
            [f"{pad}}}"]

    @staticmethod
    def _identity(op, t):
        if op == "add":
            return cpp._literal(0, t)
        if t in ("f32", "f64"):
            return cpp._literal(float("-inf") if op == "max" else float("inf"), t)
        return {"i32": ("INT32_MIN", "INT32_MAX"), "i64": ("INT64_MIN", "INT64_MAX")}[t][op == "min"]

    def expr(self, e):
        if isinstance(e, L.Load):
            return f"{ident(e.array)}[{self.index(e.array, e.index)}]"
        if isinstance(e, L.Select):  # (a GPU predicates the ternary: no eager form)
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, L.Cast) and e.a.type in L.NARROW:
            a = f"scorch_f32({self.expr(e.a)})"
            return a if e.type == "f32" else f"scorch_to_{e.type}({a})" if e.type in L.NARROW else \
                f"(({CTYPE[e.type]}){a})"
        if isinstance(e, L.Cast) and e.type in L.NARROW:
            return f"scorch_to_{e.type}((float)({self.expr(e.a)}))"
        if isinstance(e, L.Unary) and e.op in ("abs", "sqrt", "sin", "tanh", "exp", "log"):
            a, t = self.expr(e.a), CTYPE[e.type]
            if e.type == "f32":
                return {"abs": f"fabsf({a})", "sqrt": f"sqrtf({a})", "sin": f"sinf({a})", "tanh": f"tanhf({a})",
                        "exp": f"expf({a})", "log": f"logf({a})"}[e.op]
            if e.op == "abs" and e.type != "f64":
                return f"(({a}) < {t}(0) ? -({a}) : ({a}))"
            f = {"abs": "fabs"}.get(e.op, e.op)
            return f"(({t}){f}((double)({a})))"
        if isinstance(e, L.Unary) and e.op in ("gelu", "gelu_tanh", "silu"):
            if e.type != "f32":
                raise ValueError(f"{e.op} is computed on float32 values, not {e.type}")
            a = self.expr(e.a)
            return {"gelu": f"(0.5f * ({a}) * (1.0f + erff(({a}) * 0.70710678118654752f)))",
                    "gelu_tanh": f"(({a}) / (1.0f + expf(-1.59576912160573072f * (({a}) + 0.044715f * ({a}) * ({a})"
                                 f" * ({a})))))",
                    "silu": f"(({a}) / (1.0f + expf(-({a}))))"}[e.op]
        return super().expr(e)

    # --- the launcher ------------------------------------------------------------------------------------------
    def _offset(self, k):
        """Byte offset of workspace ``k`` in a worker's slice (each one 16-byte aligned)."""
        parts = [f"(((int64_t)({self.expr(a.size)}) * (int64_t)sizeof({CTYPE[a.type]}) + 15) / 16 * 16)"
                 for a in self.m.allocs[:k]]
        return " + ".join(parts) or "0"

    def launcher(self, names):
        m = self.m
        per = WARP if m.mode == "warp" else 1  # threads per worker
        stride = self._offset(len(m.allocs)) if m.allocs else "0"
        lines = [f"  const int64_t scorch_stride_ = {stride};"]
        if m.mode == "serial":
            lines += ["  const int64_t scorch_grid = 1, scorch_block = 1;"]
        else:
            lines += [
                "  int64_t scorch_block = SCORCH_EMULATED ? 32 : " + str(BLOCK) + ";",
                f"  int64_t scorch_grid = SCORCH_EMULATED ? {EMULATED_GRID} : (int64_t)scorch_sms(scorch_stream) * "
                f"{BLOCKS_PER_SM};",
            ]
            if m.allocs:  # fewer workers where their workspaces would take too much memory
                lines += [
                    f"  if (scorch_stride_ > 0) {{",
                    f"    int64_t most = {SCRATCH_BYTES}LL / scorch_stride_;",
                    f"    if (most < 1) most = 1;",
                    f"    if (scorch_grid * scorch_block / {per} > most) {{",
                    f"      scorch_block = SCORCH_EMULATED ? 32 : (most * {per} < scorch_block ? "
                    f"(most * {per} + 31) / 32 * 32 : scorch_block);",
                    f"      scorch_grid = (most * {per} + scorch_block - 1) / scorch_block;",
                    "    }",
                    "  }",
                ]
        lines += ["  char* scorch_scratch = nullptr;"]
        if m.allocs:
            lines += [f"  const int64_t scorch_workers = scorch_grid * scorch_block / {per};",
                      "  { const cudaError_t e = scorch_scratch_alloc(&scorch_scratch, scorch_workers * scorch_stride_,"
                      " scorch_stream); if (e) return (int)e; }"]
        lines += [f"  SCORCH_LAUNCH({ident(self.kernel_name)}_dev, scorch_grid, scorch_block, scorch_stream, "
                  + ", ".join(names + ["scorch_scratch", "scorch_stride_"]) + ");"]
        if m.allocs:
            lines += ["  scorch_scratch_free(scorch_scratch, scorch_stream);"]
        lines += ["  return (int)scorch_last_error();"]
        return lines
