"""Parsing einsum equations into index notation.

The equation is validated against its grammar (letters, ``,``, ``->``, ``...``, spaces) before anything
else: no part of it ever reaches generated source, which uses index names the compiler makes itself.
"""
from __future__ import annotations

import functools
import re

from .ir import Access, Mul

_EQ = re.compile(r"^[A-Za-z.,\- >]*$")


def equation(inputs, out) -> str:
    """The einsum string of parsed index letters: ``(("i", "j"), ("j", "k")), ("i", "k")`` -> ``"ij,jk->ik"``."""
    return ",".join("".join(i) for i in inputs) + "->" + "".join(out)


def parse(equation: str, ndims) -> tuple:
    if not isinstance(equation, str):
        raise TypeError(f"einsum equation must be a string, got {type(equation).__name__}")
    return _parse(equation, tuple(ndims))


@functools.lru_cache(maxsize=1024)
def _parse(equation: str, ndims) -> tuple:
    """``(inputs, output)``: the index letters of every operand and of the result, ``...`` expanded.

    Implicit output (no ``->``) is the letters used exactly once, sorted, as in ``torch.einsum``.
    Raises ``ValueError`` saying what is wrong with the equation.
    """
    if not isinstance(equation, str):
        raise TypeError(f"einsum equation must be a string, got {type(equation).__name__}")
    if not _EQ.match(equation):
        bad = next(c for c in equation if not re.match(r"[A-Za-z.,\- >]", c))
        raise ValueError(f"einsum equation {equation!r}: invalid character {bad!r}")
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        raise ValueError(f"einsum equation {equation!r}: more than one '->'")
    lhs, arrow, rhs = eq.partition("->")
    if ("-" in lhs or ">" in lhs) or ("-" in rhs or ">" in rhs):
        raise ValueError(f"einsum equation {equation!r}: '-' and '>' may only appear together as '->'")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum equation {equation!r} has {len(terms)} operand(s) but {len(ndims)} were given")
    used = set(lhs.replace(".", ""))
    ell_letters = [c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in used and c not in rhs]
    ell_dims = []
    for t, nd in zip(terms, ndims):
        if t.count("...") > 1 or t.replace("...", "").count("."):
            raise ValueError(f"einsum equation {equation!r}: malformed ellipsis in {t!r}")
        k = nd - (len(t) - 3) if "..." in t else 0
        if k < 0:
            raise ValueError(f"einsum equation {equation!r}: operand {t!r} has more indices than its"
                             f" {nd} dimensions")
        ell_dims.append(k)
    n_ell = max(ell_dims, default=0)
    ell = ell_letters[:n_ell]
    inputs = []
    for t, nd, k in zip(terms, ndims, ell_dims):
        t = t.replace("...", "".join(ell[n_ell - k:]))  # right-aligned, as broadcasting is
        if len(t) != nd:
            raise ValueError(f"einsum equation {equation!r}: operand {len(inputs)} is indexed by {t!r}"
                             f" ({len(t)} indices) but has {nd} dimensions")
        inputs.append(tuple(t))
    if arrow:
        if rhs.count("...") > 1 or rhs.replace("...", "").count("."):
            raise ValueError(f"einsum equation {equation!r}: malformed ellipsis in the output")
        out = rhs.replace("...", "".join(ell))
        for c in out:
            if not any(c in t for t in inputs):
                raise ValueError(f"einsum equation {equation!r}: output index {c!r} does not appear in the inputs")
        if len(set(out)) != len(out):
            raise ValueError(f"einsum equation {equation!r}: output index repeated")
    else:
        counts = {}
        for t in inputs:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = "".join(ell) + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    return tuple(inputs), tuple(out)


def to_index_notation(inputs) -> Mul:
    return Mul(tuple(Access(k, t) for k, t in enumerate(inputs)))
