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
differentiates the unfused ops again). Elementwise steps after a product are ``fusion_epilogue``'s.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from . import deferred
from ._autograd import _einsum_grad, pattern_ones
from . import engine
from .compiler import fuse
from . import loopir as L
from .compiler.codegen import cpp
from .compiler.target import CPU
from .deferred import Deferred
from .formats.storage import PatternMemo, array_version, segments
from .compiler.caches import cache, register
from .rules import RULES
from .sparse_tensor import SparseTensor


class _Region(threading.local):
    depth = 0


_region = _Region()


def active() -> bool:
    """Whether a ``scorch.compile``d function is running (on this thread)."""
    return _region.depth > 0


def compile(fn=None, *, fullgraph=False, dynamic=None, mode=None, backend=None, options=None, disable=False):
    """Fuse ``fn``'s scorch ops (a decorator, as ``torch.compile``; for a function its other arguments are accepted
    and ignored). Ops that cannot be fused run eagerly, as without the decorator. An ``nn.Module`` is given to
    ``torch.compile`` with the arguments (under ``import scorch as torch``, ``torch.compile(model)`` must give a
    module back: ``model.parameters()``, ``.train()``, ``state_dict()``; a sparse product in it is one custom op
    of the graph, ``scorch/dynamo.py``)."""
    if fn is None:
        return lambda f: compile(f, fullgraph=fullgraph, dynamic=dynamic, mode=mode, backend=backend,
                                 options=options, disable=disable)
    if isinstance(fn, torch.nn.Module):
        return torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic, mode=mode, options=options, disable=disable,
                             **({} if backend is None else {"backend": backend}))
    if disable:
        return fn

    @functools.wraps(fn)
    def compiled(*args, **kwargs):
        if torch.compiler.is_compiling():  # inside torch.compile: the graph fuses (scorch/dynamo_sparse.py)
            return fn(*args, **kwargs)
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
        out = out._vals
    if isinstance(out, (list, tuple)):
        for o in out:
            _finish(o)
    elif isinstance(out, dict):
        _finish(list(out.values()))
    elif type(out) is Deferred:
        out.compute()


# --- lazy attention ops -------------------------------------------------------------------------------------

#: the value types the fused kernels take (16-bit ones computed in float32, ``prepare``)
_FLOATS = (torch.float32, torch.float64) + L.HALF_DTYPES
#: the SDDMM (values at the pattern's entries) and the product of a sparse matrix with a dense one, as letters
_SDDMM = ((("i", "j"), ("i", "k"), ("j", "k")), ("i", "j"))
_PRODUCT = ((("i", "j"), ("j", "k")), ("i", "k"))


def _ones(pattern, dtype):
    """The pattern with ones at its entries: the sampled operand of an SDDMM whose mask's values are ignored."""
    return pattern.with_values(pattern_ones(pattern, dtype))


def _sddmm_grad(which, pattern, q, k, grad_values):
    """The gradient of ``q`` (``which`` 1) or ``k`` (2) of ``SDDMM(pattern, q, k)`` from its values' gradient."""
    return _einsum_grad(which, *_SDDMM, [_ones(pattern, q.dtype), q, k], pattern.with_values(grad_values))


class SddmmExpr:
    """``alpha * (q @ k^T)`` at the stored entries of a row-compressed ``pattern``, as values; plus ``bias`` (values
    on the pattern's entries: an additive attention mask's) where given."""
    exact_layout = True
    dense = False

    def __init__(self, pattern, q, k, alpha, bias=None):
        self.pattern, self.q, self.k, self.alpha, self.bias = pattern, q, k, alpha, bias
        self.operands = (q, k)
        self.grad = False  # (whether the scores are an autograd Function's output: set by lazy_sddmm)

    def describe(self):
        return "sampled_addmm"

    def compute(self):
        # the pattern's own format: the values must line up with its entries (a differentiable einsum would give
        # a padded pattern's result unpadded)
        ones = _ones(self.pattern, self.q.dtype)
        scores = engine.scaled("ij,ik,jk->ij", self.alpha, ones, self.q, self.k, format=ones.format).values()
        return scores if self.bias is None else scores + self.bias


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
        return deferred.make(expr, (expr.pattern._vals.numel(),), q.dtype, q.device)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None
        q, k = ctx.saved_tensors
        p, ds = ctx.expr.pattern, grad * ctx.expr.alpha
        dq = _sddmm_grad(1, p, q, k, ds) if ctx.needs_input_grad[1] else None
        dk = _sddmm_grad(2, p, q, k, ds) if ctx.needs_input_grad[2] else None
        return None, dq, dk


class _LazySoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expr, scores):
        if ctx is not None:
            ctx.expr = expr
            ctx.set_materialize_grads(False)
        sddmm = scores._expr  # (the scores' shape and type from their expression: no reads on the deferred value)
        return deferred.make(expr, sddmm.pattern._vals.shape, sddmm.q.dtype, sddmm.q.device)

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
    backward) differentiates the unfused ops again (``_recorded_backward``)."""

    @staticmethod
    def forward(ctx, boxed, probs, v, q, k):
        (attn,) = boxed
        expr = probs._expr
        # without a backward, the probabilities are not kept: a later read of them computes them again
        out, p = attention(expr.scores._expr, v, keep_probs=ctx is not None)
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
        if torch.is_grad_enabled():  # a backward recording a graph (double backward): see ``_recorded_backward``
            return (None, None, *_recorded_backward(ctx, grad, p, v, q, k))
        attn = ctx.pattern.with_values(p)
        dv = _einsum_grad(1, *_PRODUCT, [attn, v], grad) if ctx.needs_input_grad[2] else None
        done = None
        if not torch.is_grad_enabled() and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            done = attention_backward(ctx.pattern, p, grad, v, k, ctx.alpha)
        if done is None:  # op by op, through the lazy softmax and SDDMM
            dp = _einsum_grad(0, *_PRODUCT, [attn, v], grad) if ctx.needs_input_grad[1] else None
            return None, dp, dv, None, None
        ds, dq = done
        dk = _sddmm_grad(2, ctx.pattern, q, k, ds) if ctx.needs_input_grad[4] else None
        return None, None, dv, dq if ctx.needs_input_grad[3] else None, dk


def _recorded_backward(ctx, grad, p, v, q, k):
    """The gradients of ``v``, ``q`` and ``k`` as a graph (``create_graph=True``): the attention again, op by op
    and unfused, differentiated by autograd. The fused backward's probabilities are saved values, not a function
    of ``q`` and ``k``: the second-order terms through them were lost (wrong, silently)."""
    wanted = [x for x, need in zip((v, q, k), ctx.needs_input_grad[2:5]) if need]
    depth, mode = _region.depth, deferred._mode.value
    _region.depth, deferred._mode.value = 0, "off"
    try:
        mask = ctx.pattern.with_values(p.detach())  # (the pattern: SDDMM with beta 0 reads no values)
        scores = torch.sparse.sampled_addmm(mask, q, k.t(), beta=0.0, alpha=ctx.alpha)
        out = torch.sparse.softmax(scores, 1) @ v
        got = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True))
    finally:
        _region.depth, deferred._mode.value = depth, mode
    return tuple(next(got) if need else None for need in ctx.needs_input_grad[2:5])


def _grad(*tensors) -> bool:
    """Whether autograd records a graph through these tensors (else the Functions' forwards run directly)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rows_pos(x):
    """The row positions of a row-compressed 2-d SparseTensor (CSR-like: softmax along dim 1 by segments)."""
    if type(x) is not SparseTensor or len(x._shape) != 2 or x._levels[-1].pos is None or \
            x._levels[-1].pos.device.type != "cpu":
        return None
    return segments(x._format, x._levels, 1)


def lazy_sddmm(mask, q, kt, alpha):
    """The deferred ``sampled_addmm(mask, q, kt, beta=0, alpha=alpha)``, or None where it is not fused."""
    if not active() or type(mask) is not SparseTensor or _rows_pos(mask) is None:
        return None
    if q.dtype not in _FLOATS or kt.dtype != q.dtype or mask._vals.dtype != q.dtype:
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
    v = x._vals
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
    probs = attn._vals
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

_FUSED = cache("fused-kernels", "fused row kernels (IR and compiled kernel) per fusion key")
_PLANS = cache("fused-plans", "the row plans fused attention is made of, per operand signature")


def _compiled(key, build):
    """``(kernel IR, compiled kernel)`` of the fused kernel ``build()`` makes, built and compiled once per ``key``;
    None where its parts are not one row loop (``fuse.NotOneLoop``: op by op then)."""
    entry = _FUSED.get(key)
    if entry is None:
        try:
            kernel = build()
            entry = _FUSED[key] = (kernel, cpp.load(kernel))
        except fuse.NotOneLoop:
            entry = _FUSED[key] = False
    return entry or None


def _part_values(maps, parts):
    """The fused kernel's argument values from its parts' (``(part number, arguments by the part's parameter
    names)``), renamed as ``fuse.rows`` renames them (``maps``; the others get the part's prefix)."""
    return {maps[n].get(name, f"f{n}_{name}"): value for n, args in parts for name, value in args.items()}


_LONGEST = PatternMemo(64)
register("longest-rows", "the longest row of a mask's pattern, by its index arrays", _LONGEST.__len__,
         _LONGEST.clear)


def _longest(p) -> int:
    """The most entries of any row of a CSR ``p`` (kept per pattern: a model reuses its mask)."""
    pos = p._levels[1].pos
    return _LONGEST.lookup("longest", p._levels,
                           lambda: int((pos[1:] - pos[:-1]).max()) if pos.numel() > 1 else 0)


_SHARED = {n: n for n in ("t0_l0_lo", "t0_l0_ext", "t0_l1_pos", "t0_l1_crd", "t0_l1_lo", "t0_l1_ext", "nthreads")}
_ATTENTION_MAPS = ({**_SHARED, "out": "scores"}, {**_SHARED, "x": "scores", "y": "probs"},
                   {**_SHARED, "t0_vals": "probs", "out": "out"})
_BACKWARD_MAPS = ({**_SHARED, "out": "dp"}, {**_SHARED, "y": "probs", "g": "dp", "dx": "ds", "scale": "scale"},
                  {**_SHARED, "t0_vals": "ds", "out": "dq"})
#: ``(maps, the intermediate the product part reads)`` by (backward, 16-bit values): with 16-bit values that
#: intermediate (the probabilities, the scores' gradient) is float32 (``p32``, ``ds32``: row buffers), and the row
#: softmax part rounds it once into the kept array
_KERNEL_MAPS = {(False, False): (_ATTENTION_MAPS, "probs"), (True, False): (_BACKWARD_MAPS, "ds"),
                (False, True): ((_ATTENTION_MAPS[0], {**_ATTENTION_MAPS[1], "y": "p32", "y16": "probs"},
                                 {**_ATTENTION_MAPS[2], "t0_vals": "p32"}), "p32"),
                (True, True): ((_BACKWARD_MAPS[0], {**_BACKWARD_MAPS[1], "dx": "ds32", "dx16": "ds"},
                                {**_BACKWARD_MAPS[2], "t0_vals": "ds32"}), "ds32")}


def _parts(maps, vt, plan1, softmax, plan3, backward=False):
    """The three parts of a fused kernel for ``fuse.rows`` (the row softmax's made by ``softmax(compute type,
    rounded)``). With 16-bit values (``vt``) every part computes in float32: the first part's output and the last
    part's sparse values are retyped to float32 (not rounded between the parts), the softmax part rounds the kept
    values once, and the backward reads the probabilities widened."""
    ct = L.compute_type(vt)
    first, middle, last = plan1.lowered.kernel, softmax(ct, None if vt == ct else vt), plan3.lowered.kernel
    if vt != ct:
        first, last = fuse.retype(first, "out", ct), fuse.retype(last, "t0_vals", ct)
        middle = fuse.retype(middle, "y", vt) if backward else middle
    return [(first, maps[0]), (middle, maps[1]), (last, maps[2])]


#: prepared calls of fused attention kernels by (pattern arrays' identity, format, shapes, dtype, keep_probs).
#: Public for tests: ``tests/test_fusion.py`` checks that a call on a mask leaves its prepared call here.
READY = cache("fused-ready", "prepared calls of fused attention kernels, per pattern and signature", limit=64)


class _Ready:
    """A fused attention kernel's call for one pattern (its index arrays, while unmodified) and one signature:
    the arguments fixed by them (sizes, bounds, the longest row) bound once, the tensors' pointers filled in per
    call, so that a repeated call skips ``prepare``'s planning lookups and argument building."""

    def __init__(self, compiled, template, slots, st, zero_out, keep_probs):
        self.compiled, self.template, self.slots = compiled, template, slots
        self.zero_out, self.keep_probs = zero_out, keep_probs
        self.arrays = (weakref.ref(st.pos), array_version(st.pos), weakref.ref(st.crd), array_version(st.crd))

    @staticmethod
    def binding(kernel, values, tensors):
        """``(template, slots)``: the kernel's arguments with the per-call ones left out (``slots``: their places
        and names), found by the identity of the first call's ``tensors`` (name -> tensor) among ``values``; None
        where that is ambiguous (one tensor in two roles, ``v`` being ``q``: a later call may pass two) or an
        argument is none of them."""
        names = {}
        for name, t in tensors.items():
            if t is not None and names.setdefault(id(t), name) != name:
                return None
        per_call = {"scale": "scale", "nthreads": "threads"}
        template, slots = [], []
        for i, prm in enumerate(kernel.params):
            value = values[prm.name]
            name = per_call.get(prm.name) or (names.get(id(value), "?") if isinstance(value, torch.Tensor) else None)
            if name == "?":
                return None
            template.append(None if name else value)
            if name:
                slots.append((i, name))
        return template, slots

    def __call__(self, sddmm, v):
        """``(out, probs)``, or None where the pattern's arrays changed since (``prepare`` serves then)."""
        p, q = sddmm.pattern, sddmm.q
        st = p._levels[1]
        pos_ref, pos_version, crd_ref, crd_version = self.arrays
        if pos_ref() is not st.pos or crd_ref() is not st.crd or array_version(st.pos) != pos_version or \
                array_version(st.crd) != crd_version:
            return None
        probs = torch.empty(p._vals.shape, dtype=q.dtype) if self.keep_probs else None
        out = (torch.zeros if self.zero_out else torch.empty)(p._shape[0], v.shape[1], dtype=q.dtype)
        live = {"q": q, "k": sddmm.k, "v": v, "probs": probs, "out": out, "pos": st.pos, "crd": st.crd,
                "scale": sddmm.alpha, "threads": torch.get_num_threads(), "bias": sddmm.bias}
        args = list(self.template)
        for i, name in self.slots:
            x = live[name]
            args[i] = x.data_ptr() if isinstance(x, torch.Tensor) else x
        self.compiled(*args)
        return out, probs


def attention(sddmm: SddmmExpr, v, keep_probs=True):
    """``(out, probs)``: ``softmax_rows(alpha * SDDMM(pattern, q, k)) @ v`` by one fused kernel; ``probs`` is None
    unless ``keep_probs`` (the kernel keeps a row's probabilities in a row buffer then, as it does the scores).
    Public for tests: they call it, and spy on it to see the fused kernel run."""
    p, q, st = sddmm.pattern, sddmm.q, sddmm.pattern._levels[-1]
    key = (id(st.pos), id(st.crd), p._format, p._shape, q.dtype, q.shape, sddmm.k.shape, v.shape, keep_probs,
           sddmm.bias is None)
    ready = READY.get(key)
    if ready is not None:
        done = ready(sddmm, v)
        if done is not None:
            return done
    prepared = prepare(sddmm, v, keep_probs)
    if prepared is None:  # not one row loop each: op by op
        from .ops import segment
        probs = segment.softmax(sddmm.compute(), _rows_pos(sddmm.pattern))
        return engine.einsum("ij,jk->ik", sddmm.pattern.with_values(probs), v), probs
    fused, compiled, values = prepared
    cpp.call(fused, compiled, values)
    bound = _Ready.binding(fused, values, {"q": q, "k": sddmm.k, "v": v, "probs": values.get("probs"),
                                           "out": values["out"], "pos": st.pos, "crd": st.crd, "bias": sddmm.bias})
    if bound is not None and len(p._levels) == 2 and p._levels[0].pos is None and st.crd is not None:  # (CSR)
        zero_out = not _PLANS[_signature(sddmm, v)][1][0].lowered.writes_every_output
        READY[key] = _Ready(compiled, *bound, st, zero_out, keep_probs)
    return values["out"], values["probs"] if keep_probs else None


def _signature(sddmm, v):
    """What the fused attention kernel's plans depend on: the pattern's format, shape and index type, the dense
    operands' type and shapes."""
    p, q = sddmm.pattern, sddmm.q
    return (p._format, p._shape, p._index_dtype, q.dtype, q.shape, sddmm.k.shape, v.shape)


def prepare(sddmm: SddmmExpr, v, keep_probs=True):
    """``(fused kernel IR, compiled kernel, argument values by parameter name)``, or None where the SDDMM or the
    SpMM would not run as one row loop. Public for tests: they run the IR in the loop-IR interpreter."""
    p, q, k = sddmm.pattern, sddmm.q, sddmm.k
    plans = _row_plans(_signature(sddmm, v), p, q.dtype, (q, k), (v,))
    if plans is None:
        return None
    (plan1, sizes1), (plan3, sizes3) = plans
    vt, it = L.type_of(q.dtype), L.type_of(p.index_dtype)
    ct = L.compute_type(vt)
    maps, inner = _KERNEL_MAPS[False, vt != ct]
    additive = sddmm.bias is not None

    def build():
        # the scores are scaled as they are stored, and their max taken there too (no pass over the row for it);
        # without a backward, a row's normalization is applied to the product's output row (one multiply per
        # output instead of a pass over the row's probabilities)
        fused = fuse.rows("scorch_attention", _parts(maps, vt, plan1, lambda t, rounded: fuse.softmax_rows(
            t, it, normalize=keep_probs, peak_of="smax", rounded=rounded if keep_probs else None), plan3))
        fused = L.Kernel(fused.name, fused.params + (L.Param("scale", "scalar", ct),), fused.body)
        fused = fuse.scale_stores(fused, "scores", L.Var("scale", ct))
        if additive:
            fused = fuse.add_stores(fused, "scores", "bias", vt)
        fused = fuse.track_max(fused, "scores", "smax", ct, CPU.lanes(ct))
        if not keep_probs:
            fused = fuse.scale_stores(fused, "out", L.Var("inv_f1", ct))
        # a row's scores (and, without a backward, its probabilities) in a row buffer of each thread; the
        # SDDMM's sampled values are the pattern's ones
        fused = fuse.localize(fused, ("scores",) if keep_probs and inner == "probs" else ("scores", inner), it)
        return fuse.constant(fused, "f0_t0_vals", 1.0)

    built = _compiled((id(plan1), id(plan3), keep_probs, additive), build)
    if built is None:
        return None
    fused, compiled = built
    ones = _ones(p, q.dtype)
    probs = torch.empty(ones._vals.shape, dtype=q.dtype) if keep_probs else None
    # (the SpMM's row loop stores every output row, empty rows included, where its plan says so: no zero fill,
    # which would also wake torch's thread pool between the kernels)
    out = (torch.empty if plan3.lowered.writes_every_output else torch.zeros)(p._shape[0], v.shape[1], dtype=q.dtype)
    scores = torch.empty(0, dtype=q.dtype)  # (the SDDMM part's output: a row buffer in the kernel, only named here)
    values = _part_values(maps, ((0, engine.arguments(plan1, [ones, q, k], sizes1, scores)),
                                 (2, engine.arguments(plan3, [ones, v], sizes3, out))))
    values.update({"probs": probs, "out": out, "scale": sddmm.alpha, "nthreads": torch.get_num_threads(),
                   "longest": _longest(p), "bias": sddmm.bias})
    return fused, compiled, {prm.name: values[prm.name] for prm in fused.params}


def _row_plans(sig, pattern, dtype, first_ops, last_ops):
    """The row plans (``engine.row_plan``, cached by ``sig``) of an SDDMM ``ij,ik,jk->ij`` on ``first_ops`` and
    an SpMM ``ij,jk->ik`` on ``last_ops`` (each after the pattern's ones), or None where either is not one row
    loop, or the SpMM adds into a 16-bit output more than once (``Lowered.out_type``: a float32 buffer rounded
    after the kernel, which the fused kernels do not make)."""
    plans = _PLANS.get(sig)
    if plans is None:  # (planned once per signature: the schedule is not consulted again)
        ones = _ones(pattern, dtype)
        first = engine.row_plan(*_SDDMM, [ones, *first_ops])
        last = engine.row_plan(*_PRODUCT, [ones, *last_ops])
        plans = _PLANS[sig] = None if first is None or last is None or last[0].lowered.out_type else (first, last)
    return plans


def attention_backward(pattern, p, g, v, k, alpha):
    """``(ds, dq)`` of the attention's backward from the probabilities ``p`` and the output's gradient ``g``: the
    scores' gradient ``ds = alpha * softmax_backward(p, SDDMM(pattern, g, v))`` and ``dq = ds @ k``, by one fused
    kernel (a row's ``g @ v^T`` in a row buffer); None where the parts are not one row loop each. Public for
    tests: they call it, and spy on it to see the fused backward run."""
    prepared = prepare_backward(pattern, p, g, v, k, alpha)
    if prepared is None:
        return None
    cpp.call(*prepared)
    return prepared[2]["ds"], prepared[2]["dq"]


def prepare_backward(pattern, p, g, v, k, alpha):
    """``(fused kernel IR, compiled kernel, argument values by parameter name)`` of ``attention_backward``.
    Public for tests: they run the IR in the loop-IR interpreter."""
    dtype = p.dtype
    if dtype not in _FLOATS or g.dtype != dtype or g.device.type != "cpu":
        return None
    g = g.contiguous()
    sig = ("backward", pattern._format, pattern._shape, pattern._index_dtype, dtype, g.shape, v.shape, k.shape)
    plans = _row_plans(sig, pattern, dtype, (g, v), (k,))
    if plans is None:
        return None
    (plan1, sizes1), (plan3, sizes3) = plans
    vt, it = L.type_of(dtype), L.type_of(pattern._index_dtype)
    maps, inner = _KERNEL_MAPS[True, vt != L.compute_type(vt)]

    def build():
        fused = fuse.rows("scorch_attention_backward", _parts(maps, vt, plan1, lambda t, rounded: (
            fuse.softmax_backward_rows(t, it, rounded=rounded)), plan3, backward=True))
        return fuse.constant(fuse.localize(fused, ("dp",) if inner == "ds" else ("dp", inner), it), "f0_t0_vals",
                             1.0)

    built = _compiled(("backward", id(plan1), id(plan3)), build)
    if built is None:
        return None
    fused, compiled = built
    ones = _ones(pattern, dtype)
    ds = torch.empty(p.shape, dtype=dtype)
    dq = (torch.empty if plan3.lowered.writes_every_output else torch.zeros)(pattern._shape[0], k.shape[1],
                                                                              dtype=dtype)
    values = _part_values(maps, ((0, engine.arguments(plan1, [ones, g, v], sizes1, ds)),
                                 (2, engine.arguments(plan3, [ones, k], sizes3, dq))))
    values.update({"probs": p, "ds": ds, "dq": dq, "scale": alpha, "nthreads": torch.get_num_threads(),
                   "longest": _longest(pattern)})
    return fused, compiled, {prm.name: values[prm.name] for prm in fused.params}


RULES.register(fused_product=fused_product)
