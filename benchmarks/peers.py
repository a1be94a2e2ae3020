"""The optional anchors: Intel MKL's sparse BLAS (``sparse-dot-mkl`` with ``mkl``) and SuiteSparse:GraphBLAS
(``python-graphblas``), installed with ``pip install -e .[bench]``.

Neither is required. A peer whose package is missing raises :class:`NotInstalled` on its first call, which the
suite turns into a row that says so ("not installed (...)"); the other peers run as usual.

Threads: :func:`configure_environment` runs in ``__main__`` before anything loads, and sets
``MKL_NUM_THREADS`` (and ``MKL_THREADING_LAYER=GNU``, so that MKL runs on the same GNU OpenMP runtime as torch
and scorch's kernels instead of a second, Intel OpenMP pool whose idle threads would spin on the cores the
next peer needs); :func:`mkl` also calls ``mkl_set_num_threads``. GraphBLAS takes its thread count from
``graphblas.ss.config["nthreads"]``, set in :func:`graphblas`. Both follow ``--threads``.
"""
from __future__ import annotations

import glob
import os
import sys

import numpy as np

INSTALL_HINT = "pip install -e .[bench]"


class NotInstalled(RuntimeError):
    """A peer's package is not importable here."""


def configure_environment(threads: int) -> None:
    """Before torch or MKL loads: MKL's thread count and threading layer, and where ``libmkl_rt`` is (the
    ``mkl`` wheel puts it in ``<prefix>/lib``, where ``sparse_dot_mkl`` does not look by itself)."""
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
    if "MKL_RT" not in os.environ:
        found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
        if found:
            os.environ["MKL_RT"] = found[0]


_MODULES: dict = {}


def _load(name: str, threads: int):
    """The module (imported once, its thread count set), or the reason it could not be imported."""
    if name not in _MODULES:
        try:
            if name == "mkl":
                import sparse_dot_mkl as mod
                mod.mkl_set_num_threads(threads)
            else:
                import graphblas as mod
                mod.ss.config["nthreads"] = threads
            _MODULES[name] = mod
        except ImportError as e:  # also what sparse_dot_mkl raises when it finds no libmkl_rt
            _MODULES[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    return _MODULES[name]


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def available(name: str) -> bool:
    """Whether ``name`` ("mkl" or "graphblas") can be used."""
    return not isinstance(_load(name, _threads()), str)


def module(name: str):
    """``sparse_dot_mkl`` or ``graphblas``, or :class:`NotInstalled`."""
    mod = _load(name, _threads())
    if isinstance(mod, str):
        raise NotInstalled(f"{'sparse-dot-mkl / mkl' if name == 'mkl' else 'python-graphblas'}: {mod}; "
                           f"{INSTALL_HINT}")
    return mod


def versions() -> dict:
    """The anchors' versions (or "not installed") for RESULTS.md."""
    out = {}
    mkl = _load("mkl", _threads())
    if isinstance(mkl, str):
        out["MKL (sparse-dot-mkl)"] = "not installed"
    else:
        from importlib.metadata import version
        mkl_version = mkl.mkl_get_version_string().split("Version ", 1)[-1].split()[0].split("-")[0]
        out["MKL (sparse-dot-mkl)"] = (f"sparse-dot-mkl {version('sparse-dot-mkl')}, MKL {mkl_version}, "
                                       f"{mkl.mkl_get_max_threads()} threads, threading layer "
                                       f"{os.environ.get('MKL_THREADING_LAYER', 'default')}")
    gb = _load("graphblas", _threads())
    if isinstance(gb, str):
        out["GraphBLAS (python-graphblas)"] = "not installed"
    else:
        import suitesparse_graphblas
        out["GraphBLAS (python-graphblas)"] = (f"python-graphblas {gb.__version__}, SuiteSparse:GraphBLAS "
                                               f"{suitesparse_graphblas.__version__}, "
                                               f"{gb.ss.config['nthreads']} threads")
    return out


# --- operands, converted once (outside the timed calls) ---------------------------------------------------------

_GB_CACHE: dict = {}


def gb_matrix(m):
    """A ``data.Matrix`` as a GraphBLAS matrix (CSR, a copy made once per matrix)."""
    key = id(m)
    if key not in _GB_CACHE:
        gb = module("graphblas")
        s = m.scipy
        _GB_CACHE[key] = (m, gb.Matrix.from_csr(s.indptr, s.indices, s.data, nrows=s.shape[0], ncols=s.shape[1]))
    return _GB_CACHE[key][1]


def gb_dense(x: np.ndarray):
    """A dense numpy array as a full GraphBLAS vector or row-major matrix (a copy)."""
    gb = module("graphblas")
    x = np.ascontiguousarray(x)
    if x.ndim == 1:
        return gb.Vector.ss.import_full(x, take_ownership=False)
    return gb.Matrix.ss.import_fullr(x, take_ownership=False)


def done(obj):
    """Finish any work GraphBLAS left pending on ``obj`` (so the timed call includes it) and return it."""
    obj.wait()
    return obj


def comparable(x):
    """A GraphBLAS result as numpy (full) or scipy CSR (sparse); None for anything else."""
    if "graphblas" not in _MODULES or isinstance(_MODULES["graphblas"], str):
        return None
    gb = _MODULES["graphblas"]
    if isinstance(x, gb.Vector):
        return x.to_dense(fill_value=0)
    if isinstance(x, gb.Matrix):
        if x.nvals == x.nrows * x.ncols:
            return x.to_dense(fill_value=0)
        import scipy.sparse as sp
        indptr, cols, vals = x.to_csr()
        return sp.csr_matrix((vals, cols, indptr), shape=x.shape)
    return None


# --- the peers of each kernel: name -> zero-argument callable --------------------------------------------------
#
# Operands are converted on a peer's first call (that call is the checked one, never timed), so building these
# dicts needs neither package; a missing package shows on the first call as NotInstalled.

MKL_SPMV, GB_SPMV = "MKL  dot_product_mkl(A, v)", "GraphBLAS  A.mxv(v)"
MKL_SPMM, GB_SPMM = "MKL  dot_product_mkl(A, X)", "GraphBLAS  A.mxm(X), X full"
GB_SDDMM = "GraphBLAS  S + A.mxm(B) masked by S's pattern"
MKL_SPGEMM, GB_SPGEMM = "MKL  dot_product_mkl(A, A)", "GraphBLAS  A.mxm(A)"
GB_ADD, GB_MUL = "GraphBLAS  A.ewise_add(B)", "GraphBLAS  A.ewise_mult(B)"


def _first_call_builds(build):
    """A callable that runs ``build()`` once, on its first call, and from then on calls what it returned."""
    built = []

    def call():
        if not built:
            built.append(build())
        return built[0]()
    return call


def _mkl(*operands):
    """MKL's ``dot_product_mkl`` on scipy CSR / numpy operands (a ``data.Matrix`` stands for its scipy CSR)."""
    def build():
        mkl = module("mkl")
        ops = [o.scipy if hasattr(o, "scipy") else o for o in operands]
        return lambda: mkl.dot_product_mkl(*ops)
    return _first_call_builds(build)


def _graphblas(op, *operands):
    """``op(gb, *operands)`` with every ``data.Matrix`` as a GraphBLAS matrix and every numpy array as a full
    GraphBLAS vector or matrix; the result finished (``wait``) inside the timed call."""
    def build():
        gb = module("graphblas")
        ops = [gb_matrix(o) if hasattr(o, "scipy") else gb_dense(o) for o in operands]
        return lambda: done(op(gb, *ops))
    return _first_call_builds(build)


def spmv(a, v: np.ndarray) -> dict:
    return {MKL_SPMV: _mkl(a, v), GB_SPMV: _graphblas(lambda gb, A, V: A.mxv(V).new(), a, v)}


def spmm(a, x: np.ndarray) -> dict:
    return {MKL_SPMM: _mkl(a, x), GB_SPMM: _graphblas(lambda gb, A, X: A.mxm(X).new(), a, x)}


def _sampled_addmm(gb, s, a, bt):
    """S + (A @ B) at S's nonzeros: a copy of S, the product masked by S's structure accumulated into it. B is
    passed as its transpose (row-major) and used through ``.T``, which makes GraphBLAS take its masked dot-product
    method; with B itself it computes the whole dense product first (minutes on these sizes)."""
    c = s.dup()
    c(s.S, accum=gb.binary.plus) << a.mxm(bt.T)
    return c


def sddmm(s, a: np.ndarray, bt: np.ndarray) -> dict:
    """torch.sparse.sampled_addmm(S, A, B)'s peers; ``bt`` is B transposed, contiguous."""
    return {GB_SDDMM: _graphblas(_sampled_addmm, s, a, bt)}


def spgemm(a) -> dict:
    return {MKL_SPGEMM: _mkl(a, a), GB_SPGEMM: _graphblas(lambda gb, A, B: A.mxm(B).new(), a, a)}


def add(a, b) -> dict:
    """sparse_dot_mkl has no sparse + sparse (MKL's mkl_sparse_?_add is not wrapped): GraphBLAS only."""
    return {GB_ADD: _graphblas(lambda gb, A, B: A.ewise_add(B).new(), a, b)}


def mul(a, b) -> dict:
    return {GB_MUL: _graphblas(lambda gb, A, B: A.ewise_mult(B).new(), a, b)}
