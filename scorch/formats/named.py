"""Named formats, and the resolution of format specs (``"csr"``, ``"bsr(2, 3)"``, ``"nm(2, 4)"``, a ``Format``)
for a tensor.

Every named format is an ordinary ``Format``: a name is only a shorthand for its text.
"""
from __future__ import annotations

import functools
import re

from .expr import Div, Mod, Sub, Var, check_size
from .format import Format, install_names, nm_levels, nm_size, remember
from .levels import Compressed, Dense, Fixed, Singleton


def dense_nd(ndim: int) -> Format:
    return Format.from_levels(ndim, [(Var(d), Dense()) for d in range(ndim)])


@functools.lru_cache(maxsize=128)
def coo_nd(ndim: int, coalesced: bool = True, dense_dim: int = 0) -> Format:
    """N-d COO: a non-unique compressed level for the first dimension, singletons for the rest.
    ``coalesced=False`` gives the unsorted form with duplicates that torch's uncoalesced COO has.
    ``dense_dim``: the last ``dense_dim`` dimensions are dense levels under each entry (torch's hybrid COO,
    ``sparse_dim = ndim - dense_dim``; its values ``(nnz, *dense sizes)`` are the flat values here)."""
    sparse = ndim - dense_dim
    if not 0 < sparse <= ndim:
        raise ValueError(f"a COO format needs at least one sparse dimension: ndim={ndim}, dense_dim={dense_dim}")
    if coalesced:
        first = Compressed(unique=sparse == 1)
        rest = [Singleton(unique=d == sparse - 1) for d in range(1, sparse)]
    else:
        first = Compressed(unique=False, ordered=False)
        rest = [Singleton(unique=False, ordered=False) for _ in range(1, sparse)]
    rest += [Dense() for _ in range(dense_dim)]
    return Format.from_levels(ndim, [(Var(0), first)] + [(Var(d), lv) for d, lv in enumerate(rest, 1)])


def hybrid_coo_dims(fmt: Format):
    """``(dense_dim, coalesced)`` when ``fmt`` is a COO format (``coo_nd``, hybrid or not), else None."""
    n = fmt.ndim
    dense = 0
    while dense < n - 1 and isinstance(fmt.level_types[n - 1 - dense], Dense):
        dense += 1
    for coalesced in (True, False):
        if len(fmt.levels) == n and coo_nd(n, coalesced, dense) == fmt:
            return dense, coalesced
    return None


def csf(ndim: int) -> Format:
    """Compressed sparse fiber: every level compressed."""
    return Format.from_levels(ndim, [(Var(d), Compressed()) for d in range(ndim)])


def _check_block(name, bh, bw):
    for n in (bh, bw):
        check_size(n, "block sizes", f"{name}({bh}, {bw})")


def bsr(bh: int, bw: int) -> Format:
    """Block CSR with ``bh x bw`` blocks, each stored dense and row-major (torch's BSR layout)."""
    _check_block("bsr", bh, bw)
    return Format(f"(i, j) -> (i / {bh} : dense, j / {bw} : compressed, i % {bh} : dense, j % {bw} : dense)")


def bsc(bh: int, bw: int) -> Format:
    """Block CSC with ``bh x bw`` blocks, each stored dense and row-major (torch's BSC layout)."""
    _check_block("bsc", bh, bw)
    return Format(f"(i, j) -> (j / {bw} : dense, i / {bh} : compressed, i % {bh} : dense, j % {bw} : dense)")


@functools.lru_cache(maxsize=64, typed=True)
def nm(n: int, m: int) -> Format:
    """n:m structured sparsity (e.g. 2:4): every group of ``m`` consecutive columns of a row stores exactly ``n``
    (column offset, value) slots, padded where the group has fewer entries. The number of columns must be a
    multiple of ``m``; a tensor with more than ``n`` nonzeros in a group must be pruned before conversion.
    Offsets are stored as int32 (int64 for huge tensors): scorch's index arrays are int32 or int64."""
    _check_nm(n, m, f"nm({n}, {m})")
    return Format.from_levels(2, nm_levels(n, m))


def _check_nm(n, m, spec):
    for x in (n, m):
        check_size(x, "n and m", repr(spec))
    if n > m:
        raise ValueError(f"format {spec!r}: n ({n}) cannot exceed the group size m ({m}); n:m stores n of every m")


dense = dense_nd(2)
coo = coo_nd(2)
csr = Format("(i, j) -> (i : dense, j : compressed)")
csc = Format("(i, j) -> (j : dense, i : compressed)")
dcsr = Format("(i, j) -> (i : compressed, j : compressed)")
dcsc = Format("(i, j) -> (j : compressed, i : compressed)")
#: ELLPACK: every row stores the same number of (column, value) slots, padded
ell = Format.from_levels(2, [(Var(0), Dense()), (Var(1), Fixed())])
#: diagonal: a compressed list of diagonal offsets, each diagonal stored dense along the rows
dia = Format.from_levels(2, [(Sub(1, 0), Compressed()), (Var(0), Dense())])

_FIXED = {"csr": csr, "csc": csc, "dcsr": dcsr, "dcsc": dcsc, "ell": ell, "dia": dia}
_BY_NDIM = {"dense": dense_nd, "coo": coo_nd, "csf": csf}
_BLOCKED = {"bsr": bsr, "bsc": bsc}
_SPEC = re.compile(r"^\s*([a-z]+)\s*(?:\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\))?\s*$")

NAMES = tuple(_FIXED) + tuple(_BY_NDIM) + tuple(_BLOCKED) + ("nm",)


def resolve(spec, ndim: int | None = None) -> Format:
    """The ``Format`` a spec names for an ``ndim``-d tensor.

    ``spec`` is a ``Format``, format text ``"(i, j) -> (...)"``, or a name: ``dense``, ``coo``, ``csf``
    (any ndim), ``csr``, ``csc``, ``dcsr``, ``dcsc``, ``ell``, ``dia`` (2-d), ``bsr(bh, bw)``, ``bsc(bh, bw)``,
    ``nm(n, m)``.
    """
    if isinstance(spec, Format):
        fmt = spec
    elif isinstance(spec, str):
        fmt = _from_string(spec, ndim)
    else:
        raise TypeError(f"a format is a scorch.Format or a string, got {type(spec).__name__}")
    if ndim is not None and fmt.ndim != ndim:
        raise ValueError(f"format {spec!r} is for {fmt.ndim}-d tensors, but the tensor is {ndim}-d")
    return fmt


@functools.lru_cache(maxsize=512)
def _from_string(spec, ndim):
    if "->" in spec:
        return Format(spec)
    m = _SPEC.match(spec.lower())
    if not m or m.group(1) not in NAMES:
        raise ValueError(f"unknown format {spec!r}: expected one of {', '.join(NAMES)}, 'bsr(bh, bw)', 'nm(n, m)',"
                         " or format text such as '(i, j) -> (i : dense, j : compressed)'")
    name, a, b = m.group(1), m.group(2), m.group(3)
    if name == "nm":
        if a is None or b is None:
            raise ValueError(f"format {spec!r} needs n and m (n of every m columns stored), e.g. 'nm(2, 4)'")
        _check_nm(int(a), int(b), spec)
        return nm(int(a), int(b))
    if name in _BLOCKED:
        if a is None:
            raise ValueError(f"format {name!r} needs a block size, e.g. '{name}(2, 2)'")
        return _BLOCKED[name](int(a), int(b if b is not None else a))  # (which checks the sizes)
    if a is not None:
        raise ValueError(f"format {name!r} takes no arguments, got {spec!r}")
    if name in _BY_NDIM:
        return _BY_NDIM[name](2 if ndim is None else ndim)
    return _FIXED[name]


def name_of(fmt: Format) -> str | None:
    """The name of ``fmt`` if it is a named format, else None."""
    for name, f in _FIXED.items():
        if f == fmt:
            return name
    for name, make in _BY_NDIM.items():
        if make(fmt.ndim) == fmt:
            return name
    nmsize = nm_size(fmt)
    if nmsize is not None:
        return f"nm({nmsize[0]}, {nmsize[1]})"
    if fmt.ndim == 2 and len(fmt.levels) == 4:
        e = fmt.exprs
        if isinstance(e[0], Div):
            bh, bw = (e[0].block, e[1].block) if e[0].dim == 0 else (e[1].block, e[0].block)
            for name in _BLOCKED:
                if _BLOCKED[name](bh, bw) == fmt:
                    return f"{name}({bh}, {bw})"
    return None


def block_size(fmt: Format):
    """``(bh, bw)`` for bsr/bsc formats, else None."""
    name = name_of(fmt)
    if name and name.startswith(("bsr", "bsc")):
        e = [x for x in fmt.exprs if isinstance(x, Mod)]
        return e[0].block, e[1].block
    return None


def short_name(fmt: Format) -> str:
    """The name for display: the format's name, ``coo (uncoalesced)``, ``coo (hybrid, dense_dim=k)``, or its
    text."""
    coo = hybrid_coo_dims(fmt)
    if coo is not None and coo != (0, True):
        dense, coalesced = coo
        return "coo (" + ", ".join(([] if coalesced else ["uncoalesced"]) + (
            [f"hybrid, dense_dim={dense}"] if dense else [])) + ")"
    return name_of(fmt) or str(fmt)


install_names(resolve, name_of)  # Format("csr"), Format.name
remember(dense, coo, csr, csc, dcsr, dcsc, ell, dia, dense_nd(1), dense_nd(3), coo_nd(1), coo_nd(3))
