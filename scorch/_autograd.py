"""Autograd through scorch's compiled ops. The graph lives on the values.

A ``SparseTensor`` is a wrapper around index arrays and a 1-d ``values`` tensor. Its ``requires_grad``,
``grad``, ``grad_fn`` and ``is_leaf`` are its values' (``sparse_tensor.py``), so torch's autograd engine
only ever sees dense tensors: the values of sparse operands and the dense operands. A compiled op that may
need gradients runs as a ``torch.autograd.Function`` whose inputs are those tensors. Its output is the dense
result, or the values of the sparse result (the Function re-wraps them with the result's index arrays).

The derivative of an einsum with respect to an operand is an einsum, run through the same compiler:
- dense operand ``k``: ``grad_k = einsum(out, others -> k)``, expanded along indices only ``k`` has, summed
  over broadcast dimensions;
- sparse operand ``k``: the same einsum with ``k``'s pattern (ones at its stored positions) as one more
  factor and ``k``'s format as the output format. The pattern drives the loops, so only stored positions are
  computed (for ``S @ X``: ``grad_S`` is the SDDMM ``P * (G @ X^T)``) and the result shares ``k``'s index
  arrays; its values are the gradient of ``k``'s values. Never densified.
Backward calls the differentiable einsum, so double backward works where the forward's ops are linear in
each operand (every einsum is). No operand here repeats a letter (``"ii"``): ``engine.einsum`` replaces such
an operand by its diagonal first (``engine/diagonal.py``), and the diagonal's own gradient puts it back.
"""
from __future__ import annotations

import torch

from .compiler.einsum import equation as einsum_string
from .formats import named
from .rules import RULES
# (fusion imports pattern_ones from here)
from .sparse_tensor import SparseTensor, is_pattern_ones, padding_of, pattern_ones  # noqa: F401





class _Spec:
    """What a Function needs besides its tensor inputs: the index letters, the sparse operands' structure,
    the requested format, and (after forward) the structure of a sparse result."""

    __slots__ = ("inputs", "out", "format", "structure", "result", "schedule", "compute", "gradient")

    def __init__(self, inputs, out, fmt, operands, schedule=None, compute=None, gradient=None):
        self.inputs, self.out, self.format, self.schedule = inputs, out, fmt, schedule
        self.compute, self.gradient = compute, gradient
        self.structure = [(x._format, x._shape, x._levels) if type(x) is SparseTensor else None for x in operands]
        self.result = None

    def operands(self, tensors):
        return [t if st is None else SparseTensor(st[0], st[1], st[2], t, check=False)
                for t, st in zip(tensors, self.structure)]

    def wrap(self, values):
        if self.result is None:
            return values
        fmt, shape, levels = self.result
        return SparseTensor(fmt, shape, levels, values, check=False)


def _tensors(operands):
    return [x._vals if type(x) is SparseTensor else x for x in operands]


class _Einsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors):
        from . import engine
        with engine.structural_results():  # (every entry of the result gets its gradient)
            if spec.compute is not None:
                r = spec.compute(*spec.operands(tensors))
            else:
                r = engine.einsum(einsum_string(spec.inputs, spec.out), *spec.operands(tensors),
                                  format=spec.format, schedule=spec.schedule)
        if type(r) is SparseTensor:
            spec.result = (r._format, r._shape, r._levels)
            r = r._vals
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        # an output that is one of the inputs (an identity einsum returns its operand) must be a new tensor
        return r.view_as(r) if any(r is t for t in tensors) else r

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        ops = spec.operands(ctx.saved_tensors)
        gout = spec.wrap(grad)
        grads = [None]
        for k in range(len(ops)):
            g = None
            if ctx.needs_input_grad[k + 1]:
                # (a gradient computed otherwise serves a first backward only: the einsum's own is differentiable)
                g = spec.gradient(k, ops, gout) if spec.gradient is not None and not torch.is_grad_enabled() else None
                g = _einsum_grad(k, spec.inputs, spec.out, ops, gout) if g is None else g
            grads.append(g)
        return tuple(grads)


def differentiable_einsum(equation: str, operands, format=None, schedule=None, compute=None, gradient=None):
    """``engine.einsum`` recording a graph: the result's values (or dense result) have a ``grad_fn``. The user's
    ``schedule`` directs the forward kernel (the gradients are other expressions, scheduled by the compiler).
    ``compute(*operands)``: the forward result computed otherwise (the same einsum, in pieces: a sparse-weight
    ``linear`` in batch tiles), the graph still one node whose gradients are the einsum's. ``gradient(k, operands,
    grad_out)``: operand ``k``'s gradient computed otherwise (a sparse operand's: its values'), or None for the
    einsum's; used in a first backward (a double backward takes the einsum's, which is differentiable)."""
    from .engine import prepare
    from .compiler.einsum import parse
    from .sparse_tensor import shape_of
    ops = prepare(operands)
    inputs, out = parse(equation, [len(shape_of(x)) for x in ops])
    spec = _Spec(inputs, out, format, ops, schedule, compute, gradient)
    values = _Einsum.apply(spec, *_tensors(ops))
    return spec.wrap(values)


# --- gradients of one operand ------------------------------------------------------------------------------

def _einsum_grad(k, inputs, out, ops, gout):
    from . import engine
    target = inputs[k]
    x = ops[k]
    others = [j for j in range(len(ops)) if j != k]
    g_inputs = [tuple(out)] + [inputs[j] for j in others]
    g_ops = [gout] + [ops[j] for j in others]
    g_inputs, g_ops = _merge_shared_patterns(g_inputs, g_ops)
    if type(x) is SparseTensor and not others:
        # a unary einsum (permutation, sums): each stored entry's gradient is the output
        # gradient at the entry's output coordinates; no kernel needed
        return values_at(gout, x, target, tuple(out))
    if type(x) is SparseTensor:
        dtype = gout._vals.dtype if type(gout) is SparseTensor else gout.dtype
        # (an uncoalesced COO's duplicates share one position's gradient: the product on each position once,
        # read back at every entry; on the duplicates themselves the kernel would sum them, once per copy)
        site = engine.asformat(x.detach(), named.coo_nd(x.dim(), dense_dim=x.dense_dim())) if x._format.keeps_duplicates else x
        # (a padded format's padding: no entry to sample, and 0 times a non-finite product there is nan, which
        # must not reach the real entry: read once, for both)
        pad = padding_of(x) if x._format.padded else None
        pattern = site.with_values(pattern_ones(site, dtype) if pad is None else (~pad).to(dtype))
        r = engine.einsum(einsum_string([target] + g_inputs, target), pattern, *g_ops, format=site._format)
        g = values_at(r, x)
        return g if pad is None else torch.where(pad, 0, g)
    sizes, _ = engine.index_sizes(inputs, ops, "einsum")
    present = {v for idx in g_inputs for v in idx}
    have = tuple(v for v in target if v in present)
    if any(type(t) is SparseTensor for t in g_ops):
        r = engine.einsum(einsum_string(g_inputs, have), *g_ops, format="dense" if have else None)
    else:
        r = torch.einsum(einsum_string(g_inputs, have), *g_ops)
    if type(r) is SparseTensor:
        r = r.to_dense()
    # indices only this operand has: the gradient is constant along them
    full = r.reshape([sizes[v] if v in have else 1 for v in target]).expand([sizes[v] for v in target])
    if tuple(full.shape) != tuple(x.shape):  # broadcast dimensions of size 1
        full = full.sum_to_size(x.shape)
    return full


def _shares_arrays(a: SparseTensor, b: SparseTensor) -> bool:
    """The same pattern by construction: the same format and shape over the very same index arrays."""
    if a._format != b._format or a._shape != b._shape or a._vals.shape != b._vals.shape:
        return False
    return a._levels is b._levels or all(
        p is q for x, y in zip(a._levels, b._levels) for p, q in ((x.pos, y.pos), (x.crd, y.crd)))


def _merge_shared_patterns(inputs, ops):
    """Sparse factors indexed alike on the same arrays multiply value by value: one operand instead of two
    for the kernel to co-iterate (the output gradient of an SDDMM lies on the sampled matrix's pattern)."""
    inputs, ops = list(inputs), list(ops)
    k = 0
    while k < len(ops):
        a = ops[k]
        j = next((j for j in range(k + 1, len(ops)) if type(a) is SparseTensor and type(ops[j]) is SparseTensor
                  and inputs[j] == inputs[k] and _shares_arrays(a, ops[j])), None)
        if j is None:
            k += 1
            continue
        b = ops[j]._vals
        # (one of them the pattern's ones, as an SDDMM's sampled operand: the other's values as they are)
        ops[k] = a.with_values(b if is_pattern_ones(a._vals) and b.dtype == a._vals.dtype else
                               a._vals if is_pattern_ones(b) and a._vals.dtype == b.dtype else a._vals * b)
        del ops[j], inputs[j]
    return inputs, ops


def values_at(r, x: SparseTensor, letters=None, r_letters=None):
    """The values of ``r`` (dense or sparse) at every stored position of ``x``, aligned with ``x.values()``;
    0 at padding and where ``r`` has no entry. ``r_letters`` name ``r``'s dimensions by ``x``'s ``letters``
    (distinct; default: ``r`` is indexed as ``x``). A result that shares ``x``'s index arrays gives its values
    directly."""
    if r_letters is None and type(r) is SparseTensor and _shares_arrays(r, x):
        # (the same index arrays: a compiled graph's gradient is rebuilt around the parameter's own arrays, in new
        # level records, which took the general lookup below, a sort and a search per step)
        # (a padded format's padding slots are no entries: ``(W + W).values().sum()`` gives them gradient)
        return r._vals.masked_fill(padding_of(x), 0) if x._format.padded else r._vals
    from .formats import storage
    leaf, coords = storage.entries(x._format, x._shape, x._levels, x._vals)
    if r_letters is not None:
        coords = coords[[tuple(letters).index(v) for v in r_letters]]
    dtype = r._vals.dtype if type(r) is SparseTensor else r.dtype
    out = torch.zeros(x._vals.shape, dtype=dtype, device=x._vals.device)
    if leaf.numel() == 0:
        return out + 0 * (r._vals.sum() if type(r) is SparseTensor else r.sum())  # keeps the graph
    if type(r) is SparseTensor:
        got = storage.lookup(r._format, r._shape, r._levels, r._vals, coords)
    elif r.layout != torch.strided:  # (torch's own sparse gradient: nn.Embedding(sparse=True), for one)
        got = r.to_dense()[tuple(coords)]
    else:
        got = r[tuple(coords)]
    return out.index_put((leaf,), got, accumulate=True)


# --- other compiled ops: sums of operands (``S1 + alpha * S2``), max/min reductions -----------------------

class _Run(torch.autograd.Function):
    """``engine.run`` of an elementwise sum of operands (each a term ``T``, ``-T`` or ``alpha * T`` over the
    output's indices) or of a max/min reduction of one operand."""

    @staticmethod
    def forward(ctx, spec, kwargs, *tensors):
        from . import engine
        r = engine.run(spec.inputs, spec.out, spec.operands(tensors), format=spec.format, **kwargs)
        if type(r) is SparseTensor:
            spec.result = (r._format, r._shape, r._levels)
            r = r._vals
        ctx.spec, ctx.kwargs = spec, kwargs
        ctx.save_for_backward(*tensors, r)
        return r

    @staticmethod
    def backward(ctx, grad):
        spec, kw = ctx.spec, ctx.kwargs
        *tensors, r = ctx.saved_tensors
        ops = spec.operands(tensors)
        gout = spec.wrap(grad)
        grads = [None, None]
        if kw.get("reduce", "sum") != "sum":
            grads.append(_extremum_grad(spec.inputs[0], spec.out, ops[0], spec.wrap(r), gout))
            return tuple(grads)
        coef = _linear_terms(kw["rhs"], kw.get("scalars") or {})
        for k, x in enumerate(ops):
            if not ctx.needs_input_grad[k + 2]:
                grads.append(None)
                continue
            c = coef[k]
            g = values_at(gout, x) if type(x) is SparseTensor else (
                gout.to_dense() if type(gout) is SparseTensor else gout)
            grads.append(g if c == 1 else g * c)
        return tuple(grads)


def _linear_terms(rhs, scalars) -> dict:
    """``{operand: coefficient}`` of an elementwise sum of terms; NotImplementedError for anything else."""
    from .compiler.ir import Access, Add, Map, Mul, Scalar
    coef = {}
    for term in (rhs.terms if isinstance(rhs, Add) else (rhs,)):
        c = 1
        if isinstance(term, Map) and term.op == "neg":
            c, term = -1, term.arg
        elif isinstance(term, Mul) and len(term.factors) == 2 and isinstance(term.factors[0], Scalar):
            c, term = scalars[term.factors[0].name], term.factors[1]
        if not isinstance(term, Access) or term.operand in coef:
            raise NotImplementedError(f"scorch: no derivative for the expression {rhs}")
        coef[term.operand] = c
    return coef


def differentiable_run(inputs, out, ops, *, format=None, **kwargs):
    """``engine.run`` recording a graph (sums of operands and max/min reductions)."""
    if kwargs.get("reduce", "sum") == "sum":
        _linear_terms(kwargs["rhs"], kwargs.get("scalars") or {})  # refuse what backward cannot do, now
    spec = _Spec(inputs, out, format, ops)
    return spec.wrap(_Run.apply(spec, kwargs, *_tensors(ops)))


def _extremum_grad(src, out, x, r, gout):
    """The gradient of ``amax``/``amin`` of a sparse ``x``: shared evenly among the entries equal to the
    extremum, as torch shares it among tied elements (an implicit zero that ties takes its share, which is
    lost: it is not stored)."""
    if type(x) is not SparseTensor:
        raise NotImplementedError("scorch: amax/amin backward of a dense operand")
    from .formats import storage
    r = r.to_dense() if type(r) is SparseTensor else r
    g = gout.to_dense() if type(gout) is SparseTensor else gout
    leaf, dims = storage.entries(x._format, x._shape, x._levels, x._vals)
    keep = [src.index(v) for v in out]
    cell = tuple(dims[d] for d in keep)
    if not keep:  # (every dimension reduced: the one cell, as a 1-element vector)
        r, g, cell = r.reshape(1), g.reshape(1), (torch.zeros_like(leaf),)
    vals = x._vals[leaf]
    tie = (vals == r[cell]).to(torch.float64)
    # ties per output cell (counted in float64: 3000 ties in bfloat16 counted 256): stored ones, plus the implicit
    # zeros when the extremum is 0
    stored = torch.zeros(r.shape, dtype=tie.dtype, device=g.device).index_put(cell, torch.ones_like(tie),
                                                                              accumulate=True)
    ties = torch.zeros(r.shape, dtype=tie.dtype, device=g.device).index_put(cell, tie, accumulate=True)
    reduced = 1
    for d, n in enumerate(x._shape):
        if d not in keep:
            reduced *= n
    ties = ties + torch.where(r == 0, reduced - stored, torch.zeros_like(stored))
    share = ((g / ties.clamp(min=1))[cell] * tie).to(g.dtype)
    return torch.zeros(x._vals.shape, dtype=g.dtype, device=g.device).index_put((leaf,), share, accumulate=True)


# --- format conversion ------------------------------------------------------------------------------------

class _Convert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, convert, t):
        r = convert(spec.operands([t])[0])
        spec.result = (r._format, r._shape, r._levels)
        ctx.spec = spec
        ctx.save_for_backward(t)
        return r._vals.view_as(r._vals) if r._vals is t else r._vals

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        g = spec.wrap(grad)
        if spec.structure[0] is None:  # from dense: the gradient scattered back
            return None, None, g.to_dense()
        src = spec.operands(ctx.saved_tensors)[0]
        return None, None, values_at(g, src)


def differentiable_convert(x, convert_fn):
    """``convert_fn(x)`` (a format conversion) recording a graph from ``x``'s values (or ``x``, dense) to the
    result's values."""
    spec = _Spec((), (), None, [x])
    return spec.wrap(_Convert.apply(spec, convert_fn, _tensors([x])[0]))


# --- the wrapper in torch's graph (``_traceable``, the end of the module) ------------------------------------

class _Attach(torch.autograd.Function):
    """The node a SparseTensor over computed values hangs from in torch's graph: its forward returns the wrapper
    itself (given in a list: as an input it would come back as a view), whose history torch sets in place; its
    backward reads the wrapper's gradient at the stored positions, as the values' gradient."""

    @staticmethod
    def forward(ctx, box, values):
        x = box[0]  # (below: the pattern with no graph, so the node holds no path back to the wrapper)
        ctx.pattern = x._wrap(x._vals.detach())
        ctx.set_materialize_grads(False)  # (no gradient reached the wrapper: none, rather than dense zeros)
        return box[0]

    @staticmethod
    def backward(ctx, grad):
        return None, None if grad is None else values_at(grad, ctx.pattern)


def attach_wrapper(x):
    """Put ``x`` (its values require grad) in torch's graph. Over leaf values (a parameter) the wrapper is a leaf
    too, whose accumulated gradient each backward hands to the values (``_to_values``); over computed values it is
    a node over them (``_Attach``)."""
    if x._vals.is_leaf:
        with torch._C.DisableTorchFunctionSubclass():
            torch._C.TensorBase.requires_grad_(x)
            if not x.__dict__.get("_bridged"):
                torch.Tensor.register_post_accumulate_grad_hook(x, _to_values)
        x._bridged = True
    else:
        with torch.enable_grad():  # (made under no_grad and compiled later: ``__tensor_flatten__``)
            _Attach.apply([x], x._vals)


def _to_values(x):
    """The post-accumulate hook of a leaf wrapper: its gradient (dense, torch-sparse, or a SparseTensor of any
    pattern) read at its stored positions and accumulated into the values by torch's engine, so that the values'
    own hooks run for it too; the wrapper keeps none."""
    with torch._C.DisableTorchFunctionSubclass():
        g = torch._C.TensorBase.grad.__get__(x)
        torch._C.TensorBase.grad.__set__(x, None)
    if g is not None:  # (plain tensors: the values' hooks, a user's, run as under any backward)
        torch.autograd.backward(x._vals, values_at(g, x))


class _Adopt(torch.autograd.Function):
    """Values under a wrapper's own history (``_traceable.adopt``): a view of the values, whose gradient goes back
    to the wrapper on its pattern (a SparseTensor sharing its index arrays)."""

    @staticmethod
    def forward(ctx, x):
        ctx.structure = (x._format, x._shape, x._levels)  # (not the wrapper: its values will hold this node)
        return x._vals.view_as(x._vals)

    @staticmethod
    def backward(ctx, grad):
        fmt, shape, levels = ctx.structure
        return SparseTensor(fmt, shape, levels, grad, check=False)


def adopt_wrapper(x):
    """Give ``x`` values that are a node under its wrapper's history."""
    with torch.enable_grad():
        x._vals = _Adopt.apply(x)


RULES.register(differentiable_einsum=differentiable_einsum, differentiable_run=differentiable_run,
               differentiable_convert=differentiable_convert, attach_wrapper=attach_wrapper,
               adopt_wrapper=adopt_wrapper)
