"""Fusion of loop-IR kernels that share their parallel loop over a pattern's rows.

Kernels lowered from different expressions over the same compressed pattern (an SDDMM writing values on the
pattern, a softmax within each row, an SpMM reading those values) each loop over the rows in parallel, and row
``i`` of a later kernel reads only what row ``i`` of the earlier ones wrote. ``rows`` concatenates their row
bodies under one parallel loop: one pass over the rows instead of one per kernel, and a row's intermediate values
are still in the cache when the next body reads them.

Each part comes with a map from its parameters to the fused kernel's: parameters mapped to the same name are one
argument (the pattern's arrays, an intermediate written by one part and read by the next); the others get a
prefix of their part. Local names (variables, workspaces) get a suffix of their part, except the row variable,
which all parts share. The parts' row loops must agree (bounds and parallel schedule, after the renaming):
``rows`` raises ``ValueError`` otherwise, and the caller runs the kernels one by one.

``softmax_rows`` (and ``softmax_backward_rows``) is the row softmax as loop IR, so that it can be one of the parts.
Passes over a fused kernel use what only the fused kernel knows: ``localize`` moves intermediates that a row
writes and reads itself into per-thread row buffers, ``constant`` folds in an array known to be constant (a
pattern's ones), ``scale_stores`` multiplies what is stored into an array (a scale, a row's normalization),
``track_max`` keeps the max of the values stored into an array as partial maxima, for a later part to read,
``retype`` changes the type an array holds (a 16-bit one widened as it is read; an intermediate of 16-bit values
in a float32 buffer instead).
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

from .. import loopir as L


def rename(node, names: dict):
    """``node`` (an expression or statement) with variables and arrays renamed by ``names`` (name -> name)."""
    def renamed(e):
        if isinstance(e, L.Var):
            return replace(e, name=names.get(e.name, e.name))
        changes = {f: names.get(getattr(e, f), getattr(e, f)) for f in ("array", "name", "pos", "scratch")
                   if isinstance(getattr(e, f, None), str)}
        if hasattr(e, "reductions"):
            changes["reductions"] = tuple((op, names.get(n, n)) for op, n in e.reductions)
        return replace(e, **changes) if changes else None
    return _rewrite(node, renamed)


def _locals(stmt) -> set:
    """Names a statement declares: variables, loop variables, workspaces."""
    out = set()
    for s in L.walk(stmt):
        if isinstance(s, (L.Let, L.Decl)):
            out.add(s.var.name)
        elif isinstance(s, L.For):
            out.add(s.var.name)
            if s.parallel is not None and s.parallel.setup is not None:
                out |= _locals(s.parallel.setup)
        elif isinstance(s, (L.LocalArray, L.Alloc, L.SumLanes)):
            out.add(s.name)
    return out


def _row_loop(kernel) -> L.For:
    stmts = kernel.body.stmts
    if len(stmts) != 1 or not isinstance(stmts[0], L.For) or stmts[0].parallel is None:
        raise NotOneLoop(f"kernel {kernel.name}: its body is not one parallel row loop")
    return stmts[0]


class NotOneLoop(ValueError):
    """The parts do not run under one row loop (their loops differ: a DCSR pattern's SDDMM walks its stored rows,
    the softmax every row): the caller runs them op by op."""


def rows(name: str, parts) -> L.Kernel:
    """One kernel running the row bodies of ``parts`` (``(kernel, {param: fused name})`` pairs) in order under
    one parallel row loop."""
    params, bodies, first = {}, [], None
    for n, (kernel, mapping) in enumerate(parts):
        loop = _row_loop(kernel)
        names = {p.name: mapping.get(p.name, f"f{n}_{p.name}") for p in kernel.params}
        names.update({v: f"{v}_f{n}" for v in _locals(loop.body)})
        names[loop.var.name] = "row"
        for p in kernel.params:
            fused = names[p.name]
            old = params.get(fused)
            if old is not None and (old.kind, old.type) != (p.kind, p.type):
                raise ValueError(f"fused parameter {fused}: {old.kind} {old.type} and {p.kind} {p.type}")
            params[fused] = L.Param(fused, p.kind, p.type, p.output or (old is not None and old.output))
        loop = rename(loop, names)
        if first is None:
            first = loop
        elif (loop.lo, loop.hi, loop.parallel) != (first.lo, first.hi, first.parallel):
            raise NotOneLoop(f"kernel {kernel.name}: its row loop differs from the first part's")
        bodies.append(loop.body)
    return L.Kernel(name, tuple(params.values()), L.block(replace(first, body=L.block(*bodies))))


def _rewrite(node, fn):
    """``node`` rebuilt bottom-up with ``fn`` applied to every expression and statement in it: ``fn`` returns a
    replacement, or None to keep the node."""
    if isinstance(node, tuple):
        return tuple(_rewrite(n, fn) for n in node)
    if not is_dataclass(node) or isinstance(node, L.Param):
        return node
    changes = {f.name: _rewrite(getattr(node, f.name), fn) for f in fields(node)
               if isinstance(getattr(node, f.name), (L.Expr, L.Stmt, L.Parallel, tuple))}
    node = replace(node, **changes) if changes else node
    return fn(node) or node


def constant(kernel: L.Kernel, array: str, value) -> L.Kernel:
    """``kernel`` with the array parameter ``array`` known to hold ``value`` everywhere (an SDDMM's sampled
    pattern of ones): its loads become the constant and the parameter goes."""
    t = next(p.type for p in kernel.params if p.name == array)
    body = _rewrite(kernel.body, lambda e: L.Const(value, t) if isinstance(e, L.Load) and e.array == array else None)
    return L.Kernel(kernel.name, tuple(p for p in kernel.params if p.name != array), body)


def retype(kernel: L.Kernel, array: str, t: str) -> L.Kernel:
    """``kernel`` with the array parameter ``array`` holding values of type ``t``: its loads read ``t`` and give
    its compute type (a 16-bit array widened, ``Cast`` to ``f32``; a widening made needless by ``t = f32``
    dropped), and its stores round into ``t`` (the code generators' rule). With 16-bit values, an intermediate
    that one part writes and the next reads is made a float32 array so (then a row buffer, ``localize``): its
    values are not rounded between the parts."""
    ct = L.compute_type(t)

    def typed(e):
        if isinstance(e, L.Load) and e.array == array:
            return L.Cast(replace(e, type=t), ct) if t != ct else replace(e, type=t)
        if isinstance(e, L.Cast) and e.type == e.a.type and any(ld.array == array for ld in L.loads(e.a)):
            return e.a  # (a widening made needless, or made twice)
        return None
    params = tuple(replace(p, type=t) if p.name == array else p for p in kernel.params)
    return L.Kernel(kernel.name, params, _rewrite(kernel.body, typed))


def _reindex(node, arrays: dict, base):
    """``node`` with every load and store of an array in ``arrays`` (name -> new name) moved to the new name, at
    its index minus ``base``."""
    return _rewrite(node, lambda e: replace(e, array=arrays[e.array], index=L.binary("sub", e.index, base))
                    if isinstance(e, (L.Load, L.Store)) and e.array in arrays else None)


def localize(kernel: L.Kernel, arrays, itype: str) -> L.Kernel:
    """``kernel`` (one parallel loop over a CSR pattern's rows, as ``rows`` makes it) with the intermediates
    ``arrays``, which row ``i`` writes and reads at its own positions ``pos[i]..pos[i + 1]`` only, in buffers
    private to each thread of ``longest`` entries (a new parameter: the longest row) indexed from the row's
    first position, instead of arrays over every position: a row's intermediates stay in L1, and nothing of the
    size of the pattern is written. The interpreter bounds-checks the buffers."""
    loop = _row_loop(kernel)
    types = {p.name: p.type for p in kernel.params}
    names = {a: f"{a}_row" for a in arrays}
    base = L.Var("row_base")
    start = L.Cast(L.Load("t0_l1_pos", L.binary("sub", loop.var, L.Var("t0_l0_lo")), itype), "i64")
    setup = tuple(L.Alloc(names[a], types[a], L.Var("longest")) for a in arrays)
    if loop.parallel.setup is not None:
        setup = loop.parallel.setup.stmts + setup
    body = L.block(L.Let(base, start), *_reindex(loop.body, names, base).stmts)
    loop = replace(loop, body=body, parallel=replace(loop.parallel, setup=L.block(*setup)))
    params = tuple(p for p in kernel.params if p.name not in names) + (L.Param("longest", "scalar", "i64"),)
    return L.Kernel(kernel.name, params, L.block(loop))


def track_max(kernel: L.Kernel, array: str, name: str, vtype: str, lanes: int) -> L.Kernel:
    """``kernel`` (one parallel row loop) with the max of the values each row stores into ``array`` kept in
    ``name``: partial maxima (one vector, -inf to start with, declared at the top of the row body) that each
    store into ``array`` also takes part in, so that a later part of the row reads the max (``Load(name, 0)``)
    instead of making a pass over the values."""
    loop = _row_loop(kernel)
    zero = L.Const(0)

    def also_max(node):
        if not isinstance(node, L.Block):
            return None
        stmts = []
        for st in node.stmts:
            stmts.append(st)
            if isinstance(st, L.Store) and st.array == array:
                stmts.append(L.Store(name, zero, st.value, "max"))
        return L.Block(tuple(stmts))

    body = L.block(L.LocalArray(name, vtype, 1, L.Const(float("-inf"), vtype), sums=lanes, combine="max"),
                   _rewrite(loop.body, also_max))
    return L.Kernel(kernel.name, kernel.params, L.block(replace(loop, body=body)))


#: rows shorter than this many entries run the segment softmax kernels' loops without ``omp simd``: GCC's simd loop
#: with a reduction costs more than it saves on a few entries (a graph's rows, ~5 on Cora: 2.4x slower than plain)
SHORT_ROW = 16


def _short_or_long(row, short: int):
    """``row(simd)`` (a row body), the plain loops for rows of fewer than ``short`` entries (0: always simd)."""
    if not short:
        return row(True)
    length = L.binary("sub", L.Var("hi"), L.Var("lo"))
    return L.block(L.If(L.binary("lt", length, L.Const(short)), row(False), row(True)))


def softmax_rows(vtype: str, itype: str, normalize: bool = True, peak_of: str = None, log: bool = False,
                 short: int = 0, rounded: str = None) -> L.Kernel:
    """``y[p] = softmax(scale * x[p])`` within each row ``[pos[i], pos[i + 1])`` of a CSR pattern, as the row loop
    the lowering makes for CSR (parameters named as for operand 0: ``t0_l0_lo``, ``t0_l0_ext``, ``t0_l1_pos``).
    A row whose scaled entries are all -inf (or NaN) gives NaN, as torch's softmax does. ``normalize=False``:
    ``y`` holds the exponentials only and the row's ``inv`` (a variable of the row body, 0 for an empty row) the
    factor that normalizes them, for a later part to apply to what it makes of them (``scale_stores``).
    ``peak_of``: the values come scaled already (no ``scale`` parameter), and their max is read from the partial
    maxima of that name (``track_max``) instead of a pass over them. ``log``: ``y`` the log-softmax,
    ``scale * x[p] - peak - log(total)``. ``short``: rows of fewer entries run plain loops (``_short_or_long``).
    ``rounded`` (a 16-bit type; with ``normalize``): the normalized values are also stored into ``y16`` of that
    type, rounded once, ``y`` being an intermediate of ``vtype`` (float32) for a later part to read."""
    p, lo, hi = L.Var("p"), L.Var("lo"), L.Var("hi")
    peak, total, inv, e = L.Var("peak", vtype), L.Var("total", vtype), L.Var("inv", vtype), L.Var("e", vtype)
    x = L.Load("x", p, vtype) if peak_of else L.binary("mul", L.Load("x", p, vtype), L.Var("scale", vtype))
    ninf, zero = L.Const(float("-inf"), vtype), L.Const(0.0, vtype)

    def row(simd):
        return L.block(
            L.Decl(peak, L.Load(peak_of, L.Const(0), vtype)) if peak_of else L.Decl(peak, ninf),
            None if peak_of else
            L.For(p, lo, hi, L.block(L.Assign(peak, x, "max")), simd=simd, reductions=(("max", "peak"),)),
            L.If(L.Unary("not", L.binary("gt", peak, ninf), "bool"), L.block(L.Assign(peak, zero))),
            L.Decl(total, zero),
            L.For(p, lo, hi, L.block(
                L.Let(e, L.Unary("exp", L.binary("sub", x, peak), vtype)),
                L.Store("y", p, e),
                L.Assign(total, e, "add")), simd=simd, reductions=(("add", "total"),)),
            L.Assign(inv, L.binary("div", L.Const(1.0, vtype), total)),
            L.For(p, lo, hi, L.block(L.Store("y", p, L.binary("mul", L.Load("y", p, vtype), inv)),
                                     _rounded(rounded, "y16", p, L.Load("y", p, vtype))), simd=simd)
            if normalize and not log else None,
            L.For(p, lo, hi, L.block(L.Store("y", p, L.binary("sub", L.binary("sub", x, peak),
                                                                L.Unary("log", total, vtype)))), simd=simd)
            if log else None,
        )
    return row_kernel("scorch_softmax_rows", itype, _csr_row(itype, _short_or_long(row, short), L.Decl(inv, zero)), (
        L.Param("x", "array", vtype), L.Param("y", "array", vtype, output=True)) +
        (() if peak_of else (L.Param("scale", "scalar", vtype),)) + _rounded_param(rounded, "y16"))


def _rounded(t, array, p, value):
    """``array[p] = value`` where ``t`` (a 16-bit type) is given: a store that rounds once; else nothing."""
    return L.Store(array, p, value) if t else None


def _rounded_param(t, array) -> tuple:
    return (L.Param(array, "array", t, output=True),) if t else ()


def softmax_backward_rows(vtype: str, itype: str, log: bool = False, short: int = 0, rounded: str = None) -> L.Kernel:
    """``dx[p] = scale * y[p] * (g[p] - sum of y * g over the row)``: the gradient of the row softmax's input (times
    ``scale``) from its output ``y`` and the output's gradient ``g``, as a CSR row loop like ``softmax_rows``.
    ``log``: of the log-softmax, ``dx[p] = scale * (g[p] - exp(y[p]) * sum of g over the row)``. ``short`` and
    ``rounded`` (``dx`` also stored into ``dx16``): as for ``softmax_rows``."""
    p, lo, hi, t = L.Var("p"), L.Var("lo"), L.Var("hi"), L.Var("t", vtype)
    y, g, scale = L.Load("y", p, vtype), L.Load("g", p, vtype), L.Var("scale", vtype)
    dx = L.binary("mul", scale, L.binary("sub", g, L.binary("mul", L.Unary("exp", y, vtype), t))) if log else \
        L.binary("mul", L.binary("mul", scale, y), L.binary("sub", g, t))

    def row(simd):
        return L.block(
            L.Decl(t, L.Const(0.0, vtype)),
            L.For(p, lo, hi, L.block(L.Assign(t, g if log else L.binary("mul", y, g), "add")), simd=simd,
                  reductions=(("add", "t"),)),
            L.For(p, lo, hi, L.block(L.Store("dx", p, dx), _rounded(rounded, "dx16", p, L.Load("dx", p, vtype))),
                  simd=simd))
    return row_kernel("scorch_softmax_backward_rows", itype, _csr_row(itype, _short_or_long(row, short)), (
        L.Param("y", "array", vtype), L.Param("g", "array", vtype), L.Param("dx", "array", vtype, output=True),
        L.Param("scale", "scalar", vtype)) + _rounded_param(rounded, "dx16"))


def _csr_row(itype: str, row: L.Block, *before) -> L.Block:
    """The body of a CSR row loop (row variable ``c0``) running ``row`` on the row's positions ``[lo, hi)``
    when it has any, after the statements ``before``."""
    c0, p0, lo, hi = L.Var("c0"), L.Var("p0"), L.Var("lo"), L.Var("hi")
    return L.block(
        L.Let(p0, L.binary("sub", c0, L.Var("t0_l0_lo"))),
        L.Let(lo, L.Cast(L.Load("t0_l1_pos", p0, itype), "i64")),
        L.Let(hi, L.Cast(L.Load("t0_l1_pos", L.binary("add", p0, L.Const(1)), itype), "i64")),
        *before,
        L.If(L.binary("lt", lo, hi), row))


def scale_stores(kernel: L.Kernel, array: str, factor: L.Expr) -> L.Kernel:
    """``kernel`` with every value it stores into ``array`` multiplied by ``factor`` (a row's normalizing factor
    applied to a product's output row instead of to each entry it read)."""
    body = _rewrite(kernel.body, lambda s: replace(s, value=L.Binary("mul", s.value, factor, s.value.type))
                    if isinstance(s, L.Store) and s.array == array else None)
    return L.Kernel(kernel.name, kernel.params, body)


def add_stores(kernel: L.Kernel, array: str, addend: str, vtype: str) -> L.Kernel:
    """``kernel`` with ``addend[i]`` (an array of ``vtype`` values, read at the store's own index, in the stored
    value's type) added to every value it stores into ``array[i]``: an additive attention mask's values added to
    the scores as they are stored."""
    def add(s):
        if not isinstance(s, L.Store) or s.array != array:
            return None
        term = L.Load(addend, s.index, vtype)
        term = term if vtype == s.value.type else L.Cast(term, s.value.type)
        return replace(s, value=L.Binary("add", s.value, term, s.value.type))
    return L.Kernel(kernel.name, kernel.params + (L.Param(addend, "array", vtype),), _rewrite(kernel.body, add))


def row_kernel(name: str, itype: str, body: L.Block, params) -> L.Kernel:
    """A kernel of one parallel loop over a CSR pattern's rows (variable ``c0``, nnz-balanced by ``t0_l1_pos``),
    as the lowering makes it for operand 0, so that ``rows`` can fuse it with lowered kernels; ``params`` are the
    body's own besides the pattern's and ``nthreads``."""
    row_lo = L.Var("t0_l0_lo")
    loop = L.For(L.Var("c0"), row_lo, L.binary("add", row_lo, L.Var("t0_l0_ext")), body,
                 parallel=L.Parallel("nnz", "t0_l1_pos"))
    return L.Kernel(name, (L.Param("t0_l0_lo", "scalar", "i64"), L.Param("t0_l0_ext", "scalar", "i64"),
                           L.Param("t0_l1_pos", "array", itype)) + tuple(params) +
                    (L.Param("nthreads", "scalar", "i64"),), L.block(loop))
