"""Activations, dropout, comparisons, masking, norms and max/min on SparseTensors, with torch's semantics.

- Unary maps (activations, ``erf``, rounding...): each call first runs the torch function on a one-element zero
  tensor of the operand's dtype with the same arguments. Where that gives 0 the map is zero-preserving for these
  arguments (``F.leaky_relu``, ``F.gelu``, ``F.hardtanh(x, -1, 1)``...) and the result keeps the operand's
  pattern (shared index arrays, the map applied to the stored values; padding and positions outside the shape
  stay 0 since f(0) = 0). Otherwise (``torch.sigmoid``, ``torch.exp``, ``F.hardtanh(x, 0.5, 1)``...) the result
  is dense, computed by torch on ``x.to_dense()``, and the densification is counted and warned about once per
  op (``scorch._stats``). ``inplace=True`` (and the ``Tensor.*_`` methods) update the stored values in place;
  that is refused for formats with padded levels, for uncoalesced COO (a nonlinear map must sum duplicates
  first) and where the result would be dense.
- ``F.dropout`` / ``torch.dropout`` / ``nn.Dropout``: dropout of the stored values (an implicit zero dropped is
  still zero); in eval mode the operand itself.
- Comparisons with a scalar (``x > c``, ``torch.eq(x, c)``...): a sparse bool result on the operand's pattern
  where ``op(0, c)`` is False, a dense (counted) result where it is True. Comparisons of two sparse tensors and
  the binary maps with op(0, 0) = 0 (``maximum``, ``minimum``, ``fmax``, ``fmin``, logical and bitwise
  and/or/xor): the union of the two patterns (``union_elementwise``), dense (counted) where op(0, 0) != 0.
- ``torch.where(mask, x, 0)`` with a sparse bool mask: sparse on the mask's pattern; with a dense mask and a
  sparse ``x``: sparse on ``x``'s pattern. ``masked_fill`` of a dense tensor by a sparse mask: dense;
  ``masked_fill(S, mask, 0)``: ``S``'s pattern with the masked entries zeroed.
- ``torch.norm``, ``Tensor.norm``, ``torch.linalg.vector_norm`` / ``norm`` / ``matrix_norm`` (matrix ords
  ``'fro'``, 1, -1, inf, -inf), and ``torch.max`` / ``min`` / ``argmax`` / ``argmin``: reductions over the
  stored entries with the implicit zeros accounted for; dense results, as torch's. ``max(x, dim)`` returns the
  index of the first maximum along ``dim``, an implicit zero included, as torch does.

Everything is vectorized torch on the values and the coordinates (``storage.coordinates``), so autograd (through
the values) comes from torch's own ops.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .. import _stats
from ..formats import named, storage
from ..sparse_tensor import IMPLEMENTATIONS, NoSparseRule, SparseTensor, _describe
from .sparse_api import coalesce

_T = torch.Tensor


def _register(*funcs):
    """``implements`` that leaves alone functions another module registered already (``F.relu``...)."""
    def register(fn):
        for f in funcs:
            if f is not None and f not in IMPLEMENTATIONS:
                IMPLEMENTATIONS[f] = fn
        return fn
    return register


def _padded(x: SparseTensor) -> bool:
    return x._format.padded


# duplicates summed: a nonlinear map needs each entry once (f(a) + f(b) != f(a + b))
_coalesced = coalesce


def _desc(*operands) -> str:
    return _describe(operands, {})


def _no_out(out, name, *operands):
    if out is not None:
        raise NoSparseRule(f"scorch: {name} with out= on a sparse operand ({_desc(*operands)})")


def _entries(x: SparseTensor):
    """``(dims, values)`` of the entries, each once: duplicates summed; padding and positions outside the shape
    dropped (in a padded format a stored zero reads as an implicit one: the same value)."""
    x = _coalesced(x)
    return storage.unpack(x._format, x._shape, x._levels, x._vals)


_linear = storage.linear_index


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


# --- unary maps -------------------------------------------------------------------------------------------------

_DOC_KEEPS = ("{name}: f(0) = 0, so the result keeps the operand's pattern (f on the stored values, duplicates"
              " summed first); where the arguments make f(0) != 0, the dense f(x.to_dense()), counted by"
              " scorch.stats().")
_DOC_DENSE = ("{name}: f(0) != 0, so the result is dense: f(x.to_dense()), warned about once and counted by"
              " scorch.stats() (arguments that make f(0) = 0 keep the pattern).")
_DOC_INPLACE = ("{name} in place: updates the stored values where f(0) = 0 (not for padded formats, uncoalesced COO,"
                " or arguments that make f(0) != 0).")
_DOC_INPLACE_DENSE = ("{name} in place: NotImplementedError, since f(0) != 0 makes the result dense (unless the"
                      " arguments make f(0) = 0: then the stored values are updated).")


def _unary(name: str, func, linear: bool = False, doc: str = _DOC_KEEPS):
    """The implementation of the unary map ``func`` (reported as ``name``) on a sparse input."""
    def apply(x, *args, **kwargs):
        if not isinstance(x, SparseTensor):
            raise NoSparseRule(f"scorch: {name} with a sparse argument ({_desc(*args, *kwargs.values())});"
                                      " only the input may be sparse")
        _no_out(kwargs.get("out"), name, x)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, SparseTensor) or (isinstance(a, torch.Tensor) and a.dim() > 0):
                raise NoSparseRule(f"scorch: {name} of a sparse tensor ({_desc(x)}) with a tensor argument of"
                                          f" shape {tuple(a.shape)}: only scalar arguments are supported")
        # what the map does to an implicit zero, with these arguments (and torch's own argument checks)
        with torch.no_grad():
            probe = torch.zeros(1, dtype=x.dtype, device=x.device)
            at_zero = func(probe, *args, **kwargs)
        inplace = at_zero is probe
        keeps_zero = bool((at_zero == 0).all())
        if inplace:
            why = ("it does not map 0 to 0 here, so its result is dense" if not keeps_zero else
                   "the format has padded levels, whose padding must stay 0" if _padded(x) else
                   "duplicates must be summed first (use x = x.coalesce())"
                   if x._format.keeps_duplicates and not linear else None)
            if why:
                raise NotImplementedError(f"scorch: in-place {name} on a sparse tensor ({_desc(x)}): {why}; use the"
                                          " out-of-place form")
            func(x._vals, *args, **kwargs)
            return x
        if not keeps_zero:
            _stats.record_densify(name, _desc(x))
            return func(x.to_dense(), *args, **kwargs)
        if not linear:
            x = _coalesced(x)
        return x.with_values(func(x._vals, *args, **kwargs))
    apply.__name__ = apply.__qualname__ = getattr(func, "__name__", name.rsplit(".", 1)[-1])
    apply.__doc__ = doc.format(name=name)
    return apply


#: maps that send 0 to 0 (for any arguments, or for the usual ones: each call checks)
ZERO_PRESERVING_TORCH = ("erf", "erfinv", "expm1", "log1p", "sinh", "asinh", "arcsinh", "atanh", "arctanh", "tan",
                         "asin", "arcsin", "atan", "arctan", "trunc", "fix", "floor", "ceil", "round", "frac",
                         "deg2rad", "rad2deg", "nan_to_num", "clamp", "clip", "clamp_min", "clamp_max",
                         "isnan", "isinf", "isposinf", "isneginf", "signbit")
#: torch.nn.functional maps that send 0 to 0: (the function, its in-place form where torch has one)
ZERO_PRESERVING_NN = {
    "leaky_relu": (F.leaky_relu, getattr(F, "leaky_relu_", None)),
    "gelu": (F.gelu, None),
    "silu": (F.silu, None),
    "mish": (F.mish, None),
    "hardswish": (F.hardswish, None),
    "hardtanh": (F.hardtanh, getattr(F, "hardtanh_", None)),
    "relu6": (F.relu6, None),
    "elu": (F.elu, getattr(F, "elu_", None)),
    "selu": (F.selu, getattr(torch, "selu_", None)),
    "celu": (F.celu, getattr(torch, "celu_", None)),
    "rrelu": (F.rrelu, getattr(F, "rrelu_", None)),
    "softshrink": (F.softshrink, None),
    "hardshrink": (F.hardshrink, None),
    "tanhshrink": (F.tanhshrink, None),
    "softsign": (F.softsign, None),
    "threshold": (F.threshold, getattr(F, "threshold_", None)),
}
#: maps with f(0) != 0: their result on a sparse operand is dense (counted by scorch.stats())
DENSIFYING_TORCH = ("sigmoid", "exp", "exp2", "cos", "cosh", "log", "log2", "log10", "reciprocal", "rsqrt", "acos",
                    "arccos", "erfc", "sinc", "logit", "isfinite", "logical_not")
DENSIFYING_NN = {
    "softplus": (F.softplus, None),
    "logsigmoid": (F.logsigmoid, None),
    "hardsigmoid": (F.hardsigmoid, None),
}
_LINEAR = {"deg2rad", "rad2deg"}
# spellings that take the same arguments as the function named first
_ALIASES = {"sigmoid": (torch.special.expit,), "selu": (torch.selu,), "celu": (torch.celu,), "rrelu": (torch.rrelu,),
            "hardshrink": (_T.hardshrink,)}


def _register_map(name, func, spellings, inplace, linear, doc):
    """One implementation for ``func`` and its same-signature ``spellings``, one for the in-place forms."""
    _register(func, *spellings)(_unary(name, func, linear, doc))
    if inplace:
        _register(*inplace)(_unary(name, inplace[0], linear, _DOC_INPLACE if doc is _DOC_KEEPS else _DOC_INPLACE_DENSE))


for _n in ZERO_PRESERVING_TORCH + DENSIFYING_TORCH:
    _register_map(f"torch.{_n}", getattr(torch, _n),
                  [f for f in (getattr(_T, _n, None), getattr(torch.special, _n, None), *_ALIASES.get(_n, ()))
                   if f is not None],
                  [f for f in (getattr(_T, _n + "_", None), getattr(torch, _n + "_", None)) if f is not None],
                  _n in _LINEAR, _DOC_KEEPS if _n in ZERO_PRESERVING_TORCH else _DOC_DENSE)
# pow(x, e): zero-preserving for a scalar e > 0 (each call checks, as for every map here)
_register_map("torch.pow", torch.pow, [_T.pow, _T.__pow__], [_T.pow_, _T.__ipow__], False, _DOC_KEEPS)
for _n, (_f, _inplace) in {**ZERO_PRESERVING_NN, **DENSIFYING_NN}.items():
    _register_map(f"torch.nn.functional.{_n}", _f, _ALIASES.get(_n, ()), [_inplace] if _inplace else [], False,
                  _DOC_KEEPS if _n in ZERO_PRESERVING_NN else _DOC_DENSE)


# --- dropout -----------------------------------------------------------------------------------------------------

def _dropout(x, p, training, inplace, name):
    if not isinstance(x, SparseTensor):
        raise NoSparseRule(f"scorch: {name} with a sparse argument other than the input")
    F.dropout(torch.zeros(0, dtype=x.dtype, device=x.device), p, training)  # torch's checks of p
    if not training:
        return x
    if inplace:
        if x._format.keeps_duplicates:
            raise NotImplementedError(f"scorch: in-place {name} on uncoalesced COO ({_desc(x)}): each entry must be"
                                      " dropped as a whole, so duplicates must be summed first (x.coalesce())")
        torch.dropout_(x._vals, p, True)  # padding is 0 and stays 0
        return x
    x = _coalesced(x)
    return x.with_values(torch.dropout(x._vals, p, True))


@_register(F.dropout)
def dropout(input, p=0.5, training=True, inplace=False):
    """Dropout of the stored entries (an implicit zero dropped is still 0): the operand's pattern, duplicates summed
    first; in eval mode the operand itself; in place on the values with ``inplace=True``."""
    return _dropout(input, p, training, inplace, "torch.nn.functional.dropout")


@_register(torch.dropout)
def torch_dropout(input, p, train):
    """``torch.dropout``: as ``F.dropout``, on the operand's pattern."""
    return _dropout(input, p, train, False, "torch.dropout")


@_register(torch.dropout_)
def torch_dropout_(input, p, train):
    """``torch.dropout_``: ``F.dropout`` in place on the stored values."""
    return _dropout(input, p, train, True, "torch.dropout_")


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
    from .indexing import broadcast_to
    from .shape_ops import _coo, _delinearize
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
        if out is not None or not (isinstance(a, SparseTensor) and isinstance(b, SparseTensor)):
            raise NoSparseRule(f"{name} is sparse for two sparse operands only")
        return union_elementwise(op, name, a, b)
    apply.__name__ = apply.__qualname__ = name.rsplit(".", 1)[-1]
    apply.__doc__ = (f"{name} of two sparse tensors: the union of their patterns where op(0, 0) = 0 (else dense,"
                     " counted); with a dense operand: the dense fallback.")
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


def _kind(v) -> str:
    if isinstance(v, SparseTensor):
        return f"sparse {_desc(v)}"
    if isinstance(v, torch.Tensor):
        return f"dense {tuple(v.shape)}"
    return type(v).__name__ if not isinstance(v, numbers.Number) else f"scalar {v!r}"


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
    raise NoSparseRule(
        f"scorch: {name}(input={_kind(input)}, mask={_kind(mask)}, value={_kind(value)}) is not supported: the sparse"
        " forms are masked_fill(dense, sparse_mask, v) (dense result) and masked_fill(S, mask, 0) (S's pattern); a"
        " nonzero value on a sparse input would fill its implicit zeros (use S.to_dense().masked_fill(...))")


@_register(torch.masked_fill, _T.masked_fill)
def masked_fill(input, mask, value):
    """A dense input with a sparse bool mask: dense, the value at the mask's True entries; a sparse input with
    ``value`` 0 (mask dense or sparse): the input's pattern with the masked entries zeroed."""
    return _masked_fill(input, mask, value, inplace=False)


@_register(_T.masked_fill_)
def masked_fill_(input, mask, value):
    """``masked_fill`` in place: into a dense input by a sparse mask, or zeroing a sparse input's stored values."""
    return _masked_fill(input, mask, value, inplace=True)


# --- norms ----------------------------------------------------------------------------------------------------------

def _reduce_dims(dim, n):
    """``dim`` (None, an int or a sequence; None and () mean all) as a sorted tuple of non-negative dims."""
    if dim is None:
        return tuple(range(n))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({d % n for d in dims})) if dims else tuple(range(n))


def _groups(shape, edims, reduce_dims):
    """Each entry's output position (``gid``), the number of outputs and the group size of a reduction."""
    gid = torch.zeros(edims.shape[1], dtype=torch.int64, device=edims.device)
    groups, size = 1, 1
    for d, n in enumerate(shape):
        if d in reduce_dims:
            size *= n
        else:
            gid = gid * n + edims[d]
            groups *= n
    return gid, groups, size


def _shaped(r, shape, reduce_dims, keepdim):
    return r.reshape([1 if d in reduce_dims else n for d, n in enumerate(shape)] if keepdim else
                     [n for d, n in enumerate(shape) if d not in reduce_dims])


def _safe_root(s, p):
    """``s ** (1 / p)`` with a zero gradient at s == 0 (torch's subgradient of the norm at 0)."""
    pos = s > 0
    return torch.where(pos, torch.where(pos, s, 1) ** (1.0 / p), 0)


def _vector_norm(x: SparseTensor, ord, reduce_dims, keepdim, dtype):
    edims, vals = _entries(x)
    if dtype is not None:
        vals = vals.to(dtype)
    a = vals.abs()
    gid, groups, size = _groups(x._shape, edims, reduce_dims)
    zeros = torch.zeros(groups, dtype=a.dtype, device=a.device)
    ord = float(ord)
    if ord == math.inf:
        r = zeros.scatter_reduce(0, gid, a, "amax", include_self=True)  # |v| >= 0: the implicit zeros change nothing
    elif ord == -math.inf:
        r = torch.full_like(zeros, math.inf).scatter_reduce(0, gid, a, "amin", include_self=True)
        count = torch.bincount(gid, minlength=groups)
        r = torch.where(count < size, 0, r)  # an implicit zero in the group
    elif ord == 0:
        r = zeros.index_add(0, gid, (a != 0).to(a.dtype) + 0 * a)
    elif ord == 1:
        r = zeros.index_add(0, gid, a)
    elif ord > 0:
        r = _safe_root(zeros.index_add(0, gid, a * a if ord == 2 else a ** ord), ord)
    else:  # negative: |0| ** ord is inf, so an implicit zero makes the norm 0
        count = torch.bincount(gid, minlength=groups)
        r = zeros.index_add(0, gid, a ** ord) ** (1.0 / ord)
        r = torch.where(count < size, 0, r)
    return _shaped(r, x._shape, reduce_dims, keepdim)


def _probe_shape(x):
    return (1,) * x.dim()


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


# --- max, min, argmax, argmin ----------------------------------------------------------------------------------------

def _select(x: SparseTensor, dim, largest: bool):
    """The first extreme of each group along ``dim`` (or of the flattened tensor where ``dim`` is None), implicit
    zeros included: ``(values, indices, reduce_dims)``, values differentiable (the gradient goes to the chosen entry,
    as torch's ``max(x, dim)`` sends it)."""
    edims, v = _entries(x)
    shape = x._shape
    if dim is None:
        rdims = tuple(range(x.dim()))
        coord, n = _linear(edims, shape), x.numel()
    else:
        rdims = (dim % x.dim(),)
        coord, n = edims[rdims[0]], shape[rdims[0]]
    gid, groups, _ = _groups(shape, edims, rdims)
    vd = v.detach()
    count = torch.bincount(gid, minlength=groups)
    implicit = count < n
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    best = torch.zeros(groups, dtype=v.dtype, device=v.device)
    best = best.scatter_reduce(0, gid, vd, "amax" if largest else "amin", include_self=False)
    beyond = (best < zero) if largest else (best > zero)  # an implicit zero beats the stored extreme
    best = torch.where(implicit & beyond, zero, best)  # (a group with nothing stored keeps 0 from the start)
    if v.is_floating_point():
        nan = torch.isnan(vd)
        has_nan = torch.zeros(groups, dtype=torch.bool, device=v.device)
        has_nan = has_nan.index_put((gid[nan],), torch.ones((), dtype=torch.bool, device=v.device))
        best = torch.where(has_nan, torch.nan, best)
        hit = torch.where(has_nan[gid], nan, vd == best[gid])
    else:
        has_nan = torch.zeros(groups, dtype=torch.bool, device=v.device)
        hit = vd == best[gid]
    # the first stored position holding the extreme...
    first = torch.full((groups,), n, dtype=torch.int64, device=v.device)
    first = first.scatter_reduce(0, gid[hit], coord[hit], "amin", include_self=True)
    # ... and the first implicit zero: in a group sorted by coordinate, the k-th stored entry sits at k until the
    # first gap, so the number of entries sitting at their rank is the first missing coordinate
    order = torch.argsort(gid * max(n, 1) + coord)
    g, c = gid[order], coord[order]
    start = torch.cumsum(count, 0) - count
    rank = torch.arange(g.numel(), device=v.device) - start[g]
    gap = torch.zeros(groups, dtype=torch.int64, device=v.device).index_add(0, g, (c == rank).long())
    zero_wins = implicit & (best == 0) & ~has_nan
    index = torch.minimum(first, torch.where(zero_wins, gap, n))
    # the chosen value: from its stored entry (differentiable), or an implicit 0
    entry = torch.full((groups,), v.numel(), dtype=torch.int64, device=v.device)
    at = coord == index[gid]
    entry = entry.scatter_reduce(0, gid[at], torch.arange(v.numel(), device=v.device)[at], "amin", include_self=True)
    values = torch.cat([v, zero.reshape(1)])[entry]
    return values, index, rdims


def _dim_arg(args, kwargs):
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    return dim, keepdim


def _extremum(largest: bool):
    name = "max" if largest else "min"
    torch_fn = torch.max if largest else torch.min
    result_type = torch.return_types.max if largest else torch.return_types.min

    def apply(x, *args, **kwargs):
        """max / min: over everything (a 0-d tensor; the gradient shared by the tied positions), or along ``dim``
        (values and the index of the first extreme, an implicit zero included, as torch's); dense."""
        _no_out(kwargs.pop("out", None), f"torch.{name}", x)
        if args and isinstance(args[0], torch.Tensor) or isinstance(kwargs.get("other"), torch.Tensor) or (
                not isinstance(x, SparseTensor)):
            other = args[0] if args else kwargs.get("other")
            raise NoSparseRule(f"scorch: torch.{name}({_kind(x)}, {_kind(other)}): the elementwise {name} of"
                                      " a sparse tensor is not supported")
        dim, keepdim = _dim_arg(args, kwargs)
        probe = torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device)
        if dim is None:
            torch_fn(probe)  # torch's dtype checks
            if x.numel() == 0:
                return torch_fn(x.to_dense())  # torch's error for an empty tensor
            return _all_extreme(x, largest)
        torch_fn(probe, dim, keepdim)  # torch's checks of dim
        if x.numel() == 0:
            return torch_fn(x.to_dense(), dim, keepdim)
        values, index, rdims = _select(x, dim, largest)
        return result_type((_shaped(values, x._shape, rdims, keepdim), _shaped(index, x._shape, rdims, keepdim)))
    apply.__name__ = apply.__qualname__ = name
    return apply


def _all_extreme(x: SparseTensor, largest: bool):
    """``torch.max(x)``: the extreme over every position; the gradient is shared by all the positions holding it,
    implicit zeros included (as torch shares it)."""
    _, v = _entries(x)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    implicit = x.numel() - v.numel()
    vd = v.detach()
    if v.numel():
        best = vd.max() if largest else vd.min()
        if implicit and ((best < zero) if largest else (best > zero)):
            best = zero
    else:
        best = zero
    if not v.is_floating_point() or not v.requires_grad:
        return best.clone()
    ties = (vd == best).to(v.dtype)
    share = ties / (ties.sum() + (implicit if bool(best == 0) else 0)).clamp(min=1)
    picked = (v * share).sum()
    return best + (picked - picked.detach())  # the exact value, the gradient spread over the ties


def _arg_extremum(largest: bool):
    name = "argmax" if largest else "argmin"
    torch_fn = torch.argmax if largest else torch.argmin

    def apply(x, dim=None, keepdim=False, *, out=None):
        """argmax / argmin: the index of the first extreme (flattened, or along ``dim``), implicit zeros included."""
        _no_out(out, f"torch.{name}", x)
        torch_fn(torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device), dim, keepdim)
        if x.numel() == 0:
            return torch_fn(x.to_dense(), dim, keepdim)
        _, index, rdims = _select(x, dim, largest)
        if dim is None:
            return index.reshape((1,) * x.dim()) if keepdim else index.reshape(())
        return _shaped(index, x._shape, rdims, keepdim)
    apply.__name__ = apply.__qualname__ = name
    return apply


_register(torch.max, _T.max)(_extremum(True))
_register(torch.min, _T.min)(_extremum(False))
_register(torch.argmax, _T.argmax)(_arg_extremum(True))
_register(torch.argmin, _T.argmin)(_arg_extremum(False))
