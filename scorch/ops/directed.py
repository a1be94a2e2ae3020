"""Directives a layer carries (``scorch.schedule``'s ``.schedule(order=..., parallel=...)``): the products of a
sparse parameter, or of a module's forward, compiled with the user's schedule instead of the compiler's.

Two places hold them: a sparse tensor's ``__dict__`` (``attach``: the parameter ``apply`` installed; dropped by
``detach``, ``state_dict`` and pickling, which rebuild the tensor from its arrays) and a per-thread stack of the
modules whose forward is running (``entered``/``left``, pushed by forward hooks). ``of(operands)`` is what the
product ops (``F.linear``, ``torch.einsum``, ``matmul``/``@``/``mm``/``mv``/``bmm``) ask: an operand's own
directives first, else the innermost running module's. The ops pass them on as ``schedule=``, so they are
checked by the same code as ``scorch.einsum(..., schedule=...)`` and raise its errors.
"""
from __future__ import annotations

import threading

import torch

from ..compiler.schedule import Directives
from ..sparse_tensor import SparseTensor

KEY = "_directives"


class _Running(threading.local):
    stack = ()


_RUNNING = _Running()


def attach(t: SparseTensor, directives: Directives) -> None:
    """Let every product ``t`` is an operand of compile with ``directives``."""
    t.__dict__[KEY] = directives


def remove(t) -> None:
    if isinstance(t, SparseTensor):
        t.__dict__.pop(KEY, None)


def attached(t):
    """The directives attached to ``t``, or None."""
    return t.__dict__.get(KEY) if type(t) is SparseTensor else None


def entered(directives: Directives) -> None:
    """A module with directives starts its forward: its products take them (unless an operand has its own)."""
    _RUNNING.stack = _RUNNING.stack + (directives,)


def left() -> None:
    _RUNNING.stack = _RUNNING.stack[:-1]


def of(operands):
    """The directives a product of ``operands`` compiles with: those attached to a sparse operand (``ValueError``
    where two operands carry different ones: which to follow is not ours to pick), else the innermost running
    module's, else None (the compiler's schedule). None while Dynamo traces: directives are not carried into a
    compiled graph (docs/training.md), and a traced tensor's ``__dict__`` is no place to look (Dynamo fails on it)."""
    if torch.compiler.is_compiling():
        return None
    found = None
    for x in operands:
        d = attached(x)
        if d is not None:
            if found is not None and d != found:
                raise ValueError(f"scorch: the operands of one product carry different schedules ({describe(found)};"
                                 f" {describe(d)}): schedule only one of them")
            found = d
    if found is None and _RUNNING.stack:
        return _RUNNING.stack[-1]
    return found


def describe(d: Directives) -> str:
    """``d``'s fields that are set, as ``order oib, parallel o``."""
    parts = []
    if d.order is not None:
        parts.append(f"order {''.join(d.order)}")
    if d.parallel is not None:
        parts.append(f"parallel {d.parallel}")
    if not d.transpose:
        parts.append("transpose=False")
    if d.workspace is not None:
        parts.append(f"workspace {d.workspace}")
    if d.temporary is not None:
        parts.append(f"temporary {getattr(d.temporary, 'name', None) or d.temporary}")
    return ", ".join(parts) or "compiler's choice"
