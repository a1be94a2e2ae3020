"""scorch under ``torch.compile`` (issue 20): einsums with sparse operands as torch custom ops.

A SparseTensor is a traceable wrapper subclass (``scorch/_traceable.py``): Dynamo puts an op on it in the graph as
it is, and AOTAutograd runs the graph on SparseTensors over fake arrays, through ``__torch_function__``. While
compiling, ``__torch_function__`` hands the op here (``RULES.traced_op``): the engine behind it (einsum planning,
generated kernels called through ctypes) cannot be traced, so a supported op becomes one opaque call,
``torch.ops.scorch.einsum_dense(equation, meta, arrays, sizes)``. ``arrays`` are plain tensors (the sparse operands' values
and level arrays, and the dense operands), so the graph AOTAutograd hands on to Inductor holds only dense tensors;
``meta`` is text (each sparse operand's format and which level arrays it has), a constant of the graph, and
``sizes`` the sparse operands' shapes (symbolic under dynamic shapes). The
real implementation rebuilds the SparseTensors and runs scorch's eager einsum; the fake one gives the output's
shape and dtype. The gradient of each array is ``torch.ops.scorch.einsum_grad``, which runs scorch's eager
gradient (``_autograd._einsum_grad``: an SDDMM on the pattern for a sparse operand, never dense).

Supported here: ``@``, ``torch.matmul``, ``torch.mm``, ``torch.sparse.mm``, ``torch.mv``, ``torch.addmm``,
``torch.einsum`` and ``F.linear`` (``scorch.nn.SparseLinear``) with a sparse operand and a dense result (sparse x
dense); gradients of the dense operands and of a sparse input's leaf values. Ops with a sparse result of a known
pattern (``sampled_addmm``, the sparse softmax, zero-preserving maps) and the fused attention are
``scorch/dynamo_sparse.py``'s (``PRODUCT_HOOKS``: a product's call other than ``einsum_dense``). Every op's rule is
one entry of ``TRACED`` (torch function -> ``rule(*args, **kwargs)``), registered beside the rule, as
``jax.experimental.sparse`` fills its rule tables; any other op on a SparseTensor inside a compiled region raises
``NotCompilable`` naming the op.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from ._autograd import _einsum_grad
from ._traceable import FLATTENED, flat_key
from . import _compile_ready
from . import engine
from .compiler import relayout
from .compiler.einsum import parse
from .formats.format import from_text
from .formats import LevelStorage
from .engine import weights as weight_kernels
from .engine import prepared
from .engine.bind import STRUCTURAL, cpu_backend_name
from .engine.convert import kept_conversion
from .compiler.einsum import equation as einsum_string
from .ops.linalg import _linear_gradient, matmul_equation
from .rules import RULES
from .sparse_tensor import SparseTensor

#: the product of ``F.linear`` with a sparse weight in a graph (``_linear``): x (b x i) by the weight (o x i)
LINEAR = "bi,oi->bo"

# --- meta text: one item per operand, ";" between them -------------------------------------------------------
# a dense operand: "D"; a sparse one: "S|<format text>|<arrays>", <arrays> one letter pair per level (p: pos present,
# c: crd present, -: absent), e.g. "S|(i, j) -> (i : dense, j : compressed)|--pc". A sparse operand's shape is not
# text: its sizes are an argument of the op (``sizes``, every sparse operand's in turn), symbolic where Dynamo
# makes them dynamic.


def _sparse_meta(fmt_text: str, levels) -> str:
    have = "".join(("p" if st.pos is not None else "-") + ("c" if st.crd is not None else "-") for st in levels)
    return "S|" + fmt_text + "|" + have


def _flatten(operands):
    """``(meta, arrays, sizes)`` of ``operands`` (SparseTensors and dense tensors)."""
    metas, arrays, sizes = [], [], []
    for x in operands:
        if isinstance(x, SparseTensor):
            metas.append(_sparse_meta(str(x._format), x._levels))
            sizes.extend(x._shape)
            arrays.append(x._vals)
            for st in x._levels:
                if st.pos is not None:
                    arrays.append(st.pos)
                if st.crd is not None:
                    arrays.append(st.crd)
        else:
            metas.append("D")
            arrays.append(x)
    return ";".join(metas), arrays, sizes


@functools.lru_cache(maxsize=1024)
def _parsed(meta: str) -> tuple:
    """Per operand of ``meta``: None (dense) or ``(format text, number of dimensions, arrays letters)`` (a graph's
    constant: parsed once, not on each call of its op)."""
    out = []
    for item in meta.split(";"):
        if item == "D":
            out.append(None)
        else:
            _, fmt, have = item.split("|")
            out.append((fmt, from_text(fmt).ndim, have))
    return tuple(out)


def _items(meta: str, sizes=None):
    """Per operand: None (dense) or ``(format text, shape, arrays letters)`` (the shape from ``sizes``: the format's
    number of dimensions of them)."""
    out, at = [], 0
    for item in _parsed(meta):
        if item is None:
            out.append(None)
        else:
            fmt, n, have = item
            out.append((fmt, None if sizes is None else tuple(sizes[at:at + n]), have))
            at += n
    return out


def _arity(item) -> int:
    """How many arrays an operand takes: 1 for a dense one, values plus its present level arrays for a sparse one."""
    return 1 if item is None else 1 + sum(c != "-" for c in item[2])


def _rebuild(meta: str, arrays, sizes):
    """The operands ``_flatten`` flattened: a SparseTensor input of the compiled call itself where the arrays are
    its own (``_traceable.FLATTENED``), else the arrays wrapped again (not validated: they were valid)."""
    ops, k = [], 0
    for item in _items(meta, sizes):
        if item is None:
            ops.append(arrays[k])
            k += 1
            continue
        fmt, shape, have = item
        vals, k = arrays[k], k + 1
        levels = []
        for p, c in zip(have[0::2], have[1::2]):
            pos = crd = None
            if p != "-":
                pos, k = _canonical(arrays[k]), k + 1
            if c != "-":
                crd, k = _canonical(arrays[k]), k + 1
            levels.append(LevelStorage(pos=pos, crd=crd))
        t = _flattened(fmt, shape, levels, vals)
        ops.append(_share_conversions(assemble(fmt, shape, levels, vals)) if t is None else t)
    return ops


def _flattened(fmt: str, shape, levels, vals):
    """The SparseTensor a compiled call flattened into exactly these arrays (the same objects), of this format and
    shape, or None."""
    t = FLATTENED.get(flat_key(vals, levels))
    if t is None or t._vals is not vals or tuple(t._shape) != tuple(shape) or len(t._levels) != len(levels) or \
            any(a.pos is not b.pos or a.crd is not b.crd for a, b in zip(t._levels, levels)) or \
            str(t._format) != fmt:
        return None
    return t


#: the conversions kept for a SparseTensor (``engine.convert``'s ``_conversions``), shared by every SparseTensor
#: ``_rebuild`` makes over the same array objects. An eager constant operand (an adjacency, the features) keeps its
#: transposition for the backward on itself; a graph's op rebuilt a new tensor each call and converted it again
#: (a gather by the pattern's kept permutation, a new SparseTensor: about 20 us of a 200 us gradient product on
#: Cora). Keyed by the format, the shape and the arrays' ids, checked by weak references (an entry goes with the
#: first of its arrays); a kept conversion is still checked against the arrays' versions and the values'
#: fingerprints before it is used.
_CONVERSIONS: dict = {}


def _share_conversions(r: SparseTensor) -> SparseTensor:
    arrays = (_canonical(r._vals),) + tuple(a for st in r._levels for a in (st.pos, st.crd) if a is not None)
    key = (str(r._format), tuple(r._shape), *map(id, arrays))  # (a conversion is of a format and shape too)
    entry = _CONVERSIONS.get(key)
    if entry is None or any(ref() is not a for ref, a in zip(entry[0], arrays)):
        def drop(_, key=key):
            got = _CONVERSIONS.get(key)
            if got is not None and any(ref() is None for ref in got[0]):
                del _CONVERSIONS[key]
        entry = _CONVERSIONS[key] = ([weakref.ref(a, drop) for a in arrays], {})
    r.__dict__["_conversions"] = entry[1]
    return r


#: the first Python object seen over each index array's memory (by data pointer, dtype, shape, strides), by weak
#: reference: AOTAutograd hands an array saved for the backward back as another object over the same memory (an
#: alias), and scorch's pattern memos (``PatternMemo``, the transposition's ``recurring_pattern``) key on the
#: arrays' identity: a compiled backward missed them every step (its sparse products' transpositions weighed
#: and made again each call)
_CANONICAL: dict = {}


def _canonical(a: torch.Tensor) -> torch.Tensor:
    """The first object seen over ``a``'s memory while it lives, where it reads the same data as ``a`` (the same
    storage, view and version: aliases share the version counter), else ``a`` (and ``a`` is that object now)."""
    if a.is_inference():  # (no version counter: the memos keep nothing of it either)
        return a
    key = (a.data_ptr(), a.dtype, a.device, tuple(a.shape), a.stride())
    ref = _CANONICAL.get(key)
    c = None if ref is None else ref()
    if c is a or (c is not None and c._version == a._version and
                  c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()):
        return c  # (``a`` itself: a graph input, the same object every call)

    def drop(r, key=key):
        if _CANONICAL.get(key) is r:
            del _CANONICAL[key]
    _CANONICAL[key] = weakref.ref(a, drop)
    return a


def assemble(fmt: str, shape, levels, vals) -> SparseTensor:
    """A SparseTensor over arrays a graph holds (valid: they came from one, or its own ops made them), made directly
    (``SparseTensor.__new__``'s checks cost about 80 us a call, and would guard on a size computed from data);
    through ``__new__`` where an array is not contiguous or the index types differ."""
    arrays = [a for st in levels for a in (st.pos, st.crd) if a is not None]
    if not vals.is_contiguous() or any(not a.is_contiguous() for a in arrays) or \
            len({a.dtype for a in arrays}) > 1:
        return SparseTensor(from_text(fmt), shape, levels, vals, check=False)
    r = torch.Tensor._make_wrapper_subclass(SparseTensor, shape, dtype=vals.dtype, device=vals.device)
    r._format, r._shape, r._levels, r._vals = from_text(fmt), torch.Size(shape), tuple(levels), vals
    r._index_dtype = arrays[0].dtype if arrays else torch.int64
    return r


def _shapes(meta: str, arrays, sizes):
    """Each operand's shape (a sparse one's from ``sizes``, a dense one's from its array)."""
    shapes, k = [], 0
    for item in _items(meta, sizes):
        shapes.append(tuple(arrays[k].shape) if item is None else item[1])
        k += _arity(item)
    return shapes


def _value_arrays(meta: str, arrays):
    """The index in ``arrays`` of each operand's values (sparse) or tensor (dense)."""
    first, k = [], 0
    for item in _items(meta):
        first.append(k)
        k += _arity(item)
    return first


def _fresh(r: torch.Tensor, arrays) -> torch.Tensor:
    """A custom op's output may not alias an input: a copy where ``r`` shares storage with one. A view of a buffer
    of the op's own (a kernel's result reshaped) is returned detached from it: not a view, and not copied."""
    ptr = r.untyped_storage().data_ptr()
    if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in arrays):
        return r.clone()
    return r.detach() if r._base is not None else r


def _like(target: torch.Tensor, g: torch.Tensor, inputs=()) -> torch.Tensor:
    """The gradient ``g`` of ``target`` laid out as ``target`` (``empty_like``: the strides the fake implementation
    promises, a transposed operand's included): ``g`` itself where it already is (a copy of a whole activation's
    gradient per product was most of the compiled GCN's extra time over eager), unless it shares storage with one
    of the op's ``inputs`` (a custom op's output may not alias them)."""
    if g.dtype == target.dtype and g.shape == target.shape and g.device == target.device and \
            target.is_contiguous():
        if g.is_contiguous():
            return _fresh(g, inputs)
        if g.dim() == 2 and g.device.type == "cpu" and g.t().is_contiguous():  # (transposed: scorch's copy)
            return _fresh(relayout.dim_last(g.t(), 0), inputs)
    return torch.empty_like(target).copy_(g)


def _weight_product(equation: str, ops):
    """``(weight, x)`` where ``equation`` is ``F.linear``'s product (``_linear``) of a dense ``x`` and a sparse weight
    that the weight family takes (``engine.weights``: the kernels eager ``F.linear`` runs, forward and backward),
    else None: the compiled graph calls the same kernels as the eager model, not the general lowering's."""
    if equation != LINEAR or len(ops) != 2 or type(ops[1]) is not SparseTensor or type(ops[0]) is not torch.Tensor:
        return None
    return (ops[1], ops[0]) if weight_kernels.applies(ops[1], ops[0]) else None


# --- the ops -------------------------------------------------------------------------------------------------

@torch.library.custom_op("scorch::einsum_dense", mutates_args=())
def einsum_dense(equation: str, meta: str, arrays: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``engine.einsum(equation, *operands, format="dense")`` of the operands ``meta``, ``arrays`` and ``sizes``
    describe."""
    ops = _rebuild(meta, arrays, sizes)
    wx = _weight_product(equation, ops)
    r = weight_kernels.linear(*wx) if wx else engine.einsum(equation, *ops, format="dense")
    if isinstance(r, SparseTensor):
        r = r.to_dense()
    return _fresh(r.contiguous(), arrays)


@einsum_dense.register_fake
def _einsum_dense_fake(equation, meta, arrays, sizes):
    shapes = _shapes(meta, arrays, sizes)
    inputs, out = parse(equation, [len(s) for s in shapes])
    sizes = {}
    for letters, shape in zip(inputs, shapes):
        for v, n in zip(letters, shape):
            if guard_or_true(sizes.get(v, 1) == 1):  # (a size computed from data: not 1, as a broadcast)
                sizes[v] = n
    dtype = arrays[0].dtype
    for k in _value_arrays(meta, arrays)[1:]:
        dtype = torch.promote_types(dtype, arrays[k].dtype)
    return arrays[0].new_empty([sizes[v] for v in out], dtype=dtype)


@torch.library.custom_op("scorch::einsum_grad", mutates_args=())
def einsum_grad(equation: str, meta: str, k: int, arrays: list[torch.Tensor], sizes: list[int],
                grad: torch.Tensor) -> torch.Tensor:
    """The gradient of operand ``k``'s values (sparse: aligned with its values array) or tensor (dense) from the
    gradient ``grad`` of the dense result of ``einsum_dense(equation, meta, arrays, sizes)``."""
    ops = _rebuild(meta, arrays, sizes)
    wx = _weight_product(equation, ops)
    g = _linear_gradient(1 - k, wx, grad.t()) if wx else None  # (its operands: the weight first)
    if g is None:
        g = _kept_gradient(equation, k, ops, grad)
    if g is None:
        inputs, out = parse(equation, [len(x._shape) if isinstance(x, SparseTensor) else x.dim() for x in ops])
        g = _einsum_grad(k, inputs, out, ops, grad)
        _keep_gradient(equation, k, inputs, out, ops, grad)
    if isinstance(g, SparseTensor):
        g = g.to_dense()
    return _like(arrays[_value_arrays(meta, arrays)[k]], g, [*arrays, grad])


# --- a dense operand's gradient by its product's kept call ----------------------------------------------------
# The gradient of the dense operand of a product with one sparse operand is one product of the output's gradient
# and the sparse operand (``_einsum_grad``), which eager einsum plans through every time: its preamble (operand
# checks, signatures, lookups), then the replay of the steps kept for the call (``run.STEPS``: a transposition of
# the sparse operand for a parallel loop, the kernel's output order). A compiled backward calls it with the same
# operands every step, so the replay is kept where the sparse operand's conversions are (``_CONVERSIONS``: by its
# arrays, gone with them): the conversion (``kept_conversion``, which still checks the kept transposition against the
# arrays' versions and the values' fingerprints), the kernel's operand signatures checked, the kernel.

def _gradient_key(equation, k, ops, grad):
    """``(memo, key)``: where the kept gradient call of dense operand ``k`` is, or None where none applies (two
    operands, one sparse, a plain contiguous output gradient, no graph to record)."""
    if len(ops) != 2 or k not in (0, 1) or isinstance(ops[k], SparseTensor) or type(ops[1 - k]) is not SparseTensor \
            or type(grad) is not torch.Tensor or not grad.is_contiguous() or grad.is_neg() or \
            (torch.is_grad_enabled() and (grad.requires_grad or ops[1 - k]._vals.requires_grad)):
        return None
    memo = ops[1 - k].__dict__.get("_conversions")
    if memo is None:
        return None
    return memo, ("gradient", equation, k, grad.shape, grad.dtype, grad.device)


def _generations():
    return (prepared.BY_CALL.generation, prepared.STEPS.generation, prepared.BY_EQUATION.generation,
            STRUCTURAL.on, cpu_backend_name())


def _kept_gradient(equation, k, ops, grad):
    """Dense operand ``k``'s gradient by the kept call (``_keep_gradient``), or None."""
    at = _gradient_key(equation, k, ops, grad)
    entry = None if at is None else at[0].get(at[1])
    if entry is None or entry[0] != _generations():
        return None
    _, transpose, found, want, result = entry
    s = ops[1 - k]
    if transpose is not None:
        s = kept_conversion(s, transpose)
        if prepared.signature(s) != want:  # (another index width: the general way)
            return None
    return result(found.run([grad, s], None))


def _keep_gradient(equation, k, inputs, out, ops, grad) -> None:
    """Keep the call ``_einsum_grad`` just ran for dense operand ``k`` (the product ``grad`` times the sparse
    operand, found as eager einsum finds it: by its equation, else by its assignment's signature, taking a
    transposition and an output order first), where it was one kernel on the operands as given, or those steps."""
    at = _gradient_key(equation, k, ops, grad)
    if at is None:
        return
    g_inputs, target = [tuple(out), inputs[1 - k]], inputs[k]
    if {v for idx in g_inputs for v in idx} < set(target):  # (an index only operand k has: the gradient expands)
        return
    s = ops[1 - k]
    found, transpose, want, result = None, None, None, (lambda r: r)
    eq = einsum_string(g_inputs, target)
    sig = prepared.equation_key(eq, "dense", None, (grad, s))
    if sig is not None:
        found = prepared.BY_EQUATION.get(sig)
    if found is None:
        g_in, g_out = parse(eq, [grad.dim(), len(s._shape)])
        call = prepared.call_signature(g_in, g_out, [grad, s], "dense", None, "sum", None)
        found = prepared.BY_CALL.get(call)
        replay = prepared.STEPS.get(call) if found is None else None
        if replay is not None:
            steps, kernel_sig, found = replay
            if steps.relayout or (steps.transpose is not None and steps.transpose[0] != 1):
                return
            if steps.transpose is not None:
                transpose, want = steps.transpose[1], kernel_sig[-1]
            result = functools.partial(steps.result, out=g_out)
    if found is not None:
        at[0][at[1]] = (_generations(), transpose, found, want, result)


@einsum_grad.register_fake
def _einsum_grad_fake(equation, meta, k, arrays, sizes, grad):
    return torch.empty_like(arrays[_value_arrays(meta, arrays)[k]])


def _setup_context(ctx, inputs, output):
    equation, meta, arrays, sizes = inputs
    ctx.equation, ctx.meta, ctx.sizes, ctx.n = equation, meta, sizes, len(arrays)
    ctx.wanted = [a.requires_grad for a in arrays]  # (per array: needs_input_grad has one flag for the list)
    ctx.save_for_backward(*arrays)


def _backward(ctx, grad):
    arrays = list(ctx.saved_tensors)
    grads = [None] * ctx.n
    for k, at in enumerate(_value_arrays(ctx.meta, arrays)):
        if ctx.needs_input_grad[2] and ctx.wanted[at] and arrays[at].dtype.is_floating_point:
            grads[at] = torch.ops.scorch.einsum_grad(ctx.equation, ctx.meta, k, arrays, ctx.sizes, grad)
    return None, None, grads, None


einsum_dense.register_autograd(_backward, setup_context=_setup_context)


class NotCompilable(RuntimeError):
    """An op on a SparseTensor that scorch cannot put in a compiled graph yet. (Not a NotImplementedError: Dynamo
    takes that for a graph break and goes on tracing into the eager implementation, which fails obscurely.)"""


# --- routing from SparseTensor.__torch_function__ while Dynamo traces ----------------------------------------

#: torch function -> ``rule(*args, **kwargs)``, its call in the graph while Dynamo traces, filled next to each rule
#: (here: the products with a dense result; ``scorch/dynamo_sparse.py``: the ops with a sparse one)
TRACED = {}
#: ``hook(equation, operands)``: a product's graph call other than ``einsum_dense`` (the fused attention), or None
PRODUCT_HOOKS = []


def traced(*funcs):
    """Register the decorated rule as the traced implementation of each of ``funcs``."""
    def register(rule):
        for f in funcs:
            TRACED[f] = rule
        return rule
    return register


def traced_op(func, types, args, kwargs):
    """The graph's call for ``func(*args, **kwargs)`` with a sparse operand, while Dynamo traces."""
    rule = TRACED.get(func)
    if rule is not None:
        return rule(*args, **kwargs)
    if getattr(func, "__name__", "") in _ATTRIBUTE_ACCESS:
        return NotImplemented  # an attribute read (Dynamo reads some itself): as in eager
    raise _unsupported(func)


def _unsupported(func) -> NotCompilable:
    return NotCompilable(
        f"scorch: {getattr(func, '__name__', func)} on a SparseTensor is not supported under torch.compile yet"
        " (supported: @, torch.matmul, torch.mm, torch.mv, torch.addmm, torch.einsum and F.linear with a sparse"
        " operand and a dense result; sampled_addmm, sparse softmax and zero-preserving maps with a sparse one)")


def _product(func, equation, operands):
    """The graph's call for the product ``equation`` of ``operands`` (None: not supported), which must give a dense
    result: a hook's (the fused attention) or one ``einsum_dense``."""
    dense_out = func is torch.Tensor.to_dense or any(not isinstance(x, SparseTensor) for x in operands)
    if equation is None or not dense_out or not all(isinstance(x, torch.Tensor) for x in operands):
        raise _unsupported(func)
    for hook in PRODUCT_HOOKS:
        r = hook(equation, operands)
        if r is not None:
            return r
    meta, arrays, sizes = _flatten(operands)
    return torch.ops.scorch.einsum_dense(equation, meta, arrays, sizes)


def _matmul(func, swapped=False):
    """The rule of a product traced as ``@`` (``torch.mv`` too: a 2-d by 1-d matmul); ``swapped``: ``__rmatmul__``."""
    def rule(*args, **kwargs):
        if len(args) != 2 or kwargs:
            raise _unsupported(func)
        operands = [args[1], args[0]] if swapped else list(args)
        equation = None
        if all(isinstance(x, torch.Tensor) for x in operands):
            da, db = _ndim(operands[0]), _ndim(operands[1])  # (a sparse result, "j,j->", or a batched one: not yet)
            equation = matmul_equation(da, db) if (da, db) in ((2, 2), (2, 1), (1, 2)) else None
        return _product(func, equation, operands)
    return rule


for _f in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.sparse.mm,
           torch.mv, torch.Tensor.mv):
    TRACED[_f] = _matmul(_f)
TRACED[torch.Tensor.__rmatmul__] = _matmul(torch.Tensor.__rmatmul__, swapped=True)


@traced(torch.einsum)
def _einsum(*args, **kwargs):
    if kwargs or len(args) < 2:
        raise _unsupported(torch.einsum)
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    return _product(torch.einsum, args[0], operands)


@traced(torch.Tensor.to_dense)
def _to_dense(*args, **kwargs):
    """The entries scattered: ``"ab->ab"``, a dense result."""
    if len(args) != 1 or kwargs or not isinstance(args[0], SparseTensor):
        raise _unsupported(torch.Tensor.to_dense)
    letters = "abcdefgh"[:_ndim(args[0])]
    return _product(torch.Tensor.to_dense, f"{letters}->{letters}", list(args))


def _addmm(func):
    def rule(*args, **kwargs):
        if len(args) != 3:
            raise _unsupported(func)
        return _addmm_dense(*args, **kwargs)
    return rule


for _f in (torch.addmm, torch.Tensor.addmm, torch.sparse.addmm):
    TRACED[_f] = _addmm(_f)


def _addmm_dense(input, mat1, mat2, *, beta=1, alpha=1):
    """``beta * input + alpha * (mat1 @ mat2)`` with a dense ``input``: the product one custom op."""
    if isinstance(input, SparseTensor) or _ndim(mat1) != 2 or _ndim(mat2) != 2:
        raise NotCompilable("scorch: addmm under torch.compile takes a dense input and 2-d mat1, mat2")
    prod = traced_op(torch.mm, (), (mat1, mat2), {})
    prod = prod if alpha == 1 else prod * alpha
    return prod if beta == 0 else prod + (input if beta == 1 else input * beta)


@traced(torch.nn.functional.linear)
def _linear(input, weight, bias=None):
    """``F.linear`` with a sparse weight (out x in) or a sparse 2-d input: ``input @ weight.T + bias``, the product
    one custom op."""
    if isinstance(weight, SparseTensor) and not isinstance(input, SparseTensor):
        lead = input.shape[:-1]
        out = traced_op(torch.einsum, (), (LINEAR, input.reshape(-1, input.shape[-1]), weight), {})
        out = out.reshape(*lead, out.shape[-1])
    elif isinstance(input, SparseTensor) and not isinstance(weight, SparseTensor) and _ndim(input) == 2:
        out = traced_op(torch.einsum, (), ("bi,oi->bo", input, weight), {})
    else:
        raise NotCompilable("scorch: linear under torch.compile takes a sparse weight and a dense input, or a 2-d"
                            " sparse input and a dense weight")
    return out if bias is None else out + bias


def _wrapper_answers(func):
    """Dynamo's own reads of the wrapper (fakeifying an input: its strides, as ``_make_wrapper_subclass`` made
    them): the wrapper answers."""
    def rule(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return rule


for _f in (torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.untyped_storage, torch.Tensor.data_ptr,
           torch.Tensor._is_view, torch.Tensor.is_conj, torch.Tensor.is_neg, torch.Tensor.is_inference,
           torch.Tensor._is_zerotensor):
    TRACED[_f] = _wrapper_answers(_f)


@traced(torch.autograd.grad)
def _grad(*args, **kwargs):
    """AOTAutograd's ``torch.autograd.grad`` with a SparseTensor input (``ops.autograd_api.grad``): as in eager."""
    return NotImplemented


_ATTRIBUTE_ACCESS = ("__get__", "__set__", "__delete__")


def _ndim(x) -> int:
    return len(x._shape) if isinstance(x, SparseTensor) else x.dim()


RULES.register(traced_op=traced_op)

_compile_ready.ready(__name__)  # (last: the ops above exist now)
