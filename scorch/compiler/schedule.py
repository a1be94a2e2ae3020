"""Auto-scheduling: loop order, the parallel loop, the output strategy and specialized extents.

The loops follow the driving sparse operand's levels in storage order (concordant iteration); index
variables it does not store are dense loops placed inside, or outside when that gives a parallel loop
without write conflicts (dense x sparse: ``out[i, k] += X[i, j] * A[j, k]`` runs ``i`` outermost).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from ..formats import Compressed, Dense, Div, Format, Mod, Var
from .infer import OutputFormat, driver_access, level_letters, topological
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


def schedule(asg: Assignment, out: OutputFormat, sizes: Optional[dict] = None,
             directives: Optional["Directives"] = None) -> Schedule:
    """The schedule of an assignment with one sparse operand: automatic, or the user's ``directives`` (checked:
    a ``ValueError`` names what conflicts)."""
    if directives is not None and (directives.order is not None or directives.parallel is not None):
        return _directed(asg, out, sizes, directives)
    drv = driver_access(asg)
    if drv is None:
        raise NotImplementedError("scorch: this assignment has no sparse factor to drive the loops")
    fmt = asg.operands[drv.operand].format
    stored = set(drv.indices)
    rest = [v for v in asg.indices if v not in stored]
    level0_ok = _level0_ok(asg, out, drv, fmt)
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
    return Schedule(drv, outer, inner, parallel, _balance(fmt, parallel), out, _specialized(inner, sizes), why)


@dataclass(frozen=True)
class Directives:
    """A user's schedule for a kernel, as TACO's scheduling commands give one (``scorch.einsum(...,
    schedule=...)``): each field left None is chosen by the compiler.

    ``order``: the loop order, every index letter once, outermost first. The sparse operand's levels are walked
    in storage order, so its letters must come in that order, one after the other; a dense letter may run outside
    or inside them. An order that walks a plain-index sparse operand against its storage (``"ji"`` for CSR) has it
    converted first (its levels reordered: CSR becomes CSC) unless ``transpose=False``.
    ``parallel``: the letter of the loop that runs in parallel (it must be the outermost loop, and its iterations
    must write disjoint outputs), or ``"none"``.
    ``workspace``: how a sparse output of several sparse operands is assembled row by row: ``"dense"`` (a dense
    array over the row's coordinates, with a list of those touched) or ``"hash"`` (an open-addressing table sized
    by the row's terms, for rows too wide for a dense one); by default dense where it fits in
    ``WORKSPACE_LIMIT_BYTES`` (``row_workspace``). ``temporary``: the format of the intermediate results of a contraction of three or more operands
    (a format name, ``"dense"``, or a ``Format``).
    """
    order: Optional[tuple] = None
    parallel: Optional[str] = None
    transpose: bool = True
    workspace: Optional[str] = None
    temporary: object = None

    @staticmethod
    def of(spec) -> "Optional[Directives]":
        """``spec`` as directives: None, a ``Directives``, a dict of its fields, or a loop order (a string)."""
        if spec is None or isinstance(spec, Directives):
            return spec
        if isinstance(spec, str):
            spec = {"order": spec}
        if isinstance(spec, Schedule):
            raise TypeError("scorch: schedule= takes directives; a chosen schedule's are explain(...).directives")
        if not isinstance(spec, dict):
            raise TypeError(f"scorch: schedule= takes a loop order (str), a dict of Directives fields or Directives,"
                            f" got {type(spec).__name__}")
        known = [f.name for f in fields(Directives)]
        unknown = set(spec) - set(known)
        if unknown:
            raise ValueError(f"scorch: unknown schedule fields {sorted(unknown)} ({', '.join(known)})")
        d = dict(spec)
        if isinstance(d.get("order"), str):
            d["order"] = tuple(d["order"].replace(" ", "").replace(",", "").replace("->", ""))
        elif d.get("order") is not None:
            d["order"] = tuple(d["order"])
        if d.get("workspace") not in (None, "dense", "hash"):
            raise ValueError(f"scorch: schedule workspace {d['workspace']!r}: one of 'dense', 'hash'")
        return Directives(**d)


def directives_of(asg: Assignment, sched: Schedule) -> Directives:
    """The directives that give ``sched`` again: its loop order and parallel loop."""
    order = tuple(sched.outer) + tuple(level_letters(asg.operands[sched.driver.operand].format, sched.driver)) + \
        tuple(sched.inner)
    return Directives(order=order, parallel="none" if sched.parallel == "none" else order[0])


def discordant_format(asg: Assignment, directives: Directives):
    """The format the sparse operand must be converted to for the directives' loop order (its levels reordered to
    the order), or None when its own format suits the order. ``ValueError`` where the order cannot be met: not
    every letter once, or a walk against the storage that no conversion may fix (``transpose=False``, or levels
    that are not plain indices)."""
    order = directives.order
    if order is None:
        return None
    drv = driver_access(asg)
    if drv is None:
        return None
    fmt = asg.operands[drv.operand].format
    letters = list(dict.fromkeys(v for v in asg.indices))
    if sorted(order) != sorted(letters):
        raise ValueError(f"scorch: schedule order {''.join(order)!r} must name each index of {asg} once:"
                         f" {', '.join(letters)}")
    stored = level_letters(fmt, drv)
    walked = [v for v in order if v in stored]
    name = fmt.name or str(fmt)
    at = sorted(order.index(v) for v in stored)
    if at != list(range(at[0], at[0] + len(at))):
        between = [v for v in order[at[0]:at[-1]] if v not in stored]
        raise ValueError(f"scorch: schedule order {''.join(order)!r} puts {', '.join(between)} between the levels of"
                         f" the sparse operand T{drv.operand} ({name}: {''.join(stored)}); a dense loop runs outside"
                         " all of its levels or inside all of them")
    if walked == stored:
        return None
    if not directives.transpose:
        raise ValueError(f"scorch: schedule order {''.join(order)!r} walks the sparse operand T{drv.operand} ({name})"
                         f" as {''.join(walked)}, against its storage order {''.join(stored)}, and transpose=False"
                         " forbids converting it: give an order concordant with its levels, or allow transpose")
    if not all(isinstance(e, Var) for e in fmt.exprs) or len(stored) != len(fmt.exprs):
        raise ValueError(f"scorch: schedule order {''.join(order)!r} walks the sparse operand T{drv.operand} ({name})"
                         f" against its storage order {''.join(stored)}, and only formats whose levels store one"
                         " index each can be converted to another level order")
    by_letter = {drv.indices[e.dim]: k for k, e in enumerate(fmt.exprs)}
    types = unique_levels(fmt.level_types)
    return Format.from_levels(fmt.ndim, [(fmt.exprs[by_letter[v]], t) for v, t in zip(walked, types)])


def _directed(asg, out, sizes, d: Directives) -> Schedule:
    """The schedule the directives ask for (the driver's format already concordant: ``discordant_format``)."""
    drv = driver_access(asg)
    if drv is None:
        raise NotImplementedError("scorch: this assignment has no sparse factor to drive the loops")
    fmt = asg.operands[drv.operand].format
    stored = level_letters(fmt, drv)
    level0_ok = _level0_ok(asg, out, drv, fmt)
    if d.order is None:
        auto = schedule(asg, out, sizes)
        outer, inner = auto.outer, auto.inner
    else:
        # (discordant_format checks the order: every letter once, the sparse letters consecutive)
        if discordant_format(asg, d) is not None:  # (the engine converts first: an internal caller's mistake)
            raise ValueError(f"scorch: schedule order {''.join(d.order)!r} is discordant with {fmt.name or fmt}")
        at = [d.order.index(v) for v in stored]  # consecutive, in storage order
        outer, inner = tuple(d.order[:at[0]]), tuple(d.order[at[-1] + 1:])
    first = outer[0] if outer else stored[0]
    if d.parallel is None:
        parallel = ("outer" if first in asg.out else "none") if outer else ("level0" if level0_ok else "none")
    elif d.parallel == "none":
        parallel = "none"
    elif d.parallel != first:
        raise ValueError(f"scorch: schedule parallel loop {d.parallel!r}: only the outermost loop ({first!r}) runs in"
                         " parallel")
    elif outer:
        if first not in asg.out:
            raise ValueError(f"scorch: schedule parallel loop {first!r} would race: {first} is summed over (not an"
                             " index of the output), so its iterations write the same outputs")
        parallel = "outer"
    else:
        if not level0_ok:
            raise ValueError(f"scorch: schedule parallel loop {first!r} would race: the first level of T{drv.operand}"
                             f" ({fmt.name or fmt}) does not select disjoint outputs")
        parallel = "level0"
    why = "the user's schedule" + (f" (parallel over {first})" if parallel != "none" else " (serial)")
    return Schedule(drv, tuple(outer), tuple(inner), parallel, _balance(fmt, parallel), out,
                    _specialized(inner, sizes), why)


def _level0_ok(asg, out, drv, fmt) -> bool:
    """Whether the loop over the driver's first level writes disjoint outputs: its coordinate pins down output
    rows (``i`` or ``i / b`` of an output index, on a unique level) or the output shares the driver's positions
    (a non-unique or padded first level visits one coordinate from several iterations: a race)."""
    first = fmt.levels[0][0]
    first_vars = {drv.indices[d] for d in first.dims()}
    return out.shared_levels > 0 or (isinstance(first, (Var, Div)) and first_vars <= set(asg.out)
                                     and fmt.level_types[0].unique)


def _balance(fmt, parallel) -> str:
    first = fmt.levels[0][0]
    if parallel == "level0" and len(fmt.levels) > 1 and isinstance(fmt.levels[1][1], Compressed) and \
            (not isinstance(fmt.levels[0][1], Dense) or first.bounds([1] * fmt.ndim)[0] == 0):
        return "nnz"
    return "static"


def specialized(sched: Schedule, sizes) -> Schedule:
    """``sched`` with its innermost dense extent compiled in where it is small (``SPECIALIZE_MAX``): what
    ``schedule(..., sizes)`` gives, from a schedule made without sizes (each is made once)."""
    return replace(sched, specialize=_specialized(sched.inner, sizes))


def _specialized(inner, sizes) -> tuple:
    if inner and sizes is not None and 0 < sizes.get(inner[-1], 0) <= SPECIALIZE_MAX:
        return ((inner[-1], sizes[inner[-1]]),)
    return ()


def _inner_order(vs, asg):
    # output indices innermost, in output order: the output's and dense operands' last (contiguous) dimension
    # then varies fastest
    red = [v for v in vs if v not in asg.out]
    outs = sorted((v for v in vs if v in asg.out), key=asg.out.index)
    return red + outs


# --- co-iteration of several sparse operands ------------------------------------------------------------------
#: the most memory a row workspace (all threads' copies) may take
WORKSPACE_LIMIT_BYTES = 1 << 30


def direct_rows(cs: "CoSchedule") -> bool:
    """Whether a rows output can be written straight from its loops, without a workspace: the loops below the row
    are the workspace's indices, in its order, so that (their levels unique and ordered) each entry of a row is met
    once and in ascending order (an add or an elementwise product: a merge per row)."""
    below = cs.order[1:] if cs.row_var is not None else cs.order
    return cs.output == "rows" and tuple(below) == tuple(cs.ws_vars)


#: the cost model of ``row_workspace``: a dense workspace costs about this many of its bytes per term a hash
#: table would take in its place (measured, one thread, SpGEMM of 4k rows into widths 20k..4M: a fresh dense
#: workspace costs ~3 ns a byte in page faults and zeroing, a term through the hash table ~150 ns more than
#: through the dense array; dense / hash ms: 20k wide 87 / 329, 300k 60 / 88, 1M 34 / 26, 4M 252 / 25)
DENSE_BYTES_PER_TERM = 50
#: a thread's dense workspace up to this size is always kept: it stays in the core's cache and comes from the
#: heap, not from fresh pages (the model above was measured on workspaces of megabytes)
DENSE_WORKSPACE_CACHED = 1 << 20


def row_workspace(entries: int, threads: int, itemsize: int, requested=None, direct=False, terms=None) -> str:
    """The workspace a rows output is assembled in (``CoSchedule``): ``"direct"`` (none: ``direct`` says the loops
    meet each entry once, in order, ``direct_rows``), ``"dense"`` (per thread, a value, a mark and a touched slot
    per coordinate of a row: ``itemsize + 17`` bytes each), or ``"hash"`` (memory by the row's terms, not its
    width). Dense unless all threads' copies exceed ``WORKSPACE_LIMIT_BYTES`` or, with ``terms`` (an estimate of
    the terms the call adds into its rows), a thread's copy exceeds ``DENSE_WORKSPACE_CACHED`` and all copies
    ``DENSE_BYTES_PER_TERM`` bytes per term: a wide, thinly filled output, where zeroing and faulting in the
    dense array costs more than hashing the few terms.
    ``requested`` (the user's ``Directives.workspace``) decides where given."""
    return workspace_choice(entries, threads, itemsize, requested, direct, terms)[0]


def workspace_choice(entries: int, threads: int, itemsize: int, requested=None, direct=False, terms=None):
    """``row_workspace``'s choice and the reason for it, in words (``scorch.explain``'s ``workspace:`` line)."""
    if requested is not None:
        return requested, "asked for (schedule={'workspace': ...})"
    if direct:
        return "direct", "each entry of a row is met once, in order"
    one = entries * (itemsize + 17)
    dense = one * threads
    sizes = (f"a dense one takes {one / 2**20:.2f} MiB a thread, {dense / 2**20:.2f} MiB in all"
             + ("" if terms is None else f", for about {terms:,} terms"))
    if dense > WORKSPACE_LIMIT_BYTES:
        return "hash", f"{sizes}: over the {WORKSPACE_LIMIT_BYTES >> 20} MiB limit"
    if terms is not None and one > DENSE_WORKSPACE_CACHED and dense > DENSE_BYTES_PER_TERM * terms:
        return "hash", (f"{sizes}: over {DENSE_WORKSPACE_CACHED >> 20} MiB a thread and {DENSE_BYTES_PER_TERM} "
                        "bytes a term, where zeroing it costs more than hashing the terms")
    return "dense", (f"{sizes}: within {DENSE_WORKSPACE_CACHED >> 20} MiB a thread (it stays in cache)"
                     if one <= DENSE_WORKSPACE_CACHED else f"{sizes}: at most {DENSE_BYTES_PER_TERM} bytes a term")


@dataclass(frozen=True)
class CoSchedule:
    """The schedule of an assignment with several sparse operands, lowered by index variable (``coiterate``).

    ``order``: the loop order, concordant with every sparse operand's levels. ``reformat``: operands first
    converted to another format ((operand, Format) pairs): to a format with plain-index, unique, ordered levels,
    or transposed when no loop order is concordant with all operands. ``output``: ``dense``, or ``rows``: each
    iteration of ``row_var`` (the outermost loop; None: one virtual row) accumulates into a dense workspace over
    ``ws_vars`` with a list of touched entries, assembled in two passes (count, prefix sum, fill).
    """
    order: tuple
    reformat: tuple
    output: str
    row_var: Optional[str]
    ws_vars: tuple
    parallel: bool
    balance: Optional[tuple]
    why: str
    transposed: tuple = ()  # operands transposed because no loop order is concordant with all (their costs chose)

    def describe(self, asg: Assignment) -> str:
        return " -> ".join(self.order)


def coiterable(fmt) -> bool:
    """Levels a merge can walk: plain indices, each level dense or compressed (unique and ordered)."""
    return all(isinstance(e, Var) for e in fmt.exprs) and all(
        isinstance(lvl, Dense) or (isinstance(lvl, Compressed) and lvl.unique and lvl.ordered)
        for lvl in fmt.level_types)


def unique_levels(types):
    """The level types with every non-dense level made compressed, unique and ordered: what merges and
    conflict-free parallel loops need (COO's repeated rows, ELL's padding are gone)."""
    return [lvl if isinstance(lvl, Dense) else Compressed() for lvl in types]


def coiterable_version(fmt):
    """``fmt`` with plain-index, unique, ordered levels (``coiterable``): non-dense levels compressed, formats with
    other coordinate expressions as CSR (2-d) or CSF."""
    from ..formats import Format, named
    if not all(isinstance(e, Var) for e in fmt.exprs):
        return named.csr if fmt.ndim == 2 else named.csf(fmt.ndim)
    return Format.from_levels(fmt.ndim, list(zip(fmt.exprs, unique_levels(fmt.level_types))))


def _level_vars(fmt, access):
    return [access.indices[e.dim] for e in fmt.exprs]


def schedule_coiteration(asg: Assignment, out: OutputFormat, weights=None) -> CoSchedule:
    """The co-iteration schedule. Where no loop order is concordant with every sparse operand, the operands whose
    levels the order does not follow are transposed first: the set of least estimated cost, ``weights[k]`` the
    cost of converting operand ``k`` (its nnz; default 1 each), ties going to transposing later operands. Where
    the order found walks every coordinate of an index inside another loop, an order that converts operands to
    avoid it is taken instead (``_uncrossed``)."""
    sparse = [a for a in _accesses(asg) if asg.operands[a.operand].sparse]
    fmts = {a.operand: asg.operands[a.operand].format for a in sparse}
    reformat = {k: coiterable_version(f) for k, f in fmts.items() if not coiterable(f)}
    fmts.update(reformat)
    stored = {v for a in sparse for v in a.indices}

    def priority(v):
        if v not in stored:
            return (2, asg.indices.index(v))  # dense-only indices innermost
        return (0, asg.out.index(v)) if v in asg.out else (1, asg.indices.index(v))

    def constraints(followed):
        cs = []
        for a in followed:
            vs = _level_vars(fmts[a.operand], a)
            cs += list(zip(vs, vs[1:]))
        return cs

    followed = _followed(sparse, lambda kept: topological(asg.indices, constraints(kept), priority) is not None,
                         weights)
    order = topological(asg.indices, constraints(followed), priority)
    why = "concordant with every sparse operand"
    moved = [a for a in sparse if a not in followed]
    cost = _nest_cost(asg, out, order, sparse, fmts, moved)
    better = _uncrossed(asg, sparse, fmts, out, weights, priority, cost) if any(cost) else None
    if better is not None:
        order, moved = better
    for victim in moved:  # each transposed to follow the loop order (a format conversion of its nnz entries)
        reformat[victim.operand] = fmts[victim.operand] = _following(fmts[victim.operand], victim, order)
    if better is not None and cost[0]:
        why = (f"{', '.join(f'T{a.operand}' for a in moved)} transposed: the concordant order runs a loop over"
               " every coordinate of an index inside another loop (an inner-product nest), the transposed one"
               " reaches each index through the stored entries")
    elif better is not None:
        why = (f"{', '.join(f'T{a.operand}' for a in moved)} transposed: the concordant order starts with a summed"
               " index (an outer-product nest: the whole output one serial row), the transposed one with a row of"
               " the output, in parallel")
    elif moved:
        why = (f"{', '.join(f'T{a.operand}' for a in moved)} transposed to follow the other operands' level order"
               " (no loop order is concordant with all; the least costly conversions)")
    reformat = tuple(sorted(reformat.items()))
    if out.format is None:
        mode, row, ws = "dense", None, ()
        parallel = order[0] in asg.out
    else:
        mode = "rows"
        # (a vector is one row: rows of one coordinate each would take a count per coordinate, as much memory as
        # a dense workspace over them, where one row takes a workspace by its terms when a hash one serves)
        row = order[0] if order[0] in asg.out and len(asg.out) > 1 else None
        ws = tuple(v for v in asg.out if v != row)
        parallel = row is not None
    balance = None
    if parallel:
        for a in sparse:
            f = fmts[a.operand]
            if len(f.levels) > 1 and isinstance(f.level_types[0], Dense) and \
                    isinstance(f.level_types[1], Compressed) and a.indices[f.exprs[0].dim] == order[0]:
                balance = (a.operand, 1)
                break
    return CoSchedule(order, reformat, mode, row, ws, parallel, balance, why, tuple(a.operand for a in moved))


def _following(f, access, order):
    """Format ``f`` of a sparse access with its levels reordered to follow the loop ``order`` (each level type kept
    at its position: CSC followed row-wise is CSR)."""
    new_vars = sorted(_level_vars(f, access), key=order.index)
    return Format.from_levels(f.ndim, [(Var(access.indices.index(v)), lvl) for v, (_, lvl) in zip(new_vars, f.levels)])


def _cross_loops(order, sparse, fmts, moved) -> int:
    """How many loops below the outermost run over an index that no sparse operand reaches through an outer
    coordinate: the index is stored only at first levels or in dense levels, so the loop walks the same coordinates
    for every outer iteration (CSR @ CSC.T in the order i, k, j walks every k for every i: n^2 merges, an
    inner-product nest). Each such loop multiplies the work by an extent, not by the entries under a coordinate."""
    levels = {}
    for a in sparse:
        f = _following(fmts[a.operand], a, order) if a in moved else fmts[a.operand]
        for k, (e, lvl) in enumerate(f.levels):
            levels.setdefault(a.indices[e.dim], []).append(k > 0 and not isinstance(lvl, Dense))
    return sum(1 for v in order[1:] if v in levels and not any(levels[v]))


def _nest_cost(asg, out, order, sparse, fmts, moved) -> tuple:
    """What a loop order costs beyond the stored entries, compared first to last: its cross loops
    (``_cross_loops``), then whether a sparse output of several indices has no row loop (the first loop sums: every
    entry of the output is assembled in one serial row, in a workspace over all of its coordinates)."""
    no_row = out.format is not None and len(asg.out) > 1 and order[0] not in asg.out
    return _cross_loops(order, sparse, fmts, moved), int(no_row)


def _uncrossed(asg, sparse, fmts, out, weights, priority, cost):
    """``(order, transposed accesses)`` of less ``_nest_cost`` than ``cost``, converting the operands it does not
    follow: of those, the least cost, then the least weight converted, then the order whose first loop gives the
    output's rows, then the priority order; None where none costs less (or the indices are too many to try every
    order)."""
    import itertools
    stored = [v for v in asg.indices if any(v in a.indices for a in sparse)]
    if len(stored) > 6:
        return None
    rest = sorted((v for v in asg.indices if v not in stored), key=priority)
    w = {a.operand: (1.0 if weights is None else float(weights[a.operand])) for a in sparse}
    first = None
    if out.format is not None and isinstance(out.format.exprs[0], Var):
        first = asg.out[out.format.exprs[0].dim]
    best = None
    for perm in itertools.permutations(stored):
        order = tuple(perm) + tuple(rest)
        moved = [a for a in sparse if [order.index(v) for v in _level_vars(fmts[a.operand], a)] !=
                 sorted(order.index(v) for v in _level_vars(fmts[a.operand], a))]
        key = (_nest_cost(asg, out, order, sparse, fmts, moved), sum(w[a.operand] for a in moved),
               order[0] != first, [priority(v) for v in order])
        if key[0] < cost and (best is None or key < best[0]):
            best = (key, order, moved)
    return None if best is None else best[1:]


def _followed(sparse, acyclic, weights=None):
    """The sparse accesses whose level order the loops follow: of the sets with a loop order concordant with all
    of them (``acyclic``), the one leaving the least weight to transpose. Exhaustive over subsets for a few
    operands, greedy (heaviest first) beyond."""
    import itertools
    w = {a.operand: (1.0 if weights is None else float(weights[a.operand])) for a in sparse}
    if acyclic(sparse):
        return sparse
    if len(sparse) <= 10:
        subsets = [c for r in range(len(sparse) - 1, -1, -1) for c in itertools.combinations(sparse, r)]
        # least transposed weight first; then fewer conversions; then the earlier operands kept
        subsets.sort(key=lambda c: (sum(w[a.operand] for a in sparse if a not in c), len(sparse) - len(c)))
        return list(next(c for c in subsets if acyclic(list(c))))
    kept = []
    for a in sorted(sparse, key=lambda a: -w[a.operand]):
        if acyclic(kept + [a]):
            kept.append(a)
    return kept


def _accesses(asg):
    return asg.rhs.accesses()


#: speedup of a loop nest whose innermost loop is a contiguous vector loop over one whose outer loop is dense
VECTOR_GAIN = 4.0

#: estimated cost of a format conversion, in kernel multiply-adds per stored entry and sort step
CONVERT_COST = 4.0


def compressed_target(fmt):
    """``(row dim, col dim)`` when ``fmt`` is a 2-d ``(r : dense, c : compressed)`` format (CSR, CSC), else None."""
    if fmt.ndim != 2 or len(fmt.levels) != 2:
        return None
    (e0, l0), (e1, l1) = fmt.levels
    if isinstance(e0, Var) and isinstance(e1, Var) and isinstance(l0, Dense) and isinstance(l1, Compressed) \
            and l1.unique and l1.ordered:
        return e0.dim, e1.dim
    return None


def transposed_for_parallel(asg, sched, fmt, nnz, sizes, threads, converted=lambda alt: False,
                            recurring=lambda alt: False):
    """A format for the driver (format ``fmt``, ``nnz`` entries) whose first level is an output index (so the loop
    over it runs in parallel without write conflicts), when converting costs less than the serial loop loses; else
    None. ``converted(alt)``: whether the operand is already held in ``alt`` (then it costs nothing);
    ``recurring(alt)``: whether its pattern's conversion is one gather of the values (the pattern's permutation
    kept, or to be kept: a graph's pattern with new values every step).

    The choice between this transposition and a privatized output workspace is by this estimate; only
    formats with plain-index levels are transposed. With one thread the transposition still pays where the
    serial loop nest has a dense loop outside the sparse levels: that order streams every stored entry once per
    outer iteration, scalar, where the transposed one reads each once under a vector loop (``VECTOR_GAIN``)."""
    blocked = all(isinstance(e, (Div, Mod)) for e in fmt.exprs)  # blocks: the block levels are reordered
    if not (blocked or all(isinstance(e, Var) for e in fmt.exprs)) or fmt.keeps_duplicates or nnz < 2:
        return None
    drv = sched.driver
    movable = [k for k, e in enumerate(fmt.exprs) if not isinstance(e, Mod)]
    firsts = [k for k in movable if drv.indices[fmt.exprs[k].dim] in asg.out]
    if not firsts:
        return None
    order = [firsts[0]] + [k for k in movable if k != firsts[0]]
    order += [k for k in range(len(fmt.exprs)) if k not in order]
    work = nnz
    for v in sched.outer + sched.inner:
        work *= sizes[v]
    # the same level types in the new order, made unique (COO's repeated rows would race again)
    types = unique_levels(fmt.level_types)
    alt = Format.from_levels(fmt.ndim, [(fmt.exprs[k], lvl) for k, lvl in zip(order, types)])
    if alt == fmt:
        return None
    if converted(alt):  # a constant operand (features, an adjacency) is converted once, and already was
        return alt
    # a counting sort: a pass to count, one to fill (comparison sorts serve other targets: n log n)
    # (blocks move whole: their pattern converts by counting sort, the values by one gather)
    passes = 2 if compressed_target(alt) is not None or blocked else max(1.0, int(nnz).bit_length())
    convert = CONVERT_COST * (nnz + sizes[drv.indices[fmt.exprs[firsts[0]].dim]]) * passes
    if convert >= work * (1 - 1 / (threads * (VECTOR_GAIN if sched.outer else 1.0))) and recurring(alt):
        convert = CONVERT_COST * nnz  # (asked only where the full conversion would not pay: it counts the asking)
    gain = VECTOR_GAIN if sched.outer else 1.0
    if convert >= work * (1 - 1 / (threads * gain)):
        return None
    return alt
