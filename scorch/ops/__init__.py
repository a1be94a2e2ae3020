"""Torch ops on sparse operands, each family in its own module, expressed in index notation and run by the
compiler (``scorch.engine``). Importing this package registers them with ``SparseTensor``.

Under ``import scorch as torch`` this package is also ``torch.ops``: names it does not define (``aten``,
``prim``, ``load_library``...) are ``torch.ops``'s own."""
import functools as _functools
import inspect as _inspect

import torch as _torch

from . import (activation, autograd_api, compare, elementwise, extrema, foreach, indexing, linalg, norms, pattern, reduce,  # noqa: F401
               shape, shape_ops, sparse_api)
from .._forward import forward as _forward
from ..sparse_tensor import IMPLEMENTATIONS as _IMPLEMENTATIONS, SparseTensor as _SparseTensor
from ..sparse_tensor import dense_fallback as _dense_fallback


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


# torch functions (not methods) take out=: an implementation that has no out= of its own gets it here (torch.sum,
# torch.add, torch.bmm... with out= raised a TypeError)
for _f, _fn in list(_IMPLEMENTATIONS.items()):
    if getattr(_torch.Tensor, getattr(_f, "__name__", ""), None) is not _f and not _takes_out(_fn):
        _IMPLEMENTATIONS[_f] = _with_out(_fn, _f)

__getattr__, __dir__ = _forward(globals(), _torch.ops)
