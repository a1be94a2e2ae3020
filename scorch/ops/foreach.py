"""``torch._foreach_*`` (the list ops optimizers and ``clip_grad_norm_`` use with ``foreach=True``) on lists holding
SparseTensors: the op applied element by element through the Tensor method of the same name (``_foreach_mul_``
-> ``Tensor.mul_``), so each sparse element gets its own rule (an in-place update of its stored values, or a
clear error) and each dense element torch's method. A list argument of the first list's length is taken element
by element (tensors, scalars), anything else is passed to every element. Foreach ops with no Tensor method of
their name run on the dense form (the fallback; an in-place one raises). The fused optimizer steps
(``torch._fused_adam_``..., ``fused=True``) run on the stored values where every SparseTensor of a parameter's
state has the parameter's pattern."""
from __future__ import annotations

import torch

from ..sparse_tensor import NoSparseRule, SparseTensor, implements, padding_of
from .pattern import same_pattern


def _into_first(op):
    """``op(a, b, out=a)``: the in-place foreach ops with no Tensor method (``_foreach_maximum_``, Adamax's), for a
    sparse ``a`` only where ``b`` has its pattern (else the foreach op's own refusal: it would write ``a``)."""
    def method(a, b):
        if isinstance(a, SparseTensor) and not (isinstance(b, SparseTensor) and same_pattern(a, b)):
            raise NoSparseRule(f"torch.{op.__name__} into a sparse tensor with an operand of another pattern")
        return op(a, b, out=a)
    return method


_NO_METHOD = {"_foreach_maximum_": _into_first(torch.maximum), "_foreach_minimum_": _into_first(torch.minimum)}


def _per_element(name: str):
    method = _NO_METHOD.get(name) or getattr(torch.Tensor, name.removeprefix("_foreach_"), None)
    keyword_value = name.removeprefix("_foreach_").rstrip("_") in ("addcmul", "addcdiv")

    def apply(tensors, *args, **kwargs):
        if method is None or not isinstance(tensors, (list, tuple)):
            raise NoSparseRule(f"torch.{name} has no Tensor method to apply element by element")
        n = len(tensors)

        def at(a, i):
            return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a
        if keyword_value and len(args) == 3:  # _foreach_addcmul_(x, t1, t2, scalars): Tensor's value= is a keyword
            args, kwargs = args[:2], {**kwargs, "value": args[2]}
        out = [method(t, *(at(a, i) for a in args), **{k: at(v, i) for k, v in kwargs.items()})
               for i, t in enumerate(tensors)]
        return None if name.endswith("_") else out
    apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = (f"``torch.{name}``: ``Tensor.{name.removeprefix('_foreach_')}`` on each element (sparse elements"
                     " by their own rule).")
    return apply


for _name in dir(torch):
    if _name.startswith("_foreach_") and callable(getattr(torch, _name)):
        implements(getattr(torch, _name))(_per_element(_name))


def _fused_step(name: str):
    op = getattr(torch, name)

    def apply(params, *args, **kwargs):
        """The fused step on the stored values: each SparseTensor of the lists (gradients, optimizer state) must have
        the pattern of the parameter at its position; a padded format's padding stays 0."""
        def values(arg):
            if not isinstance(arg, (list, tuple)) or len(arg) != len(params):
                return arg
            out = []
            for p, t in zip(params, arg):
                if type(t) is SparseTensor:
                    if not (type(p) is SparseTensor and same_pattern(t, p)):
                        raise NoSparseRule(f"torch.{name} with a sparse tensor of another pattern than its parameter")
                    t = t._vals
                elif type(p) is SparseTensor and isinstance(t, torch.Tensor) and t.shape == p._shape:
                    raise NoSparseRule(f"torch.{name} with a dense tensor beside a sparse parameter")
                out.append(t)
            return out
        pads = [(p._vals, padding_of(p)) for p in params if type(p) is SparseTensor and p._format.padded]
        with torch._C.DisableTorchFunctionSubclass():
            op(values(params), *(values(a) for a in args), **{k: values(v) for k, v in kwargs.items()})
        for v, pad in pads:
            v.masked_fill_(pad, 0)
    apply.__name__ = apply.__qualname__ = name
    return apply


for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    if hasattr(torch, _name):
        implements(getattr(torch, _name))(_fused_step(_name))


@implements(torch._amp_foreach_non_finite_check_and_unscale_)
def _amp_unscale_(grads, found_inf, inv_scale):
    """``GradScaler``'s unscale of a list holding sparse gradients: each sparse gradient's stored values through
    torch's own op (multiplied by ``inv_scale`` in place, ``found_inf`` set where one is inf or nan), the dense
    gradients as they are: the op maps 0 to 0, so nothing densifies."""
    torch._amp_foreach_non_finite_check_and_unscale_(
        [g._vals if isinstance(g, SparseTensor) else g for g in grads], found_inf, inv_scale)
