"""Ops on a fixed pattern: in-place arithmetic and ``*_like`` constructors, as optimizers use them.

A SparseTensor's pattern (its index arrays) is fixed; in-place ops update its stored values. Every sparse
operand of such an op must have the same pattern (the gradient of a sparse parameter, its optimizer state
made by ``zeros_like``, and the parameter itself share their index arrays, so the check is an identity test
in the common case). Scalars apply to the stored values: ``S.add_(eps)`` adds ``eps`` to each stored value,
which is what ``torch.optim.Adam``'s ``denom.add_(eps)`` needs; an out-of-place ``S + c`` (c != 0) stays an
error, since its result would be dense.

``torch.optim`` SGD (with momentum and nesterov), Adam and AdamW run on SparseTensor parameters through these
ops and update the values in place; ``load_state_dict`` copies into a sparse parameter with ``copy_``.
"""
from __future__ import annotations

import numbers

import torch

from ..sparse_tensor import SparseTensor, implements


def same_pattern(a: SparseTensor, b: SparseTensor) -> bool:
    if a._levels is b._levels:
        return True
    if a._format != b._format or a._shape != b._shape or a._vals.shape != b._vals.shape:
        return False
    for x, y in zip(a._levels, b._levels):
        for p, q in ((x.pos, y.pos), (x.crd, y.crd)):
            if p is not q and (p is None or q is None or not torch.equal(p, q)):
                return False
    return True


def _values(x, like: SparseTensor, name: str):
    """The operand's values on ``like``'s pattern: a number or 0-d tensor stays as it is."""
    if isinstance(x, SparseTensor):
        if not same_pattern(x, like):
            raise ValueError(f"scorch: {name} of SparseTensors with different patterns (in-place ops keep the"
                             " pattern; use out-of-place ops, whose result pattern is the union)")
        return x._vals
    if isinstance(x, numbers.Number) or (isinstance(x, torch.Tensor) and x.dim() == 0):
        return x
    raise NotImplementedError(f"scorch: {name} of a SparseTensor with a dense tensor of shape {tuple(x.shape)}"
                              " (in place, the result could not keep the sparse pattern)")


def _inplace(method):
    name = method.__name__

    def op(self, *args, **kwargs):
        if not isinstance(self, SparseTensor):
            raise NotImplementedError(f"scorch: {name} into a dense tensor from a SparseTensor; use to_dense()")
        if self._format.padded and name != "zero_":
            raise NotImplementedError(f"scorch: {name} on format {self._format.name or self._format}: its padding"
                                      " must stay zero, which in-place arithmetic does not keep yet")
        args = [_values(a, self, name) if isinstance(a, torch.Tensor) or isinstance(a, numbers.Number) else a
                for a in args]
        kwargs = {k: _values(v, self, name) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        getattr(self._vals, name)(*args, **kwargs)
        return self
    op.__name__ = name
    op.__doc__ = (f"``{name}`` on the stored values, in place: the pattern is fixed, sparse operands must share"
                  " it, scalars apply to each stored value.")
    return implements(method)(op)


for _m in (torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.addcdiv_,
           torch.Tensor.addcmul_, torch.Tensor.lerp_, torch.Tensor.clamp_, torch.Tensor.neg_, torch.Tensor.sqrt_,
           torch.Tensor.abs_, torch.Tensor.relu_, torch.Tensor.__iadd__, torch.Tensor.__isub__,
           torch.Tensor.__imul__, torch.Tensor.__itruediv__, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_,
           torch.Tensor.sign_, torch.Tensor.zero_):
    _inplace(_m)


@implements(torch.Tensor.copy_)
def copy_(self, src, non_blocking=False):
    """Values from ``src``; a SparseTensor of another pattern (``load_state_dict``) replaces the pattern."""
    if not isinstance(self, SparseTensor):
        raise NotImplementedError("scorch: copying a SparseTensor into a dense tensor; use to_dense()")
    if isinstance(src, SparseTensor) and not same_pattern(src, self):
        if src._shape != self._shape:
            raise ValueError(f"copy_: shapes {tuple(src._shape)} and {tuple(self._shape)} differ")
        from ..interop import asformat
        src = asformat(src.to(self._vals.device), self._format)  # the destination keeps its format
        grad = self._vals.requires_grad
        self._format, self._levels = src._format, tuple(st.map(torch.clone) for st in src._levels)
        self._index_dtype = src._index_dtype
        self._vals = src._vals.detach().to(self._vals.dtype, copy=True).requires_grad_(grad)
        self.__dict__.pop("_conversions", None)  # conversions kept for the old pattern
        return self
    self._vals.copy_(_values(src, self, "copy_"), non_blocking)
    return self


def _like(fill):
    def like(x, dtype=None, *, layout=None, device=None, requires_grad=False, memory_format=None, **kw):
        v = x._vals
        vals = fill(v, dtype) if device is None else fill(v, dtype).to(device)
        s = SparseTensor(x._format, x._shape, x._levels if device is None else
                         tuple(st.map(lambda a: a.to(device)) for st in x._levels), vals, check=False)
        return s.requires_grad_() if requires_grad else s
    like.__doc__ = "The same pattern and format (shared index arrays), zero values: optimizer state for a sparse parameter."
    return like


implements(torch.zeros_like)(_like(lambda v, dt: torch.zeros_like(v, dtype=dt)))
implements(torch.empty_like)(_like(lambda v, dt: torch.zeros_like(v, dtype=dt)))  # zeros: padding must stay 0


@implements(torch.Tensor.conj, torch.conj, torch.Tensor.resolve_conj, torch.resolve_conj)
def conj(x):
    """Real values: the tensor itself."""
    if x.is_complex():
        raise NotImplementedError("scorch: complex SparseTensors are not supported")
    return x
