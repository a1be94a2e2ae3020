"""Merge lattices, in the compact form scorch uses: the condition under which an expression can be nonzero,
as a boolean formula over which sparse operands have an entry at the current coordinate.

A product needs every factor (intersection: ``and``), a sum needs any term (union: ``or``), a zero-preserving
map needs its argument, a dense operand or a scalar is always there. At each co-iterated loop the formula,
restricted to the operands iterated there, decides the loop: a plain loop over one operand when the others
cannot make the result nonzero without it, a two-way merge otherwise, and a dense loop when the result can be
nonzero where no iterated operand has an entry.
"""
from __future__ import annotations

from .. import loopir as L
from .ir import Access, Add, Map, Mul, Scalar

TRUE = True


def presence(e, operands):
    """The formula for ``e``: ``True``, ``("op", k)``, ``("and", (...))`` or ``("or", (...))``."""
    if isinstance(e, Access):
        return ("op", e.operand) if operands[e.operand].sparse else TRUE
    if isinstance(e, Mul):
        return _and([presence(f, operands) for f in e.factors])
    if isinstance(e, Add):
        return _or([presence(t, operands) for t in e.terms])
    if isinstance(e, Map):
        return presence(e.arg, operands)
    if isinstance(e, Scalar):
        return TRUE
    raise TypeError(f"unknown index expression {type(e).__name__}")


def _and(fs):
    fs = [f for f in fs if f is not TRUE]
    if any(f is False for f in fs):
        return False
    return TRUE if not fs else fs[0] if len(fs) == 1 else ("and", tuple(fs))


def _or(fs):
    if any(f is TRUE for f in fs):
        return TRUE
    fs = [f for f in fs if f is not False]
    return False if not fs else fs[0] if len(fs) == 1 else ("or", tuple(fs))


def restrict(f, keep):
    """``f`` with the operands outside ``keep`` taken as present (they are decided at other loops)."""
    if f is TRUE or f is False:
        return f
    if f[0] == "op":
        return f if f[1] in keep else TRUE
    parts = [restrict(g, keep) for g in f[1]]
    return _and(parts) if f[0] == "and" else _or(parts)


def evaluate(f, present: dict) -> bool:
    if f is TRUE or f is False:
        return f
    if f[0] == "op":
        return present.get(f[1], True)
    vals = [evaluate(g, present) for g in f[1]]
    return all(vals) if f[0] == "and" else any(vals)


def emit(f, flags: dict) -> L.Expr:
    """The formula as a loop-IR boolean expression over ``flags`` (operand -> bool expression)."""
    if f is TRUE or f is False:
        return L.Const(bool(f), "bool")
    if f[0] == "op":
        return flags.get(f[1], L.Const(True, "bool"))
    parts = [emit(g, flags) for g in f[1]]
    out = parts[0]
    for p in parts[1:]:
        out = L.binary(f[0], out, p)
    return out
