"""Transposition and permutation: a sparse tensor's arrays under another format (no copy)."""
from __future__ import annotations

import torch

from ..compiler import dispatch
from ..sparse_tensor import SparseTensor, implements

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@implements(torch.permute, torch.Tensor.permute)
def permute(x: SparseTensor, *dims):
    """The same arrays under the permuted format when the levels allow it, else a conversion (an einsum)."""
    if len(dims) == 1 and isinstance(dims[0], (list, tuple, torch.Size)):
        dims = tuple(dims[0])
    n = x.dim()
    dims = tuple(d % n if -n <= d < n else _bad_dim(d, n) for d in dims)
    if sorted(dims) != list(range(n)):
        raise ValueError(f"permute: {dims} is not a permutation of the {n} dimensions")
    src = _LETTERS[:n]
    return dispatch.einsum(f"{src}->{''.join(src[d] for d in dims)}", x)


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
