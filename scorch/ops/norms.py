"""Norms of SparseTensors, with torch's semantics: ``torch.norm``, ``Tensor.norm``, ``torch.linalg.vector_norm``
(any ord) / ``norm`` / ``matrix_norm`` (matrix ords ``'fro'``, 1, -1, inf, -inf). Reductions over the stored
entries with the implicit zeros accounted for; dense results, as torch's.

Everything is vectorized torch on the values and the coordinates, so autograd (through the values) comes from
torch's own ops.
"""
from __future__ import annotations

import math

import torch

from ..sparse_tensor import NoSparseRule, SparseTensor
from .entries import _desc, _entries, _groups, _no_out, _probe_shape, _reduce_dims, _register, _shaped

_T = torch.Tensor


def _safe_root(s, p):
    """``s ** (1 / p)`` with a zero gradient at s == 0 (torch's subgradient of the norm at 0); nan stays nan."""
    nonzero = s != 0
    return torch.where(nonzero, torch.where(nonzero, s, 1) ** (1.0 / p), 0)


def _vector_norm(x: SparseTensor, ord, reduce_dims, keepdim, dtype):
    edims, vals = _entries(x)
    if dtype is not None:
        vals = vals.to(dtype)
    a = vals.abs()
    out_dtype = a.dtype
    if out_dtype in (torch.float16, torch.bfloat16):  # (summed in float32, as torch's norms: bfloat16 sums of
        a = a.float()                                 # 3000 ones stopped at 256)
    gid, groups, size = _groups(x._shape, edims, reduce_dims)
    zeros = torch.zeros(groups, dtype=a.dtype, device=a.device)
    ord = float(ord)
    if ord == math.inf:
        r = zeros.scatter_reduce(0, gid, a, "amax", include_self=True)  # |v| >= 0: the implicit zeros change nothing
    elif ord == -math.inf:
        r = torch.full_like(zeros, math.inf).scatter_reduce(0, gid, a, "amin", include_self=True)
        count = torch.bincount(gid, minlength=groups)
        r = torch.where((count < size) & ~r.isnan(), 0, r)  # an implicit zero in the group (a nan wins)
    elif ord == 0:  # (the graph kept, with a zero gradient: 0 * inf would be nan)
        r = zeros.index_add(0, gid, (a != 0).to(a.dtype) + 0 * a.nan_to_num(0, 0, 0))
    elif ord == 1:
        r = zeros.index_add(0, gid, a)
    elif ord > 0:
        r = _safe_root(zeros.index_add(0, gid, a * a if ord == 2 else a ** ord), ord)
    else:  # negative: |0| ** ord is inf, so an implicit zero makes the norm 0
        count = torch.bincount(gid, minlength=groups)
        r = zeros.index_add(0, gid, a ** ord) ** (1.0 / ord)
        r = torch.where((count < size) & ~r.isnan(), 0, r)
    return _shaped(r.to(out_dtype), x._shape, reduce_dims, keepdim)


@_register(torch.linalg.vector_norm)
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    """Vector norms (any ord) over all or some dimensions, from the stored entries with the implicit zeros
    accounted for: dense, as torch's."""
    _no_out(out, "torch.linalg.vector_norm", x)
    if not isinstance(x, SparseTensor):
        raise NoSparseRule("scorch: torch.linalg.vector_norm with a sparse argument other than the input")
    # torch's own checks (ord, dim, dtype), on a tensor of this rank and dtype
    torch.linalg.vector_norm(torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device), ord, dim, keepdim,
                             dtype=dtype)
    if x.numel() == 0:  # torch's results and errors for empty tensors (no data to densify)
        return torch.linalg.vector_norm(x.to_dense(), ord, dim, keepdim, dtype=dtype)
    return _vector_norm(x, ord, _reduce_dims(dim, x.dim()), keepdim, dtype)


def _matrix_norm(x: SparseTensor, ord, dim, keepdim, dtype):
    n = x.dim()
    d0, d1 = (d % n for d in dim)
    if ord == "fro":
        return _vector_norm(x, 2, tuple(sorted((d0, d1))), keepdim, dtype)
    if ord in (1, -1, math.inf, -math.inf):
        summed, extreme = (d0, d1) if abs(ord) == 1 else (d1, d0)
        s = _vector_norm(x, 1, (summed,), True, dtype)  # absolute sums, dense
        r = s.amax(extreme, keepdim=True) if ord > 0 else s.amin(extreme, keepdim=True)
        return r if keepdim else r.squeeze((d0, d1))
    raise NoSparseRule(f"scorch: the matrix norm ord={ord!r} of a sparse tensor ({_desc(x)}) needs singular"
                              " values; supported: 'fro', 1, -1, inf, -inf")


@_register(torch.linalg.matrix_norm)
def matrix_norm(x, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None, out=None):
    """Matrix norms 'fro', 1, -1, inf, -inf (absolute sums along one dimension, then their extreme): dense.
    'nuc', 2 and -2 (singular values) run on the dense form (the fallback, warned and counted)."""
    _no_out(out, "torch.linalg.matrix_norm", x)
    if not isinstance(x, SparseTensor):
        raise NoSparseRule("scorch: torch.linalg.matrix_norm with a sparse argument other than the input")
    if ord not in ("nuc", 2, -2):  # torch's checks, without its SVD
        torch.linalg.matrix_norm(torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device), ord, dim, keepdim,
                                 dtype=dtype)
    if x.numel() == 0 and ord not in ("nuc", 2, -2):
        return torch.linalg.matrix_norm(x.to_dense(), ord, dim, keepdim, dtype=dtype)
    return _matrix_norm(x, ord, tuple(dim), keepdim, dtype)


@_register(torch.linalg.norm)
def linalg_norm(x, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    """``torch.linalg.norm``: the vector or matrix norm torch would pick for ``ord`` and ``dim``; dense."""
    _no_out(out, "torch.linalg.norm", x)
    if not isinstance(x, SparseTensor):
        raise NoSparseRule("scorch: torch.linalg.norm with a sparse argument other than the input")
    if isinstance(dim, int):
        dim = (dim,)
    if ord is None:
        return vector_norm(x, 2, dim, keepdim, dtype=dtype)
    if dim is None:
        if x.dim() not in (1, 2):
            raise RuntimeError(f"linalg.norm: If dim is not specified but ord is, the input must be 1D or 2D. Got"
                               f" {x.dim()}D.")
        dim = tuple(range(x.dim()))
    if len(dim) == 1:
        return vector_norm(x, ord, dim, keepdim, dtype=dtype)
    if len(dim) == 2:
        return matrix_norm(x, ord, dim, keepdim, dtype=dtype)
    raise RuntimeError(f"linalg.norm: If dim is specified, it must be of length 1 or 2. Got {list(dim)}")


@_register(torch.norm, _T.norm)
def norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm``, by torch's own dispatch to ``linalg.vector_norm`` / ``matrix_norm``."""
    _no_out(out, "torch.norm", input)
    if isinstance(p, str):
        if p == "fro" and (dim is None or isinstance(dim, int) or len(dim) <= 2):
            return vector_norm(input, 2, dim, keepdim, dtype=dtype)
        return matrix_norm(input, p, tuple(range(input.dim())) if dim is None else dim, keepdim, dtype=dtype)
    return vector_norm(input, 2.0 if p is None else p, dim, keepdim, dtype=dtype)


@_register(torch.nn.functional.normalize)
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``: each stored value divided by its slice's p-norm along ``dim`` (at least ``eps``), as
    torch's ``input / input.norm(p, dim, keepdim=True).clamp_min(eps)``; the pattern and format kept (0 divided
    by a positive norm stays 0). A slice whose norm is nan (a nan value) runs dense, as torch's division does."""
    _no_out(out, "torch.nn.functional.normalize", input)
    if type(input) is not SparseTensor:
        raise NoSparseRule("scorch: F.normalize with a sparse argument other than the input")
    denom = vector_norm(input, p, dim, keepdim=True).clamp_min(eps)
    if denom.is_floating_point() and bool(denom.isnan().any()):
        raise NoSparseRule("scorch: F.normalize of a slice holding nan: 0 / nan is nan at its implicit zeros")
    return torch.div(input, denom)
