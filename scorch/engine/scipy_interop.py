"""SciPy's sparse arrays and matrices viewed as SparseTensors, and SparseTensors as SciPy arrays, sharing memory
where the dtypes allow (``torch.from_numpy`` / ``Tensor.numpy()``).

scipy.sparse            scorch format       shared arrays
csr                     csr                 indptr, indices, data
csc                     csc                 indptr, indices, data
coo                     coo                 coords (row, col), data
bsr (bh, bw)            bsr(bh, bw)         indptr, indices, data (blocks, flat)
dia, lil, dok           csr                 none (``tocsr()``: SciPy's own conversion)

SciPy is optional: it is imported by the user, never here; a object is a SciPy array only when
``scipy.sparse`` is already loaded (``sys.modules``), so ``asformat`` pays nothing for it otherwise.

A SciPy array not in canonical form (indices unsorted within a row, or repeated) is summed as SciPy sums it
(``sum_duplicates`` on a copy: the result no longer shares memory); explicit zeros stay stored, as in SciPy.
Complex values are refused, as scorch refuses them everywhere (``sparse_tensor.refuse_complex``).
"""
from __future__ import annotations

import sys

import torch

from ..formats import LevelStorage, named
from ..formats import storage as _storage
from ..sparse_tensor import SparseTensor, refuse_complex


def is_scipy_sparse(x) -> bool:
    """Whether ``x`` is a SciPy sparse array or matrix (without importing SciPy)."""
    sp = sys.modules.get("scipy.sparse")
    return sp is not None and sp.issparse(x)


def _tensor(a, what: str) -> torch.Tensor:
    """The NumPy array ``a`` as a torch tensor sharing its memory, or a copy where torch cannot share it
    (read-only, non-native byte order, not contiguous)."""
    import numpy as np
    a = np.asarray(a)
    if a.dtype.kind == "c":
        refuse_complex(f"scipy {what}", a.dtype)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.writeable or not a.flags.c_contiguous:  # (read-only: torch would share it and warn that
        a = np.array(a, order="C", copy=True)             # writing through it is undefined; torch refuses
                                                           # negative strides, and kernels read contiguous arrays)
    try:
        return torch.from_numpy(a)
    except TypeError:
        raise TypeError(f"scorch: scipy {what} of dtype {a.dtype} has no torch dtype (supported: bool, integers,"
                        " float16, float32, float64)") from None


def from_scipy(a) -> SparseTensor:
    """The SparseTensor of SciPy sparse array or matrix ``a`` in its nearest format (see the module's table),
    sharing its arrays when ``a`` is in canonical form and torch can share its dtypes; bounds checked."""
    if not is_scipy_sparse(a):
        raise TypeError(f"scorch.from_scipy takes a scipy.sparse array or matrix, got {type(a).__name__}")
    if a.ndim != 2:
        raise ValueError(f"scorch.from_scipy: a {a.ndim}-d SciPy array; only 2-d ones are supported")
    if a.dtype.kind == "c":
        refuse_complex("scipy sparse array", a.dtype)
    kind = a.format
    if kind not in ("csr", "csc", "coo", "bsr"):
        a, kind = a.tocsr(), "csr"
    shape = tuple(int(n) for n in a.shape)
    if kind == "coo":
        fmt, levels, vals = named.coo, _coo_levels(a), _tensor(a.data, "data")
    else:
        fmt = named.csr if kind == "csr" else named.csc if kind == "csc" else named.bsr(*a.blocksize)
        compressed = LevelStorage(pos=_tensor(a.indptr, "indptr"), crd=_tensor(a.indices, "indices"))
        levels = [LevelStorage(), compressed] + [LevelStorage()] * (len(fmt.levels) - 2)
        vals = _tensor(a.data, "data").reshape(-1)
    levels = _storage.uniform_index_dtype(levels)
    _storage.validate_bounds(fmt, shape, levels, vals)
    if not _canonical(a, kind, levels, shape):
        a = a.copy()
        a.sum_duplicates()  # (SciPy's own rule: sorted, repeats summed, zeros kept)
        return from_scipy(a)
    return SparseTensor(fmt, shape, levels, vals, check=False)


def _coo_levels(a):
    row, col = a.coords if hasattr(a, "coords") else (a.row, a.col)
    nnz = int(a.nnz)
    row, col = _tensor(row, "row indices"), _tensor(col, "column indices")
    return [LevelStorage(pos=torch.tensor([0, nnz], dtype=row.dtype), crd=row), LevelStorage(crd=col)]


def _canonical(a, kind, levels, shape) -> bool:
    """Whether ``a``'s entries are sorted within their rows (row-major for COO) and none repeats."""
    if kind != "coo":
        return bool(a.has_canonical_format)  # (SciPy computes it once and keeps it)
    row, col = levels[0].crd.long(), levels[1].crd.long()
    if row.numel() < 2:
        return True
    key = row * shape[1] + col
    return bool((key[1:] > key[:-1]).all())


def to_scipy(s: SparseTensor):
    """``s`` (CSR, CSC, COO or BSR, 2-d, on the CPU, values of a NumPy dtype) as the SciPy sparse array of that
    format, sharing the index arrays (int8 and int16 ones are widened to int32) and values."""
    import scipy.sparse as sp
    fmt, lv = s.format, s.levels
    vals = s.values().numpy()
    index = (lambda t: (t if t.dtype in (torch.int32, torch.int64) else t.int()).numpy())
    if fmt in (named.csr, named.csc):
        make = sp.csr_array if fmt == named.csr else sp.csc_array
        out = make((vals, index(lv[1].crd), index(lv[1].pos)), shape=tuple(s.shape), copy=False)
    elif named.block_size(fmt) is not None:  # (bsr: the caller converts bsc)
        bh, bw = named.block_size(fmt)
        out = sp.bsr_array((vals.reshape(-1, bh, bw), index(lv[1].crd), index(lv[1].pos)), shape=tuple(s.shape),
                           copy=False)
    else:  # COO, coalesced or not (SciPy's COO may repeat entries: they are summed, as scorch sums them)
        out = sp.coo_array((vals, (index(lv[0].crd), index(lv[1].crd))), shape=tuple(s.shape), copy=False)
        out.has_canonical_format = named.hybrid_coo_dims(fmt) == (0, True)
        return out
    out.has_canonical_format = True  # (scorch's compressed levels are sorted and unique: validated)
    return out
