"""Running one assignment (``run``): operand types -> a compiled plan (``compiler.pipeline``), with the decisions
that change the operands before the kernel (a transposition of the driver for a parallel loop, the output
computed in another index order, a dense operand relaid), then the kernel on the operands (``bind``).
A call whose signature was seen before goes straight to its prepared call.
"""
from __future__ import annotations

import threading

import torch

from ..compiler import library, relayout, runtime
from ..compiler.caches import cache
from ..compiler.pipeline import coiteration_plan, compiled_plan, kept_plan, planned, target_of
from ..compiler.ir import reindexed
from ..compiler.schedule import discordant_format, transposed_for_parallel
from ..compiler.target import CPU
from ..formats import named
from ..rules import RULES
from ..sparse_tensor import SparseTensor, dtype_of, needs_grad
from . import memory
from .args import tensor_type, worker_count
from .bind import (STRUCTURAL, backend_for, call_coiteration, call_plan, cast, index_sizes, prepared_call,
                   result_dtype)
from .convert import asformat, converted_already, recurring_pattern


class _Explaining(threading.local):
    plans = None


_EXPLAINING = _Explaining()


def explained(plan):
    """Print ``plan`` (a call with ``explain=True``) and keep it for ``scorch.explain``'s result."""
    print(plan.explain())
    if _EXPLAINING.plans is not None:
        _EXPLAINING.plans.append(plan)


PREPARED = cache("prepared", "prepared calls per signature (expression, operand formats, dtypes, shapes)")
STEPS = cache("steps", "per call signature, the steps its operands take before the kernel (a transposition, dense"
              " operands relaid) and the prepared call of the operands they give")


def signature(x):
    """What a repeated call must match to reuse a prepared call: format, dtypes and shape."""
    if type(x) is SparseTensor:
        v = x._vals
        return (x._format, v.dtype, x._index_dtype, x._shape, v.device)
    return (None, x.dtype, x.shape, x.device, x.is_contiguous())


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


def call_signature(inputs, out, ops, format, rhs, reduce, directives) -> tuple:
    """The key of a prepared call (``PREPARED``): the assignment, the requested format, the user's directives,
    whether results are structural (``structural_results``) and each operand's ``signature``."""
    return (inputs, out, format, rhs, reduce, STRUCTURAL.on, directives) + tuple(signature(x) for x in ops)


def run(inputs, out, ops, *, format=None, explain=False, name="einsum", rhs=None, scalars=None, backend="cpp",
        reduce="sum", directives=None):
    """Evaluate ``out[...] = sum(rhs)`` where ``rhs`` defaults to the product of the accesses ``inputs``.
    ``directives``: the user's schedule (``compiler.schedule.Directives``), else the compiler's.

    One pass, top to bottom: the plan of the operands as given, then the steps that change them before the kernel,
    each decided once on the plan so far (a sparse operand converted, for the user's loop order or for a
    parallel loop; the output computed in another index order; dense operands relaid), then the kernel."""
    if (rhs is not None or reduce != "sum") and backend == "cpp" and not explain and needs_grad(ops):
        return RULES.differentiable_run(inputs, out, ops, format=format, name=name, rhs=rhs, scalars=scalars,
                                        reduce=reduce)
    if rhs is None and not all(type(x) is SparseTensor or x.is_contiguous() for x in ops):
        inputs, ops = _memory_order(inputs, ops)
    # (a differentiable einsum's result may take another format: structural_results)
    sig = call_signature(inputs, out, ops, format, rhs, reduce, directives)
    fast = PREPARED.get(sig)
    if fast is not None and not explain and backend == "cpp":
        return fast(ops, scalars)
    steps = STEPS.get(sig) if not explain and backend == "cpp" else None
    if steps is not None:
        result = _replayed(steps, inputs, out, ops, rhs, reduce, directives, scalars)
        if result is not None:
            return result
    sig0 = sig
    prepared_ok = all(type(x) is SparseTensor or x.is_contiguous() for x in ops)  # the prepared call passes
    sizes, broadcast = index_sizes(inputs, ops, name)                                  # data pointers as they are
    dtype = result_dtype(ops, name)
    prepared_ok = prepared_ok and all(dtype_of(x) == dtype for x in ops)  # ... without casting them
    backend = backend_for(ops, backend, name)
    ops = [cast(x, dtype) for x in ops]
    key, asg, output, sched0, n_sparse = _planned(inputs, out, ops, format, broadcast, rhs, reduce, directives)
    if n_sparse == 0:
        raise NotImplementedError(f"scorch: {name} with a requested format and no sparse operand")
    if STRUCTURAL.on and format is None and output.format is not None and output.format.padded:
        # a padded level cannot hold an entry that is 0 (it would read as padding, and lose its gradient): the
        # inferred format's unpadded version (ELL -> CSR)
        from ..compiler.schedule import coiterable_version
        format = coiterable_version(output.format)
        key, asg, output, sched0, n_sparse = _planned(inputs, out, ops, format, broadcast, rhs, reduce, directives)
        prepared_ok = False  # (the call's own signature asked for another format)
    if n_sparse == 1 and directives is not None and directives.workspace == "hash":
        raise ValueError(f"scorch: {name}: a hash workspace assembles the sparse output of several sparse operands;"
                         " this kernel has one sparse operand (its output is dense, or shares the operand's levels,"
                         " or goes through a dense workspace)")
    if n_sparse > 1:
        return _coiterated(key, asg, output, ops, sizes, broadcast, dtype, scalars, backend, explain, reduce,
                           directives, name)
    target = out  # the index order the kernel writes the output in
    replayable = prepared_ok and backend == "cpp" and not explain and rhs is None  # (the operands as given)
    weighed = []  # (a pattern weighed for a transposition the first time: the next call may transpose, so this
    alt = _reformat(asg, sched0, ops, sizes, backend, directives, explain, weighed)  # one's kernel is not kept
    first_weighing = bool(weighed) and not weighed[-1] and _few_fresh(sig0)          # under its signature)
    if alt is not None:
        k, fmt = alt
        ops = list(ops)
        ops[k] = asformat(ops[k], fmt)
        # the result's format is the one inferred from the operands as given, not from the converted one
        format = format if format is not None else output.format or named.dense_nd(len(out))
        key, asg, output, sched0, _ = _planned(inputs, out, ops, format, broadcast, rhs, reduce, directives)
        prepared_ok = False
    perm = relayout.output_order(out, sched0, output) if rhs is None else None
    if perm is not None:
        # the innermost loop runs along another output index: the kernel writes the output with that index
        # last (contiguous stores, a register tile), and the caller gets a permuted view, as torch returns
        # non-contiguous results elsewhere
        if explain:
            print(f"output:       computed as {''.join(perm)}, returned as a view in the order {''.join(out)}")
        target = perm
        key, asg, output, sched0, _ = _planned(inputs, target, ops, format, broadcast, rhs, reduce, directives)
        prepared_ok = False
    moves = relayout.moves(inputs, ops, sched0, sizes, broadcast)
    if rhs is not None:  # (an explicit expression: only operands it reads as the inputs give them)
        moves = tuple((k, d) for k, d in moves
                      if all(tuple(a.indices) == tuple(inputs[k]) for a in rhs.accesses() if a.operand == k))
    given = sig if prepared_ok and moves else None  # (the relayout is the one step between the call and the kernel)
    if moves:
        if explain:
            for k, d in moves:
                print(f"relayout:     T{k} copied with its dimension {d} ({inputs[k][d]}) last: the innermost loop"
                      " reads it along that dimension")
        before = inputs
        inputs, ops = relayout.apply(moves, inputs, ops, memory.kept_empty)
        for k, _ in moves if rhs is not None else ():
            rhs = reindexed(rhs, k, before[k], inputs[k])
        sizes, broadcast = index_sizes(inputs, ops, name)
        key, asg, output, sched0, _ = _planned(inputs, target, ops, format, broadcast, rhs, reduce, directives)
        prepared_ok = False
    fast = None
    if first_weighing:
        sig = None
    elif not prepared_ok:  # the kernel gets other operands than the call's: its prepared call is kept under theirs
        sig = call_signature(inputs, target, ops, format, rhs, reduce, directives)
        fast = PREPARED.get(sig) if not explain and backend == "cpp" else None
    result = fast(ops, scalars) if fast is not None else _kernel(
        key, asg, output, sched0, ops, sizes, broadcast, dtype, scalars, backend, explain, rhs, sig)
    if given is not None and backend == "cpp" and PREPARED.get(sig) is not None:
        # the next call with the given operands' signature: their relaid copies (kept: relayout.kept), then the
        # kernel's prepared call (not kept on disk: it has no ``made_of``)
        PREPARED[given] = relayout.relaid_call(moves, PREPARED[sig], memory.kept_empty)
    elif replayable and sig is not None and sig is not sig0 and perm is None and (alt is not None or moves) and \
            sig in PREPARED:
        STEPS[sig0] = (alt, moves, format, sig, PREPARED[sig])
    return result if perm is None else result.permute(*[perm.index(v) for v in out])


_FRESH = cache("fresh-patterns", "per call signature, how many new patterns were weighed for a transposition")


def _few_fresh(sig) -> bool:
    """Whether a call that weighed a new pattern for a transposition (and declined it) keeps no prepared call, so
    that the pattern, if it recurs, is transposed next time: yes for the first 3 new patterns of a signature; after
    that its patterns do not recur (a new mask every step), and the call is kept as any other."""
    n = _FRESH.get(sig, 0)
    _FRESH[sig] = n + 1
    return n < 3


def _replayed(steps, inputs, out, ops, rhs, reduce, directives, scalars):
    """A call whose signature was seen before with steps before its kernel (``STEPS``): the same steps, then the
    kept prepared call, without planning again; None (the call planned anew) where the transposition is no longer
    a cheap one (another pattern of the same signature: its cost is weighed again) or the operands it gives have
    another signature."""
    alt, moves, format, sig, fast = steps  # (format: the kernel's, which a transposition names)
    ops = list(ops)
    if alt is not None:
        k, fmt = alt
        if not (converted_already(ops[k], fmt) or recurring_pattern(ops[k], fmt)):
            return None
        ops[k] = asformat(ops[k], fmt)
    if moves:
        inputs, ops = relayout.apply(moves, inputs, ops, memory.kept_empty)
    if call_signature(inputs, out, ops, format, rhs, reduce, directives) != sig:
        return None
    return fast(ops, scalars)


def _planned(inputs, out, ops, format, broadcast, rhs, reduce, directives):
    """``(key, assignment, inferred output, schedule, sparse operand count)`` of the operands as they are now."""
    fmt = None if format is None else named.resolve(format, len(out))
    key = (inputs, out, tuple(tensor_type(x) for x in ops), broadcast, fmt, rhs, reduce, directives)
    return (key,) + planned(key)


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
    GPU); its prepared call kept under ``sig``."""
    plan, plan_key = compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)
    if backend == "cpp" and sig is not None:
        PREPARED[sig] = fast = prepared_call(plan, sizes, dtype)
        fast.made_of = (plan_key, sizes, dtype)  # what a call kept on disk needs to make it again (keep_call)
    if plan.library_call is not None and rhs is None and library.ENABLED:
        name, fn = plan.library_call
        plan.library = library.choose(library.key_of(plan_key, ops), name,
                                      lambda: call_plan(plan, ops, sizes, dtype, scalars or {}, backend),
                                      lambda: fn(ops))
        if plan.library.path != "scorch":
            if explain:
                explained(plan)
            return fn(ops)
    result = call_plan(plan, ops, sizes, dtype, scalars or {}, backend)
    if explain:
        explained(plan)
    return result


def _coiterated(key, asg, output, ops, sizes, broadcast, dtype, scalars, backend, explain, reduce, directives,
                name):
    """An assignment over several sparse operands: one merged loop nest (``compiler.coiterate``)."""
    if directives is not None and (directives.order is not None or directives.parallel is not None):
        raise NotImplementedError(f"scorch: {name}: a user's loop order or parallel loop for several sparse operands"
                                  " (a merge) is not supported yet; scorch.explain shows the order it chooses")
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


# --- calls kept on disk ----------------------------------------------------------------------------------------
# The first call of a signature in a new process would plan again (parse, infer, schedule, the decisions above)
# only to arrive at a plan kept on disk (``compiler.pipeline``). So the outcome of a call that went straight to
# one kernel on the operands as given is kept too (``runtime.keep``): under its signature (``evaluate``'s: the
# equation, requested format, directives and each operand's format, dtypes, shape and device) and the thread
# count, the plan key, index sizes and result dtype of its prepared call. A new process with that signature loads
# the plan and prepares the call, without planning. The fingerprint covers every scorch module: the decisions
# are the engine's as well as the compiler's.


def _code() -> str:
    return f"c1{CPU.key}" + runtime.source_fingerprint(".")


def kept_call(sig):
    """The prepared call kept on disk for ``sig`` with this thread count, or None (none kept, or its plan no
    longer kept)."""
    made_of = runtime.kept("calls", _code(), (sig, torch.get_num_threads()))
    try:
        plan_key, sizes, dtype = made_of
    except (TypeError, ValueError):
        return None
    plan = kept_plan(plan_key)
    if plan is None:
        return None
    fast = prepared_call(plan, sizes, dtype)
    fast.made_of = made_of
    return fast


def keep_call(sig, fast) -> None:
    """Keep ``fast`` (a prepared call ``_kernel`` made) on disk under ``sig``."""
    if hasattr(fast, "made_of"):
        runtime.keep("calls", _code(), (sig, torch.get_num_threads()), fast.made_of)
