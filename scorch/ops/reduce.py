"""Reductions: sum and mean over dimensions, with keepdim; torch.sparse.sum."""
from __future__ import annotations

import torch

from .. import engine
from ..sparse_tensor import SparseTensor, implements

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _dims(dim, n, name, empty_all=True):
    """``dim`` as sorted non-negative dims, checked; None means all, and so does () (torch's ``sum``, ``mean``,
    ``amax``) unless ``empty_all`` is false (``torch.sparse.sum``: none)."""
    if dim is None:
        return tuple(range(n))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims and empty_all:
        return tuple(range(n))
    out = []
    for d in dims:
        if not -n <= d < n:
            raise IndexError(f"{name}: dimension {d} is out of range for a {n}-d tensor")
        out.append(d % n)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: dimension repeated in {dims}")
    return tuple(out)


def _kept(n, dims):
    """``(source letters, output letters)`` of a reduction of an n-d tensor over ``dims``."""
    src = _LETTERS[:n]
    return src, "".join(c for d, c in enumerate(src) if d not in dims)


def _keepdim(r, shape, dims):
    """``r`` reshaped with the reduced dimensions kept as size 1 (dense, as torch returns it)."""
    kept = tuple(1 if d in dims else n for d, n in enumerate(shape))
    return r.to_dense().reshape(kept) if isinstance(r, SparseTensor) else r.reshape(kept)


@implements(torch.sum, torch.Tensor.sum)
def sum(x: SparseTensor, dim=None, keepdim=False, *, dtype=None, _empty_all=True):
    """Sum over ``dim`` (all by default) as an einsum: sparse over the kept indices the operand drives, dense
    where none is left; keepdim gives the dense result with size-1 dimensions, as torch; integers sum in int64."""
    n = x.dim()
    dims = _dims(dim, n, "sum", _empty_all)
    src, out = _kept(n, dims)
    if dtype is not None:
        x = x.to(dtype)
    elif not (x.dtype.is_floating_point or x.dtype.is_complex):
        x = x.to(torch.int64)  # torch sums integers (and bools) in int64
    r = engine.einsum(f"{src}->{out}", x)
    return _keepdim(r, x.shape, dims) if keepdim else r


@implements(torch._sparse_sum)
def _sparse_sum(x, *args, dim=None, dtype=None):
    """``torch.sparse.sum(x, dim, dtype)`` arrives here as ``torch._sparse_sum(x[, dim][, dtype])``, ``dim`` and
    ``dtype`` positional or by keyword (torch.sparse.sum passes ``dtype=``)."""
    dim = next((a for a in args if not isinstance(a, torch.dtype)), dim)
    dtype = next((a for a in args if isinstance(a, torch.dtype)), dtype)
    return sparse_sum(x, dim, dtype=dtype)


@implements(torch.sparse.sum)
def sparse_sum(x, dim=None, dtype=None):
    """``torch.sparse.sum``: as ``sum``, except that ``dim=()`` sums over no dimension (torch.sparse's rule) and
    that a sum over some dimensions keeps an integer or bool input's dtype (torch.sparse's too; ``sum`` gives
    int64)."""
    r = sum(x, dim, dtype=dtype, _empty_all=False)
    if dim is not None and dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex) and \
            r.dtype != x.dtype:
        r = r.to(x.dtype)
    return r


@implements(torch.mean, torch.Tensor.mean)
def mean(x: SparseTensor, dim=None, keepdim=False, *, dtype=None):
    """``sum`` divided by the count of all elements reduced (implicit zeros included), as torch."""
    if not (x.dtype.is_floating_point or dtype is not None):
        raise TypeError(f"mean: could not infer output dtype; input dtype {x.dtype} is not floating point")
    dims = _dims(dim, x.dim(), "mean")
    count = 1
    for d in dims:
        count *= x.shape[d]
    out = x.dtype if dtype is None else dtype
    # a 16-bit mean is summed and divided in float32, then rounded once, as torch's: the sum alone may overflow
    # float16 (256 entries of 300) where the mean does not
    wide = torch.float32 if out in (torch.float16, torch.bfloat16) else dtype
    s = sum(x, dim, keepdim, dtype=wide)
    if count == 0:  # the mean of nothing is nan, as in torch
        return ((s.to_dense() if isinstance(s, SparseTensor) else s) / count).to(out)
    if isinstance(s, SparseTensor):
        return s.with_values((s.values() / count).to(out))
    return (s / count).to(out)


def _extremum(reduce):
    def fn(x: SparseTensor, dim=None, keepdim=False):
        """Max/min over ``dim`` by a compiled reduction; implicit zeros take part, as in the dense tensor; the
        result is dense (duplicates and padding are removed first)."""
        n = x.dim()
        dims = _dims(dim, n, f"a{reduce}")
        for d in dims:
            if x.shape[d] == 0:
                raise IndexError(f"a{reduce}(): expected reduction dim {d} to have non-zero size")
        # max and min need each entry once: coalesce duplicates and drop padding first
        if x.format.keeps_duplicates or x.format.padded:
            from ..formats import named
            x = x.asformat(named.coo_nd(n) if x.format.keeps_duplicates or n != 2 else "csr")  # (n-d: COO)
        src, out = _kept(n, dims)
        # (dense: every cell has a max, the implicit zeros' where nothing larger is stored; a sparse result left
        # out the cells whose extremum is a stored 0, and their gradient with them)
        r = engine.run((tuple(src),), tuple(out), [x], reduce=reduce, name=f"a{reduce}",
                       format="dense" if out else None)
        r = _propagate_nan(r, x, src, out)
        return _keepdim(r, x.shape, dims) if keepdim else r
    fn.__name__ = f"a{reduce}"
    return fn


def _propagate_nan(r, x: SparseTensor, src: str, out: str):
    """``r`` (the max/min of ``x`` reduced from ``src`` to ``out`` letters) with NaN wherever a reduced group
    stores a NaN, as torch's amax/amin propagate it (the compiled reduction's comparisons skip NaN). Costs one
    ``isnan`` over the stored values when there is none."""
    vals = x.values().detach()
    if not vals.is_floating_point():
        return r
    nan = torch.isnan(vals)
    if not bool(nan.any()):
        return r
    count = engine.einsum(f"{src}->{out}", x.detach().with_values(nan.to(vals.dtype)))  # NaNs per result cell
    count = count.to_dense() if isinstance(count, SparseTensor) else count
    dense = r.to_dense() if isinstance(r, SparseTensor) else r
    return torch.where(count > 0, torch.full((), torch.nan, dtype=dense.dtype), dense)


amax = implements(torch.amax, torch.Tensor.amax)(_extremum("max"))
amin = implements(torch.amin, torch.Tensor.amin)(_extremum("min"))
