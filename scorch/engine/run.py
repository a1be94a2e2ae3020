"""Running one assignment (``run``): operand types -> a compiled plan (``compiler.pipeline``), with the decisions
that change the operands before the kernel (a transposition of the driver for a parallel loop, the output
computed in another index order, a dense operand relaid), then the kernel on the operands (``bind``).
A call whose signature was seen before goes straight to its prepared call.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

from ..compiler import library, relayout
from ..compiler.caches import cache
from ..compiler.pipeline import coiteration_plan, compiled_plan, planned, target_of
from ..compiler.ir import reindexed
from ..compiler.schedule import discordant_format, transposed_for_parallel
from ..formats import named
from ..rules import RULES
from ..sparse_tensor import SparseTensor, dtype_of, needs_grad
from . import memory
from .args import tensor_type, worker_count
from .bind import STRUCTURAL, backend_for, call_coiteration, call_plan, cast, index_sizes, result_dtype
from .prepared import BY_CALL, STEPS, Prepared, call_signature, prepared_call
from .convert import asformat, converted_already, recurring_pattern


class _Explaining(threading.local):
    plans = None
    source = True  # the generated source in the printed plan (``scorch.explain(source=...)``)
    calls = False  # every einsum explains itself (``scorch.explain(module_or_function, *args)``)


_EXPLAINING = _Explaining()


def explaining() -> bool:
    """Whether ``scorch.explain`` runs a whole call (a module's forward), whose products report themselves."""
    return _EXPLAINING.calls


def explained(plan):
    """Print ``plan`` (a call with ``explain=True``) and keep it for ``scorch.explain``'s result."""
    print(plan.explain(source=_EXPLAINING.source))
    if _EXPLAINING.plans is not None:
        _EXPLAINING.plans.append(plan)


def _memory_order(inputs, ops):
    """Dense operands that are permuted views of contiguous memory (``k.T``, ``x.permute(...)``) read in their
    memory order: the view permuted back to contiguous and its index letters permuted alike (the same
    expression), instead of a contiguous copy of the view (which a relayout might then copy back)."""
    inputs, ops = list(inputs), list(ops)
    for k, x in enumerate(ops):
        if type(x) is SparseTensor or type(x) is RULES.lazy_type or x.dim() < 2 or x.is_contiguous():
            continue
        order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        y = x.permute(order)
        if y.is_contiguous():
            inputs[k], ops[k] = tuple(inputs[k][d] for d in order), y
    return tuple(inputs), ops


class Steps(NamedTuple):
    """The steps between a call's operands and its kernel, each decided once on the plan so far, in this order,
    and replayed by later calls of the same signature (``STEPS``): ``transpose`` (a sparse operand converted:
    ``(operand, format)``, for the user's loop order or a parallel loop), ``output_order`` (the index order the
    kernel writes the output in, returned as a view in the call's order), ``relayout`` (dense operands copied with
    a dimension last: ``relayout.moves``). ``format``: the kernel's output format (a transposition names it)."""
    transpose: tuple | None = None
    output_order: tuple | None = None
    relayout: tuple = ()
    format: Any = None

    @property
    def names(self) -> tuple:
        """The steps taken, by name."""
        return tuple(n for n, v in zip(("transpose", "output order", "relayout"),
                                       (self.transpose, self.output_order, self.relayout)) if v)

    def apply(self, inputs, out, ops, rhs=None):
        """``(inputs, target, ops, rhs)`` after the steps: the kernel's accesses, output order and operands."""
        ops = list(ops)
        if self.transpose is not None:
            k, fmt = self.transpose
            ops[k] = asformat(ops[k], fmt)
        if self.relayout:
            before = inputs
            inputs, ops = relayout.apply(self.relayout, inputs, ops, memory.kept_empty)
            for k, _ in self.relayout if rhs is not None else ():
                rhs = reindexed(rhs, k, before[k], inputs[k])
        return inputs, self.output_order or out, ops, rhs

    def result(self, r, out):
        """The kernel's result ``r`` in the call's output order ``out``."""
        return r if self.output_order is None else r.permute(*[self.output_order.index(v) for v in out])


def run(inputs, out, ops, *, format=None, explain=False, name="einsum", rhs=None, scalars=None, backend="cpp",
        reduce="sum", directives=None):
    """Evaluate ``out[...] = sum(rhs)`` where ``rhs`` defaults to the product of the accesses ``inputs``.
    ``directives``: the user's schedule (``compiler.schedule.Directives``), else the compiler's.

    One pass, top to bottom: a signature seen before takes its prepared call, or replays its ``Steps``; else the
    plan of the operands as given, then the ``Steps`` (``_decide``), each decided on the plan so far, applied once,
    then the kernel, its prepared call kept under the signature of the operands it gets, and the steps under the
    call's."""
    if (rhs is not None or reduce != "sum") and backend == "cpp" and not explain and needs_grad(ops):
        return RULES.differentiable_run(inputs, out, ops, format=format, name=name, rhs=rhs, scalars=scalars,
                                        reduce=reduce)
    if rhs is None and not all(type(x) is SparseTensor or x.is_contiguous() for x in ops):
        inputs, ops = _memory_order(inputs, ops)
    # (a differentiable einsum's result may take another format: structural_results)
    sig = call_signature(inputs, out, ops, format, rhs, reduce, directives)
    kept = backend == "cpp" and not explain
    if kept:
        found = BY_CALL.get(sig)
        if found is not None:
            return found.run(ops, scalars)
        replay = STEPS.get(sig)
        if replay is not None:
            result = _replayed(replay, inputs, out, ops, rhs, reduce, directives, scalars)
            if result is not None:
                return result
    sizes, broadcast = index_sizes(inputs, ops, name)
    dtype = result_dtype(ops, name)
    # the prepared call passes the operands' data pointers as they are: contiguous, of the result's dtype
    as_given = all((type(x) is SparseTensor or x.is_contiguous()) and dtype_of(x) == dtype for x in ops)
    backend = backend_for(ops, backend, name)
    ops = [cast(x, dtype) for x in ops]
    at = _Planning(inputs, out, ops, format, broadcast, rhs, reduce, directives)
    if at.n_sparse == 0:
        raise NotImplementedError(f"scorch: {name} with a requested format and no sparse operand")
    if STRUCTURAL.on and format is None and at.output.format is not None and at.output.format.padded:
        # a padded level cannot hold an entry that is 0 (it would read as padding, and lose its gradient): the
        # inferred format's unpadded version (ELL -> CSR); the call's own signature asked for another format
        from ..compiler.schedule import coiterable_version
        format = coiterable_version(at.output.format)
        at.replan(format=format)
        as_given = False
    _refused(at, name)
    if at.n_sparse > 1:
        return _coiterated(at.key, at.asg, at.output, ops, sizes, broadcast, dtype, scalars, backend, explain, reduce,
                           directives, name)
    steps, first_weighing = _decide(at, sizes, backend, explain, name, sig)
    if steps.relayout:
        sizes, broadcast = index_sizes(at.inputs, at.ops, name)
    if first_weighing:  # (the pattern may be transposed next time: this kernel is not kept under a signature)
        kernel_sig = None
    elif not as_given or steps.names:  # the kernel gets other operands than the call's: kept under theirs
        kernel_sig = call_signature(at.inputs, at.out, at.ops, at.format, at.rhs, reduce, directives)
    else:
        kernel_sig = sig
    found = BY_CALL.get(kernel_sig) if kept and kernel_sig is not sig and kernel_sig is not None else None
    result = found.run(at.ops, scalars) if found is not None else _kernel(
        at.key, at.asg, at.output, at.sched, at.ops, sizes, at.broadcast, dtype, scalars, backend, explain, at.rhs,
        kernel_sig)
    found = BY_CALL.get(kernel_sig) if backend == "cpp" and kernel_sig is not None and kernel_sig is not sig else None
    if found is not None and as_given:
        if steps.names == ("relayout",):
            # the next call with the given operands' signature: their relaid copies (kept: relayout.kept), then the
            # kernel's prepared call (not kept on disk: it has no ``made_of``)
            BY_CALL[sig] = Prepared(relayout.relaid_call(steps.relayout, lambda ops, scalars: found.run(ops, scalars),
                                                         memory.kept_empty))
        elif rhs is None and not explain:
            STEPS[sig] = (steps, kernel_sig, found)
    return steps.result(result, out)


def check(inputs, out, ops, format, directives, name) -> None:
    """Raise what ``run`` raises for ``directives`` on operands of these types and sizes, without running a kernel
    (a sparse operand the order walks against its storage is converted, as ``run`` does): a layer's directives
    checked where they are given (``scorch.schedule``'s ``apply``), with the messages its first call would give."""
    sizes, broadcast = index_sizes(inputs, ops, name)
    at = _Planning(inputs, out, ops, format, broadcast, None, "sum", directives)
    _refused(at, name)
    if at.n_sparse == 1:
        _decide(at, sizes, "cpp", False, name, None)


def _refused(at, name) -> None:
    """The directives' requests no kernel of ``at`` can meet (``ValueError``, ``NotImplementedError``)."""
    d = at.directives
    if d is None:
        return
    if at.n_sparse == 1 and d.workspace == "hash":
        raise ValueError(f"scorch: {name}: a hash workspace assembles the sparse output of several sparse operands;"
                         " this kernel has one sparse operand (its output is dense, or shares the operand's levels,"
                         " or goes through a dense workspace)")
    if at.n_sparse > 1 and (d.order is not None or d.parallel is not None):
        raise NotImplementedError(f"scorch: {name}: a user's loop order or parallel loop for several sparse operands"
                                  " (a merge) is not supported yet; scorch.explain shows the order it chooses")


class _Planning:
    """The plan of an assignment as a call's steps change it (``replan``): the accesses, output order, operands,
    requested format and explicit expression so far, and what ``planned`` gives for them."""

    def __init__(self, inputs, out, ops, format, broadcast, rhs, reduce, directives):
        self.inputs, self.out, self.ops, self.format, self.broadcast, self.rhs = inputs, out, ops, format, broadcast, rhs
        self.reduce, self.directives = reduce, directives
        self.replan()

    def replan(self, **changes):
        for k, v in changes.items():
            setattr(self, k, v)
        fmt = None if self.format is None else named.resolve(self.format, len(self.out))
        self.key = (self.inputs, self.out, tuple(tensor_type(x) for x in self.ops), self.broadcast, fmt, self.rhs,
                    self.reduce, self.directives)
        self.asg, self.output, self.sched, self.n_sparse = planned(self.key)


def _decide(at: _Planning, sizes, backend, explain, name, sig):
    """``(steps, first_weighing)``: the ``Steps`` of this call, each decided on the plan so far and applied to ``at``
    (which then holds the kernel's plan); ``first_weighing``: whether a new pattern was weighed for a transposition
    and declined (then the kernel is not kept under a signature: the pattern, if it recurs, is transposed next
    time)."""
    weighed = []
    transpose = _reformat(at.asg, at.sched, at.ops, sizes, backend, at.directives, explain, weighed)
    first_weighing = bool(weighed) and not weighed[-1] and _few_fresh(sig)
    if transpose is not None:
        k, fmt = transpose
        ops = list(at.ops)
        ops[k] = asformat(ops[k], fmt)
        # the result's format is the one inferred from the operands as given, not from the converted one
        at.replan(ops=ops, format=at.format if at.format is not None else
                  at.output.format or named.dense_nd(len(at.out)))
    perm = relayout.output_order(at.out, at.sched, at.output) if at.rhs is None else None
    if perm is not None:
        # the innermost loop runs along another output index: the kernel writes the output with that index
        # last (contiguous stores, a register tile), and the caller gets a permuted view, as torch returns
        # non-contiguous results elsewhere
        if explain:
            print(f"output:       computed as {''.join(perm)}, returned as a view in the order {''.join(at.out)}")
        at.replan(out=perm)
    moves = relayout.moves(at.inputs, at.ops, at.sched, sizes, at.broadcast)
    if at.rhs is not None:  # (an explicit expression: only operands it reads as the inputs give them)
        moves = tuple((k, d) for k, d in moves
                      if all(tuple(a.indices) == tuple(at.inputs[k]) for a in at.rhs.accesses() if a.operand == k))
    if moves:
        if explain:
            for k, d in moves:
                print(f"relayout:     T{k} copied with its dimension {d} ({at.inputs[k][d]}) last: the innermost loop"
                      " reads it along that dimension")
        steps = Steps(relayout=moves)
        inputs, _, ops, rhs = steps.apply(at.inputs, at.out, at.ops, at.rhs)
        at.replan(inputs=inputs, ops=ops, rhs=rhs, broadcast=index_sizes(inputs, ops, name)[1])
    return Steps(transpose, perm, tuple(moves), at.format), first_weighing


_FRESH = cache("fresh-patterns", "per call signature, how many new patterns were weighed for a transposition")


def _few_fresh(sig) -> bool:
    """Whether a call that weighed a new pattern for a transposition (and declined it) keeps no prepared call, so
    that the pattern, if it recurs, is transposed next time: yes for the first 3 new patterns of a signature; after
    that its patterns do not recur (a new mask every step), and the call is kept as any other."""
    n = _FRESH.get(sig, 0)
    _FRESH[sig] = n + 1
    return n < 3


def _replayed(replay, inputs, out, ops, rhs, reduce, directives, scalars):
    """A call whose signature was seen before with steps before its kernel (``STEPS``): the same ``Steps``, then
    the kept prepared call, without planning again; None (the call planned anew) where the transposition is no
    longer a cheap one (another pattern of the same signature: its cost is weighed again) or the operands the
    steps give have another signature."""
    steps, kernel_sig, found = replay
    if steps.transpose is not None:
        k, fmt = steps.transpose
        if not (converted_already(ops[k], fmt) or recurring_pattern(ops[k], fmt)):
            return None
    inputs, target, ops, rhs = steps.apply(inputs, out, ops, rhs)
    if call_signature(inputs, target, ops, steps.format, rhs, reduce, directives) != kernel_sig:
        return None
    return steps.result(found.run(ops, scalars), out)


def _reformat(asg, sched0, ops, sizes, backend, directives, explain, weighed):
    """``(operand, format)``: the sparse operand converted before the kernel, or None. For the user's loop order
    where it walks the operand against its storage (``discordant_format``; ``planned`` gives no schedule then);
    else, without directives, where its first level writes conflicting outputs and a transposition costs less
    than a serial loop (``transposed_for_parallel``; its answers on whether the pattern recurs are appended to
    ``weighed``)."""
    if sched0 is None:
        k = next(j for j, x in enumerate(ops) if type(x) is SparseTensor)
        fmt = discordant_format(asg, directives)
        why = f"the schedule's loop order {''.join(directives.order)} walks it that way"
    elif directives is None and sched0.parallel != "level0" and (worker_count(backend) > 1 or sched0.outer):
        k = sched0.driver.operand
        x = ops[k]
        fmt = transposed_for_parallel(asg, sched0, x.format, x.nnz, sizes, worker_count(backend),
                                      lambda f: converted_already(x, f),
                                      lambda f: weighed.append(recurring_pattern(x, f)) or weighed[-1])
        why = "its first level writes conflicting outputs, and a transposition costs less than a serial loop"
    else:
        return None
    if fmt is None:
        return None
    if explain:
        print(f"reformat:     T{k} converted from {ops[k].format.name or ops[k].format} to {fmt.name or fmt}: {why}")
    return k, fmt


def _kernel(key, asg, output, sched0, ops, sizes, broadcast, dtype, scalars, backend, explain, rhs, sig):
    """The compiled kernel of one sparse operand's plan run on ``ops`` (or the measured faster library call, on a
    GPU) through its prepared call, kept under ``sig`` (so that the next call of the signature takes the same
    path as every later one: the prepared call's C form, made on its first call)."""
    plan, plan_key = compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)
    found = None
    if backend == "cpp" and sig is not None:
        BY_CALL[sig] = found = prepared_call(plan, sizes, dtype, (plan_key, sizes, dtype))
    if plan.library_call is not None and rhs is None and library.ENABLED:
        name, fn = plan.library_call
        plan.library = library.choose(library.key_of(plan_key, ops), name,
                                      lambda: call_plan(plan, ops, sizes, dtype, scalars or {}, backend),
                                      lambda: fn(ops))
        if plan.library.path != "scorch":
            if explain:
                explained(plan)
            return fn(ops)
    result = found.run(ops, scalars) if found is not None else call_plan(plan, ops, sizes, dtype, scalars or {},
                                                                          backend)
    if explain:
        explained(plan)
    return result


def _coiterated(key, asg, output, ops, sizes, broadcast, dtype, scalars, backend, explain, reduce, directives,
                name):
    """An assignment over several sparse operands: one merged loop nest (``compiler.coiterate``; the directives
    it cannot follow were refused: ``_refused``)."""
    if reduce != "sum":
        raise NotImplementedError(f"scorch: {name}: a {reduce} reduction over several sparse operands is not"
                                  " supported yet")
    plan = coiteration_plan(key + (target_of(backend),), asg, output, broadcast, backend)
    if plan.schedule.transposed:
        # no loop order suits every sparse operand: which to transpose is chosen by their sizes (the
        # conversions' cost), kept per power of two of each nnz
        nnz = tuple(float(x.nnz) if type(x) is SparseTensor else 0.0 for x in ops)
        plan = coiteration_plan(key + (target_of(backend), tuple(int(n).bit_length() for n in nnz)), asg, output,
                                broadcast, backend, nnz)
    result = call_coiteration(plan, ops, sizes, dtype, scalars or {}, backend,
                              directives.workspace if directives is not None else None)
    if explain:
        explained(plan)
    return result


def row_plan(inputs, out, ops, backend="cpp"):
    """``(plan, sizes)``: the compiled plan of an einsum with one sparse operand whose kernel loops over that
    operand's rows in parallel, exactly as ``run`` would compile it, for fusion with other row kernels
    (``fuse.rows``); None where ``run`` would first transpose, relayout or permute, or not loop over rows."""
    sizes, broadcast = index_sizes(inputs, ops, "einsum")
    key = (inputs, out, tuple(tensor_type(x) for x in ops), broadcast, None, None, "sum", None)
    asg, output, sched0, n_sparse = planned(key)
    if n_sparse != 1 or broadcast:
        return None
    if sched0.parallel != "level0" or relayout.output_order(out, sched0, output) is not None or \
            relayout.moves(inputs, ops, sched0, sizes, broadcast):
        return None
    return compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)[0], sizes
