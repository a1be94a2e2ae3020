"""Torch ops on sparse operands, each family in its own module, expressed in index notation and run by the
compiler (``scorch.engine``). Importing this package registers them with ``SparseTensor``.

Under ``import scorch as torch`` this package is also ``torch.ops``: names it does not define (``aten``,
``prim``, ``load_library``...) are ``torch.ops``'s own."""
import torch as _torch

from . import activation, elementwise, foreach, indexing, linalg, pattern, reduce, shape, shape_ops, sparse_api  # noqa: F401,E501
from .._forward import forward as _forward

__getattr__, __dir__ = _forward(globals(), _torch.ops)
