"""``scorch.compile``: fusing a function's scorch ops across op boundaries.

Inside a compiled function every scorch einsum result is deferred (``scorch.deferred``, mode ``"all"``), and the
sparse attention ops are lazy: ``torch.sparse.sampled_addmm(mask, q, k.T, beta=0, alpha=a)`` returns the mask's
pattern with deferred values (the SDDMM not run), ``softmax(scores, dim=1)`` of such scores deferred values too,
and the product of those probabilities with a dense ``v`` (``torch.sparse.mm``, ``@``, ``einsum("ij,jk->ik")``)
runs one fused kernel: per row, the scores, their softmax and the row of the output, in one pass over the
pattern (``compiler/fuse.py``: the SDDMM's and the SpMM's row loops, as lowered for the CPU, and the row softmax,
under one parallel row loop; a row's scores in a row buffer, their max taken as they are stored). With a backward
to come, the probabilities the kernel computes fill the deferred ones; without one they stay in a row buffer too
(a later read of them computes them again, op by op).

Anything else that touches a lazy value computes it as the unfused op would have: the fallback is the eager
path, op by op, and the same values. On leaving the function every deferred value among its results is computed.

Autograd: the lazy SDDMM and softmax are autograd Functions (backward: the SDDMM's gradients as einsums through the
compiler, the row softmax's backward kernel), used where their values are used otherwise. The fused product is an
autograd Function of the probabilities, ``v``, ``q`` and ``k``: its backward runs one fused kernel for the scores'
gradient and ``dq`` (the output gradient's SDDMM with ``v``, the softmax backward, the SpMM with ``k``), then
``dk`` and ``dv`` as transposed products, and gives the probabilities no gradient (a graph-recording backward
gives theirs instead, through the lazy nodes).
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from . import deferred
from ._autograd import _einsum_grad, pattern_ones
from .compiler import dispatch, fuse, loops as L, runtime
from .compiler.codegen import cpp
from .deferred import Deferred
from .formats.storage import PatternMemo
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
        mode = deferred._mode.value
        deferred._mode.value = "all"  # (as ``with deferred.deferral("all")``, without the context manager's calls)
        try:
            out = fn(*args, **kwargs)
        finally:
            deferred._mode.value = mode
            _region.depth -= 1
        _finish(out)
        return out

    return compiled


def _finish(out):
    """Every deferred value among the results computed in place (SparseTensors' values included)."""
    if type(out) is SparseTensor:
        out = out._values
    if isinstance(out, (list, tuple)):
        for o in out:
            _finish(o)
    elif isinstance(out, dict):
        _finish(list(out.values()))
    elif type(out) is Deferred:
        out.compute()


# --- lazy attention ops -------------------------------------------------------------------------------------

class SddmmExpr:
    """``alpha * (q @ k^T)`` at the stored entries of a row-compressed ``pattern``, as values."""
    exact_layout = True
    dense = False

    def __init__(self, pattern, q, k, alpha):
        self.pattern, self.q, self.k, self.alpha = pattern, q, k, alpha
        self.operands = (q, k)
        self.grad = False  # (whether the scores are an autograd Function's output: set by lazy_sddmm)

    def describe(self):
        return "sampled_addmm"

    def compute(self):
        p = self.pattern
        ones = p.with_values(pattern_ones(p, self.q.dtype))
        return dispatch.einsum("ij,ik,jk->ij", ones, self.q, self.k).values() * self.alpha


class SoftmaxExpr:
    """The softmax within each row of deferred SDDMM values."""
    exact_layout = True
    dense = False

    def __init__(self, scores, pos):
        self.scores, self.pos = scores, pos
        self.operands = ()
        self.value = None

    def describe(self):
        return "sparse softmax"

    def compute(self):
        from .ops import segment
        if self.value is None:
            self.value = segment.softmax(Deferred.compute(self.scores), self.pos)  # (computed already, or now)
        return self.value


class _LazySddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expr, q, k):
        if ctx is not None:  # (None: called directly, no gradient needed)
            ctx.expr = expr
            ctx.save_for_backward(q, k)
            ctx.set_materialize_grads(False)  # (no gradient: the fused backward took the path to q and k)
        return deferred.make(expr, (expr.pattern._values.numel(),), q.dtype, q.device)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
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
        if ctx is not None:
            ctx.expr = expr
            ctx.set_materialize_grads(False)
        sddmm = scores._expr  # (the scores' shape and type from their expression: no reads on the deferred value)
        return deferred.make(expr, sddmm.pattern._values.shape, sddmm.q.dtype, sddmm.q.device)

    @staticmethod
    def backward(ctx, grad):
        from .ops import segment
        if grad is None:
            return None, None
        y = ctx.expr.compute()
        return None, segment.softmax_backward(y, grad, ctx.expr.pos)


class _FusedAttention(torch.autograd.Function):
    """``softmax(alpha * SDDMM(pattern, q, k)) @ v`` from lazy probabilities. Its inputs are the probabilities,
    ``v``, and ``q`` and ``k`` too: the backward goes to ``q`` and ``k`` directly (the scores' gradient and ``dq``
    by one fused kernel, ``dk`` and ``dv`` by transposed products), giving the probabilities no gradient, so that
    the lazy softmax and SDDMM nodes do nothing. Where the probabilities are used elsewhere too, their other
    gradients still reach ``q`` and ``k`` through those nodes. A backward that records a graph (double
    backward) goes op by op: the gradient of the probabilities, through the lazy nodes."""

    @staticmethod
    def forward(ctx, boxed, probs, v, q, k):
        (attn,) = boxed
        expr = probs._expr
        # without a backward, the probabilities are not kept: a later read of them computes them again
        out, p = _attention(expr.scores._expr, v, keep_probs=ctx is not None)
        if p is not None:
            expr.value = p
            probs.fill(p)  # the probabilities are computed: a later use reads them
        if ctx is not None:
            ctx.pattern, ctx.alpha = attn, expr.scores._expr.alpha
            ctx.save_for_backward(p, v, q, k)
        return out

    @staticmethod
    def backward(ctx, grad):
        p, v, q, k = ctx.saved_tensors
        attn = ctx.pattern.with_values(p)
        inputs, out = (("i", "j"), ("j", "k")), ("i", "k")
        dv = _einsum_grad(1, inputs, out, [attn, v], grad) if ctx.needs_input_grad[2] else None
        done = None
        if not torch.is_grad_enabled() and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            done = _attention_backward(ctx.pattern, p, grad, v, k, ctx.alpha)
        if done is None:  # op by op, through the lazy softmax and SDDMM
            dp = _einsum_grad(0, inputs, out, [attn, v], grad) if ctx.needs_input_grad[1] else None
            return None, dp, dv, None, None
        ds, dq = done
        dk = None
        if ctx.needs_input_grad[4]:
            pattern = ctx.pattern
            ops = [pattern.with_values(pattern_ones(pattern, q.dtype)), q, k]
            dk = _einsum_grad(2, (("i", "j"), ("i", "k"), ("j", "k")), ("i", "j"), ops, pattern.with_values(ds))
        return None, None, dv, dq if ctx.needs_input_grad[3] else None, dk


def _grad(*tensors) -> bool:
    """Whether autograd records a graph through these tensors (else the Functions' forwards run directly)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rows_pos(x):
    """The row positions of a row-compressed 2-d SparseTensor (CSR-like: softmax along dim 1 by segments)."""
    from .ops.sparse_api import _segments
    if type(x) is not SparseTensor or len(x._shape) != 2 or x._levels[-1].pos is None or \
            x._levels[-1].pos.device.type != "cpu":
        return None
    return _segments(x, 1)


def lazy_sddmm(mask, q, kt, alpha):
    """The deferred ``sampled_addmm(mask, q, kt, beta=0, alpha=alpha)``, or None where it is not fused."""
    if not active() or type(mask) is not SparseTensor or _rows_pos(mask) is None:
        return None
    if q.dtype not in (torch.float32, torch.float64) or kt.dtype != q.dtype or mask._values.dtype != q.dtype:
        return None
    if type(q) is not torch.Tensor or type(kt) is not torch.Tensor or q.dim() != 2 or kt.dim() != 2:
        return None
    k = kt.t().contiguous()
    q = q.contiguous()
    expr = SddmmExpr(mask, q, k, float(alpha))
    expr.grad = _grad(q, k)
    lazy = _LazySddmm.apply(expr, q, k) if expr.grad else _LazySddmm.forward(None, expr, q, k)
    return mask._wrap(lazy, q.dtype)  # (lazy: 1-d, contiguous, on the pattern's device)


def lazy_softmax(x, dim, dtype, log):
    """The deferred row softmax of lazy SDDMM scores, or None where it is not fused."""
    v = x._values
    # (metadata from the expression: each read on the deferred value itself is a __torch_function__ call)
    if type(v) is not Deferred or not isinstance(v._expr, SddmmExpr) or log or dtype not in (None, v._expr.q.dtype):
        return None
    if dim not in (1, -1):
        return None
    pos = _rows_pos(x)
    if pos is None:
        return None
    expr = SoftmaxExpr(v, pos)
    sddmm = v._expr  # (whether v needs a gradient, and its type, from its expression: no reads on v itself)
    grad = sddmm.grad and torch.is_grad_enabled()
    return x._wrap(_LazySoftmax.apply(expr, v) if grad else _LazySoftmax.forward(None, expr, v), sddmm.q.dtype)


@functools.lru_cache(maxsize=64)
def _is_row_product(equation) -> bool:
    """Whether ``equation`` is ``ij,jk->ik`` up to the letters."""
    from .compiler.einsum import parse
    try:
        inputs, out = parse(equation, [2, 2])
    except (ValueError, TypeError):
        return False
    i, j = inputs[0]
    return inputs[1][0] == j and out == (i, inputs[1][1]) and i != j


def fused_product(equation, operands):
    """``einsum(equation, attn, v)`` as the fused attention kernel where ``attn`` holds lazy softmax values of lazy
    SDDMM scores and the product is ``attn @ v``; None otherwise (``attn``'s values are then computed when read)."""
    if len(operands) != 2 or type(operands[0]) is not SparseTensor or type(operands[1]) is not torch.Tensor:
        return None
    attn, v = operands
    probs = attn._values
    if type(probs) is not Deferred or not isinstance(probs._expr, SoftmaxExpr):
        return None
    scores = probs._expr.scores
    if type(scores) is not Deferred or v.dtype != scores._expr.q.dtype or v.dim() != 2:
        return None
    if not _is_row_product(equation):
        return None
    deferred.check_versions(scores)
    v = v.contiguous()
    sddmm = scores._expr
    if _grad(probs, v):
        return _FusedAttention.apply((attn,), probs, v, sddmm.q, sddmm.k)
    return _FusedAttention.forward(None, (attn,), probs, v, sddmm.q, sddmm.k)


# --- the fused kernel ---------------------------------------------------------------------------------------

_FUSED: dict = {}
_PLANS: dict = {}
_BINDERS: dict = {}


_LONGEST = PatternMemo(64)


def _longest(p) -> int:
    """The most entries of any row of a CSR ``p`` (kept per pattern: a model reuses its mask)."""
    n = _LONGEST.get("longest", p._levels)
    if n is None:
        pos = p._levels[1].pos
        n = int((pos[1:] - pos[:-1]).max()) if pos.numel() > 1 else 0
        _LONGEST.put("longest", p._levels, n)
    return n


_SHARED = ("t0_l0_lo", "t0_l0_ext", "t0_l1_pos", "t0_l1_crd", "t0_l1_lo", "t0_l1_ext", "nthreads")


#: prepared calls of fused attention kernels by (pattern arrays' identity, format, shapes, dtype, keep_probs)
_READY: dict = {}


class _Ready:
    """A fused attention kernel's call for one pattern (its index arrays, while unmodified) and one signature:
    the arguments fixed by them (sizes, bounds, the longest row) bound once, the tensors' pointers filled in per
    call, so that a repeated call skips the planning lookups of ``_prepare``."""

    def __init__(self, compiled, binder, st, longest, zero_out, keep_probs):
        self.compiled, self.longest, self.zero_out, self.keep_probs = compiled, longest, zero_out, keep_probs
        self.template = [const for _, const in binder]
        self.slots = [(i, name) for i, (name, _) in enumerate(binder) if name is not None]
        self.arrays = (weakref.ref(st.pos), st.pos._version, weakref.ref(st.crd), st.crd._version)

    def __call__(self, sddmm, v):
        """``(out, probs)``, or None where the pattern's arrays changed since (``_prepare`` serves then)."""
        p, q = sddmm.pattern, sddmm.q
        st = p._levels[1]
        pos_ref, pos_version, crd_ref, crd_version = self.arrays
        if pos_ref() is not st.pos or crd_ref() is not st.crd or st.pos._version != pos_version or \
                st.crd._version != crd_version:
            return None
        probs = torch.empty(p._values.shape, dtype=q.dtype) if self.keep_probs else None
        out = (torch.zeros if self.zero_out else torch.empty)(p._shape[0], v.shape[1], dtype=q.dtype)
        live = {"q": q, "k": sddmm.k, "v": v, "probs": probs, "out": out, "l1pos": st.pos, "l1crd": st.crd,
                "scale": sddmm.alpha, "threads": torch.get_num_threads(), "longest": self.longest}
        args = list(self.template)
        for i, name in self.slots:
            x = live[name]
            args[i] = x.data_ptr() if isinstance(x, torch.Tensor) else x
        self.compiled(*args)
        return out, probs


def _attention(sddmm: SddmmExpr, v, keep_probs=True):
    """``(out, probs)``: ``softmax_rows(alpha * SDDMM(pattern, q, k)) @ v`` by one fused kernel; ``probs`` is None
    unless ``keep_probs`` (the kernel keeps a row's probabilities in a row buffer then, as it does the scores)."""
    p, q, st = sddmm.pattern, sddmm.q, sddmm.pattern._levels[-1]
    key = (id(st.pos), id(st.crd), p._format, p._shape, q.dtype, q.shape, sddmm.k.shape, v.shape, keep_probs)
    ready = _READY.get(key)
    if ready is not None:
        done = ready(sddmm, v)
        if done is not None:
            return done
    prepared = _prepare(sddmm, v, keep_probs)
    if prepared is None:  # not one row loop each: op by op
        from .ops import segment
        probs = segment.softmax(sddmm.compute(), _rows_pos(sddmm.pattern))
        return dispatch.einsum("ij,jk->ik", sddmm.pattern.with_values(probs), v), probs
    fused, compiled, values = prepared
    _launch(fused, compiled, values)
    sig = (p._format, p._shape, p._index_dtype, q.dtype, q.shape, sddmm.k.shape, v.shape)
    binder = _BINDERS.get(sig + (keep_probs,))
    if binder and len(p._levels) == 2 and p._levels[0].pos is None and st.crd is not None:  # (CSR's arrays)
        if len(_READY) >= 64:
            _READY.clear()
        zero_out = not _PLANS[sig][1][0].lowered.writes_every_output
        _READY[key] = _Ready(compiled, binder, st, values["longest"], zero_out, keep_probs)
    return values["out"], values["probs"] if keep_probs else None


def _prepare(sddmm: SddmmExpr, v, keep_probs=True):
    """``(fused kernel IR, compiled kernel, argument values by parameter name)``, or None where the SDDMM or the
    SpMM would not run as one row loop."""
    p, q, k = sddmm.pattern, sddmm.q, sddmm.k
    ones_values = pattern_ones(p, q.dtype)
    sig = (p._format, p._shape, p._index_dtype, q.dtype, q.shape, k.shape, v.shape)
    plans = _row_plans(sig, p, q.dtype, (q, k), (v,))
    if plans is None:
        return None
    (plan1, sizes1), (plan3, sizes3) = plans
    key = (id(plan1), id(plan3), keep_probs)
    entry = _FUSED.get(key)
    if entry is None:
        vt, it = L.type_of(q.dtype), L.type_of(p.index_dtype)
        shared = {n: n for n in _SHARED}
        maps = ({**shared, "out": "scores"}, {**shared, "x": "scores", "y": "probs"},
                {**shared, "t0_vals": "probs", "out": "out"})
        # the scores are scaled as they are stored, and their max taken there too (no pass over the row for it);
        # without a backward, a row's normalization is applied to the product's output row (one multiply per
        # output instead of a pass over the row's probabilities)
        softmax = fuse.softmax_rows(vt, it, normalize=keep_probs, peak_of="smax")
        fused = fuse.rows("scorch_attention", [(plan1.lowered.kernel, maps[0]), (softmax, maps[1]),
                                                (plan3.lowered.kernel, maps[2])])
        fused = L.Kernel(fused.name, fused.params + (L.Param("scale", "scalar", vt),), fused.body)
        fused = fuse.scale_stores(fused, "scores", L.Var("scale", vt))
        fused = fuse.track_max(fused, "scores", "smax", vt, cpp.VECTOR_BYTES // q.element_size())
        if not keep_probs:
            fused = fuse.scale_stores(fused, "out", L.Var("inv_f1", vt))
        # a row's scores (and, without a backward, its probabilities) in a row buffer of each thread; the
        # SDDMM's sampled values are the pattern's ones
        fused = fuse.localize(fused, ("scores",) if keep_probs else ("scores", "probs"), it)
        fused = fuse.constant(fused, "f0_t0_vals", 1.0)
        entry = _FUSED[key] = (fused, runtime.load(cpp.generate(fused), fused.name, cpp.argtypes(fused)), maps,
                               (plan1, plan3))
    fused, compiled, maps, _ = entry
    probs = torch.empty(ones_values.shape, dtype=q.dtype) if keep_probs else None
    longest = _longest(p)
    # (the SpMM's row loop stores every output row, empty rows included, where its plan says so: no zero fill,
    # which would also wake torch's thread pool between the kernels)
    out = (torch.empty if plan3.lowered.writes_every_output else torch.zeros)(p._shape[0], v.shape[1], dtype=q.dtype)
    live = {"q": q, "k": k, "v": v, "ones": ones_values, "probs": probs, "out": out, "longest": longest,
            "scale": sddmm.alpha, "threads": torch.get_num_threads()}
    live.update({f"l{n}{kind}": getattr(st, kind) for n, st in enumerate(p._levels) for kind in ("pos", "crd")
                 if getattr(st, kind) is not None})
    bkey = sig + (keep_probs,)
    binder = _BINDERS.get(bkey)
    if not binder:  # which argument is which tensor, and the values fixed by the signature (sizes, bounds)
        ones = p.with_values(ones_values)
        scores = torch.empty(p._values.numel(), dtype=q.dtype)  # (as the parts' output: only named here)
        values = {}
        for n, args in ((0, dispatch.arguments(plan1, [ones, q, k], sizes1, scores)),
                        (2, dispatch.arguments(plan3, [ones, v], sizes3, out))):
            for name, value in args.items():
                values[maps[n].get(name, f"f{n}_{name}")] = value
        values.update({"probs": probs, "out": out, "scale": sddmm.alpha, "nthreads": live["threads"],
                       "longest": live["longest"]})
        values = {prm.name: values[prm.name] for prm in fused.params}
        if binder is None:
            by_id = {id(t): name for name, t in live.items() if isinstance(t, torch.Tensor)}
            fixed = {"scale": "scale", "nthreads": "threads", "longest": "longest"}
            binder = [(fixed[prm.name], None) if prm.name in fixed else
                      (by_id.get(id(values[prm.name]), "?"), None) if isinstance(values[prm.name], torch.Tensor)
                      else (None, values[prm.name]) for prm in fused.params]
            # (a tensor argument not found among the live ones: no binder, every call takes this path)
            _BINDERS[bkey] = binder if all(name != "?" for name, _ in binder) else False
        return fused, compiled, values
    values = [live[name] if name is not None else const for name, const in binder]
    return fused, compiled, dict(zip((prm.name for prm in fused.params), values))


def _row_plans(sig, pattern, dtype, first_ops, last_ops):
    """The row plans (``dispatch.row_plan``, cached by ``sig``) of an SDDMM ``ij,ik,jk->ij`` on ``first_ops`` and
    an SpMM ``ij,jk->ik`` on ``last_ops`` (each after the pattern's ones), or None where either is not one row
    loop."""
    plans = _PLANS.get(sig)
    if plans is None:  # (planned once per signature: the schedule is not consulted again)
        ones = pattern.with_values(pattern_ones(pattern, dtype))
        first = dispatch.row_plan((("i", "j"), ("i", "k"), ("j", "k")), ("i", "j"), [ones, *first_ops])
        last = dispatch.row_plan((("i", "j"), ("j", "k")), ("i", "k"), [ones, *last_ops])
        plans = _PLANS[sig] = None if first is None or last is None else (first, last)
    return plans


def _attention_backward(pattern, p, g, v, k, alpha):
    """``(ds, dq)`` of the attention's backward from the probabilities ``p`` and the output's gradient ``g``: the
    scores' gradient ``ds = alpha * softmax_backward(p, SDDMM(pattern, g, v))`` and ``dq = ds @ k``, by one fused
    kernel (a row's ``g @ v^T`` in a row buffer); None where the parts are not one row loop each."""
    prepared = _prepare_backward(pattern, p, g, v, k, alpha)
    if prepared is None:
        return None
    _launch(*prepared)
    return prepared[2]["ds"], prepared[2]["dq"]


def _prepare_backward(pattern, p, g, v, k, alpha):
    """``(fused kernel IR, compiled kernel, argument values by parameter name)`` of ``_attention_backward``."""
    dtype = p.dtype
    if dtype not in (torch.float32, torch.float64) or g.dtype != dtype or g.device.type != "cpu":
        return None
    g = g.contiguous()
    sig = ("backward", pattern._format, pattern._shape, pattern._index_dtype, dtype, g.shape, v.shape, k.shape)
    plans = _row_plans(sig, pattern, dtype, (g, v), (k,))
    if plans is None:
        return None
    (plan1, sizes1), (plan3, sizes3) = plans
    key = ("backward", id(plan1), id(plan3))
    entry = _FUSED.get(key)
    if entry is None:
        vt, it = L.type_of(dtype), L.type_of(pattern._index_dtype)
        shared = {n: n for n in _SHARED}
        maps = ({**shared, "out": "dp"}, {**shared, "y": "probs", "g": "dp", "dx": "ds", "scale": "scale"},
                {**shared, "t0_vals": "ds", "out": "dq"})
        fused = fuse.rows("scorch_attention_backward", [(plan1.lowered.kernel, maps[0]),
                                                         (fuse.softmax_backward_rows(vt, it), maps[1]),
                                                         (plan3.lowered.kernel, maps[2])])
        fused = fuse.constant(fuse.localize(fused, ("dp",), it), "f0_t0_vals", 1.0)
        entry = _FUSED[key] = (fused, runtime.load(cpp.generate(fused), fused.name, cpp.argtypes(fused)), maps)
    fused, compiled, maps = entry
    ones = pattern.with_values(pattern_ones(pattern, dtype))
    ds = torch.empty(p.shape, dtype=dtype)
    dq = (torch.empty if plan3.lowered.writes_every_output else torch.zeros)(pattern._shape[0], k.shape[1],
                                                                              dtype=dtype)
    values = {}
    for n, args in ((0, dispatch.arguments(plan1, [ones, g, v], sizes1, ds)),
                    (2, dispatch.arguments(plan3, [ones, k], sizes3, dq))):
        for name, value in args.items():
            values[maps[n].get(name, f"f{n}_{name}")] = value
    values.update({"probs": p, "ds": ds, "dq": dq, "scale": alpha, "nthreads": torch.get_num_threads(),
                   "longest": _longest(pattern)})
    return fused, compiled, {prm.name: values[prm.name] for prm in fused.params}


# --- elementwise epilogues on a product's rows ------------------------------------------------------------------

_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_MAPS = {torch.relu: "relu", torch.Tensor.relu: "relu", torch.nn.functional.relu: "relu",
         torch.tanh: "tanh", torch.Tensor.tanh: "tanh", torch.nn.functional.tanh: "tanh",
         torch.sigmoid: "sigmoid", torch.Tensor.sigmoid: "sigmoid", torch.nn.functional.sigmoid: "sigmoid"}


class EpilogueExpr:
    """Elementwise steps after a product with a sparse operand and a dense result (``relu(S @ X + b)``): a bias
    along the rows (a vector over the last dimension, or a number), a scale by a number, ``relu``, ``tanh``,
    ``sigmoid``. Computed as one kernel (the product's row loop, then the steps on each finished row) where the
    product runs as one row loop, else the product and then the steps in torch."""
    exact_layout = False
    dense = False

    def __init__(self, base, steps):
        self.base, self.steps = base, tuple(steps)  # base: an EinsumExpr; steps: ("add", t) ("mul", c) ("relu",)
        self.operands = base.operands + tuple(st[1] for st in steps if st[0] == "add" and
                                              isinstance(st[1], torch.Tensor))

    def describe(self):
        return f"{self.base.describe()} with {', '.join(st[0] for st in self.steps)}"

    def compute(self):
        fused = _epilogue_kernel(self)
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


deferred._EPILOGUE[0] = epilogue

_EPILOGUES: dict = {}


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
        elif st[0] == "relu":
            x = L.Unary("relu", x, vtype)
        elif st[0] == "tanh":
            x = L.Unary("tanh", x, vtype)
        else:  # sigmoid
            one = L.Const(1.0, vtype)
            x = L.binary("div", one, L.binary("add", one, L.Unary("exp", L.Unary("neg", x, vtype), vtype)))
    body = L.block(L.For(j, L.Const(0), L.Const(width), L.block(L.Store("out", at, x))))
    return fuse.row_kernel("scorch_epilogue_rows", itype, body, params)


def _launch(kernel, compiled, values):
    """Call a compiled fused kernel with its arguments by parameter name (tensors passed by pointer)."""
    compiled(*[values[p.name].data_ptr() if isinstance(values[p.name], torch.Tensor) else values[p.name]
               for p in kernel.params])


def _epilogue_kernel(expr: EpilogueExpr):
    """The product and its steps as one kernel, or None where the product is not one CSR row loop."""
    base = expr.base
    s, x = base.ops
    (si, xi), out = base.inputs, tuple(base.out)
    if len(si) != 2 or len(xi) != 2 or si[1] != xi[0] or out != (si[0], xi[1]) or si[0] == si[1]:
        return None
    # CSR: the row loop visits every row (an empty row gets its bias too) and row c0 is the output's row c0
    if s.format.name != "csr" or s.dtype != x.dtype or s._values.device.type != "cpu":
        return None
    x = x.contiguous()
    plan = dispatch.row_plan(base.inputs, out, [s, x])
    if plan is None:
        return None
    plan, sizes = plan
    width = sizes[base.out[1]]
    vt, it = L.type_of(x.dtype), L.type_of(s.index_dtype)
    shape_key = tuple(st[0] + ("v" if len(st) > 1 and isinstance(st[1], torch.Tensor) else "") for st in expr.steps)
    key = (id(plan), shape_key, width, it)
    entry = _EPILOGUES.get(key)
    if entry is None:
        epi = epilogue_rows(vt, it, expr.steps, width)
        shared = {n: n for n in _SHARED}
        maps = ({**shared, "out": "out"}, {**shared, "out": "out"})
        fused = fuse.rows("scorch_product_epilogue", [(plan.lowered.kernel, maps[0]), (epi, maps[1])])
        entry = _EPILOGUES[key] = (fused, runtime.load(cpp.generate(fused), fused.name, cpp.argtypes(fused)), maps)
    fused, compiled, maps = entry
    out = torch.zeros(s.shape[0], width, dtype=x.dtype)
    values = {maps[0].get(n, f"f0_{n}"): v for n, v in dispatch.arguments(plan, [s, x], sizes, out).items()}
    for k, st in enumerate(expr.steps):
        if st[0] in ("add", "mul"):
            values[f"f1_bias{k}" if isinstance(st[1], torch.Tensor) else f"f1_num{k}"] = st[1]
    values["nthreads"] = torch.get_num_threads()
    _launch(fused, compiled, values)
    return out

