"""``scorch.compile``'s elementwise epilogues: ``relu(S @ X + b)`` and the like, the product's row loop and the steps
on each finished row as one kernel (``fuse.rows``), where the product is a CSR-like SpMM with a dense result."""
from __future__ import annotations

import torch

from . import deferred
from . import engine
from . import loopir as L
from .compiler import fuse
from .compiler.codegen import cpp
from .deferred import Deferred
from .fusion import _SHARED, _compiled, _part_values, active
from .rules import RULES
from .sparse_tensor import SparseTensor
from .unary_maps import MAPS


_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
#: the unary maps an epilogue computes: each spelling -> the map's name
_MAPS = {f: m.name for m in MAPS if m.epilogue for f in m.funcs}


class EpilogueExpr:
    """Elementwise steps after a product with a sparse operand and a dense result (``relu(S @ X + b)``): a bias
    along the rows (a vector over the last dimension, or a number), a scale by a number, a unary map of
    ``unary_maps.MAPS`` marked ``epilogue`` (``relu``, ``tanh``, ``sigmoid``...). Computed as one kernel (the product's row loop, then the steps on each finished row) where the
    product runs as one row loop, else the product and then the steps in torch."""
    exact_layout = False
    dense = False

    def __init__(self, base, steps):
        self.base, self.steps = base, tuple(steps)  # base: an EinsumExpr; steps: ("add", t) ("mul", c) (map name,)
        self.operands = base.operands + tuple(st[1] for st in steps if st[0] == "add" and
                                              isinstance(st[1], torch.Tensor))

    def describe(self):
        return f"{self.base.describe()} with {', '.join(st[0] for st in self.steps)}"

    def compute(self):
        fused = epilogue_kernel(self)
        if fused is not None:
            return fused
        y = self.base.compute()
        for st in self.steps:
            y = y + st[1] if st[0] == "add" else y * st[1] if st[0] == "mul" else getattr(torch, st[0])(y)
        return y


def epilogue(func, args, kwargs):
    """The lazy result of an elementwise ``func`` on a deferred product inside ``scorch.compile``, or None."""
    if not active() or kwargs:
        return None
    if func in _MAPS and len(args) == 1:
        step = (_MAPS[func],)
        y = args[0]
    elif (func in _ADD or func in _MUL) and len(args) == 2:
        y, other = (args[0], args[1]) if type(args[0]) is Deferred else (args[1], args[0])
        kind = "add" if func in _ADD else "mul"
        if type(other) is Deferred or type(y) is not Deferred:
            return None
        if isinstance(other, torch.Tensor):
            if kind == "mul" or type(other) is not torch.Tensor or other.dtype != y.dtype or \
                    other.device != y.device or other.dim() != 1 or y.dim() != 2 or other.shape[0] != y.shape[1]:
                return None
            other = other.contiguous()
        elif not isinstance(other, (int, float)) or isinstance(other, bool) or not y.dtype.is_floating_point:
            return None
        step = (kind, other)
    else:
        return None
    if type(y) is not Deferred or not y.dtype.is_floating_point or y.dim() != 2:
        return None
    e = y._expr
    if isinstance(e, EpilogueExpr):
        expr = EpilogueExpr(e.base, e.steps + (step,))
    elif isinstance(e, deferred.EinsumExpr) and not e.dense and len(e.ops) == 2 and \
            type(e.ops[0]) is SparseTensor and type(e.ops[1]) is torch.Tensor:
        expr = EpilogueExpr(e, (step,))
    else:
        return None
    deferred.check_versions(y)
    if y.requires_grad or (step[0] == "add" and isinstance(step[1], torch.Tensor) and step[1].requires_grad):
        return None  # (under autograd the steps run op by op)
    return deferred.make(expr, y.shape, y.dtype, y.device)


RULES.register(lazy_epilogue=epilogue)


def epilogue_rows(vtype: str, itype: str, steps, width: int):
    """The steps on each row of a dense ``rows x width`` output ``out``, as the row loop of a CSR product
    (``fuse.row_kernel``); bias vectors are arrays ``bias<k>``, numbers scalars ``num<k>``."""
    c0, j = L.Var("c0"), L.Var("j")
    at = L.binary("add", L.binary("mul", c0, L.Const(width)), j)
    x = L.Load("out", at, vtype)
    params = [L.Param("out", "array", vtype, output=True)]
    for k, st in enumerate(steps):
        if st[0] == "add" and isinstance(st[1], torch.Tensor):
            params.append(L.Param(f"bias{k}", "array", vtype))
            x = L.binary("add", x, L.Load(f"bias{k}", j, vtype))
        elif st[0] in ("add", "mul"):
            params.append(L.Param(f"num{k}", "scalar", vtype))
            x = L.binary(st[0], x, L.Var(f"num{k}", vtype))
        elif st[0] == "sigmoid":
            one = L.Const(1.0, vtype)
            x = L.binary("div", one, L.binary("add", one, L.Unary("exp", L.Unary("neg", x, vtype), vtype)))
        else:  # a map of the loop IR (``unary_maps``: epilogue)
            x = L.Unary(st[0], x, vtype)
    body = L.block(L.For(j, L.Const(0), L.Const(width), L.block(L.Store("out", at, x))))
    return fuse.row_kernel("scorch_epilogue_rows", itype, body, params)


def epilogue_kernel(expr: EpilogueExpr):
    """The product and its steps as one kernel, or None where the product is not one CSR row loop. Public for
    tests: they spy on it to see which products fuse."""
    base = expr.base
    s, x = base.ops
    (si, xi), out = base.inputs, tuple(base.out)
    if len(si) != 2 or len(xi) != 2 or si[1] != xi[0] or out != (si[0], xi[1]) or si[0] == si[1]:
        return None
    # CSR: the row loop visits every row (an empty row gets its bias too) and row c0 is the output's row c0
    if s.format.name != "csr" or s.dtype != x.dtype or s._vals.device.type != "cpu":
        return None
    x = x.contiguous()
    plan = engine.row_plan(base.inputs, out, [s, x])
    if plan is None:
        return None
    plan, sizes = plan
    width = sizes[base.out[1]]
    vt, it = L.type_of(x.dtype), L.type_of(s.index_dtype)
    shape_key = tuple(st[0] + ("v" if len(st) > 1 and isinstance(st[1], torch.Tensor) else "") for st in expr.steps)
    maps = ({**_SHARED, "out": "out"}, {**_SHARED, "out": "out"})
    built = _compiled(("epilogue", id(plan), shape_key, width, it), lambda: fuse.rows(
        "scorch_product_epilogue", [(plan.lowered.kernel, maps[0]), (epilogue_rows(vt, it, expr.steps, width),
                                                                       maps[1])]))
    if built is None:
        return None
    fused, compiled = built
    out = torch.zeros(s.shape[0], width, dtype=x.dtype)
    values = _part_values(maps, ((0, engine.arguments(plan, [s, x], sizes, out)),))
    for k, st in enumerate(expr.steps):
        if st[0] in ("add", "mul"):
            values[f"f1_bias{k}" if isinstance(st[1], torch.Tensor) else f"f1_num{k}"] = st[1]
    values["nthreads"] = torch.get_num_threads()
    cpp.call(fused, compiled, values)
    return out

