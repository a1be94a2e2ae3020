"""Lowering by index variable with co-iteration: several sparse operands, merged loop by loop.

Each loop of the schedule's order binds one index variable. The operand levels that store it are its
iterators: dense levels are located (their position computed from the coordinate); compressed levels are
walked, alone when the merge lattice (``lattice``) says the result needs that operand, else merged: a
two-pointer (k-pointer) merge over their coordinates for an intersection or a union, or, when the result can
be nonzero where none of them has an entry, a dense loop with the compressed levels following along.
An operand absent at a coordinate is "dead" below it: its deeper levels iterate nothing and its value is 0.

Outputs are dense (scattered with ``+=``), or assembled row by row in two passes: ``count`` (entries per row) and,
after a prefix sum, ``fill`` (sorted coordinates and values). Where the loops below the row are the workspace's
indices in order (an add or an elementwise product: a merge meets each coordinate once, ascending), the entries
are written straight from the loops (``direct``: no workspace, no sort); else they go through a dense workspace
with a list of touched entries (sorted at the row's end), or a hash workspace. A workspace is private to each
thread, so the row loop runs in parallel.
"""
from __future__ import annotations

from ..formats.levels import LevelSymbols
from . import lattice
from .. import loopir as L
from .ir import Access, Assignment
from .lower import Lowered, _Lowering, _cast, accumulated
from .schedule import CoSchedule
from .target import CPU, Target

INT64_MAX = 2**63 - 1
#: how many entries ahead a loop prefetches the row the next loop will walk (``prefetch_rows``): 2, 4 and 8 were
#: measured on the uniform 20k SpGEMM, 2 the fastest by a little
PREFETCH_ROWS_AHEAD = 2
#: a row is marked in a bitmap (``bitmap_row``) where it has at least one entry per this many of the bitmap's
#: 64-bit words: reading 2 words a key costs less than the marks, touched list and radix sort of the other path.
#: On the uniform 20k SpGEMM (rows of B touching ~130-600 of 20,000 columns), 1 -> 2: count 4.9-5.2 -> 4.5-4.6 ms,
#: fill 20.1-22.5 -> 19.4-21.9 ms (4 a word measured the same; hand-edited sources, interleaved)
BITMAP_ROW_SPREAD = 2


def lower_coiteration(asg: Assignment, cs: CoSchedule, ct: str, broadcast=frozenset(), phase=None,
                      target: Target = CPU) -> Lowered:
    """``phase``: None for a dense output; ``"count"``, or ``"fill"`` / ``"fill32"`` (64- or 32-bit output
    coordinates), for the two passes of a rows output with a dense workspace; ``"hcount"``, ``"hfill"`` /
    ``"hfill32"`` for the same with a hash workspace (``HASH``), ``"dcount"``, ``"dfill"`` / ``"dfill32"`` written
    directly (``schedule.direct_rows``). ``target``: the machine, as for ``lower``."""
    low = _CoLowering(asg, cs, ct, broadcast, phase, target).run()
    return accumulated(low, lambda: _CoLowering(asg, cs, low.compute_type, broadcast, phase, target).run())


class _CoLowering(_Lowering):
    def __init__(self, asg, cs, ct, broadcast, phase, target=CPU):
        # ct given: the output's value type; self.ct: the type arithmetic is done in (f32 for the 16-bit floats)
        self.asg, self.cs, self.vt, self.ct = asg, cs, ct, L.compute_type(ct)
        self.broadcast, self.target = broadcast, target
        self.hash = phase is not None and phase.startswith("h")
        self.direct = phase is not None and phase.startswith("d")
        phase = phase[1:] if self.hash or self.direct else phase
        self.phase = "fill" if phase == "fill32" else phase
        self.crd_type = "i32" if phase == "fill32" else "i64"
        self.params, self.args = [], []
        self.vname = {v: f"x{k}" for k, v in enumerate(asg.indices)}
        self.spec = {}
        self.bound = {}
        self.scalars = {}
        self.formula = lattice.presence(asg.rhs, asg.operands)
        self.access = {a.operand: a for a in asg.rhs.accesses() if asg.operands[a.operand].sparse}
        self.setup_placed = False
        # a dense workspace's passes on the CPU mark a row with many entries (as many as its bitmap's words) in a
        # bitmap instead (``bitmap_row``): no test per term, no touched list, no sort
        self.bitmap_rows = self.phase in ("count", "fill") and not self.hash and not self.direct and \
            target.name == "cpu"
        self.bitmap = False  # (while lowering such a row's loops)
        self.inside = set()  # positions known to lie inside their level (``_value``'s eager reads)

    # --- operand levels -----------------------------------------------------------------------------------
    def var_of(self, k, idx):
        return self.access[k].indices[self.asg.operands[k].format.exprs[idx].dim]

    def sym(self, k, idx):
        t = self.asg.operands[k]
        lvl = t.format.level_types[idx]
        itype = L.type_of(t.index_dtype)
        pos = self.param(f"t{k}_l{idx}_pos", "array", itype, "pos", operand=k, level=idx) if "pos" in lvl.arrays \
            else None
        crd = self.param(f"t{k}_l{idx}_crd", "array", itype, "crd", operand=k, level=idx) if "crd" in lvl.arrays \
            else None
        return LevelSymbols(pos, crd, itype,
                            L.Var(self.param(f"t{k}_l{idx}_lo", "scalar", "i64", "lo", operand=k, level=idx)),
                            L.Var(self.param(f"t{k}_l{idx}_ext", "scalar", "i64", "extent", operand=k, level=idx)))

    def run(self) -> Lowered:
        cs = self.cs
        if self.phase:
            self.ws_size = L.Const(1)
            for v in cs.ws_vars:
                self.ws_size = L.binary("mul", self.ws_size, self.size(v))
            if self.direct:
                self.setup = []
            elif self.hash:
                cap = None if self.phase == "count" else L.Var(self.param("hcap", "scalar", "i64", "hcap"))
                self.setup = [] if cap is None else [
                    L.Alloc(a, t, cap) for a, t in (("hkeys", "i64"), ("hvals", self.ct), ("touched", "i64"),
                                                    ("slots", "i64"), ("sort_tmp", "i64"))]
            else:
                self.setup = [L.Alloc("mark", "bool", self.ws_size), L.Alloc("touched", "i64", self.ws_size)]
            if self.phase == "fill" and not self.hash and not self.direct:
                self.setup += [L.Alloc("ws", self.ct, self.ws_size), L.Alloc("sort_tmp", "i64", self.ws_size)]
            if self.bitmap_rows:
                self.setup.append(L.Alloc("bits", "i64", self.words))
                if self.phase == "count":  # (the thread's last row's entries: ``bitmap_row``)
                    self.setup.append(L.Decl(L.Var("nt_last"), L.Const(0)))
        state = {k: (0, L.Const(0), None) for k in self.access}
        if self.phase and cs.row_var is None:
            body = [L.Decl(L.Var("nt"), L.Const(0))] + self.row_start(L.Const(0)) + self.gen(0, state) + \
                self.row_end(L.Const(0))
        else:
            body = self.gen(0, state)
        if self.phase and not self.setup_placed:
            body = self.setup + body
        if self._parallel_used:
            self.param("nthreads", "scalar", "i64", "threads")
        kernel = L.Kernel(f"scorch_{self.phase or 'kernel'}", tuple(self.params), L.block(body))
        return Lowered(kernel, tuple(self.args), self.ct)

    _parallel_used = False

    def parallel(self, i):
        if i != 0 or not self.cs.parallel:
            return None
        self._parallel_used = True
        setup = None
        if self.phase:
            setup = L.block(self.setup)
            self.setup_placed = True
        if self.cs.balance is not None:
            k, lvl = self.cs.balance
            pos = self.sym(k, lvl).pos
            return L.Parallel("nnz", pos, setup)
        return L.Parallel("static", None, setup)

    # --- loops --------------------------------------------------------------------------------------------
    def gen(self, i, state):
        if i == len(self.cs.order):
            return self.innermost(state)
        v = self.cs.order[i]
        x = L.Var(self.vname[v])
        self.bound[v] = x
        dense_its, comp_its = [], []
        for k, (idx, parent, alive) in state.items():
            if idx < len(self.asg.operands[k].format.levels) and self.var_of(k, idx) == v:
                lvl = self.asg.operands[k].format.level_types[idx]
                (dense_its if lvl.coord_iter else comp_its).append(k)
        cond = lattice.restrict(self.formula, set(comp_its))

        def locate(st):
            lets, st = [], dict(st)
            for k in dense_its:
                idx, parent, alive = st[k]
                p = L.Var(f"p{k}_{idx}")
                lvl = self.asg.operands[k].format.level_types[idx]
                lets.append(L.Let(p, lvl.emit_coord_access(self.sym(k, idx), parent, x)))
                st[k] = (idx + 1, p, alive)
            return lets, st

        if not comp_its:
            lets, st = locate(state)
            par = self.parallel(i)
            return [L.For(x, L.Const(0), self.size(v), L.block(lets, self.body_at(i, st)), par)]

        bounds = {k: self.bounds(k, state[k]) for k in comp_its}
        need_all = lattice.evaluate(cond, {k: False for k in comp_its})
        if len(comp_its) == 1 and not need_all:
            k = comp_its[0]
            idx, _, alive = state[k]
            q = L.Var(f"q{k}_{idx}")
            lets, st = locate(state)
            st[k] = (idx + 1, q, alive)
            lvl = self.asg.operands[k].format.level_types[idx]
            par = self.parallel(i)
            ahead = self.prefetch_rows(i, state, q, bounds[k][1], lambda at: lvl.emit_pos_access(self.sym(k, idx), at))
            return [L.For(q, *bounds[k], L.block([L.Let(x, lvl.emit_pos_access(self.sym(k, idx), q))], lets, ahead,
                                                  self.body_at(i, st)), par)]
        # a merge: pointers q_k walk the compressed levels together
        decls, q, end = [], {}, {}
        for k in comp_its:
            idx = state[k][0]
            q[k], end[k] = L.Var(f"q{k}_{idx}"), L.Var(f"end{k}_{idx}")
            decls += [L.Decl(q[k], bounds[k][0]), L.Let(end[k], bounds[k][1])]

        def crd_at(k):
            idx = state[k][0]
            lvl = self.asg.operands[k].format.level_types[idx]
            return lvl.emit_pos_access(self.sym(k, idx), q[k])

        # two operands merge while both have entries (no end checks on their coordinates); what one has left
        # after, its tail walks alone (``tails``)
        two = not need_all and len(comp_its) == 2
        flags, lets = {}, []
        if need_all:
            for k in comp_its:
                f = L.Var(f"f{k}_{state[k][0]}", "bool")
                lets.append(L.Let(f, L.binary("eq", L.Select(L.binary("lt", q[k], end[k]), crd_at(k),
                                                             L.Const(-1), "i64"), x)))
                flags[k] = f
        else:
            cc = {}
            for k in comp_its:
                cc[k] = L.Var(f"cc{k}_{state[k][0]}")
                lets.append(L.Let(cc[k], crd_at(k) if two else L.Select(
                    L.binary("lt", q[k], end[k]), crd_at(k), L.Const(INT64_MAX), "i64")))
            m = cc[comp_its[0]]
            for k in comp_its[1:]:
                m = L.binary("min", m, cc[k])
            lets.append(L.Let(x, m))
            for k in comp_its:
                f = L.Var(f"f{k}_{state[k][0]}", "bool")
                lets.append(L.Let(f, L.binary("eq", cc[k], x)))
                flags[k] = f
        self.state_idx = {k: state[k][0] for k in comp_its}
        counted = self.counted(i, comp_its, cond, q, end, crd_at) if two and not dense_its else None
        if counted is not None:
            return [L.Block(tuple(decls) + (L.Assign(L.Var("nt"), counted, "add"),))]
        dlets, st = locate(state)
        for k in comp_its:
            idx, _, alive = state[k]
            st[k] = (idx + 1, q[k], flags[k] if alive is None else L.binary("and", alive, flags[k]))
        step = [L.Assign(q[k], L.Cast(flags[k], "i64"), "add") for k in comp_its]
        if two:  # (inside a two-way merge's loop both positions are inside their levels: ``_value`` reads eagerly)
            self.inside |= {q[k].name for k in comp_its}
        body = L.block(lets, L.If(lattice.emit(cond, flags), L.block(dlets, self.body_at(i, st))), step)
        self.inside -= {q[k].name for k in comp_its}
        if need_all:
            loop = L.For(x, L.Const(0), self.size(v), body)
        elif two:
            loop = L.While(L.binary("and", *(L.binary("lt", q[k], end[k]) for k in comp_its)), body)
        else:
            loop = L.While(lattice.emit(cond, {k: L.binary("lt", q[k], end[k]) for k in comp_its}), body)
        tails = self.tails(i, state, comp_its, cond, q, end, crd_at, locate) if two else []
        return [L.Block(tuple(decls) + (loop,) + tuple(tails))]

    def prefetch_rows(self, i, state, q, end, crd_at):
        """Prefetches, in a loop over one compressed level's entries, of what the next loop will walk for the entry
        ``PREFETCH_ROWS_AHEAD`` positions later: an operand whose level here is dense, located at this loop's
        coordinate, and whose next level is compressed and walked by the next loop (SpGEMM's row of B at A's
        column ``j``) has its coordinates (and, if they are its last level's and the pass reads values, its
        values) read at rows found only through A's coordinates, which the hardware prefetcher cannot follow.
        Measured on the uniform 20k SpGEMM (hand-edited generated source, 2 threads, interleaved medians): count
        9.9 -> 7.7 ms, fill 28.0 -> 23.0 ms. CPU only; none past the loop's end; only live operands."""
        if self.target.name != "cpu" or i + 1 >= len(self.cs.order) or not PREFETCH_ROWS_AHEAD:
            return []
        v, nxt = self.cs.order[i], self.cs.order[i + 1]
        later, xl = L.binary("add", q, L.Const(PREFETCH_ROWS_AHEAD)), L.Var(f"{self.vname[v]}_ahead")
        out = []
        for k, (idx, parent, alive) in state.items():
            fmt = self.asg.operands[k].format
            if alive is not None or idx + 1 >= len(fmt.levels) or self.var_of(k, idx) != v or \
                    not fmt.level_types[idx].coord_iter or self.var_of(k, idx + 1) != nxt:
                continue
            here, walked = fmt.level_types[idx], fmt.level_types[idx + 1]
            sym = self.sym(k, idx + 1)
            if sym.pos is None or sym.crd is None:
                continue
            at = walked.emit_pos_bounds(sym, here.emit_coord_access(self.sym(k, idx), parent, xl))[0]
            out.append(L.Prefetch(sym.crd, at))
            if idx + 2 == len(fmt.levels) and self.phase in (None, "fill"):
                out.append(L.Prefetch(self.values(k), at))
        if not out:
            return []
        return [L.If(L.binary("lt", later, end), L.block(L.Let(xl, crd_at(later)), out))]

    def counted(self, i, comp_its, cond, q, end, crd_at):
        """A count pass's entries from the innermost two-way merge of plain coordinate lists, without walking it
        (or None): an intersection has ``Common`` of them, a union both lengths less that. (The merge's loop
        carries its positions from step to step, each waiting on the load the last step chose.)"""
        if self.phase != "count" or not (self.direct or self.hash) or i != len(self.cs.order) - 1:
            return None
        crd = [crd_at(k) for k in comp_its]
        crd = [c.a if isinstance(c, L.Cast) else c for c in crd]
        levels = [self.asg.operands[k].format.level_types[self.state_idx[k]] for k in comp_its]
        if not all(isinstance(c, L.Load) and c.index == q[k] and getattr(lv, "unique", False) and
                   getattr(lv, "ordered", False) for c, k, lv in zip(crd, comp_its, levels)):
            return None
        k0, k1 = comp_its
        only0, only1, both = (lattice.evaluate(cond, {k0: f0, k1: f1}) for f0, f1 in
                              ((True, False), (False, True), (True, True)))
        common = L.Common(crd[0].array, q[k0], end[k0], crd[1].array, q[k1], end[k1])
        if both and not only0 and not only1:
            return common
        if both and only0 and only1:
            lengths = L.binary("add", L.binary("sub", end[k0], q[k0]), L.binary("sub", end[k1], q[k1]))
            return L.binary("sub", lengths, common)
        return None

    def tails(self, i, state, comp_its, cond, q, end, crd_at, locate):
        """After a two-way merge's loop, the entries one operand has left, walked alone where the lattice lets the
        result be nonzero without the other (a union; none for an intersection), the other's flag false."""
        x, out = self.bound[self.cs.order[i]], []
        for k in comp_its:
            if not lattice.evaluate(cond, {o: o == k for o in comp_its}):
                continue
            dlets, st = locate(state)
            for o in comp_its:
                idx, _, alive = state[o]
                st[o] = (idx + 1, q[o], alive if o == k else L.Const(False, "bool"))
            body = L.block(L.Let(x, crd_at(k)), dlets, self.body_at(i, st), L.Assign(q[k], L.Const(1), "add"))
            out.append(L.While(L.binary("lt", q[k], end[k]), body))
        return out

    def bounds(self, k, st):
        idx, parent, alive = st
        lvl = self.asg.operands[k].format.level_types[idx]
        b, e = lvl.emit_pos_bounds(self.sym(k, idx), parent)
        if alive is None:
            return b, e
        return L.Select(alive, b, L.Const(0), "i64"), L.Select(alive, e, L.Const(0), "i64")

    @property
    def words(self):
        """The 64-bit words of a bitmap over the workspace."""
        return L.binary("floordiv", L.binary("add", self.ws_size, L.Const(63)), L.Const(64))

    def bitmap_row(self, row, st, walk):
        """A row's ``walk`` (its loops from state ``st`` and ``row_end``), and beside it the same loops marking a
        bitmap (one bit set per term: no test, no touched list), read at the row's end, taken where the row's
        entries are dense in the workspace (``L.dense_keys`` with ``BITMAP_ROW_SPREAD``: at least one entry per 2
        of the bitmap's words). The fill reads the keys in order (no sort): SpGEMM's fill on the uniform 20k matrix
        (rows of ~400 entries in 20,000 columns), measured by hand, was as fast as the fill without any sort. The
        count pass counts the bits (``BitCount``), and since it does not know the row's entries before its loops,
        it goes by the thread's last row (``nt_last``): either way the count is exact, and where the guess is wrong
        the bitmap's words read are at most twice the last row's entries. On the uniform 20k SpGEMM the count went
        from 9.9 to 7.0 ms (hand-edited generated source, 2 threads, interleaved medians)."""
        self.bitmap = True
        try:
            marked = self.gen(1, st) + self.row_end(row)
        finally:
            self.bitmap = False
        if self.phase == "count":
            last = L.Var("nt_last")
            return [L.If(L.dense_keys(last, self.ws_size, BITMAP_ROW_SPREAD), L.block(marked), L.block(walk)),
                    L.Assign(last, L.Var("nt"))]
        row_ptr = self.param("row_ptr", "array", "i64", "row_ptr")
        n = L.binary("sub", L.Load(row_ptr, L.binary("add", row, L.Const(1)), "i64"), L.Load(row_ptr, row, "i64"))
        return [L.If(L.dense_keys(n, self.ws_size, BITMAP_ROW_SPREAD), L.block(marked), L.block(walk))]

    def body_at(self, i, st):
        if i == 0 and self.phase and self.cs.row_var is not None:
            row = self.bound[self.cs.row_var]
            walk = self.gen(1, st) + self.row_end(row)
            if self.bitmap_rows:
                walk = self.bitmap_row(row, st, walk)
            if self.direct and self.phase == "fill":  # (a row the count pass found empty is not walked again:
                # an intersection of rows that rarely meet, as sparse * sparse, writes almost nothing)
                row_ptr = self.param("row_ptr", "array", "i64", "row_ptr")
                walk = [L.If(L.binary("lt", L.Load(row_ptr, row, "i64"),
                                      L.Load(row_ptr, L.binary("add", row, L.Const(1)), "i64")), L.block(walk))]
            return [L.Decl(L.Var("nt"), L.Const(0))] + self.row_start(row) + walk
        return self.gen(i + 1, st)

    # --- innermost: value and output ------------------------------------------------------------------------
    def innermost(self, state):
        self.state = state
        value = self._value(self.asg.rhs)
        if self.phase is None:
            out = self.param("out", "array", self.vt, "out", output=True)
            index = L.Const(0)
            for v in self.asg.out:
                index = L.binary("add", L.binary("mul", index, self.size(v)), self.bound[v])
            return [L.Store(out, index, value, "add")]
        w = L.Const(0)
        for v in self.cs.ws_vars:
            w = L.binary("add", L.binary("mul", w, self.size(v)), self.bound[v])
        wv = L.Var("w")
        nt = L.Var("nt")
        if self.phase == "count" and (self.hash or self.direct):
            return [L.Assign(nt, L.Const(1), "add")]
        if self.hash:
            return [L.Let(wv, w)] + _hash_add(wv, value, self.ct)
        if self.direct:  # each coordinate once, ascending: the row's next entry
            at = L.binary("add", L.Var("base"), nt)
            return [L.Store(self.out_crd(), at, w), L.Store(self.out_vals(), at, value), L.Assign(nt, L.Const(1), "add")]
        if self.bitmap:
            update = [L.Store("ws", wv, value, "add")] if self.phase == "fill" else []
            return [L.Let(wv, w), L.SetBit("bits", wv)] + update
        mark = [L.Store("mark", wv, L.Const(True, "bool")), L.Store("touched", nt, wv),
                L.Assign(nt, L.Const(1), "add")]
        stmts = [L.Let(wv, w), L.If(L.Unary("not", L.Load("mark", wv, "bool"), "bool"), L.block(mark))]
        if self.phase == "fill":
            stmts.append(L.Store("ws", wv, value, "add"))
        return stmts

    def out_crd(self):
        return self.param("out_crd", "array", self.crd_type, "out_crd", output=True)

    def out_vals(self):
        return self.param("out", "array", self.vt, "out", output=True)

    def row_start(self, row):
        """Before a row's loops: where a direct fill writes the row (``base``)."""
        if self.direct and self.phase == "fill":
            return [L.Let(L.Var("base"), L.Load(self.param("row_ptr", "array", "i64", "row_ptr"), row, "i64"))]
        return []

    def row_end(self, row):
        t, nt = L.Var("t"), L.Var("nt")
        if self.hash:
            return self._hash_row_end(row)
        if self.direct:
            return [L.Store(self.param("counts", "array", "i64", "counts", output=True), row, nt)] \
                if self.phase == "count" else []
        if self.phase == "count":
            counts = self.param("counts", "array", "i64", "counts", output=True)
            if self.bitmap:
                return [L.BitCount("bits", self.words, nt), L.Store(counts, row, nt)]
            return [L.Store(counts, row, nt),
                    L.For(t, L.Const(0), nt, L.block(L.Store("mark", L.Load("touched", t, "i64"),
                                                             L.Const(False, "bool"))))]
        row_ptr = self.param("row_ptr", "array", "i64", "row_ptr")
        crd, vals = self.out_crd(), self.out_vals()
        base, wv = L.Var("base"), L.Var("w")
        at = L.binary("add", base, t)
        keys = L.BitKeys("bits", self.words, "touched", self.ws_size, nt) if self.bitmap else \
            L.Sort("touched", L.Const(0), nt, self.ws_size, "sort_tmp")
        unmark = () if self.bitmap else (L.Store("mark", wv, L.Const(False, "bool")),)
        return [keys, L.Let(base, L.Load(row_ptr, row, "i64")),
                L.For(t, L.Const(0), nt, L.block(
                    L.Let(wv, L.Load("touched", t, "i64")), L.Store(crd, at, wv),
                    L.Store(vals, at, L.Load("ws", wv, self.ct)), L.Store("ws", wv, L.Const(0, self.ct)),
                    *unmark))]

    def _hash_row_end(self, row):
        """The end of a row with a hash workspace: ``count``: the row's terms (a bound on its entries); ``fill``:
        its distinct keys sorted, written with their sums from the row's first slot on, their number kept, and
        the table emptied through the slots the row used."""
        t, nt = L.Var("t"), L.Var("nt")
        counts = self.param("counts", "array", "i64", "counts", output=True)
        if self.phase == "count":
            return [L.Store(counts, row, nt)]
        row_ptr = self.param("row_ptr", "array", "i64", "row_ptr")
        crd, vals = self.out_crd(), self.out_vals()
        base, wv, h = L.Var("base"), L.Var("w"), L.Var("h")
        at = L.binary("add", base, t)
        return [L.Sort("touched", L.Const(0), nt, self.ws_size, "sort_tmp"), L.Let(base, L.Load(row_ptr, row, "i64")),
                L.For(t, L.Const(0), nt, L.block(
                    L.Let(wv, L.Load("touched", t, "i64")), *_hash_find(wv, h),
                    L.Store(crd, at, wv), L.Store(vals, at, L.Load("hvals", h, self.ct)))),
                L.For(t, L.Const(0), nt, L.block(
                    L.Let(h, L.Load("slots", t, "i64")), L.Store("hkeys", h, L.Const(0)),
                    L.Store("hvals", h, L.Const(0, self.ct)))),
                L.Store(counts, row, nt)]

    def _value(self, e):
        if isinstance(e, Access) and self.asg.operands[e.operand].sparse:
            t = self.asg.operands[e.operand]
            _, p, alive = self.state[e.operand]
            v = _cast(L.Load(self.values(e.operand), p, L.type_of(t.dtype)), self.ct)
            eager = isinstance(p, L.Var) and p.name in self.inside
            return v if alive is None else L.Select(alive, v, L.Const(0, self.ct), self.ct, eager)
        return super()._value(e)


# --- the hash workspace ---------------------------------------------------------------------------------------
# An open-addressing table per thread of ``hcap`` slots (a power of two the engine sizes from the count pass: at
# least twice a row's terms), linear probing. ``hkeys[h]`` holds key + 1 (0: empty, as allocated); ``hvals[h]``
# the key's sum; ``touched`` the row's keys in insertion order and ``slots`` their slots, to sort the keys and to
# empty the table without probing. The first slot of key w is (w + w / hcap) mod hcap: no multiplication that
# could overflow, and keys that differ by a multiple of hcap start apart.

def _hash_start(w, h):
    cap = L.Var("hcap")
    return L.Decl(h, L.binary("mod", L.binary("add", w, L.binary("floordiv", w, cap)), cap))


def _hash_probe(w, h, stop_empty):
    """Advance ``h`` past the slots that hold another key (and, with ``stop_empty``, stop at an empty one)."""
    cap = L.Var("hcap")
    at = L.Load("hkeys", h, "i64")
    other = L.binary("ne", at, L.binary("add", w, L.Const(1)))
    cond = L.binary("and", L.binary("ne", at, L.Const(0)), other) if stop_empty else other
    return L.While(cond, L.block(L.Assign(h, L.binary("mod", L.binary("add", h, L.Const(1)), cap))))


def _hash_add(w, value, ct):
    """Add ``value`` at key ``w`` (inserting the key, with a zero sum, the first time the row meets it)."""
    h, nt = L.Var("h"), L.Var("nt")
    new = L.block(L.Store("hkeys", h, L.binary("add", w, L.Const(1))), L.Store("touched", nt, w),
                  L.Store("slots", nt, h), L.Assign(nt, L.Const(1), "add"))
    return [_hash_start(w, h), _hash_probe(w, h, True),
            L.If(L.binary("eq", L.Load("hkeys", h, "i64"), L.Const(0)), new),
            L.Store("hvals", h, value, "add")]


def _hash_find(w, h):
    """``h``: the slot of key ``w`` (in the table)."""
    return [_hash_start(w, h), _hash_probe(w, h, False)]
