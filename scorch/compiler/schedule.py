"""Auto-scheduling: loop order, the parallel loop, the output strategy and specialized extents.

The loops follow the driving sparse operand's levels in storage order (concordant iteration); index
variables it does not store are dense loops placed inside, or outside when that gives a parallel loop
without write conflicts (dense x sparse: ``out[i, k] += X[i, j] * A[j, k]`` runs ``i`` outermost).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..formats import Compressed, Dense, Div, Var
from .infer import OutputFormat, driver_access
from .ir import Access, Assignment

#: dense extents up to this are compiled in as constants (so the innermost loop vectorizes fully)
SPECIALIZE_MAX = 1024


@dataclass(frozen=True)
class Schedule:
    driver: Access
    outer: tuple          # dense index variables looped outside the driver's levels
    inner: tuple          # dense index variables looped inside them, outermost first
    parallel: str         # "outer": the first outer loop; "level0": the driver's first level; "none"
    balance: str          # "static" or "nnz" (the parallel loop's iterations weighed by positions under them)
    output: OutputFormat
    specialize: tuple = ()  # (index variable, extent) pairs compiled in as constants
    why: str = ""

    def describe(self, asg: Assignment) -> str:
        fmt = asg.operands[self.driver.operand].format
        levels = [f"{fmt.level_text(k)} (T{self.driver.operand})" for k in range(len(fmt.levels))]
        order = list(self.outer) + levels + list(self.inner)
        return " -> ".join(order)


def schedule(asg: Assignment, out: OutputFormat, sizes: Optional[dict] = None) -> Schedule:
    drv = driver_access(asg)
    if drv is None:
        raise NotImplementedError("scorch: this assignment has no sparse factor to drive the loops")
    fmt = asg.operands[drv.operand].format
    stored = set(drv.indices)
    rest = [v for v in asg.indices if v not in stored]
    first = fmt.levels[0][0]
    first_vars = {drv.indices[d] for d in first.dims()}
    # The first level's loop writes disjoint outputs if its coordinate pins down output rows
    # (``i`` or ``i / b`` of an output index) or if the output shares the driver's positions.
    level0_ok = out.shared_levels > 0 or (isinstance(first, (Var, Div)) and first_vars <= set(asg.out))
    outer_candidates = [v for v in rest if v in asg.out]
    if level0_ok or not outer_candidates:
        outer, inner = (), tuple(_inner_order(rest, asg))
        parallel = "level0" if level0_ok else "none"
        why = ("the first level's coordinate selects disjoint outputs" if level0_ok else
               "no loop writes disjoint outputs: serial (a workspace or transposition will serve this later)")
    else:
        outer = (outer_candidates[0],)
        inner = tuple(_inner_order([v for v in rest if v != outer[0]], asg))
        parallel, why = "outer", f"output index {outer[0]} looped outside the sparse operand, in parallel"
    balance = "static"
    if parallel == "level0" and len(fmt.levels) > 1 and isinstance(fmt.levels[1][1], Compressed) and \
            (not isinstance(fmt.levels[0][1], Dense) or first.bounds([1] * fmt.ndim)[0] == 0):
        balance = "nnz"
    spec = ()
    if inner and sizes is not None and 0 < sizes.get(inner[-1], 0) <= SPECIALIZE_MAX:
        spec = ((inner[-1], sizes[inner[-1]]),)
    return Schedule(drv, outer, inner, parallel, balance, out, spec, why)


def _inner_order(vs, asg):
    # output indices innermost, in output order: the output's and dense operands' last (contiguous) dimension
    # then varies fastest
    red = [v for v in vs if v not in asg.out]
    outs = sorted((v for v in vs if v in asg.out), key=asg.out.index)
    return red + outs
