"""``scorch.compile``: fusing a function's scorch ops across op boundaries.

Inside a compiled function every scorch einsum result is deferred (``scorch.deferred``, mode ``"all"``), and the
sparse attention ops are lazy: ``torch.sparse.sampled_addmm(mask, q, k.T, beta=0, alpha=a)`` returns the mask's
pattern with deferred values (the SDDMM not run), ``softmax(scores, dim=1)`` of such scores deferred values too,
and the product of those probabilities with a dense ``v`` (``torch.sparse.mm``, ``@``, ``einsum("ij,jk->ik")``)
runs one fused kernel: per row, the scores, their softmax and the row of the output, in one pass over the
pattern (``compiler/fuse.py``: the SDDMM's and the SpMM's row loops, as lowered for the CPU, and the row softmax,
under one parallel row loop). The probabilities the kernel computes fill the deferred ones, so a later use of them
(or the backward pass) does not compute them again.

Anything else that touches a lazy value computes it as the unfused op would have: the fallback is the eager
path, op by op, and the same values. On leaving the function every deferred value among its results is computed.

Autograd: the lazy SDDMM and softmax are autograd Functions (backward: the SDDMM's gradients as einsums through the
compiler, the row softmax's backward kernel); the fused kernel's backward gives the probabilities' gradient (an
SDDMM on the pattern) and ``v``'s (``P^T @ dO``). The backward is not fused.
"""
from __future__ import annotations

import functools
import threading

import torch

from . import deferred
from .deferred import Deferred
from .sparse_tensor import SparseTensor


class _Region(threading.local):
    depth = 0


_region = _Region()


def active() -> bool:
    """Whether a ``scorch.compile``d function is running (on this thread)."""
    return _region.depth > 0


def compile(fn=None, *, fullgraph=False, dynamic=None, mode=None, backend=None):
    """Fuse ``fn``'s scorch ops (a decorator, as ``torch.compile``; its other arguments are accepted and
    ignored). Ops that cannot be fused run eagerly, as without the decorator."""
    if fn is None:
        return lambda f: compile(f)

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        _region.depth += 1
        try:
            with deferred.deferral("all"):
                out = fn(*args, **kwargs)
        finally:
            _region.depth -= 1
        return _finish(out)

    return compiled


def _finish(out):
    """Every deferred value among the results computed (SparseTensors' values included)."""
    if type(out) is Deferred:
        return out.compute()
    if type(out) is SparseTensor:
        if type(out._values) is Deferred:
            out._values.compute()
        return out
    if isinstance(out, (list, tuple)):
        items = [_finish(o) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, dict):
        return {k: _finish(v) for k, v in out.items()}
    return out


# --- lazy attention ops -------------------------------------------------------------------------------------

class SddmmExpr:
    """``alpha * (q @ k^T)`` at the stored entries of a row-compressed ``pattern``, as values."""
    exact_layout = True

    def __init__(self, pattern, q, k, alpha):
        self.pattern, self.q, self.k, self.alpha = pattern, q, k, alpha
        self.operands = (q, k)

    def describe(self):
        return "sampled_addmm"

    def compute(self):
        from ._autograd import pattern_ones
        from .compiler import dispatch
        p = self.pattern
        ones = p.with_values(pattern_ones(p, self.q.dtype))
        return dispatch.einsum("ij,ik,jk->ij", ones, self.q, self.k).values() * self.alpha


class SoftmaxExpr:
    """The softmax within each row of deferred SDDMM values."""
    exact_layout = True

    def __init__(self, scores, pos):
        self.scores, self.pos = scores, pos
        self.operands = ()
        self.value = None

    def describe(self):
        return "sparse softmax"

    def compute(self):
        from .ops import segment
        if self.value is None:
            self.value = segment.softmax(self.scores.compute(), self.pos)
        return self.value


class _LazySddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expr, q, k):
        ctx.expr = expr
        ctx.save_for_backward(q, k)
        return deferred.make(expr, (expr.pattern._values.numel(),), q.dtype, q.device)

    @staticmethod
    def backward(ctx, grad):
        from ._autograd import _einsum_grad, pattern_ones
        q, k = ctx.saved_tensors
        p = ctx.expr.pattern
        ones = p.with_values(pattern_ones(p, q.dtype))
        gout = p.with_values(grad * ctx.expr.alpha)
        inputs, out = (("i", "j"), ("i", "k"), ("j", "k")), ("i", "j")
        ops = [ones, q, k]
        dq = _einsum_grad(1, inputs, out, ops, gout) if ctx.needs_input_grad[1] else None
        dk = _einsum_grad(2, inputs, out, ops, gout) if ctx.needs_input_grad[2] else None
        return None, dq, dk


class _LazySoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expr, scores):
        ctx.expr = expr
        return deferred.make(expr, scores.shape, scores.dtype, scores.device)

    @staticmethod
    def backward(ctx, grad):
        from .ops import segment
        y = ctx.expr.compute()
        return None, segment.softmax_backward(y, grad, ctx.expr.pos)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, boxed, probs, v):
        (attn,) = boxed
        expr = probs._expr
        out, p = _attention(expr.scores._expr, v)
        expr.value = p
        probs.fill(p)  # the probabilities are computed: a later use reads them
        ctx.pattern = attn
        ctx.save_for_backward(p, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        from ._autograd import _einsum_grad
        p, v = ctx.saved_tensors
        attn = ctx.pattern.with_values(p)
        inputs, out = (("i", "j"), ("j", "k")), ("i", "k")
        dp = _einsum_grad(0, inputs, out, [attn, v], grad) if ctx.needs_input_grad[1] else None
        dv = _einsum_grad(1, inputs, out, [attn, v], grad) if ctx.needs_input_grad[2] else None
        return None, dp, dv


def _rows_pos(x):
    """The row positions of a row-compressed 2-d SparseTensor (CSR-like: softmax along dim 1 by segments)."""
    from .ops.sparse_api import _segments
    if type(x) is not SparseTensor or x.dim() != 2 or x._values.device.type != "cpu":
        return None
    return _segments(x, 1)


def lazy_sddmm(mask, q, kt, alpha):
    """The deferred ``sampled_addmm(mask, q, kt, beta=0, alpha=alpha)``, or None where it is not fused."""
    if not active() or type(mask) is not SparseTensor or _rows_pos(mask) is None:
        return None
    if q.dtype not in (torch.float32, torch.float64) or kt.dtype != q.dtype or mask.dtype != q.dtype:
        return None
    if type(q) is not torch.Tensor or type(kt) is not torch.Tensor or q.dim() != 2 or kt.dim() != 2:
        return None
    k = kt.t().contiguous()
    q = q.contiguous()
    expr = SddmmExpr(mask, q, k, float(alpha))
    return mask.with_values(_LazySddmm.apply(expr, q, k))


def lazy_softmax(x, dim, dtype, log):
    """The deferred row softmax of lazy SDDMM scores, or None where it is not fused."""
    v = x._values
    if type(v) is not Deferred or not isinstance(v._expr, SddmmExpr) or log or dtype not in (None, v.dtype):
        return None
    if dim not in (1, -1):
        return None
    pos = _rows_pos(x)
    if pos is None:
        return None
    return x.with_values(_LazySoftmax.apply(SoftmaxExpr(v, pos), v))


def fused_product(equation, operands):
    """``einsum(equation, attn, v)`` as the fused attention kernel where ``attn`` holds lazy softmax values of lazy
    SDDMM scores and the product is ``attn @ v``; None otherwise (``attn``'s values are then computed when read)."""
    from .compiler.einsum import parse
    if len(operands) != 2 or type(operands[0]) is not SparseTensor or type(operands[1]) is not torch.Tensor:
        return None
    attn, v = operands
    probs = attn._values
    if type(probs) is not Deferred or not isinstance(probs._expr, SoftmaxExpr):
        return None
    scores = probs._expr.scores
    if type(scores) is not Deferred or v.dtype != attn.dtype or v.dim() != 2:
        return None
    try:
        inputs, out = parse(equation, [2, 2])
    except (ValueError, TypeError):
        return None
    i, j = inputs[0]
    if inputs[1][0] != j or out != (i, inputs[1][1]) or i == j:
        return None
    deferred.check_versions(scores)
    return _FusedAttention.apply((attn,), probs, v.contiguous())


# --- the fused kernel ---------------------------------------------------------------------------------------

_FUSED: dict = {}
_SHARED = ("t0_l0_lo", "t0_l0_ext", "t0_l1_pos", "t0_l1_crd", "t0_l1_lo", "t0_l1_ext", "nthreads")


def _attention(sddmm: SddmmExpr, v):
    """``(out, probs)``: ``softmax_rows(alpha * SDDMM(pattern, q, k)) @ v`` by one fused kernel."""
    prepared = _prepare(sddmm, v)
    if prepared is None:  # not one row loop each: op by op
        from .compiler import dispatch
        from .ops import segment
        probs = segment.softmax(sddmm.compute(), _rows_pos(sddmm.pattern))
        return dispatch.einsum("ij,jk->ik", sddmm.pattern.with_values(probs), v), probs
    fused, compiled, values = prepared
    compiled(*[values[prm.name].data_ptr() if isinstance(values[prm.name], torch.Tensor) else values[prm.name]
               for prm in fused.params])
    return values["out"], values["probs"]


def _prepare(sddmm: SddmmExpr, v):
    """``(fused kernel IR, compiled kernel, argument values by parameter name)``, or None where the SDDMM or the
    SpMM would not run as one row loop."""
    from ._autograd import pattern_ones
    from .compiler import dispatch, fuse, loops as L, runtime
    from .compiler.codegen import cpp
    p, q, k = sddmm.pattern, sddmm.q, sddmm.k
    ones = p.with_values(pattern_ones(p, q.dtype))
    first = dispatch.row_plan((("i", "j"), ("i", "k"), ("j", "k")), ("i", "j"), [ones, q, k])
    last = dispatch.row_plan((("i", "j"), ("j", "k")), ("i", "k"), [ones, v])
    if first is None or last is None:
        return None
    (plan1, sizes1), (plan3, sizes3) = first, last
    key = (id(plan1), id(plan3))
    entry = _FUSED.get(key)
    if entry is None:
        vt, it = L.type_of(q.dtype), L.type_of(p.index_dtype)
        shared = {n: n for n in _SHARED}
        maps = ({**shared, "out": "scores"}, {**shared, "x": "scores", "y": "probs", "scale": "scale"},
                {**shared, "t0_vals": "probs", "out": "out"})
        fused = fuse.rows("scorch_attention", [(plan1.lowered.kernel, maps[0]),
                                                (fuse.softmax_rows(vt, it), maps[1]),
                                                (plan3.lowered.kernel, maps[2])])
        entry = _FUSED[key] = (fused, runtime.load(cpp.generate(fused), fused.name, cpp.argtypes(fused)), maps,
                               (plan1, plan3))
    fused, compiled, maps, _ = entry
    nnz = p._values.numel()
    scores = torch.empty(nnz, dtype=q.dtype)
    probs = torch.empty(nnz, dtype=q.dtype)
    out = torch.zeros(p.shape[0], v.shape[1], dtype=q.dtype)
    values = {}
    for n, args in ((0, dispatch.arguments(plan1, [ones, q, k], sizes1, scores)),
                    (2, dispatch.arguments(plan3, [ones, v], sizes3, out))):
        for name, value in args.items():
            values[maps[n].get(name, f"f{n}_{name}")] = value
    values.update({"scores": scores, "probs": probs, "out": out, "scale": sddmm.alpha,
                   "nthreads": torch.get_num_threads()})
    return fused, compiled, values
