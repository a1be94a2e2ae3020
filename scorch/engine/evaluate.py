"""An einsum call, from operands to result: torch sparse layouts and numbers taken in, repeated letters and
early sums done once (``diagonal``), deferred operands substituted (``deferred``), the differentiable case
handed to ``_autograd``, three or more operands split by a contraction tree (``compiler.contract``: kernels,
grouped products, dense torch steps), and each kernel through ``run``.
"""
from __future__ import annotations

import functools

import torch

from ..compiler import contract
from ..compiler.caches import cache
from ..compiler.einsum import equation as einsum_string
from ..compiler.einsum import parse, to_index_notation
from ..compiler.grouped import match as match_grouping, moe_operands
from ..compiler.infer import infer
from ..compiler.ir import Assignment, Mul, Scalar, TensorType
from ..compiler.pipeline import Plan
from ..compiler.schedule import Directives, directives_of
from .. import loopir as L
from ..formats import named
from ..rules import RULES
from ..sparse_tensor import NoSparseRule, SparseTensor, needs_grad, shape_of
from . import grouped, prepared
from .prepared import _functorch_wrapped
from .prepared import SDDMM, keep_product, keep_sddmm, kept_call, kept_product, kept_sddmm  # noqa: F401  (old names)
from .convert import asformat, compressed_rows, from_torch
from .args import tensor_type
from .bind import backend_for, cast, index_sizes, result_dtype
from .run import _EXPLAINING, run

_PATHS = cache("paths", "contraction trees per equation, sizes and nnz (to a power of two)")
_FAST_EQ = prepared.BY_EQUATION  # (the name tests and tools knew it by)


def prepare(operands):
    """Torch sparse layouts become SparseTensors (zero-copy); numbers become 0-d tensors; deferred results are
    computed."""
    out = []
    for x in operands:
        if type(x) is SparseTensor:
            out.append(x)
        elif type(x) is torch.Tensor and x.layout == torch.strided:
            out.append(x.resolve_neg() if x.is_neg() else x)  # (a kernel reads storage: the bit resolved first)
        elif type(x) is RULES.lazy_type:
            out.append(x.compute())
        elif isinstance(x, SparseTensor):
            out.append(x)
        elif isinstance(x, torch.Tensor):
            out.append(from_torch(x) if x.layout != torch.strided else x)
        elif isinstance(x, (int, float, bool)):
            out.append(torch.tensor(x))
        else:
            raise TypeError(f"einsum operands must be tensors, got {type(x).__name__}")
    return out


def _sums_integers(equation, x) -> bool:
    """Whether the one-operand ``equation`` sums ``x``'s integer values over an index (torch then gives int64, as
    ``torch.sum``: ``einsum("ijk->k", int32)`` is int64, ``"ijk->kji"`` keeps int32)."""
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.int64 or not isinstance(equation, str):
        return False
    (letters,), out = parse(equation, (x.dim(),))
    return bool(set(letters) - set(out))


def einsum(equation, *operands, format=None, explain=False, backend="cpp", schedule=None):
    """``torch.einsum`` over any mix of dense and sparse operands; sparse ones go through the compiler.
    ``schedule``: the user's directives for the kernel (``compiler.schedule.Directives``: a loop order, the
    parallel loop, whether the sparse operand may be converted, the format of a contraction's temporaries)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if any(type(x) is torch.Tensor and x.is_neg() for x in operands):  # (torch's negative bit: kernels read
        operands = tuple(x.resolve_neg() if type(x) is torch.Tensor else x for x in operands)  # storage)
    if len(operands) == 1 and type(operands[0]) is SparseTensor and _sums_integers(equation, operands[0]):
        operands = (cast(operands[0], torch.int64),)  # (torch's one-operand einsum sums with torch.sum: int64)
    if any(type(x) is torch.Tensor and _functorch_wrapped(x) for x in operands) and \
            any(isinstance(x, SparseTensor) for x in operands):
        # (vmap, jvp, torch.func.grad, a vectorized jacobian: their wrapped tensors have no storage a kernel could
        # read) the dense form
        raise NoSparseRule("under a torch.func transform (vmap, grad, jvp)")
    directives = None if schedule is None else Directives.of(schedule)
    explain = explain or _EXPLAINING.calls
    # a signature seen before: its prepared call, in memory or kept on disk (only calls with no early step, no
    # gradient and one kernel on the operands as given are kept under it: the end of this function)
    sig = None if explain or backend != "cpp" else prepared.equation_key(equation, format, directives, operands)
    if sig is not None:
        found = prepared.find(sig)
        if found is not None:
            return found.run(operands, None)
    if operands and type(operands[0]) is SparseTensor and type(operands[0]._vals) is RULES.lazy_type and \
            format in (None, "dense") and not explain and backend == "cpp":
        # lazy attention probabilities (scorch.compile) times a dense matrix: one kernel
        r = RULES.fused_product(equation, operands)
        if r is not None:
            return r
    if RULES.lazy_type in map(type, operands):
        fused = RULES.substitute_lazy(equation, operands)
        if fused is not None:
            kept = format if format is not None else fused[2] or "dense"  # the format the eager call gives
            return einsum(fused[0], *fused[1], format=kept, explain=explain, backend=backend, schedule=directives)
    if not any(isinstance(x, torch.Tensor) and (isinstance(x, SparseTensor) or x.layout != torch.strided)
               for x in operands):  # torch computes, and differentiates, dense einsums itself
        r = torch.einsum(equation, *prepare(operands))
        fmt = None if format is None else named.resolve(format, r.dim())
        return r if fmt is None or fmt.is_dense else asformat(r, fmt)
    early = _diagonals_and_sums(equation, operands, explain)
    if early is not None:
        return einsum(early[0], *early[1], format=format, explain=explain, backend=backend, schedule=directives)
    if needs_grad(operands) and not explain and backend == "cpp":
        r = _grouped_with_grad(equation, operands) if directives is None and format in (None, "dense") else None
        if r is not None:
            return r
        if directives is not None:
            return RULES.differentiable_einsum(equation, operands, format, schedule=directives)
        return RULES.differentiable_einsum(equation, operands, format)
    ops = prepare(operands)
    inputs, out = parse(equation, [len(shape_of(x)) for x in ops])
    name = f"einsum({equation!r})"
    if any(type(x) is torch.Tensor and 0 in x.stride() for x in ops):
        inputs, ops = _unbroadcast(inputs, ops)
    one_kernel = directives is not None and (directives.order is not None or directives.parallel is not None)
    if len(ops) >= 3 and not one_kernel:  # (a user's loop order schedules the whole expression as one loop nest)
        tree = contraction_path(inputs, out, ops, name)
        if tree.parts is not None or tree.grouped is not None:
            if explain:
                print(f"contraction:  {contract.describe(tree, inputs)}")
            r = evaluate_tree(tree, inputs, ops, out, format, backend, explain, directives)
            want = result_dtype(ops, name)  # (16-bit operands: dense steps ran in float32, see evaluate_tree)
            return r if r.dtype == want else cast(r, want)
    result = run(inputs, out, ops, format=format, explain=explain, name=name, backend=backend, directives=directives)
    if sig is not None and all(a is b for a, b in zip(ops, operands)):
        found = prepared.BY_CALL.get(prepared.call_signature(inputs, out, ops, format, None, "sum", directives))
        if found is not None:
            prepared.keep(sig, found)  # the same prepared call, found from the equation string directly
    return result


def _grouped_with_grad(equation, operands):
    """A mixture-of-experts product that needs gradients (``compiler.grouped.moe_operands``): the grouped product's own
    autograd Function (the entries sorted once, the backward on the same order and the gathered rows), whatever
    the planner would pick for the forward alone: a generated kernel's backward is three more einsums, the gate's
    a four-operand kernel, which its cost does not see (the app's training step at 512 tokens, width 64, 16
    experts: 2.8 ms through the kernel, 1.7 ms grouped). None otherwise."""
    if len(operands) != 3:
        return None
    ops = prepare(operands)
    if not all(isinstance(x, torch.Tensor) for x in ops) or \
            any(type(x) is not SparseTensor and 0 in x.stride() for x in ops):  # (broadcast views: the generic way)
        return None
    inputs, out = parse(equation, [len(shape_of(x)) for x in ops])
    name = f"einsum({equation!r})"
    sizes, _ = index_sizes(inputs, ops, name)
    g = match_grouping(inputs, out, [isinstance(x, SparseTensor) for x in ops], sizes)
    if g is None or moe_operands(g, inputs, out) is None:
        return None
    r = grouped.evaluate(g, inputs, out, ops, sizes)
    want = result_dtype(ops, name)
    return r if r.dtype == want else r.to(want)


def _diagonals_and_sums(equation, operands, explain=False):
    """``(equation, operands)`` of the same einsum with every operand that repeats a letter (``"ii"``) replaced by
    its diagonal (``engine.diagonal``) and, where there are several operands, the letters only one operand has and
    the output has not summed out of it first (as torch does); None when there is nothing to do. This is the one
    place repeated letters are treated: nothing below (contraction paths, schedules, kernels, gradients) meets a
    letter repeated within an operand, and the diagonals are differentiable, so gradients flow through them."""
    if _nothing_early(equation):
        return None
    if not all(isinstance(x, (torch.Tensor, int, float, bool)) for x in operands):
        return None  # (the call refuses the operand: prepare)
    steps = _early_steps(equation, tuple(len(shape_of(x)) if isinstance(x, torch.Tensor) else 0 for x in operands))
    if steps is None:
        return None
    from .diagonal import check_sizes, diagonal
    eq, per_operand = steps
    ops = []
    for k, (x, (letters, uniq, kept)) in enumerate(zip(prepare(operands), per_operand)):
        if uniq != letters:
            check_sizes(letters, x, k, f"einsum({equation!r})")
            x = diagonal(x, letters)
            if explain:
                print(f"diagonal:     T{k} ({''.join(letters)}) replaced by its diagonal ({''.join(uniq)})")
        if kept != uniq:
            gone = [d for d, v in enumerate(uniq) if v not in kept]
            if explain:
                print(f"sum:          T{k} summed over {''.join(uniq[d] for d in gone)} first: no other operand"
                      " and not the output has it")
            if type(x) is SparseTensor:
                x = einsum(einsum_string([uniq], kept), x, explain=explain)
            else:
                x = x.sum(gone, dtype=x.dtype)  # (torch's sum of integers would widen them)
        ops.append(x)
    return eq, ops


@functools.lru_cache(maxsize=1024)
def _nothing_early(equation) -> bool:
    """True when an equation without ``...`` repeats no letter within an operand and has no letter to sum early,
    whatever its operands (a repeated call then skips the operands' dimensions: a few microseconds)."""
    if not isinstance(equation, str) or "." in equation:
        return False
    try:
        terms = equation.replace(" ", "").split("->")[0].split(",")
        return _early_steps(equation, tuple(len(t) for t in terms)) is None
    except ValueError:  # (a malformed equation: the call says what is wrong)
        return False


@functools.lru_cache(maxsize=1024)
def _early_steps(equation, ndims):
    """``(equation, steps)``: per operand ``(letters, distinct letters, letters kept after the early sums)`` and
    the equation over the kept letters (``_diagonals_and_sums``); None where no step changes anything."""
    inputs, out = parse(equation, ndims)
    holders = {}
    for idx in inputs:
        for v in set(idx):
            holders[v] = holders.get(v, 0) + 1
    steps = []
    for idx in inputs:
        uniq = tuple(dict.fromkeys(idx))
        kept = uniq if len(inputs) < 2 else tuple(v for v in uniq if v in out or holders[v] > 1)
        steps.append((idx, uniq, kept))
    if all(kept == idx for idx, _, kept in steps):
        return None
    return einsum_string([kept for _, _, kept in steps], out), tuple(steps)


def inferred_format(inputs, out, ops, dtype):
    """The output format inferred for one kernel over ``ops`` (None: dense)."""
    types = tuple(tensor_type(cast(x, dtype)) if type(x) is SparseTensor else
                  TensorType(x.dim(), dtype, None, None, x.device.type) for x in ops)
    return infer(Assignment(tuple(out), to_index_notation(inputs), types)).format


def dense_result(equation, ops, format):
    """``(inputs, out, shape, dtype)`` of an einsum over ``ops`` (one or two operands, a sparse one among them)
    whose result is a dense tensor, checked as the call checks it; None where the result would be sparse, the
    einsum has more operands, or the call would first take diagonals or sums (``_diagonals_and_sums``)."""
    ndims = tuple(len(shape_of(x)) for x in ops)
    inputs, out = parse(equation, ndims)
    name = f"einsum({equation!r})"
    sizes, _ = index_sizes(inputs, ops, name)
    dtype = result_dtype(ops, name)
    backend_for(ops, "cpp", name)
    if len(ops) > 2 or _early_steps(equation, ndims) is not None:
        return None
    if format is not None:
        if not named.resolve(format, len(out)).is_dense:
            return None
    elif inferred_format(inputs, out, ops, dtype) is not None:
        return None
    return inputs, out, [sizes[v] for v in out], dtype


def _unbroadcast(inputs, ops):
    """A dense operand repeated along a dimension (stride 0: ``expand``, ``rearrange(x, "bd->bnd")``) is read as
    the operand without that dimension, where another operand gives the index its extent: the product then does
    not repeat the work along it."""
    new_inputs, new_ops = [], []
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        if type(x) is torch.Tensor:
            for d in reversed(range(x.dim())):
                v = idx[d]
                if x.stride(d) == 0 and x.shape[d] > 1 and any(v in i for j, i in enumerate(inputs) if j != k):
                    x = x.select(d, 0)
                    idx = idx[:d] + idx[d + 1:]
        new_inputs.append(tuple(idx))
        new_ops.append(x)
    return tuple(new_inputs), new_ops


def contraction_path(inputs, out, ops, name):
    """The contraction tree, kept per equation, sizes and nnz (rounded to a power of two: the cost model's
    choices do not hinge on finer differences), so a repeated call does not search again."""
    sizes, _ = index_sizes(inputs, ops, name)
    nnz = [float(x.nnz) if isinstance(x, SparseTensor) else float(x.numel()) for x in ops]
    compiled = grouped.compiled_operands(ops)
    key = (inputs, out, tuple(sorted(sizes.items())),
           tuple((isinstance(x, SparseTensor), int(n).bit_length()) for x, n in zip(ops, nnz)), compiled)
    node = _PATHS.get(key)
    if node is None:
        meta = [contract.Operand(idx, isinstance(x, SparseTensor), n,
                                 frozenset(idx) if isinstance(x, SparseTensor) else frozenset())
                for idx, x, n in zip(inputs, ops, nnz)]
        node = contract.best_path(meta, out, sizes, compiled)
        _PATHS[key] = node
    return node


def evaluate_tree(node, inputs, ops, target, format=None, backend="cpp", explain=False, directives=None,
                  inner=False):
    """Run a contraction tree: each node is one kernel (or one torch.einsum when all its inputs are dense). An
    ``inner`` node's dense step on 16-bit operands runs in float32, so that the step that reads it rounds once
    (the caller rounds the tree's result to the operands' type)."""
    if node.grouped is not None:
        idx = [inputs[k] for k in node.leaves]
        leaves = [ops[k] for k in node.leaves]
        if explain:
            by = "compiled grouped kernels" if grouped.compiled_operands(leaves) and \
                moe_operands(node.grouped, idx, tuple(target)) else "torch"
            print(f"grouped:      {contract.describe(node, inputs)}: the entries of the sparse operand grouped by"
                  f" {''.join(node.grouped.group)}, one dense product per group ({by})")
        sizes, _ = index_sizes(idx, leaves, "einsum")
        r = grouped.evaluate(node.grouped, idx, tuple(target), leaves, sizes)
        # the format a kernel would have written: the requested one, else the inferred one
        fmt = named.resolve(format, len(target)) if format is not None else \
            inferred_format(idx, tuple(target), leaves, r.dtype)
        if fmt is None or fmt.is_dense:
            return r
        if not r.requires_grad:  # rows kept whole (a requested rows-compressed format): r's memory becomes the values
            rows = compressed_rows(r.contiguous(), fmt, None, False, copy=False)
            if rows is not None:
                return rows
        return asformat(r, fmt)
    if node.parts is None:
        parts = [(ops[k], inputs[k]) for k in node.leaves]
    else:
        temporary = directives.temporary if directives is not None else None  # (the user's format of temporaries)
        parts = [(evaluate_tree(p, inputs, ops, p.indices, temporary, backend, explain, inner=True), p.indices)
                 for p in node.parts]
    tensors = [t for t, _ in parts]
    idx = tuple(i for _, i in parts)
    if len(parts) == 1 and tuple(idx[0]) == tuple(target) and format is None:
        return tensors[0]  # a leaf already in the target's index order: nothing to compute
    if not any(isinstance(t, SparseTensor) for t in tensors):
        eq = einsum_string(idx, target)
        if explain:
            print(f"dense step:   torch.einsum({eq!r})")
        if inner:
            tensors = [t.float() if t.dtype in L.HALF_DTYPES else t for t in tensors]
        r = torch.einsum(eq, *tensors)
        fmt = None if format is None else named.resolve(format, len(target))
        return r if fmt is None or fmt.is_dense else asformat(r, fmt)
    return run(idx, tuple(target), tensors, format=format, name="einsum", backend=backend, explain=explain)


class Explanation(str):
    """What ``scorch.explain`` returns: the report (a ``str``; its ``repr`` is the report too, so the REPL shows it
    once, as text), and the plans behind it: ``plans`` (each kernel's ``Plan`` or ``CoPlan``, in the order they
    ran), ``schedule`` (the last kernel's schedule, printable), ``directives`` (the ``schedule=`` that gives that
    schedule again, to edit and pass to ``scorch.einsum``; None for a merge of several sparse operands) and
    ``source`` (the generated source of every kernel, whether or not the report shows it)."""
    plans: tuple = ()

    def __repr__(self):
        return str(self).rstrip("\n")

    @property
    def schedule(self):
        return self.plans[-1].schedule if self.plans else None

    @property
    def directives(self):
        plan = self.plans[-1] if self.plans else None
        if plan is None or not isinstance(plan, Plan):
            return None
        return directives_of(plan.asg, plan.schedule)

    @property
    def source(self) -> str:
        return "\n".join(p.source if isinstance(p, Plan) else "\n".join(p.sources.values()) for p in self.plans)


def scaled(equation, alpha, *operands, format=None):
    """``alpha * einsum(equation, *operands)`` with ``alpha`` inside the kernel: the sum is scaled in float32 and
    rounded once (a 16-bit result scaled afterwards is rounded twice), and no second pass goes over the values.
    A product with a gradient to take is the einsum scaled by torch (its gradient rules are the einsum's). The
    kernel's explicit product still has its dense operands relaid like the einsum's (``run``): without that, a
    float32 ``sampled_addmm(alpha=0.5)`` on the uniform 20k matrix took 14.8 ms against 3.0 at alpha=1."""
    if alpha == 1 or needs_grad(operands):
        r = einsum(equation, *operands, format=format)
        return r if alpha == 1 else r * alpha
    inputs, out = parse(equation, [x.dim() for x in operands])
    rhs = Mul((Scalar("alpha"),) + to_index_notation([tuple(ix) for ix in inputs]).factors)
    return run(tuple(map(tuple, inputs)), tuple(out), prepare(list(operands)), format=format, rhs=rhs,
               scalars={"alpha": alpha}, name="einsum")


def explain(equation, *operands, format=None, schedule=None, source=False, file=None) -> Explanation:
    """Run ``einsum(equation, *operands)`` and return its plan as a report (``Explanation``: a ``str``, with the
    plans behind it): the contraction order for three or more operands, the inferred output format and the rule
    that chose it, any operand reformatting, the loop order, workspaces and assembly, the parallel loop,
    specialized extents, where each kernel came from (compiled now, disk or memory cache); with ``source=True``
    the generated source too (``.source`` has it either way). Nothing is printed unless ``file`` is given (a
    file object the report is written to): ``print(scorch.explain(...))``, or the REPL's echo, shows it once.

    ``equation`` may instead be a module or function: ``explain(layer, x)`` runs ``layer(x)`` (without
    gradients) and reports every compiled product it runs, with the directives a ``scorch.schedule`` gave the
    layer (``.directives`` is then the last product's). Products served by a library or the dense-activation x
    sparse-weight kernels (``engine.weights``) run as usual and are not reported."""
    import contextlib
    import io
    call = callable(equation) and not isinstance(equation, str)
    if call and (format is not None or schedule is not None):
        raise TypeError("scorch.explain(module_or_function, *args): format= and schedule= are for an equation")
    buf = io.StringIO()
    before = _EXPLAINING.plans, _EXPLAINING.source, _EXPLAINING.calls
    _EXPLAINING.plans, _EXPLAINING.source, _EXPLAINING.calls = [], bool(source), call
    try:
        with contextlib.redirect_stdout(buf):
            if call:
                with torch.no_grad():
                    equation(*operands)
            else:
                einsum(equation, *operands, format=format, explain=True, schedule=schedule)
        plans = tuple(_EXPLAINING.plans)
    finally:
        _EXPLAINING.plans, _EXPLAINING.source, _EXPLAINING.calls = before
    text = Explanation(buf.getvalue() or "(no compiled plan: dense operands go straight to torch)\n")
    text.plans = plans
    if file is not None:
        print(text, end="", file=file)
    return text
