"""Layout of dense operands: one dimension moved last, so that the innermost loop reads memory contiguously.

A dense operand read with the innermost loop index on a dimension other than its last is read with a
stride: every step of that loop touches another cache line (``B[k, j]`` in the SDDMM ``"ij,ik,kj->ij"``).
The execution layer (``engine.run``) then copies the operand with that dimension moved last, when the copy is
small next to the reads, and runs the kernel on the copy. The copy is a tiled transpose of a batch of
matrices, built like the other kernels; ``torch``'s own strided copy is 3-5x slower on this machine.

A copy is kept for the next call with the same operand (``kept``): the same tensor object, unchanged since, gets
the same copy instead of another transposition (SDDMM's ``B`` in ``sampled_addmm(S, A, B)`` called again with the
same ``B``: the copy had cost half the kernel's time). Unchanged means the same version counter, data pointer,
shape and strides, and the same contents: writes through ``.data`` or a NumPy view (a hand-written optimizer
step ``p.data -= lr * p.grad``, gradcheck's perturbations) leave the version counter as it was, so the source's
bytes are fingerprinted on each use (``fingerprint``: one read of the source, a fraction of a transposition's
cost, which also writes a fresh buffer). The copy dies with its source tensor.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from . import runtime
from .caches import register
from ..formats.storage import array_version

#: a copy is made when the operand's elements number less than this fraction of the kernel's reads of it
COPY_FRACTION = 0.25

_SOURCE = r"""
#include <cstdint>
#include <cstring>
template <typename T>
__attribute__((optimize("no-tree-vectorize")))  // vectorized, the strided side becomes gathers: 3x slower
static void transpose(const T* __restrict__ src, T* __restrict__ dst, int64_t batch, int64_t rows, int64_t cols,
                      int64_t nthreads) {
  // dst[b, c, r] = src[b, r, c], in 32 x 32 tiles (a tile of each fits in L1)
  const int64_t B = 32, tr = (rows + B - 1) / B, tc = (cols + B - 1) / B;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < batch * tr * tc; ++t) {
    const int64_t b = t / (tr * tc), r0 = (t / tc) % tr * B, c0 = t % tc * B;
    const int64_t r1 = r0 + B < rows ? r0 + B : rows, c1 = c0 + B < cols ? c0 + B : cols;
    const T* s = src + b * rows * cols;
    T* d = dst + b * rows * cols;
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = r0; r < r1; ++r) d[c * rows + r] = s[r * cols + c];
  }
}
extern "C" void scorch_transpose(const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols,
                                 int64_t itemsize, int64_t nthreads) {
  if (itemsize == 8) transpose((const int64_t*)src, (int64_t*)dst, batch, rows, cols, nthreads);
  else if (itemsize == 4) transpose((const int32_t*)src, (int32_t*)dst, batch, rows, cols, nthreads);
  else if (itemsize == 2) transpose((const int16_t*)src, (int16_t*)dst, batch, rows, cols, nthreads);
  else transpose((const int8_t*)src, (int8_t*)dst, batch, rows, cols, nthreads);
}
"""
_kernel = None

_FINGERPRINT_SOURCE = r"""
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
"""
_fingerprint_kernel = None


def fingerprint(x: torch.Tensor) -> int:
    """A 64-bit fingerprint of the bytes of the contiguous CPU tensor ``x`` (any change of one 8-byte word always
    changes it; more changes leave it equal with probability about 2**-64)."""
    return _fingerprint_bytes(x.data_ptr(), x.numel() * x.element_size())


def fingerprint_span(x: torch.Tensor) -> int:
    """``fingerprint`` of the bytes a strided CPU tensor spans, from its first element to its last: exactly its
    own elements for a transposed or permuted view of a block (``W.t()``), more for a strided slice (a write to
    the bytes between its elements changes it too)."""
    if x.is_contiguous() or x.numel() == 0:
        return fingerprint(x)
    span = sum((k - 1) * s for k, s in zip(x.shape, x.stride())) + 1
    return _fingerprint_bytes(x.data_ptr(), span * x.element_size())


def _fingerprint_bytes(address: int, n: int) -> int:
    global _fingerprint_kernel
    if _fingerprint_kernel is None:
        _fingerprint_kernel = runtime.load(_FINGERPRINT_SOURCE, "scorch_fingerprint",
                                           [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], ctypes.c_uint64)
    return int(_fingerprint_kernel(address, n, torch.get_num_threads() if n >= 1 << 18 else 1))


_GATHER_SOURCE = r"""
#include <cstdint>
template <typename T, typename I>
static void gather(const T* __restrict__ src, const I* __restrict__ index, T* __restrict__ dst, int64_t n,
                   int64_t nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = src[index[i]];
}
extern "C" void scorch_gather(const void* src, const void* index, void* dst, int64_t n, int64_t itemsize,
                              int64_t index_size, int64_t nthreads) {
  if (index_size == 4) {
    if (itemsize == 8) gather((const int64_t*)src, (const int32_t*)index, (int64_t*)dst, n, nthreads);
    else gather((const int32_t*)src, (const int32_t*)index, (int32_t*)dst, n, nthreads);
  } else {
    if (itemsize == 8) gather((const int64_t*)src, (const int64_t*)index, (int64_t*)dst, n, nthreads);
    else gather((const int32_t*)src, (const int64_t*)index, (int32_t*)dst, n, nthreads);
  }
}
"""
_gather_kernel = None


def gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` for a 1-d contiguous CPU ``src`` of 4- or 8-byte elements and an int32/int64 ``index`` whose
    entries the caller guarantees in range (a permutation scorch made): one parallel loop, where
    ``torch.index_select`` measured 4-5x slower on a 543k-entry pattern's values. Other inputs: index_select."""
    global _gather_kernel
    if src.device.type != "cpu" or index.device.type != "cpu" or src.dim() != 1 or not src.is_contiguous() or \
            not index.is_contiguous() or src.element_size() not in (4, 8) or src.is_complex() or \
            index.dtype not in (torch.int32, torch.int64) or index.numel() < 2 ** 14:
        return torch.index_select(src, 0, index)
    if _gather_kernel is None:
        _gather_kernel = runtime.load(_GATHER_SOURCE, "scorch_gather",
                                      [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4)
    out = torch.empty(index.shape, dtype=src.dtype)
    _gather_kernel(src.data_ptr(), index.data_ptr(), out.data_ptr(), index.numel(), src.element_size(),
                   index.element_size(), torch.get_num_threads())
    return out


def _empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


#: the copies kept (``kept``): ``id(source) -> (weak reference, key, copy, fingerprint)``, oldest first; at most
#: ``KEEP_BYTES`` of copies in all (copy and fingerprint None: a source written in place between calls)
_KEPT: dict = {}
KEEP_BYTES = 1 << 30


def _key(x: torch.Tensor, d: int) -> tuple:
    return (d, array_version(x), x.data_ptr(), x.dtype, tuple(x.shape), x.stride())


def kept(x: torch.Tensor, d: int, alloc=_empty) -> torch.Tensor:
    """``dim_last(x, d, alloc)``, the copy kept from an earlier call on the same, unchanged ``x`` where there is
    one (unchanged: its key and its bytes' ``fingerprint``; only a contiguous CPU source is kept). (The engine
    passes an allocator on huge pages: the copy's rows are read in random order, SDDMM's ``B[j, :]`` at a row's
    columns, and on 4 KiB pages nearly every row read missed the TLB.)"""
    entry = _KEPT.get(id(x))
    print_ = None  # (x's fingerprint, taken once)
    key = _key(x, d)
    mine = entry is not None and entry[0]() is x
    if mine and entry[1] == key:
        print_ = fingerprint(x)
        if entry[3] == print_:
            _KEPT.pop(id(x), None)  # the most recently used last (another thread may have moved it already)
            _KEPT[id(x)] = entry
            return entry[2]
    elif mine and entry[1][0] == d and entry[1][2:] == key[2:]:
        # written in place since the last call (a parameter an optimizer steps): its copy is made again each call
        # and not kept, so no fingerprint is taken for it; the entry only marks it, until a call finds it unchanged
        _KEPT[id(x)] = (entry[0], key, None, None)
        return dim_last(x, d, alloc)
    out = dim_last(x, d, alloc)
    if out.data_ptr() == x.data_ptr() or out.numel() * out.element_size() > KEEP_BYTES // 2 or \
            x.device.type != "cpu" or not x.is_contiguous():
        return out  # a view (nothing to keep), a copy to keep out of the cache, or one whose source is not
                    # fingerprinted
    _KEPT.pop(id(x), None)
    used = sum(_nbytes(e[2]) for e in list(_KEPT.values()))
    for k in list(_KEPT):
        if used + out.numel() * out.element_size() <= KEEP_BYTES:
            break
        e = _KEPT.pop(k, None)
        used -= _nbytes(e[2]) if e is not None else 0
    at = id(x)
    ref = weakref.ref(x, lambda r, at=at: _KEPT.pop(at, None) if _KEPT.get(at, (None,))[0] is r else None)
    _KEPT[at] = (ref, key, out, fingerprint(x) if print_ is None else print_)
    return out


def _nbytes(copy) -> int:
    return 0 if copy is None else copy.numel() * copy.element_size()


register("relaid", "dense operands' copies with a dimension moved last, per source tensor (relayout.kept)",
         lambda: len(_KEPT), _KEPT.clear)


def dim_last(x: torch.Tensor, d: int, alloc=_empty) -> torch.Tensor:
    """``x`` with dimension ``d`` moved last (the others keep their order), contiguous: a copy (in a CPU buffer
    from ``alloc(shape, dtype)``), or a view where ``x``'s memory already is in that order."""
    global _kernel
    perm = [k for k in range(x.dim()) if k != d] + [d]
    view = x.permute(perm)
    if view.is_contiguous():  # a transposed view (``k.T``) already is that copy's layout: no copy
        return view
    x = x.contiguous()
    shape = tuple(x.shape)
    if x.device.type != "cpu":  # torch's own copy kernel on the GPU
        return x.permute(perm).contiguous()
    out = alloc([shape[k] for k in perm], x.dtype)
    if x.numel() == 0 or x.element_size() not in (1, 2, 4, 8):
        return out.copy_(x.permute(perm)) if x.numel() else out
    batch = 1
    for n in shape[:d]:
        batch *= n
    cols = 1
    for n in shape[d + 1:]:
        cols *= n
    if _kernel is None:
        _kernel = runtime.load(_SOURCE, "scorch_transpose", [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5)
    _kernel(x.data_ptr(), out.data_ptr(), batch, shape[d], cols, x.element_size(), torch.get_num_threads())
    return out


def moves(inputs, ops, sched, sizes, broadcast):
    """``(operand, dimension)`` pairs to move last before the kernel of ``sched`` runs, or ``()``: dense
    operands that the innermost loop reads along another dimension, when copying them costs less than
    ``COPY_FRACTION`` of the reads. A copy is kept out when its dimension is broadcast."""
    if not sched.inner:
        return ()
    v = sched.inner[-1]
    drv = ops[sched.driver.operand]
    reads = max(int(drv.nnz), 1)
    for w in sched.outer + sched.inner:
        reads *= sizes[w]
    moves = []
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        if not isinstance(x, torch.Tensor) or hasattr(x, "_format") or x.layout != torch.strided or v not in idx or \
                idx[-1] == v:
            continue
        d = idx.index(v)
        if (k, d) in broadcast or x.numel() > COPY_FRACTION * reads:
            continue
        moves.append((k, d))
    return tuple(moves)


def output_order(out, sched, output):
    """The output's index order with the innermost loop's index last, when it is an output index other than
    the last one of a dense output (``out[b, i] += ...`` under a loop nest ``i -> o -> b``); else None."""
    if output.format is not None or not sched.inner or sched.outer:
        return None
    v = sched.inner[-1]
    if v not in out or out[-1] == v:
        return None
    return tuple(w for w in out if w != v) + (v,)


def relaid_call(moves, call, alloc=_empty):
    """A prepared call (``call(ops, scalars)``) of the kernel compiled for the operands after ``moves``, taking
    the operands before them."""
    def relaid(ops, scalars):
        ops = list(ops)
        for k, d in moves:
            ops[k] = kept(ops[k], d, alloc)
        return call(ops, scalars)
    return relaid


def apply(moves, inputs, ops, alloc=_empty):
    """The inputs and operands with ``moves`` (``moves()``) made."""
    inputs, ops = list(inputs), list(ops)
    for k, d in moves:
        idx = inputs[k]
        inputs[k] = tuple(idx[:d]) + tuple(idx[d + 1:]) + (idx[d],)
        ops[k] = kept(ops[k], d, alloc)
    return tuple(inputs), ops
