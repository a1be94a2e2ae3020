"""Library kernels where they win: on a GPU, cuSPARSE (through ``torch.sparse``) computes some assignments too.

``candidate(asg)`` recognizes the assignments a library serves (SpMM of a CSR matrix by a dense one,
SDDMM on a CSR pattern) and returns a function computing the same result from the operands, or None. The first
time an assignment of one signature (formats, dtypes, shapes rounded to powers of two) runs on a GPU, ``choose``
times both paths (median of a few runs, after a warm-up) and keeps the faster; later calls take the kept path.
``explain`` shows the choice and the times it was made on.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..formats import named
from .caches import cache
from .ir import Access, Mul

#: timed runs of each path when a choice is made
RUNS = 5
#: False: always the compiler's kernel (the GPU benchmark measures the kernel alone this way)
ENABLED = True


@dataclass(frozen=True)
class Choice:
    path: str            # "scorch" or the library call's name
    library: str         # the library call that was measured
    scorch_ms: float
    library_ms: float

    def describe(self) -> str:
        return (f"{'library: ' + self.path if self.path != 'scorch' else 'scorch kernel'} (measured at the first"
                f" call: scorch {self.scorch_ms:.3f} ms, {self.library} {self.library_ms:.3f} ms)")


_CHOICES = cache("library-choices", "the measured choice between a kernel and a library call, per plan key and"
                 " operand shapes (on a GPU)")


def candidate(asg) -> Optional[tuple[str, Callable]]:
    """``(name, fn)`` where ``fn(ops)`` computes ``asg`` by a library call, or None."""
    if asg.reduce != "sum" or asg.out_format is not None:
        return None
    types = asg.operands
    if any(t.dtype not in (torch.float32, torch.float64) for t in types) or types[0].format != named.csr:
        return None
    accesses = list(asg.rhs.factors) if isinstance(asg.rhs, Mul) else [asg.rhs]
    if not all(isinstance(a, Access) for a in accesses) or [a.operand for a in accesses] != list(range(len(types))):
        return None
    idx = [a.indices for a in accesses]
    if len(types) == 2 and not types[1].sparse and len(idx[1]) == 2:
        (i, j), (j2, k) = idx
        if j == j2 and len({i, j, k}) == 3 and asg.out == (i, k):
            return "torch.sparse.mm (cuSPARSE SpMM)", lambda o: torch.sparse.mm(o[0].to_torch(), o[1])
    if len(types) == 3 and not types[1].sparse and not types[2].sparse:
        (i, j), (i2, k), (j2, k2) = idx
        if (i, j) == asg.out and i2 == i and j2 == j and k == k2 and len({i, j, k}) == 3:
            return "torch.sparse.sampled_addmm (cuSPARSE SDDMM)", _sddmm
    return None


def _sddmm(o):
    s, a, b = o
    pattern = s.to_torch()
    r = torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0)
    return s.with_values(r.values() * s.values())


def _p2(n) -> int:
    """``n`` rounded up to a power of two."""
    return 1 << max(int(n) - 1, 0).bit_length()


def row_skew(x) -> int:
    """For a CSR SparseTensor ``x``: its longest row over its mean row, rounded up to a power of two (1 for rows
    of one length or no entries, 4 for `benchmarks.gpu`'s uniform matrix, 256 for its power-law graph of mean
    degree 16 and a 4,000-entry row), else 0. Kept on the row level's storage (one device-to-host read a
    pattern), so a repeated call reads no device memory."""
    if getattr(x, "format", None) != named.csr or x.dim() != 2:
        return 0
    level = x._levels[1]
    kept = level.__dict__.get("_row_skew")
    if kept is None:
        nnz, kept = int(x.nnz), 1
        if nnz:  # (then there is a row)
            longest = int((level.pos[1:] - level.pos[:-1]).max())
            kept = _p2(-(-longest * x.shape[0] // nnz))
        level.__dict__["_row_skew"] = kept
    return kept


def key_of(plan_key, ops) -> tuple:
    """The choice's key: the plan's, every operand's shape rounded up to a power of two and nnz likewise, and a
    CSR operand's ``row_skew``: a uniform matrix and a power-law graph of the same size and nnz want different
    paths (on one H200, SpMM K=128: scorch's kernel 0.44 ms against cuSPARSE's 0.47 on the uniform matrix,
    1.33 against 0.39 on the graph; without the skew the graph took the uniform matrix's kept choice)."""
    return plan_key + tuple((tuple(_p2(n) for n in x.shape), _p2(x.nnz) if hasattr(x, "nnz") and x.layout !=
                             torch.strided else 0, row_skew(x)) for x in ops)


def choose(key, name, run_scorch: Callable, run_library: Callable, clock: Callable = None) -> Choice:
    """The kept choice for ``key``, measuring both paths the first time. ``clock(fn)``: the seconds one call of
    ``fn`` takes (default: CUDA events around it)."""
    c = _CHOICES.get(key)
    if c is not None:
        return c
    clock = clock or seconds
    run_scorch(), run_library()  # warm-up: compiles, cuSPARSE handles, allocator
    ts = statistics.median(clock(run_scorch) for _ in range(RUNS))
    tl = statistics.median(clock(run_library) for _ in range(RUNS))
    c = _CHOICES[key] = Choice(name if tl < ts else "scorch", name, ts * 1e3, tl * 1e3)
    return c


def seconds(fn) -> float:
    """The time one call of ``fn`` takes: between CUDA events on a GPU (its work is asynchronous)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3
