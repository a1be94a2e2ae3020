"""The rule table: what the upper layers provide for the lower ones to call, registered next to each rule.

The layers, bottom to top: ``loopir`` and ``formats``; ``compiler``; ``sparse_tensor``; ``engine`` (tensors meet
compiled plans, and every format conversion); ``_autograd``, ``deferred``, ``fusion`` and ``interop``; ``ops``,
``nn``, ``sparse``. A module imports only from its own layer and those below. Where a lower layer must hand a call
to an upper one (a differentiable einsum to autograd, a lazy value to deferral), it looks the rule up here, and the
upper layer registers it when it is imported, as ``jax.experimental.sparse`` fills its rule tables next to each
rule. This module imports nothing of scorch.

Rules, by owner:

- ``_autograd``: ``differentiable_einsum(equation, operands, format)`` and ``differentiable_run(inputs, out, ops,
  **options)``, the einsum and the generalized assignment recording a graph; ``differentiable_convert(x, convert)``,
  a format conversion recording one; ``attach_wrapper(x)``, a SparseTensor made a node of torch's graph over its
  values (``_traceable``: where torch reads the wrapper itself, its gradient reaches the values);
  ``adopt_wrapper(x)``, new values for a SparseTensor whose wrapper has a history in torch's graph they lack.
- ``deferred``: ``lazy_type``, the type of a lazy (deferred) value; ``compute_lazy(values)``, computing every lazy
  value among ``values``; ``substitute_lazy(equation, operands)``, an einsum over lazy operands as one expression
  (``(equation, operands, format)``) or None.
- ``fusion``: ``fused_product(equation, operands)``, the product of lazy attention probabilities by a dense matrix
  as one kernel, or None; ``lazy_epilogue(func, args, kwargs)``, an elementwise op kept lazy under
  ``scorch.compile``, or None.
- ``engine``: ``to_dense(format, shape, levels, values)``, ``asformat(x, format, **options)`` and ``to_torch(x)``,
  for ``SparseTensor``'s methods.
- ``interop``: ``to_scipy(x)``, for ``SparseTensor.to_scipy``.
- ``ops``: ``product_operator(s, other, left)``, ``SparseTensor.__matmul__`` (``left``) and ``__rmatmul__``.
- ``dynamo``: ``traced_op(func, types, args, kwargs)``, the graph's call for an op with a sparse operand while
  ``torch.compile`` traces (a custom op over the operands' arrays); ``traced_tensor(layout, compressed, plain,
  values, size, dtype, requires_grad)``, a compressed sparse tensor made while ``torch.compile`` traces (one call
  in the graph).
"""
from __future__ import annotations


class LazyNever:
    """The lazy type before ``deferred`` registers its own: no value is of it."""


class Rules:
    __slots__ = ("differentiable_einsum", "differentiable_run", "differentiable_convert", "lazy_type",
                 "compute_lazy", "substitute_lazy", "fused_product", "lazy_epilogue", "to_dense", "asformat",
                 "to_torch", "traced_op", "traced_tensor", "coalesce_leaf", "attach_wrapper",
                 "adopt_wrapper", "product_operator", "to_scipy")

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, None)
        self.lazy_type = LazyNever

    def register(self, **rules):
        """Register rules by name (each name once: a second registration would hide the first owner's)."""
        for name, fn in rules.items():
            if name not in self.__slots__:
                raise KeyError(f"scorch.rules: no rule named {name!r} (the rules: {', '.join(self.__slots__)})")
            current = getattr(self, name)
            if current not in (None, LazyNever, fn) and getattr(current, "__module__", None) != getattr(
                    fn, "__module__", None):  # (the owner's module imported again: its rule replaces its own)
                raise RuntimeError(f"scorch.rules: {name!r} is registered already ({current!r})")
            setattr(self, name, fn)


RULES = Rules()
