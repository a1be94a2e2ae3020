"""Lowering: a scheduled assignment -> a loop-IR kernel, through the level capability interface only.

The driving sparse operand's levels become the loop nest: a level that iterates coordinates (dense) loops
over its coordinate range and computes positions; a level that iterates positions (compressed, fixed) loops
over the positions under its parent and reads coordinates; a singleton level continues at its parent's
position. Tensor dimensions are recovered from level coordinates by the format's inverse map as soon as the
levels they need are bound, with a guard where padding can fall outside the tensor (blocks, diagonals).
Every identifier in the kernel is made here; einsum letters never reach the source.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..formats import Div, Mod
from ..formats import Var as FVar
from ..formats.levels import LevelSymbols
from .. import loopir as L
from .infer import factors
from .ir import Access, Add, Assignment, Map, Mul, Scalar
from .schedule import Schedule
from .prefetch import indirect_names, prefetch_ahead
from .target import CPU, Target
from .vectors import in_groups, lane_store, vector_sum


@dataclass(frozen=True)
class Arg:
    """Where a kernel parameter's value comes from at call time.

    ``kind``: ``values`` / ``pos`` / ``crd`` (sparse operand ``operand``, level ``level``), ``dense``
    (operand's data), ``lo`` / ``extent`` / ``width`` (a level's coordinate range start, length, fixed width),
    ``mean`` (a level's positions per position of its parent, rounded up: a hint, ``For.lead``),
    ``dim`` (operand's size along ``level``), ``size`` (index variable ``var``'s extent), ``scalar``
    (a named scalar), ``out`` (the output array), ``threads``.
    """
    param: L.Param
    kind: str
    operand: int = -1
    level: int = -1
    var: str = ""


@dataclass(frozen=True)
class Lowered:
    kernel: L.Kernel
    args: tuple
    compute_type: str
    writes_every_output: bool = False  # the output need not be zero-filled before the kernel
    #: the type of the ``out`` array where it differs from the result's: a 16-bit result that the kernel adds to
    #: more than once per entry is accumulated in the compute type and rounded once, after the kernel
    out_type: str = None


def lower(asg: Assignment, sched: Schedule, compute_type: str, broadcast=frozenset(), scatter=None,
          target: Target = CPU) -> Lowered:
    """``target``: the machine (``target.CPU`` or ``target.CUDA``); register and dot tiles are made only where
    it has explicit vectors (the CPU): the GPU mapping puts the same plain loops on warp lanes instead.

    ``broadcast``: (operand, dim) pairs of dense operands that have size 1 where the index is larger.

    ``scatter=(row, col, phase, drop_zeros)``: instead of a dense or shared output, assemble a compressed matrix whose
    rows are index ``row`` and columns ``col`` by counting sort: phase ``count`` adds one per entry to its
    row's count, phase ``fill`` writes each entry at its row's next free slot (entries reach a row in the
    order the loops visit them). Used for format conversion; runs serially.

    ``compute_type`` is the result's value type (``bf16`` and ``f16`` results are computed in ``f32``)."""
    low = _Lowering(asg, sched, compute_type, broadcast, scatter, target).run()
    return accumulated(low, lambda: _Lowering(asg, sched, low.compute_type, broadcast, scatter, target).run())


def accumulated(low: Lowered, again) -> Lowered:
    """``low``, or where it adds into a 16-bit output (a store with an update), ``again()`` (the kernel lowered
    with an output of the compute type) marked with that ``out_type``: sums kept in float32, rounded once."""
    out = next((p.type for p in low.kernel.params if p.name == "out"), None)
    if out not in L.NARROW or not any(isinstance(s, L.Store) and s.array == "out" and s.op is not None
                                      for s in L.walk(low.kernel.body)):
        return low
    return replace(again(), out_type=low.compute_type)


#: above this many bytes of dense rows read through loaded coordinates (SDDMM's ``B``), a dot tile's entries run
#: one at a time with software prefetches instead of ``U`` at a time: measured by hand (prefetches into L1 then,
#: see ``prefetch.PREFETCH_LOCALITY``; K=64 float32, 2 threads,
#: AMD EPYC Zen 4, interleaved medians, with the L3 flushed before each call / warm): power-law 100k (25.6 MB of
#: B) 21.6 -> 16.6 / 21.1 -> 16.2 ms, uniform 20k (5.1 MB) 2.13 -> 1.84 / 1.24 -> 1.04 ms, 8192 rows of 60
#: entries (2 MB) 1.38 -> 1.05 / 0.91 -> 0.91 ms, 4096 rows (1 MB) 0.59 -> 0.49 / 0.40 -> 0.44 ms; 4096 rows of
#: 133 entries at K=32 (0.5 MB) 0.67 -> 0.68 / 0.47 -> 0.58 ms: the tile wins where B stays in a core's L2
DOT_TILE_BYTES = 1 << 20


class _Lowering:
    target = CPU

    def __init__(self, asg, sched, vt, broadcast, scatter=None, target=CPU):
        # vt: the output's value type; ct: the type arithmetic is done in (f32 for the 16-bit floats)
        self.asg, self.sched, self.vt, self.ct, self.broadcast = asg, sched, vt, L.compute_type(vt), broadcast
        self.target = target
        self.scatter = scatter
        self.covering = set()  # loops that visit each coordinate of an output index exactly once
        self.writes_every_output = False
        self.params, self.args = [], []
        self.vname = {v: f"x{k}" for k, v in enumerate(asg.indices)}  # einsum letter -> generated name
        self.spec = dict(sched.specialize)
        self.bound = {}
        self.scalars = {}
        self.block_loops = {}  # loop variable of a dense level over a block's offsets -> the block size
        self.tile = None       # (rows, columns) of a register tile, for explain
        self.block_covering = set()  # loops over all of a dense ``i / b`` or ``i % b`` level of an output index

    def param(self, name, kind, type_, arg_kind, output=False, **where):
        if all(p.name != name for p in self.params):
            p = L.Param(name, kind, type_, output)
            self.params.append(p)
            self.args.append(Arg(p, arg_kind, **where))
        return name

    def values(self, k):
        """The values array of sparse operand ``k`` (a kernel parameter, added on first use)."""
        t = self.asg.operands[k]
        return self.param(f"t{k}_vals", "array", L.type_of(t.dtype), "values", operand=k)

    def size(self, v):
        if v in self.spec:
            return L.Const(self.spec[v])
        return L.Var(self.param(f"n{self.vname[v][1:]}", "scalar", "i64", "size", var=v))

    def run(self) -> Lowered:
        asg, sched = self.asg, self.sched
        drv = sched.driver
        t = asg.operands[drv.operand]
        itype = L.type_of(t.index_dtype)
        items = []
        for k, v in enumerate(sched.outer):
            x = L.Var(self.vname[v])
            par = L.Parallel("static") if k == 0 and sched.parallel == "outer" else None
            items.append(("for", x, L.Const(0), self.size(v), par))
            if v in self.asg.out:  # (a loop over a summed index revisits every output location)
                self.covering.add(x.name)
            self.bound[v] = x
        fmt = t.format
        parent = L.Const(0)
        coords, dims = {}, {}
        o = drv.operand
        self.positions = []
        for k, (e, lvl) in enumerate(fmt.levels):
            pos = self.param(f"t{o}_l{k}_pos", "array", itype, "pos", operand=o, level=k) if "pos" in lvl.arrays \
                else None
            crd = self.param(f"t{o}_l{k}_crd", "array", itype, "crd", operand=o, level=k) if "crd" in lvl.arrays \
                else None
            const_range = isinstance(e, Mod) and lvl.coord_iter  # an offset in a block spans [0, block)
            if const_range:
                self.block_loops[f"c{k}"] = e.block
            sym = LevelSymbols(
                pos, crd, itype,
                L.Const(0) if const_range else
                L.Var(self.param(f"t{o}_l{k}_lo", "scalar", "i64", "lo", operand=o, level=k)),
                L.Const(e.block) if const_range else
                L.Var(self.param(f"t{o}_l{k}_ext", "scalar", "i64", "extent", operand=o, level=k)),
                (L.Const(lvl.slots) if getattr(lvl, "slots", None) else  # n:m: the width is the format's n
                 L.Var(self.param(f"t{o}_l{k}_w", "scalar", "i64", "width", operand=o, level=k)))
                if lvl.padded else None)
            par = None
            if k == 0 and sched.parallel == "level0":
                par = L.Parallel("static")
                if sched.balance == "nnz":
                    par = L.Parallel("nnz", self.param(f"t{o}_l1_pos", "array", itype, "pos", operand=o, level=1))
            p, c = L.Var(f"p{k}"), L.Var(f"c{k}")
            if lvl.coord_iter:
                lo, hi = lvl.emit_coord_bounds(sym, parent)
                items += [("for", c, lo, hi, par), ("let", p, lvl.emit_coord_access(sym, parent, c))]
                if isinstance(e, FVar) and drv.indices[e.dim] in asg.out:
                    self.covering.add(c.name)  # visits every coordinate of an output index once
                elif isinstance(e, (Div, Mod)) and lvl.full and drv.indices[e.dim] in asg.out:
                    self.block_covering.add(c.name)  # with the other part of the same index: each once
            else:
                bounds = lvl.emit_pos_bounds(sym, parent)
                if bounds is None:
                    items.append(("let", p, parent))
                else:
                    items.append(("for", p, bounds[0], bounds[1], par))
                items.append(("let", c, lvl.emit_pos_access(sym, p)))
                if lvl.padded and bounds is not None and k == len(fmt.levels) - 1 and \
                        not any(x.padded for x in fmt.level_types[:-1]):
                    # padding is no entry: it is 0, but 0 times an inf or nan operand would not be
                    value = _cast(L.Load(self.values(o), p, L.type_of(t.dtype)), self.ct)
                    items.append(("if", lvl.emit_is_entry(sym, bounds[0], p, c, value)))
            parent, coords[k] = p, c
            self.positions.append(p)
            items += self._recover(fmt, k, coords, dims, drv)
        self.leaf = parent
        for v in sched.inner:
            x = L.Var(self.vname[v])
            items.append(("for", x, L.Const(0), self.size(v), None))
            self.bound[v] = x
        if self.scatter:  # counting sort visits entries in order: one thread
            items = [("for", *it[1:4], None) if it[0] == "for" else it for it in items]
        body = self._output(items)
        if any(isinstance(it[4], L.Parallel) for it in items if it[0] == "for"):
            self.param("nthreads", "scalar", "i64", "threads")
        inner = {self.vname[v] for v in sched.inner}
        body = L.mark_simd(L.block(body), lambda name: name in inner)
        kernel = L.Kernel("scorch_kernel", tuple(self.params), body)
        return Lowered(kernel, tuple(self.args), self.ct, self.writes_every_output)

    def _recover(self, fmt, k, coords, dims, drv):
        items = []
        for rec in fmt.inverse:
            if rec.dim in dims or rec.level > k or rec.other_level > k or (rec.other >= 0 and rec.other not in dims):
                continue
            c = coords[rec.level]
            if rec.kind == "level":
                ex = c
            elif rec.kind == "block":
                ex = L.binary("add", L.binary("mul", c, L.Const(rec.block)), coords[rec.other_level])
            elif rec.kind == "plus":
                ex = L.binary("add", c, dims[rec.other])
            elif rec.kind == "minus":
                ex = L.binary("sub", c, dims[rec.other])
            else:
                ex = L.binary("sub", dims[rec.other], c)
            d = L.Var(f"d{rec.dim}")
            items.append(("let", d, ex))
            dims[rec.dim] = d
            v = drv.indices[rec.dim]
            n = self.size(v)
            if rec.kind == "block":
                items.append(("if", L.binary("lt", d, n)))  # padding of a partial block
            elif rec.kind != "level":
                items.append(("if", L.binary("and", L.binary("ge", d, L.Const(0)), L.binary("lt", d, n))))
            self.bound[v] = d  # (no letter repeats within an operand: engine.einsum took the diagonal)
        return items

    # --- the output ------------------------------------------------------------------------------------
    def _scatter(self, items):
        row, col, phase, drop_zeros = self.scatter
        value = self._value(self.asg.rhs)
        r, c = self.bound[row], self.bound[col]
        if phase == "count":
            body = [L.Store(self.param("counts", "array", "i64", "counts", output=True), r, L.Const(1), "add")]
        else:
            nxt = self.param("next", "array", "i64", "next", output=True)
            slot = L.Var("slot")
            body = [L.Let(slot, L.Load(nxt, r, "i64")), L.Store(nxt, r, L.binary("add", slot, L.Const(1))),
                    L.Store(self.param("out_crd", "array", "i64", "out_crd", output=True), slot, c),
                    L.Store(self.param("out", "array", self.vt, "out", output=True), slot, value)]
        if drop_zeros or self.asg.operands[self.sched.driver.operand].format.padded:
            # (padding and stored zeros look alike in a padded level: neither is an entry)
            body = [L.Let(L.Var("v", self.ct), value),
                    L.If(L.binary("ne", L.Var("v", self.ct), L.Const(0, self.ct)), L.block(body))]
        return [_nest(items, body)]

    def _mean_length(self, rest):
        """Where ``rest`` starts with the loop over a driver level's positions under their parent (CSR's row): a
        parameter holding that level's positions per parent, rounded up (``Arg`` kind ``mean``), the expected
        trip count of the loop. Else None."""
        if not rest or rest[0][0] != "for":
            return None
        names = [p.name for p in self.positions]
        if rest[0][1].name not in names:
            return None
        k = names.index(rest[0][1].name)
        if self.asg.operands[self.sched.driver.operand].format.levels[k][1].coord_iter:
            return None
        o = self.sched.driver.operand
        return L.Var(self.param(f"t{o}_l{k}_mean", "scalar", "i64", "mean", operand=o, level=k))

    def _row_workspace(self, items, out, index, value):
        """A workspace for the output tile of the innermost dense loops, held across the reduction loops that
        enclose them (SpMM's row of K): accumulated in registers or on the stack, written once. None when the
        loop nest does not have that shape."""
        asg = self.asg
        tail_names = {self.vname[v] for v in asg.out if v in self.spec}
        j = len(items)
        while j > 0 and items[j - 1][0] == "for" and items[j - 1][1].name in tail_names:
            j -= 1
        tail, head = items[j:], items[:j]
        if not tail:
            return None
        tvars = [next(v for v in asg.out if self.vname.get(v) == it[1].name) for it in tail]
        names = {self.bound[v].name for v in asg.out if v not in tvars}
        b = max((i for i, it in enumerate(head) if it[0] != "if" and it[1].name in names), default=-1)
        while b + 1 < len(head) and head[b + 1][0] == "if":
            b += 1
        between = head[b + 1:]
        if not any(it[0] == "for" for it in between):
            return None
        size, lin = 1, L.Const(0)
        for v in tvars:
            lin = L.binary("add", L.binary("mul", lin, L.Const(self.spec[v])), self.bound[v])
            size *= self.spec[v]
        if size > 1024:
            return None
        tiled = self._register_tile(items, head, tail, tvars, out) if self.target.vectors else None
        if tiled is not None:
            return tiled
        # every output location written exactly once: the loops down to the tile only walk output indices
        # densely, without guards, so the output need not be zeroed first
        once = all(it[0] == "let" or (it[0] == "for" and it[1].name in self.covering) for it in head[:b + 1])
        self.writes_every_output = once
        w = "wrow"
        stmts = [L.LocalArray(w, self.ct, size, L.Const(0, self.ct)),
                 _nest(between + tail, [L.Store(w, lin, value, "add")]),
                 _nest(tail, [L.Store(out, index, L.Load(w, lin, self.ct), None if once else "add")])]
        return [_nest(head[:b + 1], stmts)]

    def _register_tile(self, items, head, tail, tvars, out):
        """The output tile held in vector registers across the reduction loops (SpMM with a dense K, BSR's
        block rows x K): the innermost output loop (extent S, contiguous) is split into tiles of T columns,
        looped outside the reduction, and a dense level over a block's rows, if one binds the output row, moves
        inside the reduction as the tile's rows. Per reduction step the tile takes one broadcast per row and
        one vector load per T / lanes columns, so the loads per multiply-add fall with the tile's size.
        None when the loop nest does not have that shape."""
        ct = self.ct
        if ct not in ("f32", "f64") or len(tvars) != 1 or len(tail) != 1:
            return None  # (16-bit arrays: read and written as float vectors, scorch_widen / scorch_narrow)
        bvar = tvars[0]
        lanes = self.target.lanes(ct)
        S = self.spec[bvar]
        if S % lanes:
            return None
        # the reduction starts at the first loop whose variable no output coordinate depends on
        out_names = {self.bound[v].name for v in self.asg.out if v != bvar}
        lets = {it[1].name: L.uses(it[2]) for it in head if it[0] == "let"}
        deps, todo = set(), list(out_names)
        while todo:
            n = todo.pop()
            if n not in deps:
                deps.add(n)
                todo += lets.get(n, ())
        h = next((i for i, it in enumerate(head) if it[0] == "for" and it[1].name not in deps), None)
        if h is None:
            return None
        pre, rest = head[:h], head[h:]
        bound_pre = {it[1].name for it in pre if it[0] != "if"}
        late = [it for it in rest if it[0] == "let" and it[1].name in out_names]
        rows = None
        if late:
            # output rows bound inside the reduction: only through one block-row loop
            loops = [it for it in rest if it[0] == "for" and it[1].name in self.block_loops]
            deps = set().union(*(L.uses(it[2]) for it in late))
            row_loops = [it for it in loops if it[1].name in deps]
            if len(row_loops) != 1 or not deps <= bound_pre | {row_loops[0][1].name}:
                return None
            rows = row_loops[0]
        if not any(it[0] == "for" and it is not rows for it in rest):
            return None
        R = self.block_loops[rows[1].name] if rows else 1
        bt, bv = L.Var("bt"), L.Var("bv")
        self.bound[bvar] = L.binary("add", bt, bv)
        value = self._value(self.asg.rhs)
        # the tile's vectors: 4, or 8 where every row the tile reads is 16-bit, so
        # that an entry's tile still reads as many bytes of it (on AVX2, 64 bf16 columns: 128 bytes; with 32
        # columns the same row took twice the passes over the entries: K=128 bf16 SpMM 1.2x -> 1.75x float32's
        # speed, one thread; float32 with 8 vectors was slower, 6.4 -> 7.1 ms)
        tile_loads = [ld for ld in L.loads(value) if L.coefficient(ld.index, bv.name) == 1]
        wide = bool(tile_loads) and all(ld.type in L.NARROW for ld in tile_loads)
        V = next(v for v in ((8, 4, 2, 1) if wide else (4, 2, 1)) if S % (v * lanes) == 0)
        Rt = next(r for r in range(min(R, max(1, 16 // V)), 0, -1) if R % r == 0)
        T = V * lanes
        index = L.Const(0)
        for v in self.asg.out:
            index = L.binary("add", L.binary("mul", index, self.size(v)), self.bound[v])
        if not all(_contiguous(x, bv.name) for x in [index] + _loads(value)):
            self.bound[bvar] = tail[0][1]
            return None
        # split the reduction's items: those that follow from the row go inside the row loop
        moved, kept, row_names = [], [], {rows[1].name} if rows else set()
        for it in rest:
            if it is rows:
                continue
            if it[0] != "for" and (L.uses(it[1] if it[0] == "if" else it[2]) & row_names):
                moved.append(it)
                if it[0] == "let":
                    row_names.add(it[1].name)
            else:
                kept.append(it)
        w = "wtile"
        ir_loop = (lambda body: L.For(L.Var("ir"), L.Const(0), L.Const(Rt), body, unroll=True))
        lin = L.binary("add", L.binary("mul", L.Var("ir"), L.Const(T)), bv) if rows else bv
        row_lets = []
        if rows:
            i0, ir = L.Var("i0"), L.Var("ir")
            row_lets = [("let", rows[1], L.binary("add", i0, ir))]
        update = [L.For(bv, L.Const(0), L.Const(T), L.block(L.Store(w, lin, value, "add")), vector=lanes)]
        accumulate = ir_loop(_nest(row_lets + moved, update)) if rows else _nest(row_lets + moved, update)
        # the write-back needs the row's output coordinates only: the lets that do not read the reduction
        unknown = {it[1].name for it in kept if it[0] != "if"}
        back = []
        for it in moved:
            if L.uses(it[1] if it[0] == "if" else it[2]) & unknown:
                if it[0] == "let":
                    unknown.add(it[1].name)
            else:
                back.append(it)
        # every output location written once: the loops outside the tile walk output indices densely (whole
        # coordinates, or a block level whose offsets are the tile's rows), without a guard that skips rows
        covering = self.covering | (self.block_covering if rows and rows[1].name in self.block_covering else set())
        once = all(it[0] == "let" or (it[0] == "for" and it[1].name in covering) for it in pre)
        self.writes_every_output = once
        store = [L.For(bv, L.Const(0), L.Const(T), L.block(
            L.Store(out, index, L.Load(w, lin, ct), None if once else "add")), vector=lanes)]
        # (prefetches of a later entry's row, after the entry's lets.) One tile for all of a row's entries: copies
        # of it taking a group of entries each (independent multiply-add chains) were slower on every case
        # measured (SpMM K=8..128 on Cora, uniform and power-law, the fused attention's product)
        ahead = None if rows else prefetch_ahead(pre, kept, value, bv, T)
        stmts = [L.LocalArray(w, ct, Rt * T, L.Const(0, ct), vector=lanes), _nest(kept, [accumulate] + (ahead or [])),
                 ir_loop(_nest(row_lets + back, store)) if rows else _nest([], store)]
        body = L.block(stmts)
        if rows:
            body = L.block(L.Let(L.Var("i0"), L.Const(0)), body) if Rt == R else _strided(L.Var("i0"), R, Rt, body)
        self.tile = (Rt, T)
        return [_nest(pre, [_strided(bt, S, T, body)])]

    def _dot_tile(self, items, ready, out, index, value):
        """Dot products at the stored entries (SDDMM: ``out[p] = sum_k A[i, k] B[j, k]``) for ``U`` entries at
        once: the innermost loop (over k, contiguous) runs on vectors with one partial sum per entry, so U
        independent chains hide the multiply-add latency and A's row is loaded once for U entries; U is a
        vector's lane count, so that the U partial sums are added up together (``SumLanes``: a transposed tree,
        about 3 shuffles and adds per entry instead of 8: an f32 SDDMM with 32 columns, 4096 rows of 133
        entries, went from 0.58 to 0.39 ms). The entries left over (fewer than U) are taken one at a time. None
        when the loop nest has another shape."""
        ct, rest = self.ct, items[ready + 1:]
        loops = [it for it in rest if it[0] == "for"]
        if ct not in ("f32", "f64") or len(loops) != 1 or loops[0] is not rest[-1]:
            return None
        kvar = next((v for v in self.asg.indices if self.vname[v] == loops[0][1].name), None)
        lanes = self.target.lanes(ct)
        if kvar is None or kvar in self.asg.out or self.spec.get(kvar, 0) % lanes or not self.spec.get(kvar):
            return None
        P = max((i for i in range(ready + 1) if items[i][0] == "for"), default=None)
        if P is None or items[P][4] is not None:
            return None
        if not all(_contiguous(x, loops[0][1].name) for x in _loads(value)):
            return None
        # factors that do not vary along k multiply the sum once, at the write (SDDMM's sampled values)
        fs = factors(self.asg.rhs)
        inner_fs = [f for f in fs if kvar in _index_vars(f)]
        outer = None
        if inner_fs and len(inner_fs) < len(fs):
            value = self._value(Mul(tuple(inner_fs)) if len(inner_fs) > 1 else inner_fs[0])
            outer = self._value(Mul(tuple(f for f in fs if f not in inner_fs)) if len(fs) - len(inner_fs) > 1
                                else next(f for f in fs if f not in inner_fs))
        U = lanes  # (as many entries as a vector has lanes: their totals come out as one vector, see SumLanes)
        _, pv, lo, hi, _ = items[P]
        per_entry = items[P + 1:ready + 1] + rest[:-1]  # lets and guards of one entry
        u, sums, kloop = L.Var("u"), "esum", loops[0]
        rest_lets = [it for it in rest[:-1] if it[0] == "let"]
        lets = [it for it in items[P + 1:ready + 1] if it[0] == "let"] + rest_lets
        product = (lambda t: t if outer is None else L.Binary("mul", outer, t, ct))

        def block_of_entries(base):
            entry = [("let", pv, L.binary("add", base, u))]
            # entry by entry, each reading its whole row of B before the next: the lines of one row in a row (the
            # k loop inside) were 14-20% faster than k outside, which reads one line of each of the U rows in turn
            # (SDDMM K=64 on the uniform 20k matrix, 1.39 -> 1.14 and 1.70 -> 1.37 ms; power-law 25.1 -> 23.0 ms;
            # 2 threads, AMD EPYC Zen 4, the generated kernel edited and called by hand, interleaved medians)
            accumulate = L.For(u, L.Const(0), L.Const(U), _nest(entry + per_entry, [L.For(
                kloop[1], kloop[2], kloop[3], L.block(L.Store(sums, u, value, "add")), vector=lanes)]), unroll=True)
            total = product(L.Load("etot", u, ct))
            write = lane_store(entry + lets, u, lanes, out, index, total, ct) or L.For(
                u, L.Const(0), L.Const(U), _nest(entry + lets, [L.Store(out, index, total)]), unroll=True)
            return [L.LocalArray(sums, ct, U, L.Const(0, ct), sums=lanes), accumulate,
                    L.SumLanes("etot", sums, ct, U), write]

        blocked, start = in_groups(lo, hi, U, "e", block_of_entries)
        # the entries left over (fewer than U): one at a time, each dot product in one vector of partial sums
        # added up at its end. A tile of U with its extra lanes repeating the last entry was tried first: the
        # uniform 20k matrix's rows of ~20 entries then computed 32 products a row for 20 (K=64, 16 lanes: 2.40
        # -> 2.01 ms one at a time; power-law 21.7 -> 19.7 ms; 2 threads, AVX-512, the kernels called by hand)
        rest_at = L.Var("e_rest")
        # (the sum in a one-trip loop: a scope of its own, since the write binds the entry's lets again outside
        # the entry's guards, as a tile's write does)
        def one(ahead=()):
            return [L.LocalArray("vsum", ct, 1, L.Const(0, ct), sums=lanes),
                    L.For(L.Var("e_one"), L.Const(0), L.Const(1), _nest(per_entry, [*ahead, L.For(
                        kloop[1], kloop[2], kloop[3], L.block(L.Store("vsum", L.Const(0), value, "add")),
                        vector=lanes)])),
                    _nest(lets, [L.Store(out, index, product(L.Load("vsum", L.Const(0), ct)))])]
        partial = L.block(L.Let(rest_at, start), L.For(pv, rest_at, hi, L.block(*one())))
        self.tile = (U, lanes)
        # every stored entry is written (by a whole tile or one at a time), unguarded, under loops that walk every
        # position of the shared levels: the output need not be zero-filled first
        self.writes_every_output = not self.sched.outer and not any(it[0] == "if" for it in items[:ready + 1])
        tiled = L.block(blocked, partial)
        # where an entry's row is found through a loaded coordinate (SDDMM's row of B at the entry's column) and
        # the rows so read are more than a core's cache keeps (``DOT_TILE_BYTES``), the entries go one at a time
        # with the row ``prefetch_distance`` entries later asked for: the tile's burst of U rows' loads waits on
        # memory together, while one entry at a time leaves room for the prefetches (see ``DOT_TILE_BYTES``)
        ahead = prefetch_ahead(items[:P], items[P:ready + 1] + rest[:-1], value, kloop[1], self.spec[kvar])
        gathered = self._gathered_bytes(inner_fs or fs, indirect_names(pv, per_entry)) if ahead else None
        if gathered is None:
            return [_nest(items[:P], [tiled])]
        return [_nest(items[:P], [L.If(L.binary("gt", gathered, L.Const(DOT_TILE_BYTES)),
                                       L.block(L.For(pv, lo, hi, L.block(*one(ahead)))), tiled)])]

    def _gathered_bytes(self, fs, indirect):
        """The bytes of the dense operands among the factors ``fs`` that are read at a position found through a
        loaded coordinate (an index bound to one of the names ``indirect``), as an expression; None if none."""
        total = None
        for f in fs:
            if not isinstance(f, Access) or self.asg.operands[f.operand].sparse or not any(
                    v in self.bound and L.uses(self.bound[v]) & indirect for v in f.indices):
                continue
            size = L.Const(self.asg.operands[f.operand].dtype.itemsize)
            for d, v in enumerate(f.indices):
                size = L.binary("mul", size, self._extent(f.operand, d, v))
            total = size if total is None else L.binary("add", total, size)
        return total

    def _extent(self, operand, d, v):
        """Dense operand ``operand``'s size along its dimension ``d`` (index ``v``): the specialized extent, else a
        kernel argument."""
        return self.size(v) if v in self.spec else L.Var(
            self.param(f"t{operand}_s{d}", "scalar", "i64", "dim", operand=operand, level=d))

    def _output(self, items):
        asg, sched = self.asg, self.sched
        if self.scatter:
            return self._scatter(items)
        out = self.param("out", "array", self.vt, "out", output=True)
        shared = sched.output.shared_levels
        red = asg.reduce
        update = "add" if red == "sum" else red
        if shared:
            index = self.positions[shared - 1]
            ready = max(i for i, it in enumerate(items) if it[0] != "if" and it[1] == index)
            # each position is written once, unless a loop over a summed index encloses the write (a user's loop
            # order may put one outside the sparse levels): then the writes add up, into a zeroed output
            reduced = {self.bound[v].name for v in asg.indices if v not in asg.out and v in self.bound}
            outer_sum = any(it[0] == "for" and it[1].name in reduced for it in items[:ready + 1])
            op = update if outer_sum else None
        else:
            index = L.Const(0)
            for v in asg.out:
                index = L.binary("add", L.binary("mul", index, self.size(v)), self.bound[v])
            names = {self.bound[v].name for v in asg.out}
            ready = max((i for i, it in enumerate(items) if it[0] != "if" and it[1].name in names), default=-1)
            op = update
        # guards right after the point where the output location is known still apply to it
        while ready + 1 < len(items) and items[ready + 1][0] == "if":
            ready += 1
        value = self._value(asg.rhs)
        if not shared and red == "sum":
            tiled = self._row_workspace(items, out, index, value)
            if tiled is not None:
                return tiled
        rest = items[ready + 1:]
        if shared and red == "sum" and self.target.vectors and op is None:
            tiled = self._dot_tile(items, ready, out, index, value)
            if tiled is not None:
                return tiled
        # max/min also count the stored entries reduced into each output: where fewer than the reduced extent,
        # an implicit zero takes part too (applied after the kernel)
        counts = self.param("counts", "array", "i64", "counts", output=True) if red != "sum" else None
        if any(it[0] == "for" for it in rest):
            acc, cnt = L.Var("acc", self.ct), L.Var("cnt")
            once = op is not None and not shared and all(
                it[0] == "let" or (it[0] == "for" and it[1].name in self.covering) for it in items[:ready + 1])
            if once:  # every output written by exactly one iteration: stored, not added (no zero-filled output)
                op, self.writes_every_output = None, True
            summed = red == "sum" and self.target.vectors and self.ct in ("f32", "f64") and vector_sum(
                rest, value, self.target.sum_lanes(self.ct), self.ct, lambda: self._mean_length(rest),
                self.target.lead_gathers)
            if summed:
                return [_nest(items[:ready + 1], summed[0] + [L.Store(out, index, summed[1], op)])]
            inner = [L.Decl(acc, identity(red, self.ct)), L.Decl(cnt, L.Const(0)) if counts else None,
                     _nest(rest, [L.Assign(acc, value, update), L.Assign(cnt, L.Const(1), "add") if counts else None]),
                     L.Store(out, index, acc, op), L.Store(counts, index, cnt, "add") if counts else None]
        else:
            inner = [_nest(rest, [L.Store(out, index, value, op),
                                  L.Store(counts, index, L.Const(1), "add") if counts else None])]
        return [_nest(items[:ready + 1], inner)]

    def _value(self, e):
        asg, ct = self.asg, self.ct
        if isinstance(e, Access):
            t = asg.operands[e.operand]
            if t.sparse:
                if e != self.sched.driver:
                    raise NotImplementedError("scorch: einsum with more than one sparse operand is not supported yet")
                return _cast(L.Load(self.values(e.operand), self.leaf, L.type_of(t.dtype)), ct)
            data = self.param(f"t{e.operand}", "array", L.type_of(t.dtype), "dense", operand=e.operand)
            off = L.Const(0)
            for d, v in enumerate(e.indices):
                bc = (e.operand, d) in self.broadcast
                ext = L.Const(1) if bc else self._extent(e.operand, d, v)
                off = L.binary("add", L.binary("mul", off, ext), L.Const(0) if bc else self.bound[v])
            return _cast(L.Load(data, off, L.type_of(t.dtype)), ct)
        if isinstance(e, Mul):
            vals = [self._value(f) for f in factors(e)]
            out = vals[0]
            for v in vals[1:]:
                out = L.Binary("mul", out, v, ct)
            return out
        if isinstance(e, Add):
            vals = [self._value(t) for t in e.terms]
            out = vals[0]
            for v in vals[1:]:
                out = L.Binary("add", out, v, ct)
            return out
        if isinstance(e, Map):
            return L.Unary(e.op, self._value(e.arg), ct)
        if isinstance(e, Scalar):
            k = self.scalars.setdefault(e.name, len(self.scalars))
            return L.Var(self.param(f"s{k}", "scalar", ct, "scalar", var=e.name), ct)
        raise TypeError(f"unknown index expression {type(e).__name__}")


def identity(reduce, t):
    """The identity of a reduction in type ``t``."""
    if reduce == "sum":
        return L.Const(0, t)
    if t in ("f32", "f64"):
        return L.Const(float("-inf") if reduce == "max" else float("inf"), t)
    bits = 31 if t == "i32" else 63
    return L.Const(-(2**bits) if reduce == "max" else 2**bits - 1, t)


def _cast(e, t):
    return e if e.type == t else L.Cast(e, t)


def _index_vars(e) -> set:
    """The index variables an index expression reads."""
    if isinstance(e, Access):
        return set(e.indices)
    if isinstance(e, Mul):
        return set().union(*(_index_vars(f) for f in e.factors))
    if isinstance(e, Add):
        return set().union(*(_index_vars(t) for t in e.terms))
    if isinstance(e, Map):
        return _index_vars(e.arg)
    return set()


def _loads(e) -> list:
    if isinstance(e, L.Load):
        return [e.index]
    return [x for c in (getattr(e, f, None) for f in ("a", "b", "cond")) if isinstance(c, L.Expr) for x in _loads(c)]


def _contiguous(index, var) -> bool:
    return L.coefficient(index, var) in (0, 1)


def _strided(var, extent, step, body):
    """``for var in range(0, extent, step)`` as a loop over ``var / step`` (the loop IR steps by one)."""
    k = L.Var(var.name + "_k")
    return L.For(k, L.Const(0), L.Const(extent // step),
                 L.block(L.Let(var, L.binary("mul", k, L.Const(step))), body))


def _nest(items, body):
    """Fold nest items (for / let / if) around ``body`` (a list of statements)."""
    stmts = list(body)
    for it in reversed(items):
        if it[0] == "for":
            _, var, lo, hi, par = it
            stmts = [L.For(var, lo, hi, L.block(stmts), par)]
        elif it[0] == "let":
            stmts = [L.Let(it[1], it[2])] + stmts
        else:
            stmts = [L.If(it[1], L.block(stmts))]
    return L.block(stmts)
