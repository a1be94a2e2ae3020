"""Running a compiled plan on tensors.

A ``Plan`` (``compiler.pipeline``) knows its kernel's parameters by kind; ``args.argument`` finds each one's value
on the operands, ``call_plan``
allocates the output, calls the kernel and wraps what it wrote in the output format (``prepared.prepared_call``
does the same with everything that depends only on the operands' signature worked out once). ``call_coiteration`` runs a co-iteration plan (several sparse
operands): operands reformatted as its schedule says, then one kernel (dense output) or a count pass, a prefix
sum and a fill pass (a sparse output).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ..compiler.pipeline import BACKENDS, Plan, CoPlan, lowerable, target_of
from ..compiler.schedule import WORKSPACE_LIMIT_BYTES, direct_rows, workspace_choice
from .. import loopir as L
from ..loopir import TO_TORCH
from ..formats import named, storage
from ..sparse_tensor import (NoSparseRule, ShapeError, SparseTensor, UnsupportedDtype, device_of, dtype_of,
                             pattern_ones, shape_of)
from .args import SUPPORTED, argument, level_info, mean_length  # noqa: F401  (mean_length: read by the direct call)
from .convert import asformat
from . import memory


NARROW_COORDINATES = 2**31 - 1  # a rows output whose workspace has at most this many entries writes int32


def index_sizes(inputs, ops, name):
    sizes, broadcast = {}, set()
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        for d, v in enumerate(idx):
            n = shape_of(x)[d]
            if v not in sizes or sizes[v] == 1:
                sizes[v] = n
            elif n != sizes[v] and n != 1:
                raise ShapeError(f"scorch {name}: index {v!r} has size {sizes[v]} in one operand and {n} in"
                                 f" operand {k} (shape {tuple(x.shape)})")
    for k, (idx, x) in enumerate(zip(inputs, ops)):
        for d, v in enumerate(idx):
            if shape_of(x)[d] == 1 and sizes[v] != 1:
                if isinstance(x, SparseTensor):  # (a torch function then runs on the dense form: a fallback)
                    raise NoSparseRule(f"scorch {name}: broadcasting the sparse operand {k} along index {v!r} is"
                                       " not supported")
                broadcast.add((k, d))
    return sizes, frozenset(broadcast)


def result_dtype(ops, name):
    dtype = dtype_of(ops[0])
    for x in ops[1:]:
        dtype = torch.promote_types(dtype, dtype_of(x))
    if dtype not in SUPPORTED:
        raise UnsupportedDtype(f"scorch {name}: unsupported dtype {dtype} (supported: float32, float64, int32,"
                               " int64, bfloat16, float16)")
    return dtype


def cast(x, dtype):
    """``x`` with values of ``dtype``; a dense one contiguous, with torch's negative bit resolved (a view whose
    values read negated: its storage holds the other sign)."""
    if dtype_of(x) == dtype:
        return x if type(x) is SparseTensor else x.resolve_neg().contiguous()
    if isinstance(x, SparseTensor):
        return x.with_values(x.values().to(dtype))
    return x.to(dtype).contiguous()


class _CpuBackend(threading.local):
    name = "cpp"


_CPU_BACKEND = _CpuBackend()


@contextlib.contextmanager
def cpu_backend(name: str):
    """Within this block (this thread), calls that would run C++ kernels on CPU tensors run the ``name`` backend
    instead: ``"cuda-emulate"`` (the CUDA source, emulated on the CPU: CUDA kernels tested without a GPU) or
    ``"interp"`` (the loop-IR interpreter). For every op, not only those that take a ``backend=`` argument. The
    prepared calls are dropped on entry (they would run the C++ kernels they were prepared with)."""
    if name not in BACKENDS or name == "cuda":
        raise ValueError(f"scorch: cpu_backend takes one of cpp, cuda-emulate, interp; got {name!r}")
    from ..compiler.caches import cache
    for prepared in ("prepared", "prepared-by-equation"):
        cache(prepared, "").clear()
    before, _CPU_BACKEND.name = _CPU_BACKEND.name, name
    try:
        yield
    finally:
        _CPU_BACKEND.name = before


def cpu_backend_name() -> str:
    """The backend CPU tensors' ``"cpp"`` calls run here: ``"cpp"`` unless inside a ``cpu_backend`` block."""
    return _CPU_BACKEND.name


def backend_for(ops, backend, name):
    """The backend for operands on their devices: CUDA tensors run CUDA kernels; CPU tensors the requested
    backend (the ``cpu_backend`` block's for ``"cpp"``); mixed devices are refused as torch refuses them."""
    if backend not in BACKENDS:
        raise ValueError(f"scorch: unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    devices = {device_of(x) for x in ops}
    kinds = {d.type for d in devices}
    if kinds == {"cpu"}:
        if backend == "cuda":
            raise ValueError(f"scorch {name}: the cuda backend takes CUDA tensors; these are on the CPU")
        return _CPU_BACKEND.name if backend == "cpp" else backend
    if kinds == {"cuda"} and len(devices) == 1:
        if backend not in ("cpp", "cuda"):
            raise ValueError(f"scorch {name}: the {backend} backend runs on the CPU; these tensors are on CUDA")
        return "cuda"
    if kinds == {"cuda"} or len(kinds) > 1:
        raise ValueError(f"scorch {name}: expected all tensors on the same device, got "
                         f"{', '.join(sorted(str(d) for d in devices))}")
    raise NotImplementedError(f"scorch: {name} on {', '.join(sorted(kinds))} tensors is not supported (CPU and"
                              " CUDA only)")


class _Structural(threading.local):
    on = False


#: set while a differentiable einsum computes its result (``structural_results``)
STRUCTURAL = _Structural()


@contextlib.contextmanager
def structural_results():
    """Within this block a sparse result assembled from a dense workspace keeps every entry the operands'
    patterns produce, numerically zero or not (an entry of a stored zero, or of a zero in a dense operand):
    gradients flow to exactly the stored entries of a result, so a dropped zero would lose its gradient
    (``_autograd`` computes differentiable einsums in this block). Outside it such zeros are left out."""
    before = STRUCTURAL.on
    STRUCTURAL.on = True
    try:
        yield
    finally:
        STRUCTURAL.on = before


def structural_result(plan: Plan, ops, sizes, dtype, scalars, backend, out_arr):
    """``out_arr`` (the dense workspace of ``plan``'s result) in the result's format, keeping the entries where the
    kernel run on the patterns (ones at every stored position, ones for dense operands: no cancellation) is
    nonzero."""
    ones = [x.with_values(pattern_ones(x, dtype)) if type(x) is SparseTensor else torch.ones_like(x) for x in ops]
    reach = call_plan(plan, ones, sizes, dtype, {v: 1 for v in scalars}, backend, raw=True)
    dims = reach.nonzero().T
    fmt, shape = plan.output.format, tuple(out_arr.shape)
    levels, values = storage.pack(fmt, shape, dims, out_arr[tuple(dims)])
    return SparseTensor(fmt, shape, levels, values, check=False)


def buffer_dtype(low, dtype):
    """The dtype of the array a lowered kernel writes for a result of ``dtype``: the result's, or (``out_type``:
    a 16-bit result the kernel adds to) float32, rounded to ``dtype`` once after the kernel."""
    return dtype if low.out_type is None else TO_TORCH[low.out_type]


def call_plan(plan: Plan, ops, sizes, dtype, scalars, backend="cpp", raw=False):
    """Run ``plan``'s kernel on ``ops``: the result, or (``raw``) the array the kernel wrote."""
    asg, out = plan.asg, plan.output
    s = ops[plan.schedule.driver.operand]
    info, counts = level_info(s)
    out_shape = tuple(sizes[v] for v in asg.out)
    written = lowerable(asg, out)
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
    wanted, dtype = dtype, buffer_dtype(plan.lowered, dtype)
    if backend == "interp" and dtype in L.HALF_DTYPES:
        raise NotImplementedError(f"scorch: the loop-IR interpreter takes no {dtype} values (NumPy has no bfloat16)")
    if red == "sum":
        alloc = memory.empty if plan.lowered.writes_every_output else memory.zeros
        out_arr, counted = alloc(n_out, dtype=dtype, device=dev), None
    else:
        ident = float("-inf") if red == "max" else float("inf")
        if not dtype.is_floating_point:
            ident = torch.iinfo(dtype).min if red == "max" else torch.iinfo(dtype).max
        out_arr, counted = torch.full(n_out if isinstance(n_out, tuple) else (n_out,), ident, dtype=dtype,
                                      device=dev), torch.zeros(n_out, dtype=torch.int64, device=dev)
    args = [counted if a.kind == "counts" else argument(a, ops, info, sizes, scalars, out_arr, backend)
            for a in plan.lowered.args]
    if backend == "interp":
        interpret(plan.lowered, args)
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
    if dtype != wanted:
        out_arr, dtype = out_arr.to(wanted), wanted
    if raw:
        return out_arr
    if written.shared_levels and out.format is not None:
        m = written.shared_levels
        return SparseTensor(out.format, out_shape, s.levels[:m], out_arr, check=False)
    if written.shared_levels:
        return out_arr.reshape(out_shape)
    if out.format is not None:
        if STRUCTURAL.on and red == "sum":
            return structural_result(plan, ops, sizes, dtype, scalars, backend, out_arr)
        return asformat(out_arr, out.format)
    return out_arr


#: work (stored values x the 8-value vectors the other indices span: SpMV 1 per entry, SpMM K=64 8) below which
#: a prepared call runs on one thread: about 50 us of one core
SMALL_WORK = 1 << 13


def call_threads(work: int) -> int:
    """Threads for a call of ``work`` (see ``SMALL_WORK``): one below it (a parallel region's start and join cost
    about what 8k entries of SpMV take), else torch's thread count. On 2 idle cores the Cora-sized products
    (13k entries) already gain from two threads: SpMV 27.8 -> 24.8 us, SpMM K=16 44 -> 40 us, K=32 54 -> 43 us."""
    return 1 if work < SMALL_WORK else torch.get_num_threads()


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def interpret(low, args) -> None:
    """Run the lowered kernel ``low`` on ``args`` (tensors and scalars, in ``low.args``' order) through the loop-IR
    interpreter (the "interp" CPU backend), its arrays NumPy views of the tensors."""
    from ..compiler import interp
    half = [v.dtype for v in args if isinstance(v, torch.Tensor) and v.dtype in L.HALF_DTYPES]
    if half:
        raise NotImplementedError(f"scorch: the loop-IR interpreter takes no {half[0]} arrays (its arrays are "
                                  "NumPy's, without the 16-bit floats' rounding): use the \"cpp\" backend")
    interp.run(low.kernel, {a.param.name: (v.reshape(-1).numpy() if isinstance(v, torch.Tensor) else v)
                            for a, v in zip(low.args, args)})


def call_coiteration(plan: CoPlan, ops, sizes, dtype, scalars, backend, workspace=None):
    """Run a co-iteration plan; a rows output is assembled in the workspace ``row_workspace`` chooses (``workspace``:
    the user's directive)."""
    cs, asg = plan.schedule, plan.asg
    ops = list(ops)
    for k, f in cs.reformat:
        ops[k] = asformat(ops[k], f, index_dtype=storage.wide_index(ops[k].index_dtype))
    infos = {k: level_info(x)[0] for k, x in enumerate(ops) if isinstance(x, SparseTensor)}
    out_shape = tuple(sizes[v] for v in asg.out)
    if cs.output == "rows":
        ws = 1
        for v in cs.ws_vars:
            ws *= sizes[v]
        # (a GPU launcher runs as many workers as fit its scratch: one workspace is what must fit)
        threads = torch.get_num_threads() if cs.parallel and target_of(backend) == "cpu" else 1
        terms = _terms(asg, ops, sizes) if target_of(backend) == "cpu" else None
        plan.workspace, plan.workspace_why = workspace_choice(ws, threads, dtype.itemsize, workspace,
                                                              direct_rows(cs), terms)
        if plan.workspace == "dense" and ws * threads * (dtype.itemsize + 17) > WORKSPACE_LIMIT_BYTES:
            raise ValueError(
                f"scorch: the dense workspace over ({', '.join(cs.ws_vars)}) would take"
                f" {ws * threads * (dtype.itemsize + 17) / 2**20:.0f} MiB (limit {WORKSPACE_LIMIT_BYTES >> 20} MiB):"
                " schedule={'workspace': 'hash'} assembles it through a hash table instead")
        if plan.workspace == "hash" and target_of(backend) == "cuda":
            raise NotImplementedError("scorch: hash workspaces on CUDA are not supported yet")

    def launch(phase, extra):
        kernel = plan.kernel(phase)
        low = plan.lowered[phase]
        args = [extra[a.kind] if a.kind in extra else
                argument(a, ops, infos.get(a.operand), sizes, scalars, None, backend) for a in low.args]
        if backend == "interp":
            interpret(low, args)
        else:
            kernel(*[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args])

    plan.calls += 1
    dev = device_of(ops[0])
    if cs.output == "dense":
        plan.kernel(None)
        out = torch.zeros(out_shape, dtype=buffer_dtype(plan.lowered[None], dtype), device=dev)
        launch(None, {"out": out})
        return out.to(dtype)
    rows = sizes[cs.row_var] if cs.row_var is not None else 1
    if rows * 16 > WORKSPACE_LIMIT_BYTES:
        raise NotImplementedError(
            f"scorch: assembling the output row by row over {cs.row_var!r} needs {rows} row counts"
            f" ({rows * 16 / 2**20:.0f} MiB); a sparse output with that many rows is not supported (a rows output"
            " keeps a count per row)")
    if plan.workspace == "hash":
        return _hash_rows(plan, launch, rows, ws, threads, out_shape, sizes, dtype, dev)
    p = "d" if plan.workspace == "direct" else ""  # (written straight from the loops, or through a dense workspace)
    counts = torch.zeros(rows, dtype=torch.int64, device=dev)
    launch(p + "count", {"counts": counts})
    row_ptr, crd, vals = _row_arrays(counts, ws, dtype)
    launch(p + ("fill32" if crd.dtype == torch.int32 else "fill"), {"row_ptr": row_ptr, "out_crd": crd, "out": vals})
    return _assemble(plan, out_shape, sizes, row_ptr, counts, crd, vals)


def _terms(asg, ops, sizes) -> int:
    """An estimate of the terms a co-iteration adds into its output rows, for ``row_workspace``: the product of
    the sparse operands' stored entries over the extents of the summed indices (SpGEMM: ``nnz(A) * nnz(B) / J``,
    exact for uniform rows), at least their sum (a merge meets each entry once) and at least 1."""
    product, total = 1, 0
    for x in ops:
        if type(x) is SparseTensor:
            product *= x._vals.numel()
            total += x._vals.numel()
    summed = 1
    for v in asg.reduced:
        summed *= max(1, sizes[v])
    return max(1, total, product // summed)


def _offsets(counts):
    """The row pointers of rows of ``counts`` entries (0, then the running sums)."""
    row_ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return row_ptr


def _row_arrays(counts, ws, dtype):
    """``(row_ptr, crd, vals)`` for rows of ``counts`` entries: coordinates of 32 bits where a row's workspace has
    at most ``NARROW_COORDINATES`` entries."""
    row_ptr = _offsets(counts)
    nnz = int(row_ptr[-1])
    crd = torch.empty(nnz, dtype=torch.int32 if ws <= NARROW_COORDINATES else torch.int64, device=counts.device)
    vals = torch.empty(nnz, dtype=dtype, device=counts.device)
    for t in (crd, vals):
        memory.advise_huge(t)
    return row_ptr, crd, vals


def _hash_rows(plan, launch, rows, ws, threads, out_shape, sizes, dtype, dev):
    """A rows output through hash workspaces: the count pass counts each row's terms (a bound on its entries),
    the table gets twice the most terms of a row (a power of two), the fill pass writes each row's distinct
    entries from its first slot and their number, and the slots left over are dropped."""
    terms = torch.zeros(rows, dtype=torch.int64, device=dev)
    launch("hcount", {"counts": terms})
    most = int(terms.max()) if rows else 0
    cap = 1 << max(1, (2 * most - 1).bit_length())
    table = cap * threads * (dtype.itemsize + 32)
    if table > WORKSPACE_LIMIT_BYTES:
        raise NotImplementedError(
            f"scorch: a row of this output has {most} terms: its hash workspace would take {table / 2**20:.0f} MiB"
            f" (limit {WORKSPACE_LIMIT_BYTES >> 20} MiB)")
    plan.workspace = f"hash ({cap} slots)"
    bound, crd, vals = _row_arrays(terms, ws, dtype)
    total = crd.numel()
    counts = torch.zeros(rows, dtype=torch.int64, device=dev)
    launch("hfill32" if crd.dtype == torch.int32 else "hfill", {"row_ptr": bound, "out_crd": crd, "out": vals,
                                                                "counts": counts, "hcap": cap})
    row_ptr = _offsets(counts)
    if int(row_ptr[-1]) != total:  # (rows with repeated keys: their slots past the distinct entries are dropped)
        offset = torch.arange(total, device=dev) - torch.repeat_interleave(bound[:-1], terms)
        keep = offset < torch.repeat_interleave(counts, terms)
        crd, vals = crd[keep], vals[keep]
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
        return s if fmt == direct else asformat(s, fmt)
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
