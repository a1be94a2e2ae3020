"""Transposition and permutation: views, a sparse tensor's arrays under another format (no copy).

``S.t()`` of a CSR matrix is the CSC matrix on the same arrays, as torch's is: every format's transpose is a
format (the levels keep their order and types, each level's coordinate expression names the permuted
dimensions), so a permutation never copies. The view shares the index arrays and the values with ``S``: an
in-place op on either changes both, as with torch's views. Where ``S``'s values require grad, the view's
values are a ``view_as`` of them, so autograd records the view (and refuses an in-place op on a view of a
leaf, as torch does). A dense-format tensor's permutation is torch's strided view of its values."""
from __future__ import annotations

import functools

import torch

from ..formats import Format
from ..formats import storage
from ..sparse_tensor import SparseTensor, dense_fallback, implements


@implements(torch.permute, torch.Tensor.permute)
def permute(x: SparseTensor, *dims, **kwargs):
    """The same arrays (and values) under the permuted format: a view. ``dims`` as numbers, one sequence, or
    ``dims=`` (torch's keyword)."""
    if kwargs:
        if set(kwargs) != {"dims"} or dims:
            raise TypeError(f"permute() got unexpected arguments {sorted(kwargs)}")
        dims = (kwargs["dims"],)
    if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
        dims = tuple(dims[0])
    n = x.dim()
    dims = tuple(d % n if -n <= d < n else _bad_dim(d, n) for d in dims)
    if sorted(dims) != list(range(n)):
        raise ValueError(f"permute: {dims} is not a permutation of the {n} dimensions")
    if dims == tuple(range(n)):
        return x
    values = x.values()
    if storage.row_major(x.format):  # a dense format: torch's own view of the values
        return values.reshape(x.shape).permute(dims)
    view = SparseTensor(permuted_format(x.format, dims), [x.shape[d] for d in dims], x.levels,
                        values.view_as(values) if values.requires_grad else values, check=False)
    if getattr(x, "_pattern_grad", False):
        view._pattern_grad = True
    return view


@functools.lru_cache(maxsize=256)
def permuted_format(fmt: Format, dims: tuple) -> Format:
    """``fmt`` for the tensor whose dimension ``k`` is dimension ``dims[k]`` of ``fmt``'s: the same levels, each
    coordinate expression over the renumbered dimensions."""
    new = [0] * len(dims)
    for k, d in enumerate(dims):
        new[d] = k
    return Format.from_levels(fmt.ndim, [(e.renumber(new), lvl) for e, lvl in fmt.levels])


def _bad_dim(d, n):
    raise IndexError(f"dimension {d} is out of range for a {n}-d tensor")


@implements(torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes)
def transpose(x, dim0, dim1):
    """``permute`` swapping two dimensions."""
    n = x.dim()
    order = list(range(n))
    d0 = dim0 % n if -n <= dim0 < n else _bad_dim(dim0, n)
    d1 = dim1 % n if -n <= dim1 < n else _bad_dim(dim1, n)
    order[d0], order[d1] = order[d1], order[d0]
    return permute(x, order)


@implements(torch.t, torch.Tensor.t, torch.Tensor.T.__get__)
def t(x):
    """Transpose of a matrix (``x.T`` too), as ``transpose(x, 0, 1)``."""
    if x.dim() > 2:
        raise ValueError(f"t() expects a tensor with at most 2 dimensions, got {x.dim()}")
    return x if x.dim() < 2 else transpose(x, 0, 1)


@implements(torch.Tensor.mT.__get__)
def mT(x):
    """``x.mT``: the last two dimensions swapped, as ``transpose(x, -2, -1)`` (it went to the dense fallback, whose
    copy an in-place op changed without reaching ``x``; ``x.T`` was sparse)."""
    if x.dim() < 2:
        raise RuntimeError(f"tensor.mT is only supported on matrices or batches of matrices. Got {x.dim()}-D tensor.")
    return transpose(x, -2, -1)


@implements(torch.Tensor.mH.__get__, torch.adjoint, torch.Tensor.adjoint)
def mH(x):
    """``x.mH`` / ``x.adjoint()``: ``x.mT`` (complex values, which have no sparse rules, take the dense
    fallback as before)."""
    if x.is_complex():
        return dense_fallback(torch.Tensor.adjoint, (x,), {}, "complex values")
    return mT(x)
