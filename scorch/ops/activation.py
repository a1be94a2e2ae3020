"""Activations and the other unary maps (``erf``, rounding...), and dropout, on SparseTensors, with torch's
semantics.

- Unary maps: each call first runs the torch function on a one-element zero tensor of the operand's dtype with
  the same arguments. Where that gives 0 the map is zero-preserving for these arguments (``F.leaky_relu``,
  ``F.gelu``, ``F.hardtanh(x, -1, 1)``...) and the result keeps the operand's pattern (shared index arrays, the
  map applied to the stored values; padding and positions outside the shape stay 0 since f(0) = 0). Otherwise
  (``torch.sigmoid``, ``torch.exp``, ``F.hardtanh(x, 0.5, 1)``...) the result is dense, computed by torch on
  ``x.to_dense()``, and the densification is counted and warned about once per op (``scorch._stats``).
  ``inplace=True`` (and the ``Tensor.*_`` methods) update the stored values in place; that is refused for
  formats with padded levels, for uncoalesced COO (a nonlinear map must sum duplicates first) and where the
  result would be dense.
- ``F.dropout`` / ``torch.dropout`` / ``nn.Dropout``: dropout of the stored values (an implicit zero dropped is
  still zero); in eval mode the operand itself.

Both are torch on the stored values, so autograd (through the values) comes from torch's own ops. Comparisons,
``where`` and ``masked_fill`` are in ``compare``, norms in ``norms``, max / min in ``extrema``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _stats
from ..sparse_tensor import NoSparseRule, SparseTensor
from ..unary_maps import MAPS
from .entries import _coalesced, _desc, _no_out, _register, mapped_values


def _padded(x: SparseTensor) -> bool:
    return x._format.padded


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
        return x.with_values(mapped_values(x, lambda v: func(v, *args, **kwargs)))
    apply.__name__ = apply.__qualname__ = getattr(func, "__name__", name.rsplit(".", 1)[-1])
    apply.__doc__ = doc.format(name=name)
    return apply


def _register_map(m):
    """One implementation for the map ``m``'s spellings, one for its in-place forms."""
    doc = _DOC_KEEPS if m.zero else _DOC_DENSE
    _register(*m.funcs)(_unary(m.qualname, m.funcs[0], m.linear, doc))
    if m.inplace:
        _register(*m.inplace)(_unary(m.qualname, m.inplace[0], m.linear, _DOC_INPLACE if m.zero else
                                     _DOC_INPLACE_DENSE))


# the maps whose calls are checked (the others, without arguments, are ``elementwise``'s)
for _m in MAPS:
    if _m.probe:
        _register_map(_m)


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
