"""Torch ops on sparse operands, each family in its own module, expressed in index notation and run by the
compiler (``scorch.engine``). Importing this package registers them with ``SparseTensor``.

Under ``import scorch as torch`` this package is also ``torch.ops``: names it does not define (``aten``,
``prim``, ``load_library``...) are ``torch.ops``'s own."""
import functools as _functools
import inspect as _inspect

import torch as _torch

from . import (activation, attention, autograd_api, compare, conv, elementwise, embedding, extrema,  # noqa: F401
               foreach, indexing, linalg, mha, norms, pattern, reduce, shape, shape_ops, sparse_api)
from .._forward import forward as _forward
from ..sparse_tensor import IMPLEMENTATIONS as _IMPLEMENTATIONS, SparseTensor as _SparseTensor
from ..sparse_tensor import _INPLACE_DUNDERS, dense_fallback as _dense_fallback


def _takes_out(fn) -> bool:
    try:
        return "out" in _inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True  # (a builtin: left as it is)


def _with_out(fn, func):
    """``fn`` (an implementation without ``out=``) taking torch's ``out=``: the result written into it (a dense
    tensor, or a tuple of them for a tuple result) by ``linalg.into``, as the products' ``out=`` is; a sparse
    ``out`` is refused by ``dense_fallback`` (a sparse tensor cannot be written as a dense result in place)."""
    name = getattr(func, "__name__", "op")

    @_functools.wraps(fn)
    def call(*args, out=None, **kwargs):
        if out is None:
            return fn(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(type(o) is _SparseTensor for o in outs):
            return _dense_fallback(func, args, {**kwargs, "out": out})
        r = fn(*args, **kwargs)
        if isinstance(out, (tuple, list)) and isinstance(r, tuple) and len(out) == len(r):
            return type(r)(linalg.into(o, x, name) for o, x in zip(out, r))
        return linalg.into(out, r, name)
    return call


#: torch's view ops whose results a SparseTensor gives as copies where they do not share its values
_VIEWS = (_torch.Tensor.__getitem__, _torch.Tensor.select, _torch.select, _torch.Tensor.narrow, _torch.narrow,
          _torch.Tensor.unbind, _torch.unbind, _torch.Tensor.__iter__, _torch.Tensor.view, _torch.Tensor.view_as,
          _torch.Tensor.reshape, _torch.reshape, _torch.Tensor.reshape_as, _torch.Tensor.flatten, _torch.flatten,
          _torch.Tensor.unflatten, _torch.unflatten, _torch.Tensor.squeeze, _torch.squeeze, _torch.Tensor.unsqueeze,
          _torch.unsqueeze, _torch.Tensor.expand, _torch.Tensor.expand_as, _torch.split, _torch.Tensor.split,
          _torch.chunk, _torch.Tensor.chunk, _torch.tensor_split, _torch.Tensor.tensor_split)


def _basic_index(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice)) for k in keys)


def _marking_copies(fn, func):
    """``fn`` (a view op's implementation) marking each SparseTensor result that does not share the input's values:
    a copy, where torch's dense op gives a view, so an in-place op on it would not reach the input."""
    name = getattr(func, "__name__", "op")

    @_functools.wraps(fn)
    def call(x, *args, **kwargs):
        r = fn(x, *args, **kwargs)
        if type(x) is _SparseTensor and (func is not _torch.Tensor.__getitem__ or _basic_index(args[0])):
            shared = x._vals.untyped_storage().data_ptr()
            for y in (r if isinstance(r, (tuple, list)) else (r,)):
                if type(y) is _SparseTensor and y._vals.untyped_storage().data_ptr() != shared:
                    y.__dict__["_copy_of"] = name
        return r
    return call


def _refusing_copies(fn, func):
    """``fn`` (an in-place op's implementation) refusing a SparseTensor marked by ``_marking_copies``: the change
    would land in the copy only (``S[1].zero_()`` left ``S`` as it was, silently)."""
    name = getattr(func, "__name__", "op")

    @_functools.wraps(fn)
    def call(x, *args, **kwargs):
        view = x.__dict__.get("_copy_of") if type(x) is _SparseTensor else None
        if view is not None:
            raise NotImplementedError(
                f"scorch: in-place {name} on the result of a SparseTensor's {view}: that result is a copy of the "
                "entries (sparse indexing and reshaping copy where dense torch gives a view), so the change would "
                "not reach the tensor it came from. Change that tensor itself (its values(), or a masked op on it),"
                " or .clone() the result first to change only the copy")
        return fn(x, *args, **kwargs)
    return call


for _f, _fn in list(_IMPLEMENTATIONS.items()):
    _name = getattr(_f, "__name__", "")
    if _f in _VIEWS:
        _IMPLEMENTATIONS[_f] = _marking_copies(_fn, _f)
    elif getattr(_torch.Tensor, _name, None) is _f and (
            (_name.endswith("_") and not _name.endswith("__")) or _name in _INPLACE_DUNDERS):
        _IMPLEMENTATIONS[_f] = _refusing_copies(_fn, _f)

# torch functions (not methods) take out=: an implementation that has no out= of its own gets it here (torch.sum,
# torch.add, torch.bmm... with out= raised a TypeError)
for _f, _fn in list(_IMPLEMENTATIONS.items()):
    if getattr(_torch.Tensor, getattr(_f, "__name__", ""), None) is not _f and not _takes_out(_fn):
        _IMPLEMENTATIONS[_f] = _with_out(_fn, _f)

__getattr__, __dir__ = _forward(globals(), _torch.ops)
