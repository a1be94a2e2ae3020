"""The compiler pipeline: from an assignment over operand types to a loaded kernel with its plan.

One straight line, each stage a module of this package: parse (``einsum``) -> index notation (``ir``) ->
format inference (``infer``) -> schedule (``schedule``) -> lowering to the loop IR for a target (``lower``, or
``coiterate`` for several sparse operands; the machine's facts from ``target``) -> for CUDA, the GPU mapping
(``mapping``) -> rendering (``codegen.cpp``, ``codegen.cuda``) -> build and load (``runtime``).
``planned`` runs the first four once per assignment and operand types; ``compiled_plan`` (one sparse operand)
and ``coiteration_plan`` (several) the rest once per key. The result is a ``Plan`` (or ``CoPlan``): the
decisions made, the generated source and the loaded kernel. Nothing here knows tensors: binding tensors to a
plan's arguments and running it is the execution layer's (``scorch.engine``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .. import loopir as L
from ..formats.storage import wide_index
from . import library, runtime
from .caches import cache
from .codegen import cpp, cuda
from .einsum import to_index_notation
from .infer import OutputFormat, infer
from .ir import Access, Assignment, TensorType
from .lower import lower
from .mapping import map_to_gpu
from .schedule import SPECIALIZE_MAX, discordant_format, schedule, specialized
from .target import CPU, CUDA, Target

_PLANNED = cache("planned", "assignment, inferred output and schedule per einsum key (operand types)")
_COMPILED = cache("compiled", "compiled plans (loaded kernels) per einsum key, specialized extent and target")
_CONVERTERS = cache("converters", "count and fill kernels of a conversion per source type, target format")


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

    def explain(self, source: bool = True) -> str:
        """The plan in words; ``source``: with the generated source (else one line saying it is left out)."""
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
            lines += gpu_lines(self.kernel)
            if self.library is not None:
                lines.append(f"path:         {self.library.describe()}")
            lines += [f"kernel:       {how}: {self.kernel.path}", *_source_lines(self.source, source)]
        return "\n".join(lines)


def compiled_plans():
    """``(key, plan)`` of every compiled plan (``Plan`` or ``CoPlan``) in the cache, oldest first."""
    return list(_COMPILED.items())


def planned(key):
    """``(assignment, inferred output, schedule, sparse operand count)`` of an einsum by ``run``'s key (cached);
    the schedule only for one sparse operand."""
    planned = _PLANNED.get(key)
    if planned is None:
        inputs, out, types, _, fmt, rhs, reduce, directives = key
        if any(len(set(idx)) != len(idx) for idx in inputs):  # (an internal caller's mistake, not the user's)
            raise ValueError(f"scorch: {inputs} repeats a letter within an operand; kernels take distinct letters"
                             " (einsum takes the diagonal first: engine/diagonal.py)")
        asg = Assignment(out, rhs if rhs is not None else to_index_notation(inputs), types, reduce, fmt)
        output = infer(asg)
        n = sum(t.sparse for t in types)
        # (None also where the user's loop order walks the sparse operand against its storage: the engine converts
        # it first, discordant_format)
        sched0 = schedule(asg, lowerable(asg, output), directives=directives) if n == 1 and (
            directives is None or discordant_format(asg, directives) is None) else None
        planned = _PLANNED[key] = (asg, output, sched0, n)
    return planned


def compiled_plan(key, asg, output, sched0, sizes, broadcast, backend):
    """``(plan, plan key)``: the kernel of one sparse operand's schedule, compiled once per key, the innermost
    dense extent (where small enough to be compiled in) and the target."""
    plan_key = key
    if sched0.inner and 0 < sizes[sched0.inner[-1]] <= SPECIALIZE_MAX:
        plan_key = key + (sizes[sched0.inner[-1]],)
    plan_key += (target_of(backend),)
    plan = _COMPILED.get(plan_key)
    if plan is None:
        plan = _stored_plan(plan_key, backend)
        if plan is None:
            plan = compile_plan(asg, output, sizes, broadcast, backend, key[7], sched0)
            _store_plan(plan_key, plan, backend)
        _COMPILED[plan_key] = plan
    return plan, plan_key


def kept_plan(plan_key, backend="cpp"):
    """The compiled plan of ``plan_key`` (a key ``compiled_plan`` made) from the memory cache or the plans kept on
    disk, or None where it is in neither (nothing is compiled here)."""
    plan = _COMPILED.get(plan_key)
    if plan is None:
        plan = _stored_plan(plan_key, backend)
        if plan is not None:
            _COMPILED[plan_key] = plan
    return plan


def lowerable(asg, output: OutputFormat) -> OutputFormat:
    """The output the lowering writes: the inferred one when it shares the driver's positions or is dense;
    otherwise a dense workspace that is compressed afterwards."""
    if output.format is None or output.shared_levels:
        return output
    return OutputFormat(None, 0, output.rule)


def compile_plan(asg, output, sizes, broadcast, backend="cpp", directives=None, sched0=None) -> Plan:
    """The plan of one sparse operand's assignment: ``sched0`` (``planned``'s schedule, made without sizes) with
    the innermost dense extent compiled in, lowered, rendered and built."""
    written = lowerable(asg, output)
    sched = specialized(sched0, sizes) if sched0 is not None else schedule(asg, written, sizes, directives)
    ct = L.type_of(asg.operands[0].dtype)
    plan = Plan(asg, output, sched, assemble_from_dense=written is not output)
    plan.lowered = lower(asg, sched, ct, broadcast, target=target_for(backend))
    plan.source, plan.kernel = build(plan.lowered, backend)
    plan.library_call = library.candidate(asg) if backend == "cuda" else None
    return plan


#: backends: ``cpp`` (C++ on the CPU), ``cuda`` (CUDA on the tensors' GPU), ``cuda-emulate`` (the CUDA source run on
#: the CPU by the emulation in ``codegen.cuda``: tests without a GPU), ``interp`` (the loop-IR interpreter)
BACKENDS = ("cpp", "cuda", "cuda-emulate", "interp")


def target_for(backend) -> Target:
    """The target a backend generates code for: ``target.CPU`` or ``target.CUDA``."""
    return CUDA if backend in ("cuda", "cuda-emulate") else CPU


def target_of(backend) -> str:
    """The name of the target a backend generates code for: ``cpu`` or ``cuda``."""
    return target_for(backend).name


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


def build(low, backend="cpp"):
    """``(source, kernel)``: a lowered kernel mapped onto the GPU (for CUDA), rendered for the backend's target,
    compiled (or found in a cache) and loaded."""
    target = target_for(backend)
    mapping = map_to_gpu(low.kernel) if target.name == "cuda" else None
    source = render(low.kernel, target, mapping)
    return source, load(source, low.kernel, backend, mapping)


def render(kernel: L.Kernel, target: Target, mapping=None) -> str:
    """The source of ``kernel`` for ``target``: C++, or CUDA on its GPU ``mapping`` (``map_to_gpu``)."""
    return cuda.generate(kernel, mapping) if target.name == "cuda" else cpp.generate(kernel)


def load(source: str, kernel: L.Kernel, backend="cpp", mapping=None, argtypes=None):
    """``source`` (``kernel`` rendered for the backend's target) compiled, or found in a cache, and loaded: a
    ``runtime.Kernel``, or a ``CudaKernel`` launcher that keeps its ``mapping``. ``argtypes``: the C kernel's
    ``cpp.argtypes``, where known."""
    if target_of(backend) == "cpu":
        return runtime.load(source, kernel.name, argtypes or cpp.argtypes(kernel))
    import ctypes
    emulated = backend == "cuda-emulate"
    arch = "" if emulated else _cuda_arch()
    tool = "emulate" if emulated else "nvcc"
    k = runtime.load(source, kernel.name, cuda.argtypes(kernel), ctypes.c_int, toolchain=tool, arch=arch)
    err = runtime.load(source, kernel.name + "_error", [ctypes.c_int], ctypes.c_char_p, toolchain=tool, arch=arch)
    return CudaKernel(k, err.fn, emulated, mapping)


def gpu_lines(kernel) -> list:
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
    workspace: str = "dense"  # the workspace the last call assembled a rows output in (the engine's choice)
    workspace_why: str = ""   # ... and why (``schedule.workspace_choice``)

    def kernel(self, phase):
        """The kernel of ``phase`` (None, "count", "fill" or "fill32"), lowered and loaded on first use: a rows
        output needs the fill with 32-bit coordinates or the one with 64-bit coordinates, rarely both."""
        if phase not in self.kernels:
            from .coiterate import lower_coiteration
            low = lower_coiteration(self.inner_asg, self.schedule, L.type_of(self.asg.operands[0].dtype),
                                    self.broadcast, phase, target_for(self.backend))
            self.lowered[phase] = low
            self.sources[phase], self.kernels[phase] = build(low, self.backend)
        return self.kernels[phase]

    def explain(self, source: bool = True) -> str:
        """The plan in words; ``source``: with the generated sources (else one line saying they are left out)."""
        cs, out = self.schedule, self.output
        fmt = "dense (torch tensor)" if out.format is None else (out.format.name or str(out.format))
        lines = [f"expression:   {self.asg}",
                 f"operands:     {', '.join(f'T{k}: {t}' for k, t in enumerate(self.asg.operands))}",
                 f"output:       {fmt}  [rule: {out.rule}]"]
        for k, f in cs.reformat:
            lines.append(f"reformat:     T{k} converted to {f.name or f} before the kernel")
        lines.append(f"loop order:   {' -> '.join(cs.order)}  ({cs.why})")
        if cs.output == "rows" and self.workspace.startswith("hash"):
            row = cs.row_var or "(one virtual row)"
            lines.append(f"assembly:     per {row}: {self.workspace} workspace keyed by ({', '.join(cs.ws_vars)});"
                         " count pass (terms: a bound), prefix sum, fill pass (distinct entries, sorted), the"
                         " unused slots dropped")
        elif cs.output == "rows" and self.workspace == "direct":
            row = cs.row_var or "(one virtual row)"
            lines.append(f"assembly:     per {row}: written straight from the loops (each entry met once, in order: no"
                         " workspace, no sort); count pass, prefix sum, fill pass")
        elif cs.output == "rows":
            row = cs.row_var or "(one virtual row)"
            marks = "with a touched list" if target_for(self.backend).name != "cpu" else \
                "with a touched list, or a bitmap where a row is dense in it"
            lines.append(f"assembly:     per {row}: dense workspace over ({', '.join(cs.ws_vars)}) {marks};"
                         " count pass, prefix sum, fill pass")
        if cs.output == "rows" and self.workspace_why:
            lines.append(f"workspace:    {self.workspace.split(' ')[0]}: {self.workspace_why}")
        lines.append(f"parallel:     {'the outermost loop' if cs.parallel else 'none'}"
                     f"{' (balanced by nnz)' if cs.balance else ''}")
        for phase, k in self.kernels.items():
            how = {"compiled": f"compiled now ({k.compile_seconds:.2f} s)", "disk": "loaded from the disk cache",
                   "memory": "from the memory cache"}.get(k.origin, k.origin)
            lines += gpu_lines(k)
            lines += [f"kernel {phase}: {how}: {k.path}", *_source_lines(self.sources[phase], source)]
        return "\n".join(lines)


def _source_lines(text: str, source: bool) -> list:
    if source:
        return ["source:", text]
    n = len(text.splitlines())
    return [f"source:       left out ({n} lines: scorch.explain(..., source=True) shows it)"]


def coiteration_plan(key, asg, output, broadcast, backend, weights=None) -> CoPlan:
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
        ops[k] = TensorType(t.ndim, t.dtype, f, wide_index(t.index_dtype), t.device)  # (as bind converts it)
    inner = Assignment(asg.out, asg.rhs, tuple(ops), asg.reduce, asg.out_format)
    plan = CoPlan(asg, output, cs, inner, broadcast=broadcast, backend=backend)
    if cs.output == "dense":
        plan.kernel(None)
    return plan


def conversion_plan(source: TensorType, fmt, drop_zeros, rc) -> dict:
    """The kernels converting a 2-d ``source`` into the CSR-like ``fmt`` (row dimension ``rc[0]`` dense, column
    ``rc[1]`` compressed) by counting sort: ``{"count": (lowered, kernel, source), "fill": ...}``.
    ``drop_zeros``: the fill leaves stored zeros out."""
    key = (source, fmt, drop_zeros)
    plans = _CONVERTERS.get(key)
    if plans is None:
        letters = ("i", "j")
        asg = Assignment(letters, Access(0, letters), (source,), out_format=fmt)
        sched = schedule(asg, OutputFormat(None, 0, "conversion"))
        sched = replace(sched, parallel="none", balance="static")
        ct = L.type_of(source.dtype)
        plans = {}
        for phase in ("count", "fill"):
            low = lower(asg, sched, ct, frozenset(), scatter=(letters[rc[0]], letters[rc[1]], phase, drop_zeros))
            src, kernel = build(low)
            plans[phase] = (low, kernel, src)
        _CONVERTERS[key] = plans
    return plans


# --- plans kept on disk ---------------------------------------------------------------------------------------
# A new process asks for the kernels the last one compiled: the disk cache (``runtime``) holds their libraries,
# keyed by source, but the source is only known after lowering and rendering, the most work of a first call
# (about 1,800 of its 2,100 Python calls for an SpMM). So the plan itself (schedule, lowered kernel, source and
# the kernel's C signature) is kept too, under the plan's key (``runtime.keep``), and a new process loads it and
# goes straight to the library. An entry is used only where its key equals the one asked for, and only by the
# same compiler: the fingerprint of the code that makes plans (this package, the loop IR, the formats).

PLAN_STORE_VERSION = "p2"


def _fingerprint() -> str:
    # (the machine: the register tiles are sized for its vectors, and lead vectors gather or not: target.Target.key)
    return f"{PLAN_STORE_VERSION}{CPU.key}" + runtime.source_fingerprint("compiler", "loopir.py", "formats")


def _stored_plan(plan_key, backend):
    """The plan kept for ``plan_key``, its kernel loaded; None where there is none (or it is damaged, or another
    key's, or another compiler's: compiled again, and written over)."""
    kept = runtime.kept("plans", _fingerprint(), plan_key)
    try:
        fields, argtypes = kept
        plan = Plan(*fields)
    except Exception:  # noqa: BLE001  (none, or not a plan)
        return None
    mapping = map_to_gpu(plan.lowered.kernel) if target_for(backend).name == "cuda" else None
    plan.kernel = load(plan.source, plan.lowered.kernel, backend, mapping, argtypes)
    plan.library_call = library.candidate(plan.asg) if backend == "cuda" else None
    return plan


def _store_plan(plan_key, plan, backend):
    fields = (plan.asg, plan.output, plan.schedule, plan.lowered, plan.source, None, plan.assemble_from_dense)
    argtypes = cpp.argtypes(plan.lowered.kernel) if target_of(backend) == "cpu" else None
    runtime.keep("plans", _fingerprint(), plan_key, (fields, argtypes))
