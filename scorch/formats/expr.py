"""Coordinate expressions: what one storage level stores, as a function of the tensor's dimensions.

The grammar is deliberately small, because the compiler must invert every map and bound every level:
a dimension ``i``, a block split ``i / b`` and ``i % b``, a diagonal ``j - i`` and an anti-diagonal ``i + j``.
Dimensions are referred to by position, so formats compare by value whatever names the text used.
"""
from __future__ import annotations

from dataclasses import dataclass


#: The largest block size or number of slots a format may name. Kernels index with int32 or int64 and a block
#: or slot count multiplies into positions, so a larger one could only overflow (or allocate absurdly) later.
MAX_SIZE = 2**31 - 1


def check_size(n, what: str, spec) -> int:
    """``n`` as a block size or slot count: a positive int up to ``MAX_SIZE``, else ``ValueError`` naming the
    format ``spec`` (or ``TypeError`` for a non-integer)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format {spec}: {what} must be integers, got {n!r}")
    if not 0 < n <= MAX_SIZE:
        raise ValueError(f"format {spec}: {what} must be positive integers no larger than 2**31 - 1, got {n}")
    return n


def dim_name(d: int) -> str:
    """The canonical name of dimension ``d`` in rendered formats: i, j, k, l, m, n, then d6, d7..."""
    return "ijklmn"[d] if d < 6 else f"d{d}"


class CoordExpr:
    """Base of the coordinate expressions. Subclasses are frozen dataclasses (hashable, compared by value)."""

    def dims(self) -> tuple[int, ...]:
        raise NotImplementedError

    def evaluate(self, coords):
        """The level coordinate from the dimension coordinates (ints or integer tensors, indexed by dim)."""
        raise NotImplementedError

    def bounds(self, shape) -> tuple[int, int]:
        """The half-open range ``[lo, hi)`` of the level coordinate for a tensor of ``shape``."""
        raise NotImplementedError

    def render(self, names) -> str:
        raise NotImplementedError

    def renumber(self, new) -> "CoordExpr":
        """The same expression over other dimension numbers: dimension ``d`` becomes ``new[d]``."""
        fields = {k: (new[v] if k in ("dim", "a", "b") else v) for k, v in self.__dict__.items()}
        return type(self)(**fields)

    def __str__(self) -> str:
        return self.render([dim_name(d) for d in range(max(self.dims()) + 1)])


@dataclass(frozen=True)
class Var(CoordExpr):
    dim: int

    def dims(self):
        return (self.dim,)

    def evaluate(self, coords):
        return coords[self.dim]

    def bounds(self, shape):
        return 0, int(shape[self.dim])

    def render(self, names):
        return names[self.dim]


@dataclass(frozen=True)
class Div(CoordExpr):
    """``i / b``: the block index of dimension ``i`` for blocks of ``b``."""

    dim: int
    block: int

    def __post_init__(self):
        check_size(self.block, "block sizes", f"level {dim_name(self.dim)} / {self.block}")

    def dims(self):
        return (self.dim,)

    def evaluate(self, coords):
        return coords[self.dim] // self.block

    def bounds(self, shape):
        return 0, -(-int(shape[self.dim]) // self.block)

    def render(self, names):
        return f"{names[self.dim]} / {self.block}"


@dataclass(frozen=True)
class Mod(CoordExpr):
    """``i % b``: the offset of dimension ``i`` inside its block of ``b``. The level always spans ``b``."""

    dim: int
    block: int

    def __post_init__(self):
        check_size(self.block, "block sizes", f"level {dim_name(self.dim)} % {self.block}")

    def dims(self):
        return (self.dim,)

    def evaluate(self, coords):
        return coords[self.dim] % self.block

    def bounds(self, shape):
        return 0, self.block

    def render(self, names):
        return f"{names[self.dim]} % {self.block}"


@dataclass(frozen=True)
class Add(CoordExpr):
    """``i + j``: the anti-diagonal of dimensions ``a`` and ``b``."""

    a: int
    b: int

    def dims(self):
        return (self.a, self.b)

    def evaluate(self, coords):
        return coords[self.a] + coords[self.b]

    def bounds(self, shape):
        return 0, max(0, int(shape[self.a]) + int(shape[self.b]) - 1)

    def render(self, names):
        return f"{names[self.a]} + {names[self.b]}"


@dataclass(frozen=True)
class Sub(CoordExpr):
    """``j - i`` (``a - b``): the diagonal offset, negative below the main diagonal."""

    a: int
    b: int

    def dims(self):
        return (self.a, self.b)

    def evaluate(self, coords):
        return coords[self.a] - coords[self.b]

    def bounds(self, shape):
        lo = min(0, 1 - int(shape[self.b]))
        return lo, max(lo, int(shape[self.a]))

    def render(self, names):
        return f"{names[self.a]} - {names[self.b]}"


@dataclass(frozen=True)
class Recovery:
    """How one dimension is computed back from level coordinates (and dimensions recovered before it).

    ``kind`` is one of: ``level`` (``i = L[k]``), ``block`` (``i = L[k] * b + L[m]``), ``plus`` (``i = L[k] + x``),
    ``minus`` (``i = L[k] - x``), ``sub_from`` (``i = x - L[k]``), where ``x`` is the dimension ``other``.
    """

    dim: int
    kind: str
    level: int
    other_level: int = -1
    block: int = 0
    other: int = -1

    def evaluate(self, level_coords, dims):
        L = level_coords[self.level]
        if self.kind == "level":
            return L
        if self.kind == "block":
            return L * self.block + level_coords[self.other_level]
        x = dims[self.other]
        if self.kind == "plus":
            return L + x
        if self.kind == "minus":
            return L - x
        return x - L  # sub_from


def solve_inverse(exprs, ndim, names):
    """Find how to recover every dimension from the level coordinates, or say precisely why not.

    Returns the recoveries in an order where each only uses dimensions recovered before it.
    Raises ``ValueError`` naming the first dimension that cannot be recovered.
    """
    known: dict[int, Recovery] = {}
    order: list[Recovery] = []
    changed = True
    while changed and len(known) < ndim:
        changed = False
        for k, e in enumerate(exprs):
            rec = None
            if isinstance(e, Var) and e.dim not in known:
                rec = Recovery(e.dim, "level", k)
            elif isinstance(e, Div) and e.dim not in known:
                m = next((m for m, f in enumerate(exprs) if f == Mod(e.dim, e.block)), None)
                if m is not None:
                    rec = Recovery(e.dim, "block", k, other_level=m, block=e.block)
            elif isinstance(e, Add):
                if e.a in known and e.b not in known:
                    rec = Recovery(e.b, "minus", k, other=e.a)
                elif e.b in known and e.a not in known:
                    rec = Recovery(e.a, "minus", k, other=e.b)
            elif isinstance(e, Sub):
                if e.b in known and e.a not in known:
                    rec = Recovery(e.a, "plus", k, other=e.b)
                elif e.a in known and e.b not in known:
                    rec = Recovery(e.b, "sub_from", k, other=e.a)
            if rec is not None:
                known[rec.dim] = rec
                order.append(rec)
                changed = True
    for d in range(ndim):
        if d not in known:
            raise ValueError(f"the map is not invertible: dimension {names[d]} cannot be recovered from the levels"
                             f" ({_why_not(d, exprs, names)})")
    return tuple(order)


def _why_not(d, exprs, names):
    n = names[d]
    uses = [e for e in exprs if d in e.dims()]
    if not uses:
        return f"no level uses {n}"
    divs = [e for e in uses if isinstance(e, Div)]
    mods = [e for e in uses if isinstance(e, Mod)]
    if divs and not mods:
        return f"{n} / {divs[0].block} needs a level {n} % {divs[0].block} beside it"
    if mods and not divs:
        return f"{n} % {mods[0].block} needs a level {n} / {mods[0].block} beside it"
    if divs and mods:
        return f"the block sizes of {n} / {divs[0].block} and {n} % {mods[0].block} differ"
    pair = [e for e in uses if isinstance(e, (Add, Sub))]
    if pair:
        return f"{pair[0].render(names)} needs a level storing one of its dimensions on its own"
    return "no level determines it"
