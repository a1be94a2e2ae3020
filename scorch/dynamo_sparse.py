"""Sparse results inside a ``torch.compile`` graph (issue 20), beside ``scorch/dynamo.py``'s dense-result products.

A sparse result of an op that keeps its operand's pattern (``sampled_addmm`` keeps its mask's, the sparse softmax and
the zero-preserving maps their input's) is rebuilt inside the graph from the operand's pattern arrays (graph inputs
or values computed earlier in it) and new values: the op computes only the values array. So
``sampled_addmm -> softmax -> mm`` stays sparse end to end, and Inductor sees only dense tensors.

* A zero-preserving map (``unary_maps.MAPS`` marked ``traced``: ``relu``, ``tanh``, ``F.gelu``, ``clamp(x, -1, 1)``
  ..., with number arguments that keep f(0) = 0), ``x * c`` and ``x / c`` are torch's own op on the values: Inductor
  compiles and fuses it like any dense op.
* ``sampled_addmm`` and the sparse ``softmax`` / ``log_softmax`` run scorch's eager implementation inside one
  opaque custom op, ``scorch::eager(name, meta, arrays, sizes, scalars)``, which returns the result's values array
  (``meta``, ``arrays`` and ``sizes`` describe the operands as for ``scorch::einsum_dense``; ``scalars`` are the
  op's numbers). Its gradient, ``scorch::eager_grad``, runs the eager op again with autograd on and asks autograd
  for the floating arrays' gradients: the eager gradient itself.
* scorch's fused attention (``scorch.compile``'s row kernels, ``scorch/fusion.py``) stays available: the traced
  ``sampled_addmm`` (``beta=0``, a CSR mask) and the row softmax of its result remember what they are, and the
  product of those probabilities with a dense ``v`` becomes one ``scorch::eager("attention", ...)`` call, which
  runs the fused kernel (its backward the fused backward kernel). The unfused values ops it replaces are left with
  no user and dropped from the graph; where the probabilities are read otherwise, they stay and are computed too.
* A CSR / CSC / BSR / BSC / COO tensor made inside the compiled function (``torch.sparse_csr_tensor(crow, col,
  values, size)``, as the MoE app builds its gates) is one call in the graph (``torch._dynamo.allow_in_graph``)
  that wraps its arrays, not validated (``check_invariants`` is not honoured while tracing).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _compile_ready
from . import deferred
from .dynamo import PRODUCT_HOOKS, NotCompilable, _flatten, _fresh, _like, _rebuild, assemble, traced
from .compiler import kv_grad as _kv
from .compiler.caches import register
from .formats import LevelStorage
from .formats.storage import PatternMemo
from .formats.format import from_text
from .rules import RULES
from .sparse_tensor import IMPLEMENTATIONS, SparseTensor
from .unary_maps import MAPS

# --- eager scorch ops as one custom op (values of a known pattern, or a dense result) --------------------------

#: name -> ``fn(operands, scalars)``, scorch's eager op (a SparseTensor result gives its values)
EAGER = {}
#: name -> ``fake(arrays, scalars)``: the result's shape and dtype from the operands' arrays (fake tensors)
FAKE = {}


def _run(name, meta, arrays, sizes, scalars):
    with deferred.deferral("off"):
        r = EAGER[name](_rebuild(meta, arrays, sizes), scalars)
        if isinstance(r, SparseTensor):
            r = r._vals
        if deferred.pending(r):
            r = deferred.compute_all([r])[0]
    return r


@torch.library.custom_op("scorch::eager", mutates_args=())
def eager(name: str, meta: str, arrays: list[torch.Tensor], sizes: list[int], scalars: list[float]) -> torch.Tensor:
    """scorch's eager op ``name`` on the operands ``meta``, ``arrays``, ``sizes`` describe: its dense result, or the
    values of its sparse one (aligned with the pattern the op keeps)."""
    return _fresh(_run(name, meta, arrays, sizes, scalars).detach().contiguous(), arrays)


@eager.register_fake
def _eager_fake(name, meta, arrays, sizes, scalars):
    return FAKE[name](arrays, scalars)


def _floating(arrays):
    return [k for k, a in enumerate(arrays) if a.dtype.is_floating_point or a.dtype.is_complex]


def _autograd_recording():
    """Autograd on inside a custom op's implementation: the dispatcher runs it with the autograd keys excluded (torch's
    ops would record no graph), and grad mode off."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                torch._C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
    return _Both(guard, torch.enable_grad())


class _Both:
    def __init__(self, *managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)


@torch.library.custom_op("scorch::eager_grad", mutates_args=())
def eager_grad(name: str, meta: str, arrays: list[torch.Tensor], sizes: list[int], scalars: list[float],
               wanted: list[int], grad: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the arrays ``wanted`` (their indices) of ``eager(name, meta, arrays, sizes, scalars)`` from its
    result's gradient ``grad``, by scorch's eager autograd (zeros where an array does not reach the result)."""
    inputs = list(arrays)
    for k in wanted:
        inputs[k] = arrays[k].detach().requires_grad_()
    with _autograd_recording():
        r = _run(name, meta, inputs, sizes, scalars)
        grads = torch.autograd.grad(r, [inputs[k] for k in wanted], grad, allow_unused=True) if r.requires_grad \
            else [None] * len(wanted)
    out = []
    for k, g in zip(wanted, grads):  # (an output may alias neither an input nor another output)
        out.append(torch.zeros_like(arrays[k]) if g is None else _like(arrays[k], g, [*arrays, grad, *out]))
    return out


@eager_grad.register_fake
def _eager_grad_fake(name, meta, arrays, sizes, scalars, wanted, grad):
    return [torch.empty_like(arrays[k]) for k in wanted]


def _setup_context(ctx, inputs, output):
    name, meta, arrays, sizes, scalars = inputs
    ctx.args = (name, meta, sizes, scalars)
    ctx.wanted = [k for k in _floating(arrays) if arrays[k].requires_grad]  # (needs_input_grad: one flag, the list)
    ctx.save_for_backward(*arrays)


def _backward(ctx, grad):
    arrays = list(ctx.saved_tensors)
    name, meta, sizes, scalars = ctx.args
    grads = [None] * len(arrays)
    if ctx.needs_input_grad[2] and ctx.wanted:
        for k, g in zip(ctx.wanted, torch.ops.scorch.eager_grad(name, meta, arrays, sizes, scalars, ctx.wanted, grad)):
            grads[k] = g
    return None, None, grads, None, None


eager.register_autograd(_backward, setup_context=_setup_context)


def call(name, operands, scalars=()):
    """The graph's ``scorch::eager`` call of ``name`` on ``operands``."""
    meta, arrays, sizes = _flatten(operands)
    return torch.ops.scorch.eager(name, meta, arrays, sizes, [float(s) for s in scalars])


def _sddmm(ops, scalars):
    return IMPLEMENTATIONS[torch.sparse.sampled_addmm](*ops, beta=scalars[0], alpha=scalars[1])


def _softmax(ops, scalars):
    fn = torch.sparse.log_softmax if scalars[1] else torch.sparse.softmax
    return IMPLEMENTATIONS[fn](ops[0], int(scalars[0]))


def _attention(ops, scalars):
    """``softmax(sampled_addmm(mask, q, kt, beta=0, alpha), 1) @ v`` inside ``scorch.compile``: the fused kernel."""
    from .fusion import compile as fuse
    mask, q, kt, v = ops
    return fuse(lambda: torch.sparse.mm(torch.sparse.softmax(
        torch.sparse.sampled_addmm(mask, q, kt, beta=0.0, alpha=scalars[0]), 1), v))()


EAGER.update(sddmm=_sddmm, softmax=_softmax, attention=_attention)
FAKE.update(sddmm=lambda arrays, s: torch.empty_like(arrays[0]),
            softmax=lambda arrays, s: torch.empty_like(arrays[0]),
            attention=lambda arrays, s: arrays[-1].new_empty((arrays[-3].shape[0], arrays[-1].shape[1]),
                                                            dtype=arrays[-1].dtype))


# --- the fused attention, its probabilities kept for the backward -----------------------------------------------
# ``scorch::eager("attention")``'s gradient ran the fused forward again (``eager_grad`` asks eager autograd, which
# needs a recorded forward): a third of the compiled sparse transformer's attention time. Here the forward also
# returns the probabilities, and the backward is the fused backward kernel on them, as eager's ``_FusedAttention``.

def _attention_operands(meta, arrays, sizes):
    """``(mask, q, k, v)`` of the graph's ``[mask, q, kt, v]`` (``k`` row-major, as the fused kernels read it)."""
    mask, q, kt, v = _rebuild(meta, arrays, sizes)
    return mask, q.contiguous(), kt.t().contiguous(), v


@torch.library.custom_op("scorch::attention", mutates_args=())
def attention(meta: str, arrays: list[torch.Tensor], sizes: list[int], alpha: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """``(softmax_rows(alpha * SDDMM(mask, q, kt)) @ v, the probabilities)`` by the fused kernel
    (``fusion.attention``) on the operands ``meta``, ``arrays``, ``sizes`` describe (``[mask, q, kt, v]``)."""
    from .fusion import SddmmExpr, attention as fused
    mask, q, k, v = _attention_operands(meta, arrays, sizes)
    with deferred.deferral("off"), torch.no_grad():
        out, p = fused(SddmmExpr(mask, q, k, alpha), v, keep_probs=True)
    return _fresh(out.contiguous(), arrays), _fresh(p.contiguous(), [*arrays, out])


@attention.register_fake
def _attention_fake(meta, arrays, sizes, alpha):
    return FAKE["attention"](arrays, [alpha]), torch.empty_like(arrays[0])


@torch.library.custom_op("scorch::attention_grad", mutates_args=())
def attention_grad(meta: str, arrays: list[torch.Tensor], sizes: list[int], alpha: float, probs: torch.Tensor,
                   grad: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of ``q``, ``kt`` and ``v`` (the last three arrays) of ``attention`` from its output's gradient
    ``grad`` and its probabilities: the scores' gradient and ``dq`` by the fused backward kernel, then ``dv = P^T
    grad`` and ``dk`` from the scores' gradient by one pass over the mask's kept transposed pattern (``_kv_grad``;
    the general products, eager ``_FusedAttention.backward``'s way, where it declines). Where the fused backward does not
    serve the shapes, eager autograd through the op (``eager_grad``)."""
    from .fusion import _PRODUCT, _einsum_grad, _sddmm_grad, attention_backward
    mask, q, k, v = _attention_operands(meta, arrays, sizes)
    n = len(arrays)
    with deferred.deferral("off"), torch.no_grad():
        done = attention_backward(mask, probs, grad, v, k, alpha)
        if done is None:
            return eager_grad("attention", meta, arrays, sizes, [alpha], [n - 3, n - 2, n - 1], grad)
        ds, dq = done
        kv = _kv_grad(mask, probs, ds, grad, q)
        if kv is not None:
            dv, dk = kv
        else:
            dk = _sddmm_grad(2, mask, q, k, ds)
            dv = _einsum_grad(1, *_PRODUCT, [mask.with_values(probs), v], grad)
    out = []
    for target, g in zip(arrays[-3:], (dq, dk.t(), dv)):
        out.append(_like(target, g, [*arrays, probs, grad, *out]))
    return out


#: per pattern, its transpose for ``_kv_grad`` (the same mask every step)
_TRANSPOSED = PatternMemo(16)
register("attention-transposed", "a mask's pattern by columns, for the compiled attention's dv and dk, by its index"
         " arrays", _TRANSPOSED.__len__, _TRANSPOSED.clear)


def _kv_grad(mask, probs, ds, grad, q):
    """``(dv, dk)`` by one pass over the kept transposed pattern (``kv_grad``: no values gathered into the
    transposed order per call, which each general product with ``P^T`` or ``dS^T`` did), or None where that
    kernel does not take the operands."""
    st = mask._levels[-1]
    if len(mask._levels) != 2 or mask._levels[0].pos is not None or st.pos is None or st.crd is None or \
            not _kv.applies(st.pos, st.crd, probs, grad, q):
        return None
    cols = mask._shape[1]
    transposed = _TRANSPOSED.lookup(("kv_grad", cols), mask._levels, lambda: _kv.transpose(st.pos, st.crd, cols))
    return _kv.kv_grad(transposed, probs, ds, grad.contiguous(), q)


@attention_grad.register_fake
def _attention_grad_fake(meta, arrays, sizes, alpha, probs, grad):
    return [torch.empty_like(a) for a in arrays[-3:]]


def _attention_setup(ctx, inputs, output):
    meta, arrays, sizes, alpha = inputs
    ctx.args = (meta, sizes, alpha)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*arrays, output[1])


def _attention_backward(ctx, grad, _probs_grad):
    *arrays, probs = ctx.saved_tensors
    meta, sizes, alpha = ctx.args
    grads = [None] * len(arrays)
    if ctx.needs_input_grad[1] and any(a.requires_grad for a in arrays[-3:]):
        grads[-3:] = torch.ops.scorch.attention_grad(meta, arrays, sizes, alpha, probs, grad)
    return None, grads, None, None


attention.register_autograd(_attention_backward, setup_context=_attention_setup)

# --- the traced ops ----------------------------------------------------------------------------------------------


_CSR = str(from_text("(i, j) -> (i : dense, j : compressed)"))


def _with_values(x: SparseTensor, values, expr=None) -> SparseTensor:
    r = x._wrap(values)
    r._graph_expr = expr  # what the values are, for the fused attention (``_fused_product``)
    return r


@traced(torch.sparse.sampled_addmm)
def _sampled_addmm(input, mat1, mat2, *, beta=1.0, alpha=1.0, out=None):
    if out is not None or not isinstance(input, SparseTensor) or isinstance(mat1, SparseTensor) or \
            isinstance(mat2, SparseTensor):
        raise NotCompilable("scorch: sampled_addmm under torch.compile takes a sparse input and dense mat1, mat2"
                            " (no out=)")
    if input._format.keeps_duplicates or input._vals.dim() != 1:
        raise NotCompilable(f"scorch: sampled_addmm on a {input._format} input is not supported under torch.compile")
    vals = call("sddmm", [input, mat1, mat2], [beta, alpha])
    fusable = beta == 0 and str(input._format) == _CSR and mat1.dim() == 2 and mat2.dim() == 2 and \
        mat1.dtype == mat2.dtype == input.dtype and mat1.dtype.is_floating_point
    return _with_values(input, vals, ("sddmm", input, mat1, mat2, float(alpha)) if fusable else None)


def _softmax_traced(log):
    def rule(x, dim=None, *args, **kwargs):
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dim is None or not isinstance(x, SparseTensor) or dtype not in (None, x.dtype) or \
                x._format.keeps_duplicates or x._vals.dim() != 1:
            raise NotCompilable(f"scorch: {'log_' if log else ''}softmax under torch.compile takes a SparseTensor"
                                " without duplicates, a dim and no other dtype")
        n = len(x._shape)
        if not -n <= dim < n:
            raise IndexError(f"softmax: dimension {dim} is out of range for a {n}-d tensor")
        dim %= n
        vals = call("softmax", [x], [dim, log])
        expr = getattr(x, "_graph_expr", None)
        fusable = not log and dim == 1 and expr is not None and expr[0] == "sddmm"
        return _with_values(x, vals, ("softmax", expr) if fusable else None)
    return rule


traced(torch.sparse.softmax, torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)(_softmax_traced(False))
traced(torch.sparse.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
       torch.nn.functional.log_softmax)(_softmax_traced(True))


def fused_product(equation, operands):
    """``attn @ v`` as the fused attention (one ``scorch::eager("attention")`` call) where ``attn`` is the row softmax
    of a fusable traced ``sampled_addmm``; None otherwise."""
    if len(operands) != 2 or equation.replace(" ", "") not in ("ij,jk->ik",) or \
            not isinstance(operands[0], SparseTensor) or isinstance(operands[1], SparseTensor):
        return None
    attn, v = operands
    expr = getattr(attn, "_graph_expr", None)
    if expr is None or expr[0] != "softmax" or v.dim() != 2 or v.dtype != attn.dtype:
        return None
    _, mask, q, kt, alpha = expr[1]
    meta, arrays, sizes = _flatten([mask, q, kt, v])
    return torch.ops.scorch.attention(meta, arrays, sizes, float(alpha))[0]


def _unary(m):
    """The traced rule of the map ``m``: torch's op on the values, the pattern kept. Its arguments must be numbers,
    strings or None (the graph's constants), for which f(0) = 0: checked as the eager call checks, on a real zero."""
    fn = m.funcs[0]

    def rule(x, *args, **kwargs):
        if kwargs.get("inplace") is False:  # (F.relu's default)
            del kwargs["inplace"]
        constants = all(a is None or isinstance(a, (bool, int, float, str)) for a in (*args, *kwargs.values()))
        if not isinstance(x, SparseTensor) or "inplace" in kwargs or not constants or \
                (not m.probe and (args or kwargs)) or (m.probe and not _keeps_zero(fn, x.dtype, args, kwargs)):
            raise NotCompilable(f"scorch: {m.name} under torch.compile takes one SparseTensor and number arguments"
                                " for which it maps 0 to 0 (no inplace=True)")
        return _with_values(x, fn(x._vals, *args, **kwargs))
    return rule


def _keeps_zero(fn, dtype, args, kwargs) -> bool:
    """Whether ``fn(0, *args, **kwargs) == 0``, on a real tensor (fake tensors and the graph's tracing set aside)."""
    with _disable_current_modes(), torch.no_grad():
        return bool((fn(torch.zeros(1, dtype=dtype), *args, **kwargs) == 0).all())


for _m in MAPS:
    if _m.traced:
        traced(*_m.funcs)(_unary(_m))


def _scale(op):
    def rule(a, b, *args, **kwargs):
        x, c = (a, b) if isinstance(a, SparseTensor) else (b, a)
        if args or kwargs or not isinstance(x, SparseTensor) or not isinstance(c, (int, float)) or \
                (op == "div" and x is not a):
            raise NotCompilable(f"scorch: {op} under torch.compile takes a SparseTensor and a Python number"
                                " (a SparseTensor divided by it)")
        return _with_values(x, x._vals * c if op == "mul" else x._vals / c)
    return rule


traced(torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)(_scale("mul"))
traced(torch.div, torch.Tensor.div, torch.Tensor.__truediv__)(_scale("div"))


PRODUCT_HOOKS.append(fused_product)

# --- sparse tensors made inside the compiled function -------------------------------------------------------------

_COMPRESSED = {torch.sparse_csr: "csr", torch.sparse_csc: "csc"}
_FORMATS = {"csr": "(i, j) -> (i : dense, j : compressed)", "csc": "(i, j) -> (j : dense, i : compressed)"}


@torch._dynamo.allow_in_graph
def build_compressed(fmt: str, compressed, plain, values, n: int, m: int):
    """A 2-d CSR / CSC SparseTensor wrapping its arrays (one call in the graph; not validated, and built directly:
    ``SparseTensor.__new__``'s checks would guard on a size computed from data)."""
    if compressed.dtype != plain.dtype:
        compressed, plain = compressed.long(), plain.long()
    return assemble(_FORMATS[fmt], (n, m), (LevelStorage(), LevelStorage(pos=compressed.contiguous(),
                                                                          crd=plain.contiguous())),
                    values.contiguous())


def traced_compressed(layout, compressed, plain, values, size, dtype=None, requires_grad=False):
    """``torch.sparse_csr_tensor`` / ``sparse_csc_tensor`` while compiling (``scorch/interop.py``)."""
    if layout not in _COMPRESSED or size is None or len(size) != 2 or values.dim() != 1 or requires_grad:
        raise NotCompilable(f"scorch: sparse_compressed_tensor({layout}) under torch.compile takes 1-d values and a"
                            " 2-d size (CSR or CSC), and no requires_grad (values computed in the function carry"
                            " their gradient)")
    if dtype is not None and dtype != values.dtype:
        values = values.to(dtype)
    for n in size:  # (a size computed from data, as the MoE's slot capacity: an unbacked symbol, known to be >= 0)
        if isinstance(n, torch.SymInt):
            torch._check(n >= 0)
    return build_compressed(_COMPRESSED[layout], compressed, plain, values, size[0], size[1])


RULES.register(traced_tensor=traced_compressed)

_compile_ready.ready(__name__)  # (last: the ops above exist now)
