"""Dispatch: from an einsum call on tensors to a ready compiled kernel, through two caches.

The first cache maps (equation, operand types) to the planned assignment (format inference and schedule);
the second adds the specialized extents and holds the compiled kernel with a prepared argument list, so a
repeated call costs a dictionary look-up, a few size computations and the ctypes call.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field, replace

import torch

from .. import deferred, interop
from .._autograd import needs_grad
from ..deferred import Deferred
from ..formats import named
from ..sparse_tensor import SparseTensor, device_of, dtype_of, shape_of
from . import contract
from .. import loopir as L
from . import grouped, library, relayout, runtime
from .codegen import cpp, cuda
from .einsum import equation as einsum_string
from .einsum import parse, to_index_notation
from .infer import OutputFormat, infer
from .ir import Access, Assignment, TensorType
from .lower import lower
from .schedule import SPECIALIZE_MAX, schedule

_PLANNED: dict = {}
_COMPILED: dict = {}
_FAST: dict = {}  # call signature (expression, operand formats, dtypes, shapes) -> prepared call
_FAST_EQ: dict = {}  # the same, keyed by the einsum equation string
SUPPORTED = (torch.float32, torch.float64, torch.int32, torch.int64)
#: the largest dense row workspace (all threads together) before a hash workspace would be needed
NARROW_COORDINATES = 2**31 - 1  # a rows output whose workspace has at most this many entries writes int32
WORKSPACE_LIMIT_BYTES = 1 << 30


@dataclass
class Plan:
    """Everything decided for one assignment over one set of operand types, and the loaded kernel."""
    asg: Assignment
    output: OutputFormat
    schedule: object
    lowered: object = None
    source: str = ""
    kernel: object = None
    assemble_from_dense: bool = False
    calls: int = 0
    library: object = None  # on a GPU: the measured choice between this kernel and a library call (library.py)
    library_call: object = None  # on a GPU: ``(name, fn)`` of a library call computing this assignment, or None

    def explain(self) -> str:
        out = self.output
        fmt = "dense (torch tensor)" if out.format is None else (out.format.name or str(out.format))
        lines = [f"expression:   {self.asg}",
                 f"operands:     {', '.join(f'T{k}: {t}' for k, t in enumerate(self.asg.operands))}",
                 f"output:       {fmt}  [rule: {out.rule}]"]
        if self.assemble_from_dense:
            lines.append("assembly:     computed into a dense workspace, then compressed into the output format")
        s = self.schedule
        lines += [f"loop order:   {s.describe(self.asg)}",
                  f"parallel:     {s.parallel}{' (balanced by nnz)' if s.balance == 'nnz' else ''}: {s.why}",
                  f"specialized:  {', '.join(f'{v}={n}' for v, n in s.specialize) or 'none'}"]
        if self.kernel is not None:
            how = {"compiled": f"compiled now ({self.kernel.compile_seconds:.2f} s)", "disk": "loaded from the disk"
                   " cache", "memory": "from the memory cache"}.get(self.kernel.origin, self.kernel.origin)
            lines += _gpu_lines(self.kernel)
            if self.library is not None:
                lines.append(f"path:         {self.library.describe()}")
            lines += [f"kernel:       {how}: {self.kernel.path}", "source:", self.source]
        return "\n".join(lines)


def _type(x) -> TensorType:
    if type(x) is SparseTensor:
        return TensorType(len(x._shape), x._vals.dtype, x._format, x.index_dtype, x._vals.device.type)
    return TensorType(x.dim(), x.dtype, None, None, x.device.type)


def prepare(operands):
    """Torch sparse layouts become SparseTensors (zero-copy); numbers become 0-d tensors; deferred results are
    computed."""
    out = []
    for x in operands:
        if type(x) is SparseTensor or (type(x) is torch.Tensor and x.layout == torch.strided):
            out.append(x)
        elif type(x) is Deferred:
            out.append(x.compute())
        elif isinstance(x, SparseTensor):
            out.append(x)
        elif isinstance(x, torch.Tensor):
            out.append(interop.from_torch(x) if x.layout != torch.strided else x)
        elif isinstance(x, (int, float, bool)):
            out.append(torch.tensor(x))
        else:
            raise TypeError(f"einsum operands must be tensors, got {type(x).__name__}")
    return out


def einsum(equation, *operands, format=None, explain=False, backend="cpp"):
    """``torch.einsum`` over any mix of dense and sparse operands; sparse ones go through the compiler."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if operands and type(operands[0]) is SparseTensor and type(operands[0]._vals) is Deferred and \
            format in (None, "dense") and not explain and backend == "cpp":
        from .. import fusion  # lazy attention probabilities (scorch.compile) times a dense matrix: one kernel
        r = fusion.fused_product(equation, operands)
        if r is not None:
            return r
    if Deferred in map(type, operands):
        fused = _substitute(equation, operands)
        if fused is not None:
            kept = format if format is not None else fused[2] or "dense"  # the format the eager call gives
            return einsum(fused[0], *fused[1], format=kept, explain=explain, backend=backend)
    if not any(isinstance(x, torch.Tensor) and (isinstance(x, SparseTensor) or x.layout != torch.strided)
               for x in operands):  # torch computes, and differentiates, dense einsums itself
        r = torch.einsum(equation, *prepare(operands))
        fmt = None if format is None else named.resolve(format, r.dim())
        return r if fmt is None or fmt.is_dense else interop.asformat(r, fmt)
    early = _diagonals_and_sums(equation, operands, explain)
    if early is not None:
        return einsum(early[0], *early[1], format=format, explain=explain, backend=backend)
    if needs_grad(operands) and not explain and backend == "cpp":
        from .. import _autograd as autograd
        return autograd.einsum(equation, operands, format)
    if not explain and backend == "cpp" and all(type(x) is SparseTensor or (
            isinstance(x, torch.Tensor) and x.layout == torch.strided) for x in operands):
        sig = (equation, format, _STRUCTURAL.on) + tuple(_signature(x) for x in operands)
        fast = _FAST_EQ.get(sig)
        if fast is not None:
            return fast(operands, None)
    else:
        sig = None
    ops = prepare(operands)
    inputs, out = parse(equation, [len(shape_of(x)) for x in ops])
    name = f"einsum({equation!r})"
    if any(type(x) is torch.Tensor and 0 in x.stride() for x in ops):
        inputs, ops = _unbroadcast(inputs, ops)
    if len(ops) >= 3:
        tree = _path(inputs, out, ops, name)
        if tree.parts is not None or tree.grouped is not None:
            if explain:
                print(f"contraction:  {contract.describe(tree, inputs)}")
            return _evaluate(tree, inputs, ops, out, format, backend, explain)
    result = run(inputs, out, ops, format=format, explain=explain, name=name, backend=backend)
    if sig is not None and all(a is b for a, b in zip(ops, operands)):
        fast = _FAST.get((inputs, out, format, None, "sum", _STRUCTURAL.on) + tuple(_signature(x) for x in ops))
        if fast is not None and len(_FAST_EQ) < 4096:
            _FAST_EQ[sig] = fast  # the same prepared call, found from the equation string directly
    return result


def _diagonals_and_sums(equation, operands, explain=False):
    """``(equation, operands)`` of the same einsum with every operand that repeats a letter (``"ii"``) replaced by
    its diagonal (``ops.diagonal``) and, where there are several operands, the letters only one operand has and
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
    from ..ops.diagonal import check_sizes, diagonal
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


def _inferred_format(inputs, out, ops, dtype):
    """The output format inferred for one kernel over ``ops`` (None: dense)."""
    types = tuple(_type(_cast(x, dtype)) if type(x) is SparseTensor else TensorType(x.dim(), dtype, None, None,
                                                                                   x.device.type) for x in ops)
    return infer(Assignment(tuple(out), to_index_notation(inputs), types)).format


def dense_result(equation, ops, format):
    """``(inputs, out, shape, dtype)`` of an einsum over ``ops`` (one or two operands, a sparse one among them)
    whose result is a dense tensor, checked as the call checks it; None where the result would be sparse, the
    einsum has more operands, or the call would first take diagonals or sums (``_diagonals_and_sums``)."""
    ndims = tuple(len(shape_of(x)) for x in ops)
    inputs, out = parse(equation, ndims)
    name = f"einsum({equation!r})"
    sizes, _ = _sizes(inputs, ops, name)
    dtype = _result_dtype(ops, name)
    _backend(ops, "cpp", name)
    if len(ops) > 2 or _early_steps(equation, ndims) is not None:
        return None
    if format is not None:
        if not named.resolve(format, len(out)).is_dense:
            return None
    elif _inferred_format(inputs, out, ops, dtype) is not None:
        return None
    return inputs, out, [sizes[v] for v in out], dtype


def _substitute(equation, operands):
    """``(equation, operands)`` with deferred dense operands replaced by their expressions, where a sparse operand
    is there to drive the combined expression's loops; else None, the deferred operands computed."""
    if not any(isinstance(x, SparseTensor) or (isinstance(x, torch.Tensor) and x.layout != torch.strided)
               for x in operands):
        deferred.compute_all(operands)
        return None
    inputs, out = parse(equation, [len(shape_of(x)) for x in operands])
    ops = [x if type(x) is Deferred else prepare([x])[0] for x in operands]
    # only all-dense deferred expressions, into a consumer of one kernel: its output format stays the eager one
    sub = None
    if len(ops) <= 2 and all(type(x) is not Deferred or x._expr.dense for x in ops):
        dtype = _result_dtype(ops, f"einsum({equation!r})")
        fmt = _inferred_format(inputs, out, ops, dtype)
        sub = deferred.substitute(inputs, out, ops)
    if sub is None:
        deferred.compute_all(operands)
        return None
    return einsum_string(sub[0], out), sub[1], fmt


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


_PATHS: dict = {}


def _path(inputs, out, ops, name):
    """The contraction tree, kept per equation, sizes and nnz (rounded to a power of two: the cost model's
    choices do not hinge on finer differences), so a repeated call does not search again."""
    sizes, _ = _sizes(inputs, ops, name)
    nnz = [float(x.nnz) if isinstance(x, SparseTensor) else float(x.numel()) for x in ops]
    key = (inputs, out, tuple(sorted(sizes.items())),
           tuple((isinstance(x, SparseTensor), int(n).bit_length()) for x, n in zip(ops, nnz)))
    node = _PATHS.get(key)
    if node is None:
        meta = [contract.Operand(idx, isinstance(x, SparseTensor), n,
                                 frozenset(idx) if isinstance(x, SparseTensor) else frozenset())
                for idx, x, n in zip(inputs, ops, nnz)]
        node = contract.best_path(meta, out, sizes)
        if len(_PATHS) >= 4096:
            _PATHS.clear()
        _PATHS[key] = node
    return node


def _evaluate(node, inputs, ops, target, format=None, backend="cpp", explain=False):
    """Run a contraction tree: each node is one kernel (or one torch.einsum when all its inputs are dense)."""
    if node.grouped is not None:
        idx = [inputs[k] for k in node.leaves]
        if explain:
            print(f"grouped:      {contract.describe(node, inputs)}: the entries of the sparse operand grouped by"
                  f" {''.join(node.grouped.group)}, one dense product per group (torch)")
        leaves = [ops[k] for k in node.leaves]
        sizes, _ = _sizes(idx, leaves, "einsum")
        r = grouped.evaluate(node.grouped, idx, tuple(target), leaves, sizes)
        # the format a kernel would have written: the requested one, else the inferred one
        fmt = named.resolve(format, len(target)) if format is not None else \
            _inferred_format(idx, tuple(target), leaves, r.dtype)
        if fmt is None or fmt.is_dense:
            return r
        if not r.requires_grad:  # rows kept whole (a requested rows-compressed format): r's memory becomes the values
            rows = interop._compressed_rows(r.contiguous(), fmt, None, False, copy=False)
            if rows is not None:
                return rows
        return interop.asformat(r, fmt)
    if node.parts is None:
        parts = [(ops[k], inputs[k]) for k in node.leaves]
    else:
        parts = [(_evaluate(p, inputs, ops, p.indices, backend=backend, explain=explain), p.indices)
                 for p in node.parts]
    tensors = [t for t, _ in parts]
    idx = tuple(i for _, i in parts)
    if len(parts) == 1 and tuple(idx[0]) == tuple(target) and format is None:
        return tensors[0]  # a leaf already in the target's index order: nothing to compute
    if not any(isinstance(t, SparseTensor) for t in tensors):
        eq = einsum_string(idx, target)
        if explain:
            print(f"dense step:   torch.einsum({eq!r})")
        r = torch.einsum(eq, *tensors)
        fmt = None if format is None else named.resolve(format, len(target))
        return r if fmt is None or fmt.is_dense else interop.asformat(r, fmt)
    return run(idx, tuple(target), tensors, format=format, name="einsum", backend=backend, explain=explain)


def _signature(x):
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
        if type(x) is SparseTensor or type(x) is Deferred or x.dim() < 2 or x.is_contiguous():
            continue
        order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        y = x.permute(order)
        if y.is_contiguous():
            inputs[k], ops[k] = tuple(inputs[k][d] for d in order), y
    return tuple(inputs), ops


def run(inputs, out, ops, *, format=None, explain=False, name="einsum", rhs=None, scalars=None, backend="cpp",
        reduce="sum", relaid=False):
    """Evaluate ``out[...] = sum(rhs)`` where ``rhs`` defaults to the product of the accesses ``inputs``.
    ``relaid``: the dense operands were already given their layout (``relayout``)."""
    if (rhs is not None or reduce != "sum") and backend == "cpp" and not explain and needs_grad(ops):
        from .. import _autograd as autograd
        return autograd.run(inputs, out, ops, format=format, name=name, rhs=rhs, scalars=scalars, reduce=reduce)
    if rhs is None and not all(type(x) is SparseTensor or x.is_contiguous() for x in ops):
        inputs, ops = _memory_order(inputs, ops)
    # (a differentiable einsum's result may take another format: structural_results)
    sig = (inputs, out, format, rhs, reduce, _STRUCTURAL.on) + tuple(_signature(x) for x in ops)
    fast = _FAST.get(sig)
    if fast is not None and not explain and backend == "cpp":
        return fast(ops, scalars)
    prepared_ok = all(type(x) is SparseTensor or x.is_contiguous() for x in ops)  # the prepared call passes
    sizes, broadcast = _sizes(inputs, ops, name)                                  # data pointers as they are
    dtype = _result_dtype(ops, name)
    prepared_ok = prepared_ok and all(dtype_of(x) == dtype for x in ops)  # ... without casting them
    backend = _backend(ops, backend, name)
    ops = [_cast(x, dtype) for x in ops]
    fmt = None if format is None else named.resolve(format, len(out))
    types = tuple(_type(x) for x in ops)
    key = (inputs, out, types, broadcast, fmt, rhs, reduce)
    asg, output, sched0, n_sparse = _planned(key)
    if n_sparse == 0:
        raise NotImplementedError(f"scorch: {name} with a requested format and no sparse operand")
    if _STRUCTURAL.on and fmt is None and output.format is not None and output.format.padded:
        # a padded level cannot hold an entry that is 0 (it would read as padding, and lose its gradient): the
        # inferred format's unpadded version (ELL -> CSR)
        from .schedule import coiterable_version
        return run(inputs, out, ops, format=coiterable_version(output.format), explain=explain, name=name, rhs=rhs,
                   scalars=scalars, backend=backend, reduce=reduce, relaid=relaid)
    if n_sparse > 1:
        if reduce != "sum":
            raise NotImplementedError(f"scorch: {name}: a {reduce} reduction over several sparse operands is not"
                                      " supported yet")
        plan = _coiteration_plan(key + (_target(backend),), asg, output, broadcast, backend)
        if plan.schedule.transposed:
            # no loop order suits every sparse operand: which to transpose is chosen by their sizes (the
            # conversions' cost), kept per power of two of each nnz
            nnz = tuple(float(x.nnz) if type(x) is SparseTensor else 0.0 for x in ops)
            plan = _coiteration_plan(key + (_target(backend), tuple(int(n).bit_length() for n in nnz)), asg, output,
                                     broadcast, backend, nnz)
        result = _call_coiteration(plan, ops, sizes, dtype, scalars or {}, backend)
        if explain:
            print(plan.explain())
        return result
    if sched0.parallel != "level0" and (_threads(backend) > 1 or sched0.outer):
        k = sched0.driver.operand
        alt = _transposed_for_parallel(asg, sched0, ops[k], sizes, _threads(backend))
        if alt is not None:
            if explain:
                print(f"reformat:     T{k} converted from {ops[k].format.name or ops[k].format} to {alt.name or alt}:"
                      " its first level writes conflicting outputs, and a transposition costs less than a serial"
                      " loop")
            ops = list(ops)
            ops[k] = interop.asformat(ops[k], alt)
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
                reduce=reduce, relaid=relaid)
        return r.permute(*[perm.index(v) for v in out])
    moves = relayout.plan(inputs, ops, sched0, sizes, broadcast) if rhs is None and not relaid else ()
    if moves:
        if explain:
            for k, d in moves:
                print(f"relayout:     T{k} copied with its dimension {d} ({inputs[k][d]}) last: the innermost loop"
                      " reads it along that dimension")
        inputs, ops = relayout.apply(moves, inputs, ops)
        return run(inputs, out, ops, format=format, explain=explain, name=name, scalars=scalars, backend=backend,
                   reduce=reduce, relaid=True)
    plan, plan_key = _compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)
    if backend == "cpp" and prepared_ok and len(_FAST) < 4096:
        _FAST[sig] = _prepared_call(plan, sizes, dtype)
    if plan.library_call is not None and rhs is None and library.ENABLED:
        name, fn = plan.library_call
        plan.library = library.choose(library.key_of(plan_key, ops), name,
                                      lambda: _call(plan, ops, sizes, dtype, scalars or {}, backend),
                                      lambda: fn(ops))
        if plan.library.path != "scorch":
            if explain:
                print(plan.explain())
            return fn(ops)
    result = _call(plan, ops, sizes, dtype, scalars or {}, backend)
    if explain:
        print(plan.explain())
    return result


def _planned(key):
    """``(assignment, inferred output, schedule, sparse operand count)`` of an einsum by ``run``'s key (cached);
    the schedule only for one sparse operand."""
    planned = _PLANNED.get(key)
    if planned is None:
        inputs, out, types, _, fmt, rhs, reduce = key
        if any(len(set(idx)) != len(idx) for idx in inputs):  # (an internal caller's mistake, not the user's)
            raise ValueError(f"scorch: {inputs} repeats a letter within an operand; kernels take distinct letters"
                             " (einsum takes the diagonal first: ops/diagonal.py)")
        asg = Assignment(out, rhs if rhs is not None else to_index_notation(inputs), types, reduce, fmt)
        output = infer(asg)
        n = sum(t.sparse for t in types)
        sched0 = schedule(asg, _lowerable(asg, output)) if n == 1 else None
        planned = _PLANNED[key] = (asg, output, sched0, n)
    return planned


def _compiled_plan(key, asg, output, sched0, sizes, broadcast, backend):
    """``(plan, plan key)``: the kernel of one sparse operand's schedule, compiled once per key, the innermost
    dense extent (where small enough to be compiled in) and the target."""
    plan_key = key
    if sched0.inner and 0 < sizes[sched0.inner[-1]] <= SPECIALIZE_MAX:
        plan_key = key + (sizes[sched0.inner[-1]],)
    plan_key += (_target(backend),)
    plan = _COMPILED.get(plan_key)
    if plan is None:
        plan = _COMPILED[plan_key] = _compile(asg, output, sizes, broadcast, backend)
    return plan, plan_key


def row_plan(inputs, out, ops, backend="cpp"):
    """``(plan, sizes)``: the compiled plan of an einsum with one sparse operand whose kernel loops over that
    operand's rows in parallel, exactly as ``run`` would compile it, for fusion with other row kernels
    (``fuse.rows``); None where ``run`` would first transpose, relayout or permute, or not loop over rows."""
    sizes, broadcast = _sizes(inputs, ops, "einsum")
    key = (inputs, out, tuple(_type(x) for x in ops), broadcast, None, None, "sum")
    asg, output, sched0, n_sparse = _planned(key)
    if n_sparse != 1 or broadcast:
        return None
    if sched0.parallel != "level0" or relayout.output_order(out, sched0, output) is not None or \
            relayout.plan(inputs, ops, sched0, sizes, broadcast):
        return None
    return _compiled_plan(key, asg, output, sched0, sizes, broadcast, backend)[0], sizes


def arguments(plan: Plan, ops, sizes, out_arr, backend="cpp") -> dict:
    """The kernel parameters' values of ``plan`` on ``ops``, by parameter name (``out_arr`` the output array)."""
    info, _ = _level_info(ops[plan.schedule.driver.operand])
    return {a.param.name: _arg(a, ops, info, sizes, {}, out_arr, backend) for a in plan.lowered.args}


#: speedup of a loop nest whose innermost loop is a contiguous vector loop over one whose outer loop is dense
VECTOR_GAIN = 4.0

#: estimated cost of a format conversion, in kernel multiply-adds per stored entry and sort step
CONVERT_COST = 4.0


def _transposed_for_parallel(asg, sched, x, sizes, threads):
    """A format for the driver whose first level is an output index (so the loop over it runs in parallel
    without write conflicts), when converting costs less than the serial loop loses; else None.

    The choice between this transposition and a privatized output workspace is by this estimate; only
    formats with plain-index levels are transposed. With one thread the transposition still pays where the
    serial loop nest has a dense loop outside the sparse levels: that order streams every stored entry once per
    outer iteration, scalar, where the transposed one reads each once under a vector loop (``VECTOR_GAIN``)."""
    from ..formats import Div, Format, Mod, Var
    from .schedule import unique_levels
    fmt = x.format
    blocked = all(isinstance(e, (Div, Mod)) for e in fmt.exprs)  # blocks: the block levels are reordered
    if not (blocked or all(isinstance(e, Var) for e in fmt.exprs)) or fmt.keeps_duplicates or x.nnz < 2:
        return None
    drv = sched.driver
    movable = [k for k, e in enumerate(fmt.exprs) if not isinstance(e, Mod)]
    firsts = [k for k in movable if drv.indices[fmt.exprs[k].dim] in asg.out]
    if not firsts:
        return None
    order = [firsts[0]] + [k for k in movable if k != firsts[0]]
    order += [k for k in range(len(fmt.exprs)) if k not in order]
    work = x.nnz
    for v in sched.outer + sched.inner:
        work *= sizes[v]
    # the same level types in the new order, made unique (COO's repeated rows would race again)
    types = unique_levels(fmt.level_types)
    alt = Format.from_levels(fmt.ndim, [(fmt.exprs[k], lvl) for k, lvl in zip(order, types)])
    if alt == fmt:
        return None
    if interop.converted_already(x, alt):  # a constant operand (features, an adjacency) converts once
        return alt
    # a counting sort: a pass to count, one to fill (comparison sorts serve other targets: n log n)
    # (blocks move whole: their pattern converts by counting sort, the values by one gather)
    passes = 2 if compressed_target(alt) is not None or blocked else max(1.0, int(x.nnz).bit_length())
    convert = CONVERT_COST * (x.nnz + sizes[drv.indices[fmt.exprs[firsts[0]].dim]]) * passes
    gain = VECTOR_GAIN if sched.outer else 1.0
    if convert >= work * (1 - 1 / (threads * gain)):
        return None
    return alt


def _lowerable(asg, output: OutputFormat) -> OutputFormat:
    """The output the lowering writes: the inferred one when it shares the driver's positions or is dense;
    otherwise a dense workspace that is compressed afterwards."""
    if output.format is None or output.shared_levels:
        return output
    return OutputFormat(None, 0, output.rule)


def _compile(asg, output, sizes, broadcast, backend="cpp") -> Plan:
    written = _lowerable(asg, output)
    sched = schedule(asg, written, sizes)
    ct = L.type_of(asg.operands[0].dtype)
    plan = Plan(asg, output, sched, assemble_from_dense=written is not output)
    plan.lowered = lower(asg, sched, ct, broadcast, target=_target(backend))
    plan.source, plan.kernel = _build(plan.lowered, backend)
    plan.library_call = library.candidate(asg) if backend == "cuda" else None
    return plan


#: backends: ``cpp`` (C++ on the CPU), ``cuda`` (CUDA on the tensors' GPU), ``cuda-emulate`` (the CUDA source run on
#: the CPU by the emulation in ``codegen.cuda``: tests without a GPU), ``interp`` (the loop-IR interpreter)
BACKENDS = ("cpp", "cuda", "cuda-emulate", "interp")


def _target(backend) -> str:
    """The code generator a backend uses: ``cpu`` or ``cuda``."""
    return "cuda" if backend in ("cuda", "cuda-emulate") else "cpu"


def _threads(backend) -> int:
    """How many workers a parallel loop gets, for the schedule's cost estimates: on a GPU, many."""
    return 1 << 14 if _target(backend) == "cuda" else torch.get_num_threads()


def _backend(ops, backend, name):
    """The backend for operands on their devices: CUDA tensors run CUDA kernels; CPU tensors the requested
    backend; mixed devices are refused as torch refuses them."""
    if backend not in BACKENDS:
        raise ValueError(f"scorch: unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    devices = {device_of(x) for x in ops}
    kinds = {d.type for d in devices}
    if kinds == {"cpu"}:
        if backend == "cuda":
            raise ValueError(f"scorch {name}: the cuda backend takes CUDA tensors; these are on the CPU")
        return backend
    if kinds == {"cuda"} and len(devices) == 1:
        if backend not in ("cpp", "cuda"):
            raise ValueError(f"scorch {name}: the {backend} backend runs on the CPU; these tensors are on CUDA")
        return "cuda"
    if kinds == {"cuda"} or len(kinds) > 1:
        raise ValueError(f"scorch {name}: expected all tensors on the same device, got "
                         f"{', '.join(sorted(str(d) for d in devices))}")
    raise NotImplementedError(f"scorch: {name} on {', '.join(sorted(kinds))} tensors is not supported (CPU and"
                              " CUDA only)")


class CudaKernel:
    """A loaded CUDA launcher (``codegen.cuda``): called with the kernel's arguments, it adds the current CUDA
    stream and raises ``RuntimeError`` on a CUDA error. ``emulated``: the CPU emulation build."""

    def __init__(self, kernel, error, emulated, mapping):
        self.kernel, self.error, self.emulated, self.mapping = kernel, error, emulated, mapping
        self.path, self.origin, self.compile_seconds = kernel.path, kernel.origin, kernel.compile_seconds

    def __call__(self, *args):
        stream = None if self.emulated else torch.cuda.current_stream().cuda_stream
        code = self.kernel.fn(*args, stream)
        if code:
            raise RuntimeError(f"scorch: CUDA kernel {self.kernel.name} failed: {self.error(code).decode()}"
                               f" (error {code})")


def _build(low, backend="cpp"):
    """``(source, kernel)``: a lowered kernel's source for the backend, compiled (or found in a cache) and
    loaded."""
    if _target(backend) == "cpu":
        src = cpp.generate(low.kernel)
        return src, runtime.load(src, low.kernel.name, cpp.argtypes(low.kernel))
    import ctypes
    src = cuda.generate(low.kernel)
    emulated = backend == "cuda-emulate"
    arch = "" if emulated else _cuda_arch()
    tool = "emulate" if emulated else "nvcc"
    k = runtime.load(src, low.kernel.name, cuda.argtypes(low.kernel), ctypes.c_int, toolchain=tool, arch=arch)
    err = runtime.load(src, low.kernel.name + "_error", [ctypes.c_int], ctypes.c_char_p, toolchain=tool, arch=arch)
    return src, CudaKernel(k, err.fn, emulated, cuda.plan(low.kernel))


def _gpu_lines(kernel) -> list:
    if not isinstance(kernel, CudaKernel):
        return []
    where = "CUDA, emulated on the CPU" if kernel.emulated else "CUDA"
    return [f"target:       {where}; workers: {kernel.mapping.describe}"]


def _cuda_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@dataclass
class CoPlan:
    """A co-iteration plan: operands reformatted as the schedule says, then one kernel (dense output) or two
    (count and fill passes of a rows output)."""
    asg: Assignment
    output: OutputFormat
    schedule: object
    inner_asg: Assignment = None
    lowered: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    calls: int = 0
    broadcast: frozenset = frozenset()
    backend: str = "cpp"

    def kernel(self, phase):
        """The kernel of ``phase`` (None, "count", "fill" or "fill32"), lowered and loaded on first use: a rows
        output needs the fill with 32-bit coordinates or the one with 64-bit coordinates, rarely both."""
        if phase not in self.kernels:
            from .coiterate import lower_coiteration
            low = lower_coiteration(self.inner_asg, self.schedule, L.type_of(self.asg.operands[0].dtype),
                                    self.broadcast, phase)
            self.lowered[phase] = low
            self.sources[phase], self.kernels[phase] = _build(low, self.backend)
        return self.kernels[phase]

    def explain(self) -> str:
        cs, out = self.schedule, self.output
        fmt = "dense (torch tensor)" if out.format is None else (out.format.name or str(out.format))
        lines = [f"expression:   {self.asg}",
                 f"operands:     {', '.join(f'T{k}: {t}' for k, t in enumerate(self.asg.operands))}",
                 f"output:       {fmt}  [rule: {out.rule}]"]
        for k, f in cs.reformat:
            lines.append(f"reformat:     T{k} converted to {f.name or f} before the kernel")
        lines.append(f"loop order:   {' -> '.join(cs.order)}  ({cs.why})")
        if cs.output == "rows":
            row = cs.row_var or "(one virtual row)"
            lines.append(f"assembly:     per {row}: dense workspace over ({', '.join(cs.ws_vars)}) with a touched list;"
                         " count pass, prefix sum, fill pass")
        lines.append(f"parallel:     {'the outermost loop' if cs.parallel else 'none'}"
                     f"{' (balanced by nnz)' if cs.balance else ''}")
        for phase, k in self.kernels.items():
            how = {"compiled": f"compiled now ({k.compile_seconds:.2f} s)", "disk": "loaded from the disk cache",
                   "memory": "from the memory cache"}.get(k.origin, k.origin)
            lines += _gpu_lines(k)
            lines += [f"kernel {phase}: {how}: {k.path}", "source:", self.sources[phase]]
        return "\n".join(lines)


def _coiteration_plan(key, asg, output, broadcast, backend, weights=None) -> CoPlan:
    plan = _COMPILED.get(key)
    if plan is None:
        plan = _COMPILED[key] = _compile_coiteration(asg, output, broadcast, backend, weights)
    return plan


def _compile_coiteration(asg, output, broadcast, backend="cpp", weights=None) -> CoPlan:
    from .schedule import schedule_coiteration
    cs = schedule_coiteration(asg, output, weights)
    ops = list(asg.operands)
    for k, f in cs.reformat:
        t = ops[k]
        ops[k] = TensorType(t.ndim, t.dtype, f, t.index_dtype, t.device)
    inner = Assignment(asg.out, asg.rhs, tuple(ops), asg.reduce, asg.out_format)
    plan = CoPlan(asg, output, cs, inner, broadcast=broadcast, backend=backend)
    if cs.output == "dense":
        plan.kernel(None)
    return plan


def _call_coiteration(plan: CoPlan, ops, sizes, dtype, scalars, backend):
    cs, asg = plan.schedule, plan.asg
    ops = list(ops)
    for k, f in cs.reformat:
        ops[k] = interop.asformat(ops[k], f, index_dtype=ops[k].index_dtype)
    infos = {k: _level_info(x)[0] for k, x in enumerate(ops) if isinstance(x, SparseTensor)}
    out_shape = tuple(sizes[v] for v in asg.out)
    if cs.output == "rows":
        ws = 1
        for v in cs.ws_vars:
            ws *= sizes[v]
        # (a GPU launcher runs as many workers as fit its scratch: one workspace is what must fit)
        threads = torch.get_num_threads() if cs.parallel and _target(backend) == "cpu" else 1
        if ws * threads * (dtype.itemsize + 17) > WORKSPACE_LIMIT_BYTES:
            raise NotImplementedError(
                f"scorch: the dense workspace over ({', '.join(cs.ws_vars)}) would take"
                f" {ws * threads * (dtype.itemsize + 17) / 2**20:.0f} MiB; hash workspaces for such outputs are not"
                " supported yet (ask for format='dense' or reorder the operands)")

    def launch(phase, extra):
        kernel = plan.kernel(phase)
        low = plan.lowered[phase]
        args = [extra[a.kind] if a.kind in extra else _arg(a, ops, infos.get(a.operand), sizes, scalars, None,
                                                           backend) for a in low.args]
        if backend == "interp":
            from . import interp
            interp.run(low.kernel, {a.param.name: (v.reshape(-1).numpy() if isinstance(v, torch.Tensor) else v)
                                    for a, v in zip(low.args, args)})
        else:
            kernel(*[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args])

    plan.calls += 1
    dev = device_of(ops[0])
    if cs.output == "dense":
        out = torch.zeros(out_shape, dtype=dtype, device=dev)
        launch(None, {"out": out})
        return out
    rows = sizes[cs.row_var] if cs.row_var is not None else 1
    if rows * 16 > WORKSPACE_LIMIT_BYTES:
        raise NotImplementedError(
            f"scorch: assembling the output row by row over {cs.row_var!r} needs {rows} row counts"
            f" ({rows * 16 / 2**20:.0f} MiB) and a workspace over ({', '.join(cs.ws_vars)}); hash workspaces for"
            " such outputs are not supported yet")
    counts = torch.zeros(rows, dtype=torch.int64, device=dev)
    launch("count", {"counts": counts})
    row_ptr = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    nnz = int(row_ptr[-1])
    narrow = ws <= NARROW_COORDINATES
    crd = torch.empty(nnz, dtype=torch.int32 if narrow else torch.int64, device=dev)
    vals = torch.empty(nnz, dtype=dtype, device=dev)
    launch("fill32" if narrow else "fill", {"row_ptr": row_ptr, "out_crd": crd, "out": vals})
    return _assemble(plan, out_shape, sizes, row_ptr, counts, crd, vals)


def _assemble(plan, out_shape, sizes, row_ptr, counts, crd, vals):
    """The result in the output format, from the rows the kernels wrote: directly when they already are that
    format's arrays (CSR or CSC), else through the coordinate list."""
    cs, asg, fmt = plan.schedule, plan.asg, plan.output.format
    from ..formats import storage
    idx = storage.pick_index_dtype(crd.numel(), *out_shape)
    if len(asg.out) == 2 and cs.row_var is not None:
        direct = named.csr if cs.row_var == asg.out[0] else named.csc
        s = SparseTensor(direct, out_shape, [None, {"pos": row_ptr.to(idx), "crd": crd.to(idx)}], vals, check=False)
        return s if fmt == direct else interop.asformat(s, fmt)
    coords = {}
    if cs.row_var is not None:
        coords[cs.row_var] = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    rest = crd.long()  # (pack takes int64 coordinates; the kernel wrote int32 ones where they fit)
    for v in reversed(cs.ws_vars):
        coords[v] = rest % sizes[v] if sizes[v] else rest
        rest = rest // sizes[v] if sizes[v] else rest
    dims = torch.stack([coords[v] for v in asg.out]) if asg.out else torch.zeros(0, vals.numel(), dtype=torch.int64,
                                                                                device=vals.device)
    levels, values = storage.pack(fmt, out_shape, dims, vals, idx)
    return SparseTensor(fmt, out_shape, levels, values, check=False)


def _sizes(inputs, ops, name):
    sizes, broadcast = {}, set()
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        for d, v in enumerate(idx):
            n = shape_of(x)[d]
            if v not in sizes or sizes[v] == 1:
                sizes[v] = n
            elif n != sizes[v] and n != 1:
                raise ValueError(f"scorch {name}: index {v!r} has size {sizes[v]} in one operand and {n} in"
                                 f" operand {k} (shape {tuple(x.shape)})")
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        for d, v in enumerate(idx):
            if shape_of(x)[d] == 1 and sizes[v] != 1:
                if isinstance(x, SparseTensor):
                    raise NotImplementedError(f"scorch {name}: broadcasting the sparse operand {k} along"
                                              f" index {v!r} is not supported")
                broadcast.add((k, d))
    return sizes, frozenset(broadcast)


def _result_dtype(ops, name):
    dtype = dtype_of(ops[0])
    for x in ops[1:]:
        dtype = torch.promote_types(dtype, dtype_of(x))
    if dtype not in SUPPORTED:
        raise TypeError(f"scorch {name}: unsupported dtype {dtype} (supported: float32, float64, int32, int64)")
    return dtype


def _cast(x, dtype):
    if dtype_of(x) == dtype:
        return x if type(x) is SparseTensor else x.contiguous()
    if isinstance(x, SparseTensor):
        return x.with_values(x.values().to(dtype))
    return x.to(dtype).contiguous()


def _level_info(x: SparseTensor):
    """Per level: ``(lo, extent, width)`` and the number of positions, from the storage."""
    fmt = x.format
    count, info, counts = 1, [], []
    for (lo, hi), lvl, st in zip(fmt.level_bounds(x._shape), fmt.level_types, x._levels):
        width = lvl.width(st, count) if lvl.padded else 0
        info.append((lo, hi - lo, width))
        count = lvl.num_positions(st, count, lo, hi)
        counts.append(count)
    return info, counts


def _prepared_call(plan: Plan, sizes, dtype):
    """A call of ``plan`` for operands of one signature, with everything that depends only on the signature
    (sizes, level bounds, the argument list's constant entries) computed once: a repeated call then costs
    the pointer reads, the output allocation and the ctypes call."""
    asg, out = plan.asg, plan.output
    written = _lowerable(asg, out)
    if asg.reduce != "sum" or (out.format is not None and not written.shared_levels) or any(
            t.format.padded for t in asg.operands if t.sparse):
        return lambda ops, scalars: _call(plan, ops, sizes, dtype, scalars or {})
    k_drv = plan.schedule.driver.operand
    out_shape = tuple(sizes[v] for v in asg.out)
    m = written.shared_levels
    alloc = torch.empty if plan.lowered.writes_every_output else torch.zeros
    template, dynamic = [], []
    for n, a in enumerate(plan.lowered.args):
        k = a.kind
        if k in ("pos", "crd"):
            dynamic.append((n, a.operand, a.level, 0 if k == "pos" else 1))
            template.append(None)
        elif k == "values":
            dynamic.append((n, a.operand, -1, 2))
            template.append(None)
        elif k == "dense":
            dynamic.append((n, a.operand, -1, 3))
            template.append(None)
        elif k in ("out", "threads", "scalar"):
            template.append(None)
        else:
            template.append(_arg(a, None, None, sizes, None, None) if k in ("size",) else None)
    # the remaining static values (level bounds and operand dimensions) come from the first call
    statics = {}
    out_pos = [n for n, a in enumerate(plan.lowered.args) if a.kind == "out"][0]
    thr_pos = [n for n, a in enumerate(plan.lowered.args) if a.kind == "threads"]
    scal = [(n, a.var) for n, a in enumerate(plan.lowered.args) if a.kind == "scalar"]
    fn = plan.kernel.fn

    def call(ops, scalars):
        if not statics:
            s = ops[k_drv]
            info, _ = _level_info(s)
            for n, a in enumerate(plan.lowered.args):
                if a.kind in ("lo", "extent"):
                    template[n] = info[a.level][0 if a.kind == "lo" else 1]
                elif a.kind == "dim":
                    template[n] = shape_of(ops[a.operand])[a.level]
            statics["done"] = True
        args = list(template)
        for n, op, lvl, what in dynamic:
            x = ops[op]
            args[n] = (x._levels[lvl].pos if what == 0 else x._levels[lvl].crd if what == 1 else
                       x._vals if what == 2 else x).data_ptr()
        if m:
            s = ops[k_drv]
            _, counts = _level_info(s)
            out_arr = alloc(counts[m - 1], dtype=dtype)
        else:
            out_arr = alloc(out_shape, dtype=dtype)
        args[out_pos] = out_arr.data_ptr()
        for n in thr_pos:
            args[n] = torch.get_num_threads()
        for n, v in scal:
            args[n] = scalars[v]
        fn(*args)
        plan.calls += 1
        if m and out.format is not None:
            return SparseTensor(out.format, out_shape, ops[k_drv]._levels[:m], out_arr, check=False)
        return out_arr.reshape(out_shape) if m else out_arr
    return call


class _Structural(threading.local):
    on = False


#: set while a differentiable einsum computes its result (``structural_results``)
_STRUCTURAL = _Structural()


@contextlib.contextmanager
def structural_results():
    """Within this block a sparse result assembled from a dense workspace keeps every entry the operands'
    patterns produce, numerically zero or not (an entry of a stored zero, or of a zero in a dense operand):
    gradients flow to exactly the stored entries of a result, so a dropped zero would lose its gradient
    (``_autograd`` computes differentiable einsums in this block). Outside it such zeros are left out."""
    before = _STRUCTURAL.on
    _STRUCTURAL.on = True
    try:
        yield
    finally:
        _STRUCTURAL.on = before


def _structural(plan: Plan, ops, sizes, dtype, scalars, backend, out_arr):
    """``out_arr`` (the dense workspace of ``plan``'s result) in the result's format, keeping the entries where the
    kernel run on the patterns (ones at every stored position, ones for dense operands: no cancellation) is
    nonzero."""
    from .._autograd import pattern_ones
    from ..formats import storage
    ones = [x.with_values(pattern_ones(x, dtype)) if type(x) is SparseTensor else torch.ones_like(x) for x in ops]
    reach = _call(plan, ones, sizes, dtype, {v: 1 for v in scalars}, backend, raw=True)
    dims = reach.nonzero().T
    fmt, shape = plan.output.format, tuple(out_arr.shape)
    levels, values = storage.pack(fmt, shape, dims, out_arr[tuple(dims)])
    return SparseTensor(fmt, shape, levels, values, check=False)


def _call(plan: Plan, ops, sizes, dtype, scalars, backend="cpp", raw=False):
    """Run ``plan``'s kernel on ``ops``: the result, or (``raw``) the array the kernel wrote."""
    asg, out = plan.asg, plan.output
    s = ops[plan.schedule.driver.operand]
    info, counts = _level_info(s)
    out_shape = tuple(sizes[v] for v in asg.out)
    written = _lowerable(asg, out)
    n_out = counts[written.shared_levels - 1] if written.shared_levels else out_shape
    if plan.assemble_from_dense:
        cells = 1
        for n in out_shape:
            cells *= n
        if cells * dtype.itemsize > WORKSPACE_LIMIT_BYTES:
            raise NotImplementedError(
                f"scorch: the {out.format.name or out.format} output of {asg} would be assembled through a dense"
                f" workspace of {cells * dtype.itemsize / 2**20:.0f} MiB; direct assembly of this output is not"
                " supported yet (ask for another format=)")
    red = asg.reduce
    dev = s._vals.device
    if red == "sum":
        alloc = torch.empty if plan.lowered.writes_every_output else torch.zeros
        out_arr, counted = alloc(n_out, dtype=dtype, device=dev), None
    else:
        ident = float("-inf") if red == "max" else float("inf")
        if not dtype.is_floating_point:
            ident = torch.iinfo(dtype).min if red == "max" else torch.iinfo(dtype).max
        out_arr, counted = torch.full(n_out if isinstance(n_out, tuple) else (n_out,), ident, dtype=dtype,
                                      device=dev), torch.zeros(n_out, dtype=torch.int64, device=dev)
    args = [counted if a.kind == "counts" else _arg(a, ops, info, sizes, scalars, out_arr, backend)
            for a in plan.lowered.args]
    if backend == "interp":
        from . import interp
        interp.run(plan.lowered.kernel, {a.param.name: (v.reshape(-1).numpy() if isinstance(v, torch.Tensor) else v)
                                         for a, v in zip(plan.lowered.args, args)})
    else:
        plan.kernel(*[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args])
    plan.calls += 1
    if counted is not None:
        reduced = 1
        for v in asg.reduced:
            reduced *= sizes[v]
        zero = torch.zeros((), dtype=dtype, device=dev)
        implicit = counted.reshape(out_arr.shape) < reduced  # an implicit zero takes part in the max/min
        out_arr = torch.where(implicit, (torch.maximum if red == "max" else torch.minimum)(out_arr, zero), out_arr)
    if raw:
        return out_arr
    if written.shared_levels and out.format is not None:
        m = written.shared_levels
        return SparseTensor(out.format, out_shape, s.levels[:m], out_arr, check=False)
    if written.shared_levels:
        return out_arr.reshape(out_shape)
    if out.format is not None:
        if _STRUCTURAL.on and red == "sum":
            return _structural(plan, ops, sizes, dtype, scalars, backend, out_arr)
        return interop.asformat(out_arr, out.format)
    return out_arr


def _arg(a, ops, info, sizes, scalars, out_arr, backend="cpp"):
    """The value of one kernel argument: a tensor (passed by pointer) or a number."""
    k = a.kind
    if k in ("pos", "crd"):
        return getattr(ops[a.operand]._levels[a.level], k)
    if k == "values":
        return ops[a.operand]._vals
    if k == "dense":
        return ops[a.operand]
    if k in ("lo", "extent", "width"):
        return info[a.level][("lo", "extent", "width").index(k)]
    if k == "dim":
        return shape_of(ops[a.operand])[a.level]
    if k == "size":
        return sizes[a.var]
    if k == "scalar":
        return scalars[a.var]
    if k == "out":
        return out_arr
    if k == "threads":
        return _threads(backend)
    raise AssertionError(f"unknown argument kind {k!r}")


def explain(equation, *operands, format=None, file=None) -> str:
    """Run ``einsum(equation, *operands)`` and print (to ``file``, default stdout) and return its plan: the
    contraction order for three or more operands, the inferred output format and the rule that chose it, any
    operand reformatting, the loop order, workspaces and assembly, the parallel loop, specialized extents,
    where each kernel came from (compiled now, disk or memory cache) and the generated source."""
    import contextlib
    import io
    import sys
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        einsum(equation, *operands, format=format, explain=True)
    text = buf.getvalue() or "(no compiled plan: dense operands go straight to torch)\n"
    print(text, end="", file=file or sys.stdout)
    return text


# --- format conversion by generated kernels -----------------------------------------------------------------
_CONVERTERS: dict = {}


def compressed_target(fmt):
    """``(row dim, col dim)`` when ``fmt`` is a 2-d ``(r : dense, c : compressed)`` format (CSR, CSC), else None."""
    from ..formats import Compressed, Dense, Var
    if fmt.ndim != 2 or len(fmt.levels) != 2:
        return None
    (e0, l0), (e1, l1) = fmt.levels
    if isinstance(e0, Var) and isinstance(e1, Var) and isinstance(l0, Dense) and isinstance(l1, Compressed) \
            and l1.unique and l1.ordered:
        return e0.dim, e1.dim
    return None


def convert(x: SparseTensor, fmt, index_dtype=None, drop_zeros=False):
    """``x`` in the CSR-like format ``fmt`` by generated kernels (counting sort: count, prefix sum, fill), or
    None when this path does not apply (another target, or a source with duplicates to sum).
    ``drop_zeros``: leave stored zeros out (a dense source's zeros are not entries)."""
    from ..formats import storage
    rc = compressed_target(fmt)
    if rc is None or x.format.keeps_duplicates or x.dim() != 2 or x.dtype not in SUPPORTED or \
            x.device.type != "cpu":  # (conversions on a GPU go through torch's sort)
        return None
    letters = ("i", "j")
    types = (_type(x),)
    key = (types, fmt, drop_zeros)
    plans = _CONVERTERS.get(key)
    if plans is None:
        asg = Assignment(letters, Access(0, letters), types, out_format=fmt)
        sched = schedule(asg, OutputFormat(None, 0, "conversion"))
        sched = replace(sched, parallel="none", balance="static")
        ct = L.type_of(x.dtype)
        plans = {}
        for phase in ("count", "fill"):
            low = lower(asg, sched, ct, frozenset(), scatter=(letters[rc[0]], letters[rc[1]], phase, drop_zeros))
            src, kernel = _build(low)
            plans[phase] = (low, kernel, src)
        _CONVERTERS[key] = plans
    info, _ = _level_info(x)
    sizes = {"i": x.shape[0], "j": x.shape[1]}
    rows = x.shape[rc[0]]
    counts = torch.zeros(rows, dtype=torch.int64)
    low, k, _ = plans["count"]
    k(*[_ptr(counts if a.kind == "counts" else _arg(a, [x], info, sizes, {}, None)) for a in low.args])
    row_ptr = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    nnz = int(row_ptr[-1])
    nxt = row_ptr[:-1].clone()
    crd = torch.empty(nnz, dtype=torch.int64)
    vals = torch.empty(nnz, dtype=x.dtype)
    extra = {"next": nxt, "out_crd": crd, "out": vals}
    low, k, _ = plans["fill"]
    k(*[_ptr(extra[a.kind] if a.kind in extra else _arg(a, [x], info, sizes, {}, None)) for a in low.args])
    # entries reach each row in the source's loop order: sorted when the source's outermost level stores the
    # target's column coordinate (ordered, unique: CSR -> CSC and back); else checked, and None when not sorted
    from ..formats import Var
    e0, l0 = x.format.levels[0]
    if nnz > 1 and not (isinstance(e0, Var) and e0.dim == rc[1] and l0.ordered and l0.unique):
        starts = torch.zeros(nnz, dtype=torch.bool)
        starts[row_ptr[:-1][counts > 0]] = True
        if bool(((crd[1:] <= crd[:-1]) & ~starts[1:]).any()):
            return None
    idx = index_dtype or storage.pick_index_dtype(nnz, *x.shape)
    return SparseTensor(fmt, x.shape, [None, {"pos": row_ptr.to(idx), "crd": crd.to(idx)}], vals, check=False)


def _ptr(v):
    return v.data_ptr() if isinstance(v, torch.Tensor) else v
