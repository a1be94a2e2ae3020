"""Running one assignment (``run``): operand types -> a compiled plan (``compiler.pipeline``), with the decisions
that change the operands before the kernel (a transposition of the driver for a parallel loop, the output
computed in another index order, a dense operand relaid), then the kernel on the operands (``bind``).
A call whose signature was seen before goes straight to its prepared call.
"""
from __future__ import annotations

import threading

from ..compiler import library, relayout
from ..compiler.caches import cache
from ..compiler.pipeline import coiteration_plan, compiled_plan, planned, target_of
from ..compiler.schedule import discordant_format, transposed_for_parallel
from ..formats import named
from ..rules import RULES
from ..sparse_tensor import SparseTensor, dtype_of, needs_grad
from .args import tensor_type, worker_count
from .bind import (STRUCTURAL, backend_for, call_coiteration, call_plan, cast, index_sizes, prepared_call,
                   result_dtype)
from .convert import asformat, converted_already


class _Explaining(threading.local):
    plans = None


_EXPLAINING = _Explaining()


def explained(plan):
    """Print ``plan`` (a call with ``explain=True``) and keep it for ``scorch.explain``'s result."""
    print(plan.explain())
    if _EXPLAINING.plans is not None:
        _EXPLAINING.plans.append(plan)


PREPARED = cache("prepared", "prepared calls per signature (expression, operand formats, dtypes, shapes)")


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


def run(inputs, out, ops, *, format=None, explain=False, name="einsum", rhs=None, scalars=None, backend="cpp",
        reduce="sum", relaid=False, directives=None):
    """Evaluate ``out[...] = sum(rhs)`` where ``rhs`` defaults to the product of the accesses ``inputs``.
    ``relaid``: the dense operands were already given their layout (``relayout``). ``directives``: the user's
    schedule (``compiler.schedule.Directives``), else the compiler's."""
    if (rhs is not None or reduce != "sum") and backend == "cpp" and not explain and needs_grad(ops):
        return RULES.differentiable_run(inputs, out, ops, format=format, name=name, rhs=rhs, scalars=scalars,
                                        reduce=reduce)
    if rhs is None and not all(type(x) is SparseTensor or x.is_contiguous() for x in ops):
        inputs, ops = _memory_order(inputs, ops)
    # (a differentiable einsum's result may take another format: structural_results)
    sig = (inputs, out, format, rhs, reduce, STRUCTURAL.on, directives) + tuple(signature(x) for x in ops)
    fast = PREPARED.get(sig)
    if fast is not None and not explain and backend == "cpp":
        return fast(ops, scalars)
    prepared_ok = all(type(x) is SparseTensor or x.is_contiguous() for x in ops)  # the prepared call passes
    sizes, broadcast = index_sizes(inputs, ops, name)                                  # data pointers as they are
    dtype = result_dtype(ops, name)
    prepared_ok = prepared_ok and all(dtype_of(x) == dtype for x in ops)  # ... without casting them
    backend = backend_for(ops, backend, name)
    ops = [cast(x, dtype) for x in ops]
    fmt = None if format is None else named.resolve(format, len(out))
    types = tuple(tensor_type(x) for x in ops)
    key = (inputs, out, types, broadcast, fmt, rhs, reduce, directives)
    asg, output, sched0, n_sparse = planned(key)
    if n_sparse == 0:
        raise NotImplementedError(f"scorch: {name} with a requested format and no sparse operand")
    if STRUCTURAL.on and fmt is None and output.format is not None and output.format.padded:
        # a padded level cannot hold an entry that is 0 (it would read as padding, and lose its gradient): the
        # inferred format's unpadded version (ELL -> CSR)
        from ..compiler.schedule import coiterable_version
        return run(inputs, out, ops, format=coiterable_version(output.format), explain=explain, name=name, rhs=rhs,
                   scalars=scalars, backend=backend, reduce=reduce, relaid=relaid, directives=directives)
    if n_sparse > 1 and directives is not None and (directives.order is not None or directives.parallel is not None):
        raise NotImplementedError(f"scorch: {name}: a user's loop order or parallel loop for several sparse operands"
                                  " (a merge) is not supported yet; scorch.explain shows the order it chooses")
    if sched0 is None and n_sparse == 1:
        # the user's loop order walks the sparse operand against its storage: it is converted to suit the order
        k = next(j for j, x in enumerate(ops) if type(x) is SparseTensor)
        alt = discordant_format(asg, directives)
        if explain:
            print(f"reformat:     T{k} converted from {ops[k].format.name or ops[k].format} to {alt.name or alt}:"
                  f" the schedule's loop order {''.join(directives.order)} walks it that way")
        ops = list(ops)
        ops[k] = asformat(ops[k], alt)
        kept = format if format is not None else output.format or named.dense_nd(len(out))
        return run(inputs, out, ops, format=kept, explain=explain, name=name, rhs=rhs, scalars=scalars,
                   backend=backend, reduce=reduce, directives=directives)
    if n_sparse > 1:
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
        result = call_coiteration(plan, ops, sizes, dtype, scalars or {}, backend)
        if explain:
            explained(plan)
        return result
    if directives is None and sched0.parallel != "level0" and (worker_count(backend) > 1 or sched0.outer):
        k = sched0.driver.operand
        x = ops[k]
        alt = transposed_for_parallel(asg, sched0, x.format, x.nnz, sizes, worker_count(backend),
                                      lambda f: converted_already(x, f))
        if alt is not None:
            if explain:
                print(f"reformat:     T{k} converted from {ops[k].format.name or ops[k].format} to {alt.name or alt}:"
                      " its first level writes conflicting outputs, and a transposition costs less than a serial"
                      " loop")
            ops = list(ops)
            ops[k] = asformat(ops[k], alt)
            # the result's format is the one inferred from the operands as given, not from the converted one
            kept = format if format is not None else output.format or named.dense_nd(len(out))
            return run(inputs, out, ops, format=kept, explain=explain, name=name, rhs=rhs, scalars=scalars,
                       backend=backend, reduce=reduce)
    perm = relayout.output_order(out, sched0, output) if rhs is None else None
    if perm is not None:
        # the innermost loop runs along another output index: the kernel writes the output with that index
        # last (contiguous stores, a register tile), and the caller gets a permuted view, as torch returns
        # non-contiguous results elsewhere
        if explain:
            print(f"output:       computed as {''.join(perm)}, returned as a view in the order {''.join(out)}")
        r = run(inputs, perm, ops, format=format, explain=explain, name=name, scalars=scalars, backend=backend,
                reduce=reduce, relaid=relaid, directives=directives)
        return r.permute(*[perm.index(v) for v in out])
    moves = relayout.plan(inputs, ops, sched0, sizes, broadcast) if rhs is None and not relaid else ()
    if moves:
        if explain:
            for k, d in moves:
                print(f"relayout:     T{k} copied with its dimension {d} ({inputs[k][d]}) last: the innermost loop"
                      " reads it along that dimension")
        inputs, ops = relayout.apply(moves, inputs, ops)
        return run(inputs, out, ops, format=format, explain=explain, name=name, scalars=scalars, backend=backend,
                   reduce=reduce, relaid=True, directives=directives)
    plan, plan_key = compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)
    if backend == "cpp" and prepared_ok and len(PREPARED) < 4096:
        PREPARED[sig] = prepared_call(plan, sizes, dtype)
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
            relayout.plan(inputs, ops, sched0, sizes, broadcast):
        return None
    return compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)[0], sizes
