"""Loops on explicit vectors, for the lowering (``lower``): groups of a loop's entries taken a vector's lanes at
a time, a loop of lane writes made one vector store, and a sum over a row's entries held in one vector of
partial sums (SpMV's row sum). They build loop IR from loop IR and nest items (``("for", var, lo, hi,
parallel)``, ``("let", var, value)``, ``("if", cond)``), and know nothing of formats or einsum indices."""
from __future__ import annotations

from .. import loopir as L


def in_groups(lo, hi, size, name, body):
    """``(loop, start)``: a loop over the whole groups of ``size`` in ``[lo, hi)`` running ``body(base)`` (a list of
    statements; ``base`` the group's first position, ``<name>_base``), and the first position past the last whole
    group (the entries left over, for the caller's loop)."""
    k, base = L.Var(f"{name}_k"), L.Var(f"{name}_base")
    full = L.binary("div", L.binary("sub", hi, lo), L.Const(size))
    loop = L.For(k, L.Const(0), full, L.block(L.Let(base, L.binary("add", lo, L.binary("mul", k, L.Const(size)))),
                                               *body(base)))
    return loop, L.binary("add", lo, L.binary("mul", full, L.Const(size)))


def inlined(lets, *exprs) -> tuple:
    """``exprs`` with the variables of the nest items ``lets`` (``("let", var, value)``, in order, each value able to
    read the earlier ones) replaced by their values."""
    env = {}
    for it in lets:
        env[it[1].name] = L.substitute(it[2], env)
    return tuple(L.substitute(e, env) for e in exprs)


def lane_store(lets, u, lanes, out, index, value, ct):
    """``for u in [0, lanes): out[index] = value`` (after ``lets``) as one vector store, the lets inlined, when
    the index is ``u`` plus a constant offset and the value is arithmetic on ``ct`` loads contiguous in ``u`` (or
    not depending on it) and scalars; else None."""
    index, value = inlined(lets, index, value)

    def plain(e):
        if isinstance(e, L.Const):
            return True
        if isinstance(e, L.Var):
            return e.name != u.name and e.type == ct
        if isinstance(e, L.Load):
            return e.type == ct and L.coefficient(e.index, u.name) in (0, 1)
        return isinstance(e, L.Binary) and e.op in ("add", "sub", "mul", "div") and e.type == ct \
            and plain(e.a) and plain(e.b)

    if L.coefficient(index, u.name) != 1 or not plain(value):
        return None
    return L.For(u, L.Const(0), L.Const(lanes), L.block(L.Store(out, index, value)), vector=lanes)


def vector_sum(rest, value, lanes, ct, lead=None, lead_gathers=True):
    """``(statements, total)``: the sum of ``value`` over the loop ``rest[0]`` (followed by lets only, inlined) in
    one vector of partial sums, where every load that varies along the loop is contiguous in it or read at
    positions that an integer array holds contiguously (a gather: SpMV's ``x[crd[p]]``), and the arithmetic is
    add/sub/mul/div on ``ct``. The loop's last vector is partial (``For.tail``): a row's variable length costs no
    scalar loop, whose exit the branch predictor misses about once a row (SpMV on a 20k matrix of ~20 entries a
    row, one thread: 438 -> 348 us, measured by hand). The sum is reassociated (lane by lane). ``lead``: the
    loop's expected trip count, for ``For.lead``, made by calling ``lead()`` (it adds a kernel argument), not where
    the sum gathers and ``lead_gathers`` is False (``target.native_lead_gathers``). Else None."""
    if not rest or rest[0][0] != "for" or rest[0][4] is not None or any(it[0] != "let" for it in rest[1:]):
        return None
    _, pv, lo, hi, _ = rest[0]
    (value,) = inlined(rest[1:], value)

    def vectorizable(e):
        if isinstance(e, L.Const):
            return True
        if isinstance(e, L.Var):
            return e.name != pv.name
        if isinstance(e, L.Load):
            if not L.depends(e.index, pv.name):
                return True
            return e.type == ct and (L.coefficient(e.index, pv.name) == 1 or L.gathered(e.index, pv.name) is not None)
        if isinstance(e, L.Cast):
            return not L.depends(e.a, pv.name)
        return isinstance(e, L.Binary) and e.op in ("add", "sub", "mul", "div") and e.type == ct \
            and vectorizable(e.a) and vectorizable(e.b)

    if not L.depends(value, pv.name) or not vectorizable(value):
        return None
    gathers = any(L.gathered(ld.index, pv.name) is not None for ld in L.loads(value))
    return [L.LocalArray("vsum", ct, 1, L.Const(0, ct), sums=lanes),
            L.For(pv, lo, hi, L.block(L.Store("vsum", L.Const(0), value, "add")), vector=lanes, tail=True,
                  lead=lead() if lead is not None and (lead_gathers or not gathers) else None)], \
        L.Load("vsum", L.Const(0), ct)
