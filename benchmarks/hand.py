"""Hand-written C++ SpMM kernels (``kernels/spmm.cpp``), built through scorch's own runtime (same compiler,
flags and cache) with the dense width compiled in."""
from __future__ import annotations

import ctypes
import pathlib
from typing import Callable

import torch

from scorch.compiler import runtime

SOURCE = pathlib.Path(__file__).with_name("kernels") / "spmm.cpp"

#: candidates for the yardstick: the fastest of these on a case is "the hand kernel"
CANDIDATES = ("spmm_vec16_u2", "spmm_vec16", "spmm_vec16_pf", "spmm_vec8_u2", "spmm_simd")
#: builds of the generated kernel's loops, written by hand (see spmm.cpp): (label suffix, variants, lines
#: prepended to the source). The pragmas set both knobs whatever scorch's own flags are: no suffix is GCC 12's
#: -O3 default on this CPU (256-bit vectors preferred, loop unroll-and-jam on); "512-bit" lets the
#: auto-vectorizer use zmm; "no unroll-and-jam" turns off the pass that jams two nonzeros and gathers.
_JAM, _NOJAM = '#pragma GCC optimize("loop-unroll-and-jam")\n', '#pragma GCC optimize("no-loop-unroll-and-jam")\n'
_W256, _W512 = '#pragma GCC target("prefer-vector-width=256")\n', '#pragma GCC target("prefer-vector-width=512")\n'
ABLATION_BUILDS = (("", ("spmm_gen_rmw", "spmm_gen_acc"), _JAM + _W256),
                   (" (512-bit)", ("spmm_gen_rmw", "spmm_gen_acc"), _JAM + _W512),
                   (" (no unroll-and-jam)", ("spmm_gen_acc",), _NOJAM + _W256),
                   (" (no unroll-and-jam, 512-bit)", ("spmm_gen_acc",), _NOJAM + _W512))

_ARGTYPES = [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64]


def spmm_kernels(k: int, names=CANDIDATES, prelude: str = "") -> dict[str, Callable]:
    """``{name: f(a, x) -> y}`` for each variant in ``names`` that exists for width ``k``; ``a`` is a torch
    CSR tensor with int32 indices, ``x`` a contiguous float32 (n, k) tensor. ``prelude`` is prepended."""
    source = f"#define BENCH_K {int(k)}\n" + prelude + SOURCE.read_text()
    out = {}
    for name in names:
        try:
            fn = runtime.load(source, name, _ARGTYPES).fn
        except runtime.CompileError as e:
            if "does not export" in str(e):  # the variant needs a vector width that does not divide k
                continue
            raise
        out[name] = _bind(fn, k)
    return out


def ablation_kernels(k: int) -> dict[str, Callable]:
    """Every build in ``ABLATION_BUILDS``, named ``variant + suffix``."""
    out = {}
    for suffix, names, prelude in ABLATION_BUILDS:
        out.update({n + suffix: f for n, f in spmm_kernels(k, names, prelude).items()})
    return out


def _bind(fn, k):
    def spmm(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != k:
            raise ValueError(f"hand SpMM: x must be contiguous float32 with {k} columns")
        pos, crd, val = a.crow_indices(), a.col_indices(), a.values()
        if pos.dtype != torch.int32 or crd.dtype != torch.int32 or val.dtype != torch.float32:
            raise ValueError("hand SpMM: a must be float32 CSR with int32 indices")
        m = a.shape[0]
        y = torch.empty(m, k, dtype=torch.float32)
        fn(m, pos.data_ptr(), crd.data_ptr(), val.data_ptr(), x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y
    return spmm
