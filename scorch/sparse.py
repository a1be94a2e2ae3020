"""``scorch.sparse``: torch.sparse's names, plus scorch's storage checks.

The functions of torch.sparse that take sparse operands (``mm``, ``addmm``, ``sampled_addmm``, ``softmax``,
``log_softmax``, ``sum``) first view torch's own sparse tensors (``x.to_sparse()``, ``to_sparse_csr()``...)
as SparseTensors, zero-copy, so they run through scorch too. A torch sparse tensor that requires grad is
left to torch: its gradient belongs to it, not to a view.
"""
import contextlib
import functools

import torch as _torch
import torch.sparse as _tsparse

from . import _forward
from .sparse_tensor import IMPLEMENTATIONS, SparseTensor, _checking

_view = _forward.view_torch_layout


def routed(fn):
    """``fn`` with torch sparse operands viewed as SparseTensors. With a SparseTensor first, scorch's
    implementation is called as torch's operator would call it (``SparseTensor.__torch_function__``), without
    the operator's own argument parsing and dispatch (several microseconds a call), unless a
    ``TorchFunctionMode`` is active (it must see the call)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _torch.compiler.is_compiling():  # torch.compile traces: torch's function, as the graph's call
            return fn(*args, **kwargs)
        args = [_view(a) for a in args]
        kwargs = {k: _view(v) for k, v in kwargs.items()} if kwargs else kwargs
        if args and type(args[0]) is SparseTensor and fn in IMPLEMENTATIONS and \
                not _torch._C._is_torch_function_mode_enabled():
            types = tuple({type(a) for a in (*args, *kwargs.values()) if isinstance(a, _torch.Tensor)})
            return SparseTensor.__torch_function__(fn, types, tuple(args), kwargs)
        return fn(*args, **kwargs)
    return call


mm = routed(_tsparse.mm)
addmm = routed(_tsparse.addmm)
sampled_addmm = routed(_tsparse.sampled_addmm)
softmax = routed(_tsparse.softmax)
log_softmax = routed(_tsparse.log_softmax)
sum = routed(_tsparse.sum)


@contextlib.contextmanager
def check_invariants():
    """Within this context, every SparseTensor built is validated (sorted, in-range coordinates, lengths);
    a violation raises ``ValueError`` naming the level and position."""
    _checking.depth += 1
    try:
        yield
    finally:
        _checking.depth -= 1


__getattr__, __dir__ = _forward.forward(globals(), _tsparse)
