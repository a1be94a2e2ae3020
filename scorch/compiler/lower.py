"""Lowering: a scheduled assignment -> a loop-IR kernel, through the level capability interface only.

The driving sparse operand's levels become the loop nest: a level that iterates coordinates (dense) loops
over its coordinate range and computes positions; a level that iterates positions (compressed, fixed) loops
over the positions under its parent and reads coordinates; a singleton level continues at its parent's
position. Tensor dimensions are recovered from level coordinates by the format's inverse map as soon as the
levels they need are bound, with a guard where padding can fall outside the tensor (blocks, diagonals).
Every identifier in the kernel is made here; einsum letters never reach the source.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..formats import Var as FVar
from ..formats.levels import LevelSymbols
from . import loops as L
from .infer import factors
from .ir import Access, Add, Assignment, Map, Mul, Scalar
from .schedule import Schedule


@dataclass(frozen=True)
class Arg:
    """Where a kernel parameter's value comes from at call time.

    ``kind``: ``values`` / ``pos`` / ``crd`` (sparse operand ``operand``, level ``level``), ``dense``
    (operand's data), ``lo`` / ``extent`` / ``width`` (a level's coordinate range start, length, fixed width),
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


def lower(asg: Assignment, sched: Schedule, compute_type: str, broadcast=frozenset(), scatter=None) -> Lowered:
    """``broadcast``: (operand, dim) pairs of dense operands that have size 1 where the index is larger.

    ``scatter=(row, col, phase, drop_zeros)``: instead of a dense or shared output, assemble a compressed matrix whose
    rows are index ``row`` and columns ``col`` by counting sort: phase ``count`` adds one per entry to its
    row's count, phase ``fill`` writes each entry at its row's next free slot (entries reach a row in the
    order the loops visit them). Used for format conversion; runs serially."""
    return _Lowering(asg, sched, compute_type, broadcast, scatter).run()


class _Lowering:
    def __init__(self, asg, sched, ct, broadcast, scatter=None):
        self.asg, self.sched, self.ct, self.broadcast = asg, sched, ct, broadcast
        self.scatter = scatter
        self.covering = set()  # loops that visit each coordinate of an output index exactly once
        self.writes_every_output = False
        self.params, self.args = [], []
        self.vname = {v: f"x{k}" for k, v in enumerate(asg.indices)}  # einsum letter -> generated name
        self.spec = dict(sched.specialize)
        self.bound = {}
        self.scalars = {}

    def param(self, name, kind, type_, arg_kind, output=False, **where):
        if all(p.name != name for p in self.params):
            p = L.Param(name, kind, type_, output)
            self.params.append(p)
            self.args.append(Arg(p, arg_kind, **where))
        return name

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
            sym = LevelSymbols(
                pos, crd, itype,
                L.Var(self.param(f"t{o}_l{k}_lo", "scalar", "i64", "lo", operand=o, level=k)),
                L.Var(self.param(f"t{o}_l{k}_ext", "scalar", "i64", "extent", operand=o, level=k)),
                L.Var(self.param(f"t{o}_l{k}_w", "scalar", "i64", "width", operand=o, level=k))
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
            else:
                bounds = lvl.emit_pos_bounds(sym, parent)
                if bounds is None:
                    items.append(("let", p, parent))
                else:
                    items.append(("for", p, bounds[0], bounds[1], par))
                items.append(("let", c, lvl.emit_pos_access(sym, p)))
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
            if v in self.bound:
                items.append(("if", L.binary("eq", d, self.bound[v])))  # repeated index: the diagonal
            else:
                self.bound[v] = d
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
                    L.Store(self.param("out", "array", self.ct, "out", output=True), slot, value)]
        if drop_zeros or self.asg.operands[self.sched.driver.operand].format.padded:
            # (padding and stored zeros look alike in a padded level: neither is an entry)
            body = [L.Let(L.Var("v", self.ct), value),
                    L.If(L.binary("ne", L.Var("v", self.ct), L.Const(0, self.ct)), L.block(body))]
        return [_nest(items, body)]

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
        # every output location written exactly once: the loops down to the tile only walk output indices
        # densely, without guards, so the output need not be zeroed first
        once = all(it[0] == "let" or (it[0] == "for" and it[1].name in self.covering) for it in head[:b + 1])
        self.writes_every_output = once
        w = "wrow"
        stmts = [L.LocalArray(w, self.ct, size, L.Const(0, self.ct)),
                 _nest(between + tail, [L.Store(w, lin, value, "add")]),
                 _nest(tail, [L.Store(out, index, L.Load(w, lin, self.ct), None if once else "add")])]
        return [_nest(head[:b + 1], stmts)]

    def _output(self, items):
        asg, sched = self.asg, self.sched
        if self.scatter:
            return self._scatter(items)
        out = self.param("out", "array", self.ct, "out", output=True)
        shared = sched.output.shared_levels
        red = asg.reduce
        update = "add" if red == "sum" else red
        if shared:
            index = self.positions[shared - 1]
            ready = max(i for i, it in enumerate(items) if it[0] != "if" and it[1] == index)
            op = None  # each position is written once
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
        # max/min also count the stored entries reduced into each output: where fewer than the reduced extent,
        # an implicit zero takes part too (applied after the kernel)
        counts = self.param("counts", "array", "i64", "counts", output=True) if red != "sum" else None
        if any(it[0] == "for" for it in rest):
            acc, cnt = L.Var("acc", self.ct), L.Var("cnt")
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
                vals = self.param(f"t{e.operand}_vals", "array", L.type_of(t.dtype), "values", operand=e.operand)
                return _cast(L.Load(vals, self.leaf, L.type_of(t.dtype)), ct)
            data = self.param(f"t{e.operand}", "array", L.type_of(t.dtype), "dense", operand=e.operand)
            off = L.Const(0)
            for d, v in enumerate(e.indices):
                bc = (e.operand, d) in self.broadcast
                ext = L.Const(1) if bc else (self.size(v) if v in self.spec else L.Var(
                    self.param(f"t{e.operand}_s{d}", "scalar", "i64", "dim", operand=e.operand, level=d)))
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
