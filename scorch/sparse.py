"""``scorch.sparse``: torch.sparse's names, plus scorch's storage checks."""
import contextlib

import torch.sparse as _tsparse

from . import _forward
from .sparse_tensor import _checking


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
