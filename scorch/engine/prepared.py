"""The prepared call: one owner for what a call's preparation leaves behind, and for where it is found again.

A call whose operands have a signature seen before (formats, dtypes, shapes, devices) skips planning: its
prepared call reads the operands' array addresses, allocates the output and runs the kernel. It is made once
(``prepared_call``, from a ``Plan``), held in one record type (``Prepared``), and found again in one order:

1. **on the tensor**: ``S @ X`` keeps its call on ``S`` (a ``KeptProduct`` in ``S.__dict__["_products"]``:
   ``kept_product``, ``kept_sddmm``), valid while ``stands`` says so; the C operators (``direct.operators``) make
   that test compiled, reading the record's fields at the positions ``KeptProduct`` declares;
2. **by signature**, in memory: ``BY_EQUATION`` (the einsum equation, requested format, directives and each
   operand's ``signature``: ``find``) and ``BY_CALL`` (the assignment ``run`` plans after the early steps:
   ``call_signature``), and the steps ``run`` took before a kernel (``STEPS``, replayed);
3. **on disk**: ``kept_call`` (a call that went straight to one kernel: its plan key, sizes and dtype), read once
   per signature and thread count in a process.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, NamedTuple

import torch

from ..compiler import runtime
from ..compiler.caches import cache
from ..compiler.codegen.cpp import pack_format
from ..compiler.pipeline import Plan, kept_plan, lowerable
from ..compiler.target import CPU
from ..formats.storage import array_version
from ..sparse_tensor import SparseTensor, needs_grad, shape_of
from .args import level_info, mean_length
from .bind import _CPU_BACKEND, STRUCTURAL, buffer_dtype, call_plan, contiguous_strides
from . import bind, direct, memory
from .direct import CRD, DENSE, MEAN, POS, VALUES


class Prepared:
    """One prepared call. ``run(ops, scalars)`` is what a repeated call takes: the Python call (``python``) until
    its first call makes the C form (``direct.program``), then that. ``made_of``: ``(plan key, index sizes, result
    dtype)``, what a new process needs to prepare the same call from the plan kept on disk (None where the call
    cannot be made again from a plan alone, such as one taking relaid operands)."""
    __slots__ = ("run", "python", "made_of")

    def __init__(self, python: Callable, made_of: tuple | None = None):
        self.run = self.python = python
        self.made_of = made_of

    def __repr__(self):
        return f"<prepared call: {'C' if self.run is not self.python else 'Python'}>"


class KeptProduct(NamedTuple):
    """A product's prepared call kept on its SparseTensor (``keep_product``, ``keep_sddmm``), with what ``stands``
    compares: the values' dtype, the format and index width (by identity: an in-place change of pattern swaps
    them), ``BY_EQUATION``'s generation and whether results were structural when it was kept. ``prepared`` None:
    looked for and none found, ``tries`` times. An SDDMM's entry has the pattern of ones it runs on, the levels it
    was made of and the pattern values' version. (The C operators read these fields by position: ``FIELDS``.)"""
    prepared: Prepared | None
    values_dtype: torch.dtype
    format: Any
    index_dtype: torch.dtype
    generation: int
    structural: bool
    tries: int
    levels: Any = None
    pattern: Any = None
    version: Any = None


#: each field of ``KeptProduct`` by name -> its position, for the C operators (``direct.operators``)
FIELDS = {name: n for n, name in enumerate(KeptProduct._fields)}

BY_EQUATION = cache("prepared-by-equation", "the prepared calls again, keyed by the einsum equation string")
BY_CALL = cache("prepared", "prepared calls per signature (expression, operand formats, dtypes, shapes)")
STEPS = cache("steps", "per call signature, the steps its operands take before the kernel (a transposition, dense"
              " operands relaid, the output's index order) and the prepared call of the operands they give")
NOT_KEPT = cache("not-kept-calls", "equation signatures (and thread counts) with no prepared call kept on disk")


# --- signatures ------------------------------------------------------------------------------------------------

def signature(x):
    """What a repeated call must match to reuse a prepared call: format, dtypes and shape."""
    if type(x) is SparseTensor:
        v = x._vals
        return (x._format, v.dtype, x._index_dtype, x._shape, v.device)
    return (None, x.dtype, x.shape, x.device, x.is_contiguous())


def call_signature(inputs, out, ops, format, rhs, reduce, directives) -> tuple:
    """The key of ``BY_CALL``: the assignment, the requested format, the user's directives, whether results are
    structural (``structural_results``) and each operand's ``signature``."""
    return (inputs, out, format, rhs, reduce, STRUCTURAL.on, directives) + tuple(signature(x) for x in ops)


def equation_signature(equation, format, directives, operands) -> tuple:
    """The key of ``BY_EQUATION``: the equation, requested format, the user's directives, whether results are
    structural, and each operand's ``signature``."""
    return (equation, format, STRUCTURAL.on, directives) + tuple(signature(x) for x in operands)


def equation_key(equation, format, directives, operands):
    """``equation_signature`` of a call that may be kept by its signature: SparseTensors with plain values and
    plain strided tensors, at least one of them sparse, no graph to record, the "cpp" CPU backend; else None.
    Every repeated einsum of a small product comes here first."""
    if _CPU_BACKEND.name != "cpp":
        return None
    grad, sparse = torch.is_grad_enabled(), False
    for x in operands:
        t = type(x)
        if t is SparseTensor:
            if type(x._vals) is not torch.Tensor or (grad and x._vals.requires_grad):
                return None
            sparse = True
        elif t is not torch.Tensor or x.layout != torch.strided or (grad and x.requires_grad):
            return None
    return equation_signature(equation, format, directives, operands) if sparse else None


# --- the lookup order: the tensor, then the signature, then the disk ---------------------------------------------

_any_autocast = torch._C._is_any_autocast_enabled  # (under autocast, matmul casts its operands first)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def stands(d, entry: KeptProduct, dense) -> bool:
    """Whether the call kept in ``entry`` is the one a signature lookup would give now, for the SparseTensor whose
    ``__dict__`` is ``d`` and the ``dense`` operands: each a plain contiguous strided CPU tensor with storage (a
    torch.func transform's has none), no gradient to record, no autocast, ``d``'s values plain and of the kept
    dtype, the kept format and index width, ``structural_results`` as kept, the "cpp" backend, ``BY_EQUATION``
    not cleared since. The one test of a kept call; ``direct.operators`` compiles the same test, in this order
    (``tests/test_product_operator.py`` compares them). ``d`` rather than the tensor: an attribute of a tensor
    subclass is looked up through ``torch.Tensor``'s type first, microseconds with the caches cold."""
    v = d["_vals"]
    if type(v) is not torch.Tensor or entry.values_dtype is not v.dtype or entry.format is not d["_format"] or \
            entry.index_dtype is not d["_index_dtype"] or entry.generation != BY_EQUATION.generation or \
            entry.structural != STRUCTURAL.on or _CPU_BACKEND.name != "cpp":
        return False
    grad = v.requires_grad
    for x in dense:
        if type(x) is not torch.Tensor or not x.is_cpu or x.layout is not torch.strided or not x.is_contiguous() or \
                x.is_neg() or _functorch_wrapped(x):
            return False
        grad = grad or x.requires_grad
    return not ((grad and torch.is_grad_enabled()) or _any_autocast())


def kept_product(s, other, left: bool):
    """What ``s @ other`` (``left``) or ``other @ s`` runs, for the 2-d SparseTensor ``s`` and a dense ``other``:
    the ``run`` of the prepared call kept on ``s`` by ``keep_product`` (its C form once its first call made one);
    None where there is none or it does not stand, False where ``keep_product`` looked and found none often enough
    to stop looking. A repeated product then skips ``matmul``'s checks and the signature of both operands."""
    memo = s.__dict__.get("_products")
    if memo is None or type(other) is not torch.Tensor:
        return None
    entry = memo.get((left, other.shape, other.dtype))
    if entry is None or not stands(s.__dict__, entry, (other,)):
        return None
    if entry.prepared is None:
        return False if entry.tries >= 3 else None
    return entry.prepared.run


def product_operators(fallback, deferral):
    """``(__matmul__, __rmatmul__)`` in C (``direct.operators``): ``kept_product``'s test (``stands``) and the kept
    call in one C function, ``fallback(s, other, left)`` for every other product; None where there is no C helper."""
    return direct.operators(fallback, BY_EQUATION, STRUCTURAL, _CPU_BACKEND, deferral, FIELDS)


def find(sig) -> Prepared | None:
    """The prepared call of the einsum signature ``sig`` (``equation_key``): in memory, else kept on disk (looked
    for once per signature and thread count in a process: a call that is never kept, such as a gradient's on a
    pattern of ones, would read the disk every time)."""
    found = BY_EQUATION.get(sig)
    if found is None:
        missed = (sig, torch.get_num_threads())
        if missed in NOT_KEPT:
            return None
        found = kept_call(sig)
        if found is None:
            NOT_KEPT[missed] = True
            return None
        BY_EQUATION[sig] = found
    return found


def keep(sig, found: Prepared) -> None:
    """Keep ``found`` under the einsum signature ``sig``: in memory and on disk."""
    BY_EQUATION[sig] = found
    if found.made_of is not None:
        runtime.keep("calls", _code(), (sig, torch.get_num_threads()), found.made_of)


def _seen(equation, operands, format) -> Prepared | None:
    """The prepared call kept in memory for an einsum of these operands (no disk read)."""
    sig = equation_key(equation, format, None, operands)
    return None if sig is None else BY_EQUATION.get(sig)


def _keep_on(s, key, found, *extra):
    """Keep ``found`` (or, where it is None, count the look) on ``s`` under ``key``, with what ``stands``
    compares and ``extra`` (``KeptProduct``'s last fields)."""
    memo = s.__dict__.setdefault("_products", {})
    if key not in memo and len(memo) >= 16:
        return
    entry = memo.get(key)
    tries = 0 if found is not None else entry.tries + 1 if entry is not None and entry.prepared is None else 1
    memo[key] = KeptProduct(found, s._vals.dtype, s._format, s._index_dtype, BY_EQUATION.generation, STRUCTURAL.on,
                            tries, *extra)


def _keepable(s, dense) -> bool:
    """Whether a product of ``s`` and ``dense`` may be kept on ``s`` (or its look counted): ``stands``' conditions
    on the dense operands, ``s`` on the CPU, no gradient to record."""
    return all(type(x) is torch.Tensor and x.is_cpu and x.layout is torch.strided and x.is_contiguous()
               for x in dense) and s._vals.device.type == "cpu" and not needs_grad((s, *dense))


def keep_product(s, other, left: bool, equation: str):
    """Keep on ``s`` the prepared call kept in memory for ``einsum(equation, ...)`` of ``s @ other`` (``left``) or
    ``other @ s`` with a dense result, for ``kept_product``; where there is none, count the look."""
    if _keepable(s, (other,)):
        _keep_on(s, (left, other.shape, other.dtype), _seen(equation, (s, other) if left else (other, s), "dense"))


#: SDDMM's equation on a pattern of ones (``sampled_addmm``)
SDDMM = "ij,ik,kj->ij"


def kept_sddmm(s, mat1, mat2):
    """``(run, pattern)``: the prepared call of ``einsum(SDDMM, pattern, mat1, mat2)`` and the ``pattern`` (``s``'s
    index arrays with values of ones) kept on the SparseTensor ``s`` by ``keep_sddmm``, for ``sampled_addmm`` with
    ``alpha`` 1; None where there is none. It stands where ``stands`` says so and where ``s``'s index arrays are
    still the pattern's (an in-place change of pattern swaps the tuple) and the pattern's values are still the
    ones they were (their version)."""
    d = s.__dict__
    memo = d.get("_products")
    if memo is None or type(mat1) is not torch.Tensor or type(mat2) is not torch.Tensor:
        return None
    entry = memo.get(("sddmm", mat1.shape, mat1.dtype, mat2.shape, mat2.dtype))
    if entry is None or entry.prepared is None or entry.levels is not d["_levels"] or \
            array_version(entry.pattern._vals) != entry.version or not stands(d, entry, (mat1, mat2)):
        return None
    return entry.prepared.run, entry.pattern


def keep_sddmm(s, pattern, mat1, mat2, format):
    """Keep on ``s`` the prepared call kept in memory for ``einsum(SDDMM, pattern, mat1, mat2, format=format)``,
    with ``pattern``, for ``kept_sddmm``; where there is none, count the look (up to 3 times)."""
    if not _keepable(s, (mat1, mat2)):
        return
    key = ("sddmm", mat1.shape, mat1.dtype, mat2.shape, mat2.dtype)
    entry = s.__dict__.get("_products", {}).get(key)
    if entry is not None and entry.prepared is None and entry.tries >= 3:
        return
    _keep_on(s, key, _seen(SDDMM, (pattern, mat1, mat2), format), s._levels, pattern, array_version(pattern._vals))


# --- making a prepared call --------------------------------------------------------------------------------------

def prepared_call(plan: Plan, sizes, dtype, made_of=None) -> Prepared:
    """The prepared call of ``plan`` for operands of one signature, with everything that depends only on the
    signature (sizes, level bounds, the argument list's constant entries) computed once: a repeated call then
    costs the pointer reads, the output allocation and the kernel call. Its first call makes its C form
    (``direct.program``) where there is one, and the record runs that from then on."""
    asg, out = plan.asg, plan.output
    written = lowerable(asg, out)
    if asg.reduce != "sum" or (out.format is not None and not written.shared_levels) or any(
            t.format.padded for t in asg.operands if t.format is not None):
        return Prepared(lambda ops, scalars: call_plan(plan, ops, sizes, dtype, scalars or {}), made_of)
    k_drv = plan.schedule.driver.operand
    out_shape = tuple(sizes[v] for v in asg.out)
    m = written.shared_levels
    alloc = memory.empty if plan.lowered.writes_every_output else memory.zeros
    wanted, dtype = dtype, buffer_dtype(plan.lowered, dtype)
    alloc_args = (out_shape,)
    if not m and math.prod(out_shape) * dtype.itemsize < memory.THRESHOLD_BYTES:
        alloc = torch.empty if plan.lowered.writes_every_output else torch.zeros  # (no huge-page advice to give)
        if alloc is torch.empty:  # (``empty_strided``: 1.5 -> 1.0 us a call warm, 25 -> 17 us with the caches cold)
            alloc, alloc_args = torch.empty_strided, (out_shape, contiguous_strides(out_shape))
    # each argument: a constant of the signature (``template``), or read per call (``dynamic``: an operand's array
    # or dense tensor, or a level's mean length, each an ``ARRAY``)
    template, dynamic = [], []
    for n, a in enumerate(plan.lowered.args):
        what = ARRAY.get(a.kind)
        if what is not None:
            dynamic.append((n, a.operand, -1 if a.kind in ("values", "dense") else a.level, what))
        template.append(sizes[a.var] if a.kind == "size" else None)
    # work per call: the driver's stored values times the vectors the indices it does not have span (SpMM:
    # nnz * K / 8); below SMALL_WORK one thread does it (a parallel region would cost more than it saves)
    drv = next(a for a in asg.rhs.accesses() if a.operand == k_drv)
    span = 1
    for v in set(asg.out).union(*(a.indices for a in asg.rhs.accesses())) - set(drv.indices):
        span *= sizes[v]
    per_entry = -(-span // 8)
    # the remaining static values (level bounds and operand dimensions) come from the first call
    statics = {}
    # (the output is the driver's whole pattern, in its format and order: only its wrapper is made, ``_wrap``)
    fmt = asg.operands[k_drv].format
    whole = bool(m) and out.format is not None and out.format == fmt and m == len(fmt.level_types) and \
        tuple(asg.out) == tuple(drv.indices)
    out_pos = [n for n, a in enumerate(plan.lowered.args) if a.kind == "out"][0]
    thr_pos = [n for n, a in enumerate(plan.lowered.args) if a.kind == "threads"]
    scal = [(n, a.var) for n, a in enumerate(plan.lowered.args) if a.kind == "scalar"]
    fn = plan.kernel.fn
    packed = getattr(plan.kernel, "packed", None)  # (one bytes argument instead of a ctypes conversion per argument)
    pack = struct.Struct(pack_format(plan.lowered.kernel)).pack if packed is not None else None

    def call(ops, scalars):
        if not statics:
            bounds = ops[k_drv].format.level_bounds(ops[k_drv]._shape)  # (no padded level here: no widths)
            for n, a in enumerate(plan.lowered.args):
                if a.kind in ("lo", "extent"):
                    lo, hi = bounds[a.level]
                    template[n] = lo if a.kind == "lo" else hi - lo
                elif a.kind == "dim":
                    template[n] = shape_of(ops[a.operand])[a.level]
            statics["done"] = True
            if not scal and not m and dtype == wanted:
                def direct_form():  # (what the record runs from the next call on; once the helper is there)
                    fast = direct.program(plan, template, dynamic, out_pos, thr_pos, per_entry, k_drv, alloc,
                                          alloc_args, dtype, bind)
                    if fast is not None:
                        record.run = fast
                direct.when_ready(direct_form)
        args = list(template)
        for n, op, lvl, what in dynamic:  # (a SparseTensor's arrays from its __dict__: see ``stands``)
            x = ops[op]
            if what == MEAN:
                args[n] = mean_length(x, lvl)
                continue
            d = x.__dict__
            args[n] = (d["_levels"][lvl].pos if what == POS else d["_levels"][lvl].crd if what == CRD else
                       d["_vals"] if what == VALUES else x).data_ptr()
        if m:
            s = ops[k_drv]
            _, counts = level_info(s)
            out_arr = alloc(counts[m - 1], dtype=dtype)
        else:
            out_arr = alloc(*alloc_args, dtype=dtype)
        args[out_pos] = out_arr.data_ptr()
        if thr_pos:
            threads = bind.call_threads(ops[k_drv].__dict__["_vals"].numel() * per_entry)
            for n in thr_pos:
                args[n] = threads
        for n, v in scal:
            args[n] = scalars[v]
        if packed is not None:  # (called here, not through a function that packs: one function fewer entered)
            packed(pack(*args))
        else:
            fn(*args)
        plan.calls += 1
        if dtype != wanted:
            out_arr = out_arr.to(wanted)
        if whole:
            return ops[k_drv]._wrap(out_arr)
        if m and out.format is not None:
            return SparseTensor(out.format, out_shape, ops[k_drv]._levels[:m], out_arr, check=False)
        return out_arr.reshape(out_shape) if m else out_arr

    record = Prepared(call, made_of)
    return record


#: an argument kind read per call -> what it reads (``direct``'s numbering, which its C call reads too)
ARRAY = {"pos": POS, "crd": CRD, "values": VALUES, "dense": DENSE, "mean": MEAN}


# --- calls kept on disk ----------------------------------------------------------------------------------------
# The first call of a signature in a new process would plan again (parse, infer, schedule, the engine's
# decisions) only to arrive at a plan kept on disk (``compiler.pipeline``). So the outcome of a call that went
# straight to one kernel on the operands as given is kept too (``runtime.keep``): under its einsum signature and
# the thread count, the plan key, index sizes and result dtype of its prepared call. A new process with that
# signature loads the plan and prepares the call, without planning. The fingerprint covers every scorch module:
# the decisions are the engine's as well as the compiler's.

def _code() -> str:
    return f"c1{CPU.key}" + runtime.source_fingerprint(".")


def kept_call(sig) -> Prepared | None:
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
    return prepared_call(plan, sizes, dtype, made_of)

