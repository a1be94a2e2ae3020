"""The GPU mapping pass: how a lowered kernel's loops are laid onto GPU workers and lanes (``map_to_gpu``).

Run by the pipeline on every kernel lowered for the ``cuda`` target, between the lowering and the CUDA renderer
(``codegen.cuda``), which renders the ``Mapping`` it is given. It reads the loop IR alone:

* The schedule's parallel loop runs across **workers** (how the renderer deals its iterations out: grid-stride
  for ``static`` loops, contiguous ranges balanced by rows + stored entries for ``nnz`` ones).
* A worker is a **warp** when the loop body has an innermost dense loop whose iterations are independent
  (SpMM's ``k``; SDDMM's ``k`` with its sum): its iterations go to the lanes (``lane_loops``), scalar sums over
  it are combined across the lanes, the rest of the body runs on every lane alike, and stores outside the lane
  loops are done by lane 0. The hazards that would make this wrong (a lane reading what another lane wrote,
  ``_hazards``) are checked, and a kernel that has one gets thread workers instead. Otherwise a worker is a
  **thread** (SpGEMM's row with its workspace). A kernel whose body is not one parallel loop after plain
  ``Let``/``Decl`` statements runs on one thread (``serial``).
* Per-worker workspaces (``Alloc``) are slices of one scratch buffer (``allocs``, in order); their sizes must
  depend on the kernel's parameters alone.
* Private arrays of a warp worker indexed only by a lane loop's variable are split across the lanes
  (``compressed``): each lane holds only its own entries.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import loopir as L


@dataclass(frozen=True)
class Mapping:
    """How one kernel runs: ``mode`` is ``"serial"`` (one thread runs the whole body), ``"thread"`` or
    ``"warp"`` (the workers of the parallel loop ``loop``, after the ``prologue`` statements); ``lane_loops``:
    ids of the loops whose iterations go to lanes; ``allocs``: the per-worker workspaces in the scratch, in
    order; ``compressed``: names of the private arrays split across the lanes."""
    mode: str
    loop: object = None
    prologue: tuple = ()
    lane_loops: frozenset = frozenset()
    allocs: tuple = ()
    compressed: frozenset = frozenset()

    @property
    def describe(self) -> str:
        if self.mode == "serial":
            return "one thread (no parallel loop)"
        kind = self.loop.parallel.kind
        split = "grid-stride" if kind == "static" else "contiguous ranges balanced by rows + stored entries"
        if self.mode == "warp":
            return (f"a warp per iteration of the parallel loop ({split}); {len(self.lane_loops)} inner loop(s)"
                    " across the lanes")
        return f"a thread per iteration of the parallel loop ({split})"


def map_to_gpu(kernel: L.Kernel) -> Mapping:
    """The worker mapping of ``kernel`` (see the module docstring)."""
    allocs = tuple(s for s in _walk(kernel.body) if isinstance(s, L.Alloc))
    params = {p.name for p in kernel.params}
    for a in allocs:
        free = L.uses(a.size) - params
        if free:
            raise ValueError(f"workspace {a.name}: its size depends on {sorted(free)}, not on parameters alone")
    stmts = kernel.body.stmts
    loops = [s for s in stmts if isinstance(s, L.For) and s.parallel is not None]
    rest = [s for s in stmts if not (isinstance(s, L.For) and s.parallel is not None)]
    if len(loops) != 1 or stmts[-1] is not loops[0] or not all(isinstance(s, (L.Let, L.Decl)) for s in rest) \
            or any(isinstance(s, L.For) and s.parallel is not None for s in L.walk(loops[0].body)):
        return Mapping("serial", allocs=allocs)
    loop = loops[0]
    prologue = tuple(rest)
    lanes = frozenset() if allocs else _lane_loops(loop)
    if lanes and _hazards(loop, lanes):
        lanes = frozenset()
    if not lanes:
        return Mapping("thread", loop, prologue, lanes, allocs)
    return Mapping("warp", loop, prologue, lanes, allocs, _compressed(loop, lanes))


def _walk(stmt):
    """Every statement under ``stmt``, parallel loops' setups included."""
    yield stmt
    if isinstance(stmt, L.For) and stmt.parallel is not None and stmt.parallel.setup is not None:
        yield from _walk(stmt.parallel.setup)
    for c in L._children(stmt):
        yield from _walk(c)


def _lane_loops(loop: L.For) -> frozenset:
    """Ids of the innermost loops under ``loop`` whose iterations may run on separate lanes."""
    out = set()
    for s in L.walk(loop.body):
        if isinstance(s, L.For) and s.parallel is None and (s.simd or s.vector) and _independent(s):
            out.add(id(s))
    return frozenset(out)


def _independent(f: L.For) -> bool:
    """Iterations of ``f`` touch disjoint locations: no nested loop, every store indexed by an injective affine
    function of the loop variable (over variables bound outside the loop), and every update of an outer scalar
    a declared reduction."""
    var = f.var.name
    local = {s.var.name for s in L.walk(f.body) if isinstance(s, (L.Let, L.Decl))}
    reductions = {name for op, name in f.reductions if op in ("add", "max", "min")}
    for s in L.walk(f.body):
        if isinstance(s, (L.For, L.While, L.Sort, L.Alloc, L.LocalArray, L.SetBit, L.BitKeys, L.BitCount)):
            return False
        if isinstance(s, L.Store):
            c = L.coefficient(s.index, var)
            if c in (0, None) or L.uses(s.index) & local:
                return False
        if isinstance(s, L.Assign) and s.var.name not in local and s.var.name not in reductions:
            return False
    return True


def _hazards(loop: L.For, lanes: frozenset) -> bool:
    """Whether splitting the ``lanes`` loops would let a lane read what another lane wrote: an array written in
    a lane loop and read outside lane loops (or by lane loops over another variable or index), or an array
    written outside lane loops (by lane 0) and read anywhere in the worker."""
    in_lane, outside = [], []   # (statement, lane loop or None)

    def visit(s, owner):
        if isinstance(s, L.For) and id(s) in lanes:
            owner = s
        (in_lane if owner is not None else outside).append((s, owner))
        for c in L._children(s):
            visit(c, owner)
    visit(loop.body, None)
    stored_lane = {s.array for s, _ in in_lane if isinstance(s, L.Store)}
    stored_out = {s.array for s, _ in outside if isinstance(s, L.Store)}
    for s, _ in outside:
        for e in L.expressions(s):
            if any(ld.array in stored_lane | stored_out for ld in L.loads(e)):
                return True
    local = {s.name for s in L.walk(loop.body) if isinstance(s, L.LocalArray)}
    # a private array touched in lane loops: every access the same index, linear in the same loop variable
    seen = {}
    for s, owner in in_lane:
        for array, index in L.accesses(s):
            if array in stored_out:
                return True
            if array in local:
                if seen.setdefault(array, (owner.var.name, index)) != (owner.var.name, index):
                    return True
                if L.coefficient(index, owner.var.name) != 1:
                    return True
    return False


def _compressed(loop: L.For, lanes: frozenset) -> frozenset:
    """Private arrays under ``loop`` indexed only by a lane loop's variable: each lane holds only its own
    entries (``size / 32`` of them, in registers when the loop is unrolled)."""
    arrays = {s.name for s in L.walk(loop.body) if isinstance(s, L.LocalArray)}
    indices = {name: set() for name in arrays}
    for s in L.walk(loop.body):
        if isinstance(s, L.For) and id(s) in lanes:
            for t in L.walk(s.body):
                for array, index in L.accesses(t):
                    if array in indices:
                        indices[array].add(index)
    return frozenset(name for name, idx in indices.items() if idx and all(isinstance(i, L.Var) for i in idx))


