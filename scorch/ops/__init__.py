"""Torch ops on sparse operands, each family in its own module, expressed in index notation and run by the
compiler (``scorch.engine``). Importing this package registers them with ``SparseTensor``.

Under ``import scorch as torch`` this package is also ``torch.ops``: names it does not define (``aten``,
``prim``, ``load_library``...) are ``torch.ops``'s own."""
import torch as _torch

from . import (activation, compare, elementwise, extrema, foreach, indexing, linalg, norms, pattern, reduce,  # noqa: F401
               shape, shape_ops, sparse_api)
from .._forward import forward as _forward

__getattr__, __dir__ = _forward(globals(), _torch.ops)
