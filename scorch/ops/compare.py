"""Comparisons, the binary maps of two sparse operands, ``where`` and ``masked_fill`` on SparseTensors, with
torch's semantics.

- Comparisons with a scalar (``x > c``, ``torch.eq(x, c)``...): a sparse bool result on the operand's pattern
  where ``op(0, c)`` is False, a dense (counted) result where it is True. Comparisons of two sparse tensors and
  the binary maps with op(0, 0) = 0 (``maximum``, ``minimum``, ``fmax``, ``fmin``, logical and bitwise
  and/or/xor): the union of the two patterns (``union_elementwise``), dense (counted) where op(0, 0) != 0.
- ``torch.where(mask, x, 0)`` with a sparse bool mask: sparse on the mask's pattern; with a dense mask and a
  sparse ``x``: sparse on ``x``'s pattern. ``masked_fill`` of a dense tensor by a sparse mask: dense;
  ``masked_fill(S, mask, 0)``: ``S``'s pattern with the masked entries zeroed; ``masked_fill(S, sparse_mask, v)``:
  the union of both patterns; a nonzero value with a dense mask: dense (the fallback, counted).

Everything is vectorized torch on the values and the coordinates (``storage.coordinates``), so autograd (through
the values) comes from torch's own ops.
"""
from __future__ import annotations

import numbers

import torch

from .. import _stats
from ..engine.convert import asformat, coo_from_entries
from ..formats import storage
from ..sparse_tensor import NoSparseRule, SparseTensor
from .entries import _coalesced, _desc, _entries, _kind, _linear, _no_out, _register
from .indexing import broadcast_to
from .shape_ops import _coo, _delinearize

_T = torch.Tensor


# --- comparisons with a scalar -------------------------------------------------------------------------------------

_COMPARISONS = {
    "gt": (torch.gt, (torch.gt, torch.greater, _T.gt, _T.greater, _T.__gt__), "lt"),
    "lt": (torch.lt, (torch.lt, torch.less, _T.lt, _T.less, _T.__lt__), "gt"),
    "ge": (torch.ge, (torch.ge, torch.greater_equal, _T.ge, _T.greater_equal, _T.__ge__), "le"),
    "le": (torch.le, (torch.le, torch.less_equal, _T.le, _T.less_equal, _T.__le__), "ge"),
    "eq": (torch.eq, (torch.eq, _T.eq, _T.__eq__), "eq"),
    "ne": (torch.ne, (torch.ne, torch.not_equal, _T.ne, _T.not_equal, _T.__ne__), "ne"),
}


def _scalar(c) -> bool:
    return isinstance(c, numbers.Number) or (isinstance(c, torch.Tensor) and not isinstance(c, SparseTensor)
                                             and c.dim() == 0)


def _compare(op_name):
    op, _, reflected = _COMPARISONS[op_name]
    name = f"torch.{op_name}"

    def apply(x, other, *, out=None):
        if not isinstance(x, SparseTensor) and isinstance(other, SparseTensor) and _scalar(x):
            return _COMPARE[reflected](other, x, out=out)  # 0-d dense < S: S > 0-d dense
        _no_out(out, name, x, other)
        if not isinstance(other, (torch.Tensor, numbers.Number)):
            # Tensor.__eq__(S, None) and the like: a TypeError becomes NotImplemented, as for dense tensors
            raise TypeError(f"{name}: cannot compare a sparse tensor with {type(other).__name__}")
        if isinstance(x, SparseTensor) and isinstance(other, SparseTensor):
            return union_elementwise(op, name, x, other)
        if not isinstance(x, SparseTensor) or not _scalar(other):
            raise NoSparseRule(f"{name} of a sparse tensor with a dense tensor")
        with torch.no_grad():
            at_zero = bool(op(torch.zeros((), dtype=x.dtype, device=x.device), other))
        if at_zero:
            _stats.record_densify(name, _desc(x))
            return op(x.to_dense(), other)
        x = _coalesced(x)
        return x.with_values(op(x._vals, other))  # padding: op(0, c) is False, stored as 0
    apply.__name__ = apply.__qualname__ = op_name
    apply.__doc__ = (f"{name} with a scalar: where op(0, c) is False a sparse bool result on the operand's pattern"
                     " (duplicates summed first), else the dense result, counted by scorch.stats(). Of two sparse"
                     " tensors (broadcast as torch's): where op(0, 0) is False a sparse bool result on the union of"
                     " their patterns, else dense (counted).")
    return apply


def union_elementwise(op, name, a: SparseTensor, b: SparseTensor):
    """``op(a, b)`` of two sparse tensors (broadcast as torch's), elementwise. Where op(0, 0) is 0 (False): the
    union of the patterns (canonical COO) holding op of the two values at each position (0 where one stores
    nothing), differentiable in both; otherwise the dense result, counted by ``scorch.stats()``."""
    shape = tuple(torch.broadcast_shapes(a._shape, b._shape))
    with torch.no_grad():
        at_zero = op(torch.zeros((), dtype=a.dtype), torch.zeros((), dtype=b.dtype))
    if bool(at_zero != 0):
        _stats.record_densify(name, _desc(a, b))
        return op(a.to_dense(), b.to_dense())
    (da, va), (db, vb) = (_entries(broadcast_to(t, shape)) for t in (a, b))
    keys, where = torch.unique(torch.cat([_linear(da, shape), _linear(db, shape)]), return_inverse=True)
    on_union = [torch.zeros(keys.shape, dtype=v.dtype, device=v.device).index_put((w,), v, accumulate=True)
                for v, w in ((va, where[:va.numel()]), (vb, where[va.numel():]))]
    return _coo(_delinearize(keys, shape), op(*on_union), shape, False, name)


def _union_op(op, name):
    def apply(a, b, *, out=None):
        if isinstance(out, SparseTensor) and isinstance(a, SparseTensor) and isinstance(b, SparseTensor):
            from .pattern import same_pattern
            if same_pattern(a, out) and same_pattern(b, out):  # (Adamax's state: one pattern, values in place)
                with torch.no_grad():
                    op(a._vals, b._vals, out=out._vals)
                return out
        if out is not None or not (isinstance(a, SparseTensor) and isinstance(b, SparseTensor)):
            raise NoSparseRule(f"{name} is sparse for two sparse operands only")
        return union_elementwise(op, name, a, b)
    apply.__name__ = apply.__qualname__ = name.rsplit(".", 1)[-1]
    apply.__doc__ = (f"{name} of two sparse tensors: the union of their patterns where op(0, 0) = 0 (else dense,"
                     " counted); with a dense operand: the dense fallback. ``out=`` a sparse tensor: written in place"
                     " when both operands have its pattern.")
    return apply


# binary maps with op(0, 0) = 0 (False): two sparse operands give the union of their patterns
for _fn, _spellings in (
        (torch.maximum, (torch.maximum, _T.maximum)), (torch.minimum, (torch.minimum, _T.minimum)),
        (torch.fmax, (torch.fmax, _T.fmax)), (torch.fmin, (torch.fmin, _T.fmin)),
        (torch.logical_and, (torch.logical_and, _T.logical_and)), (torch.logical_or, (torch.logical_or, _T.logical_or)),
        (torch.logical_xor, (torch.logical_xor, _T.logical_xor)),
        (torch.bitwise_and, (torch.bitwise_and, _T.bitwise_and, _T.__and__)),
        (torch.bitwise_or, (torch.bitwise_or, _T.bitwise_or, _T.__or__)),
        (torch.bitwise_xor, (torch.bitwise_xor, _T.bitwise_xor, _T.__xor__))):
    _register(*_spellings)(_union_op(_fn, f"torch.{_fn.__name__}"))


_COMPARE = {n: _compare(n) for n in _COMPARISONS}
for _n, (_, _fs, _) in _COMPARISONS.items():
    _register(*_fs)(_COMPARE[_n])


# --- where, masked_fill --------------------------------------------------------------------------------------------

def _zero_scalar(v) -> bool:
    if isinstance(v, numbers.Number):
        return v == 0
    return (isinstance(v, torch.Tensor) and not isinstance(v, SparseTensor) and v.dim() == 0
            and not v.requires_grad and bool(v == 0))


def _bool_mask(mask, name):
    dt = mask.dtype
    if dt != torch.bool:
        raise RuntimeError(f"{name}: expected a boolean mask (condition), got {dt}")


def _clamped(dims, inside, shape):
    """Coordinates safe to index a tensor of ``shape`` with (positions outside it are sent to 0; ``inside`` says
    which were real)."""
    return tuple(torch.where(inside, dims[d], 0) for d in range(len(shape)))


def _lookup(table: SparseTensor, dims: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``table``'s value at each coordinate of ``dims`` (0 / False where nothing is stored or not ``valid``);
    differentiable in ``table``'s values."""
    dims = torch.where(valid, dims, torch.zeros((), dtype=dims.dtype, device=dims.device))
    got = storage.lookup(table._format, table._shape, table._levels, table._vals, dims)
    return torch.where(valid, got, torch.zeros((), dtype=got.dtype, device=got.device))


def _scatter_positions(x: SparseTensor, leaf, vals):
    """A values array for ``x``'s stored positions: ``vals`` at ``leaf``, 0 at the positions not listed."""
    out = torch.zeros(x._vals.shape, dtype=vals.dtype, device=vals.device)
    return out.index_put((leaf,), vals)


def _where_dtype(x, y):
    """The dtype torch.where(cond, x, y) gives (torch's promotion of x and y; a sparse x counts as a 1-d tensor)."""
    if isinstance(x, SparseTensor):
        x = torch.zeros(1, dtype=x.dtype)
    elif isinstance(x, torch.Tensor):
        x = torch.zeros((1,) * min(x.dim(), 1), dtype=x.dtype)
    if isinstance(y, torch.Tensor):
        y = torch.zeros((), dtype=y.dtype)
    elif not isinstance(x, torch.Tensor):
        x = torch.tensor(x)  # two scalars: as torch.where wraps them
    return torch.result_type(x, y)


@_register(torch.where)
def where(condition, input=None, other=None, *, out=None):
    """``torch.where(mask, x, 0)``: sparse on a sparse mask's pattern, or on a sparse ``x``'s pattern under a dense
    mask; ``torch.where(mask)``: the coordinates of a sparse mask's True entries."""
    if input is None and other is None:
        return _nonzero_tuple(condition)
    _no_out(out, "torch.where", condition, input, other)
    if isinstance(condition, SparseTensor) and _zero_scalar(other) and not (
            isinstance(input, SparseTensor) and input._shape != condition._shape):
        return _where_sparse_mask(condition, input, other)
    if (isinstance(input, SparseTensor) and isinstance(condition, torch.Tensor)
            and not isinstance(condition, SparseTensor) and _zero_scalar(other)):
        return _where_dense_mask(condition, input, other)
    raise NoSparseRule(
        f"scorch: torch.where(condition={_kind(condition)}, input={_kind(input)}, other={_kind(other)}) is not"
        " supported: the sparse forms are where(sparse_mask, x, 0) (x dense, sparse or a scalar, result on the mask's"
        " pattern) and where(dense_mask, S, 0) (result on S's pattern)")


@_register(_T.where)
def tensor_where(self, condition, other):
    """``x.where(mask, 0)``: ``torch.where(mask, x, 0)``."""
    return where(condition, self, other)


def _where_sparse_mask(mask: SparseTensor, x, y):
    _bool_mask(mask, "torch.where")
    shape = mask._shape
    if isinstance(x, torch.Tensor) and not isinstance(x, SparseTensor):
        if tuple(torch.broadcast_shapes(x.shape, shape)) != tuple(shape):
            raise NoSparseRule(f"scorch: torch.where with a sparse mask of shape {tuple(shape)} and x of shape"
                                      f" {tuple(x.shape)}: the mask would be broadcast")
    dtype = _where_dtype(x, y)
    mask = _coalesced(mask)
    leaf, dims, inside = storage.coordinates(mask._format, shape, mask._levels)
    chosen = mask._vals[leaf] & inside
    if isinstance(x, SparseTensor):
        picked = _lookup(x, dims, inside)
    elif isinstance(x, torch.Tensor):
        picked = x.expand(shape)[_clamped(dims, inside, shape)] if leaf.numel() else x.new_zeros(0)
    else:
        picked = x
    vals = torch.where(chosen, picked, y).to(dtype)
    return mask.with_values(_scatter_positions(mask, leaf, vals.expand(leaf.shape)))


def _where_dense_mask(mask: torch.Tensor, x: SparseTensor, y):
    _bool_mask(mask, "torch.where")
    shape = x._shape
    if tuple(torch.broadcast_shapes(mask.shape, shape)) != tuple(shape):
        raise NoSparseRule(f"scorch: torch.where with a dense mask of shape {tuple(mask.shape)} and a sparse"
                                  f" x of shape {tuple(shape)}: x would be broadcast")
    dtype = _where_dtype(x, y)
    leaf, dims, inside = storage.coordinates(x._format, shape, x._levels)
    keep = (mask.expand(shape)[_clamped(dims, inside, shape)] if leaf.numel() else mask.new_zeros(0)) & inside
    vals = torch.where(keep, x._vals[leaf], y).to(dtype)
    return x.with_values(_scatter_positions(x, leaf, vals))  # duplicates are masked alike: linear


def _nonzero_tuple(mask):
    if not isinstance(mask, SparseTensor):
        raise NoSparseRule("scorch: torch.where(condition) with a sparse argument other than the condition")
    dims, vals = _entries(mask)
    dims = dims[:, vals != 0]
    order = torch.argsort(_linear(dims, mask._shape))
    return tuple(dims[:, order].unbind(0)) if mask.dim() else ()


def _true_coordinates(mask: SparseTensor):
    """The coordinates (``(ndim, K)``) of a sparse bool mask's True entries."""
    leaf, dims, inside = storage.coordinates(mask._format, mask._shape, mask._levels)
    return dims[:, mask._vals[leaf] & inside]


def _masked_fill(input, mask, value, inplace):
    name = "Tensor.masked_fill_" if inplace else "torch.masked_fill"
    if isinstance(value, SparseTensor) or (isinstance(value, torch.Tensor) and value.dim() != 0):
        raise RuntimeError(f"{name} only supports a 0-dimensional value tensor, got {_kind(value)}")
    if not isinstance(input, SparseTensor) and isinstance(input, torch.Tensor) and isinstance(mask, SparseTensor):
        _bool_mask(mask, name)
        if mask._shape != input.shape:
            raise NoSparseRule(f"scorch: {name} of a dense tensor of shape {tuple(input.shape)} by a sparse"
                                      f" mask of shape {tuple(mask._shape)}: the shapes must be equal")
        idx = tuple(_true_coordinates(mask).unbind(0))
        fill = torch.as_tensor(value, dtype=input.dtype, device=input.device)
        out = input if inplace else input.clone()
        return out.index_put_(idx, fill)
    if isinstance(input, SparseTensor) and _zero_scalar(value):
        _bool_mask(mask, name)
        shape = input._shape
        leaf, dims, inside = storage.coordinates(input._format, shape, input._levels)
        if isinstance(mask, SparseTensor):
            if mask._shape != shape:
                raise NoSparseRule(f"scorch: {name} of {_desc(input)} by a sparse mask of shape"
                                          f" {tuple(mask._shape)}: the shapes must be equal")
            hit = _lookup(mask, dims, inside)
        else:
            if tuple(torch.broadcast_shapes(mask.shape, shape)) != tuple(shape):
                raise RuntimeError(f"{name}: the mask of shape {tuple(mask.shape)} does not broadcast to the input's"
                                   f" shape {tuple(shape)}")
            hit = (mask.expand(shape)[_clamped(dims, inside, shape)] if leaf.numel() else mask.new_zeros(0)) & inside
        at = torch.zeros(input._vals.shape, dtype=torch.bool, device=hit.device).index_put((leaf,), hit)
        if inplace:
            input._vals.masked_fill_(at, 0)  # zeroing keeps padding 0
            return input
        return input.with_values(input._vals.masked_fill(at, 0))
    if isinstance(input, SparseTensor) and isinstance(mask, SparseTensor) and not inplace:
        return _filled_union(input, mask, value, name)
    raise NoSparseRule(
        f"scorch: {name}(input={_kind(input)}, mask={_kind(mask)}, value={_kind(value)}) has no sparse form: the"
        " sparse forms are masked_fill(dense, sparse_mask, v) (dense result), masked_fill(S, mask, 0) (S's pattern)"
        " and masked_fill(S, sparse_mask, v) (the union of both patterns); a nonzero value with a dense mask fills"
        " the implicit zeros the mask selects, a dense result")


def _filled_union(input: SparseTensor, mask: SparseTensor, value, name):
    """``masked_fill(S, sparse_mask, v)`` with a nonzero ``v``: torch's result is ``v`` at the mask's True
    entries, stored or not, and ``S`` elsewhere, so the union of the two patterns, in ``S``'s format (explicit
    zeros of ``S`` stay stored). The fill is torch's own ``masked_fill`` on the values (its casts, its gradient)."""
    _bool_mask(mask, name)
    shape = input._shape
    if mask._shape != shape:
        raise NoSparseRule(f"scorch: {name} of {_desc(input)} by a sparse mask of shape {tuple(mask._shape)}: the"
                           " shapes must be equal")
    edims, vals = _entries(input)
    trues = _true_coordinates(_coalesced(mask))
    stored, filled = _linear(edims, shape), _linear(trues, shape)
    hit = torch.isin(stored, filled)
    new = trues[:, ~torch.isin(filled, stored)]
    dims = torch.cat([edims, new], 1)
    vals = torch.cat([vals, vals.new_zeros(new.shape[1])])
    at = torch.cat([hit, torch.ones(new.shape[1], dtype=torch.bool, device=hit.device)])
    out = coo_from_entries(list(dims.unbind(0)), vals.masked_fill(at, value), tuple(shape), duplicates=False)
    return out if out._format == input._format else asformat(out, input._format)


@_register(torch.masked_fill, _T.masked_fill)
def masked_fill(input, mask, value):
    """A dense input with a sparse bool mask: dense, the value at the mask's True entries; a sparse input with
    ``value`` 0 (mask dense or sparse): the input's pattern with the masked entries zeroed; a sparse input, a
    sparse mask and another value: the union of the two patterns, in the input's format."""
    return _masked_fill(input, mask, value, inplace=False)


@_register(_T.masked_fill_)
def masked_fill_(input, mask, value):
    """``masked_fill`` in place: into a dense input by a sparse mask, or zeroing a sparse input's stored values."""
    return _masked_fill(input, mask, value, inplace=True)
