"""Torch ops on sparse operands, each family in its own module, expressed in index notation and run by the
compiler (``scorch.compiler.dispatch``). Importing this package registers them with ``SparseTensor``."""
from . import activation, elementwise, foreach, indexing, linalg, pattern, reduce, shape, shape_ops, sparse_api  # noqa: F401,E501
