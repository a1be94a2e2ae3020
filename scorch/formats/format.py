"""``Format``: an invertible map from a tensor's dimensions to an ordered list of typed storage levels.

Text form (UST-style)::

    (i, j) -> (i / 2 : dense, j / 3 : compressed, i % 2 : dense, j % 3 : dense)

Left of the arrow, the dimension names; right, one ``expr : type[(props)]`` per level, outermost first.
``expr`` is ``i``, ``i / b`` (or ``i // b``), ``i % b``, ``i + j`` or ``i - j``; ``type`` is one of the
level types (dense, compressed, singleton, fixed) and ``props`` any of ``nonunique``, ``nonordered``; a fixed
level may give its number of slots per parent, ``fixed(2)`` (else it is the most entries under one parent).
Formats are immutable, hashable and compare by value; ``str(fmt)`` parses back to an equal format.
"""
from __future__ import annotations

import re

from .expr import MAX_SIZE, Add, CoordExpr, Div, Mod, Sub, Var, dim_name, solve_inverse
from .levels import LEVEL_TYPES, Dense, Fixed, Level, Singleton

_TOKEN = re.compile(r"\s*(?:(?P<arrow>->)|(?P<op>//|[(),:/%+\-])|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<int>\d+)|(?P<bad>\S))")
_PROPS = {"unique": ("unique", True), "nonunique": ("unique", False),
          "ordered": ("ordered", True), "nonordered": ("ordered", False)}


#: (format, shape) -> level bounds: computed on every kernel call, so memoized (listed by scorch.cache_info)
BOUNDS: dict = {}

# The named formats ("csr", "bsr(2, 2)"...) are Formats built by scorch.formats.named, which imports this module;
# it installs its two lookups here when imported (importing scorch.formats does): the Format a name spells, for
# Format("csr"), and the name of a Format, for Format.name and repr.
_resolve_name = None
_name_of = None


def install_names(resolve, name_of) -> None:
    """Called by ``scorch.formats.named``: ``resolve(spec)`` is the Format a name spells, ``name_of(fmt)`` the
    name of ``fmt`` or None."""
    global _resolve_name, _name_of
    _resolve_name, _name_of = resolve, name_of


#: format text -> Format: the formats a pickle names by their text (``from_text``); the named formats are known
#: from import (``remember``), so unpickling a plan or a call kept on disk parses none of them
BY_TEXT: dict = {}


def from_text(text: str) -> "Format":
    """The Format of ``text`` (``str(fmt)``): a known one, else parsed (and then known). Unpickling calls this."""
    fmt = BY_TEXT.get(text)
    if fmt is None:
        fmt = Format(text)
        if len(BY_TEXT) < 4096:
            BY_TEXT[text] = fmt
    return fmt


def remember(*formats) -> None:
    """Make ``formats`` known by their text (``from_text``)."""
    for fmt in formats:
        BY_TEXT.setdefault(str(fmt), fmt)


class Format:
    """An immutable storage format. Build it from text, ``Format("(i, j) -> (i : dense, j : compressed)")``,
    a name (``Format("bsr(2, 2)")``, 2-d for the n-d names), or from parts, ``Format.from_levels(ndim, [(Var(0), Dense()), (Var(1), Compressed())])``."""

    __slots__ = ("ndim", "levels", "_inverse", "_hash", "_text", "_types", "_exprs", "_padded", "_duplicates",
                 "_dense")

    def __init__(self, text: str | "Format"):
        if isinstance(text, Format):
            ndim, levels = text.ndim, text.levels
        elif isinstance(text, str) and "->" not in text and text.strip()[:1].isalpha():
            named = _resolve_name(text)  # a name: Format("csr"), Format("bsr(2, 2)")
            ndim, levels = named.ndim, named.levels
        elif isinstance(text, str):
            ndim, levels = _Parser(text).parse()
        else:
            raise TypeError(f"Format() takes the format text, got {type(text).__name__}")
        self._init(ndim, levels)

    @classmethod
    def from_levels(cls, ndim: int, levels) -> "Format":
        fmt = object.__new__(cls)
        fmt._init(int(ndim), tuple((e, l) for e, l in levels))
        return fmt

    def _init(self, ndim, levels):
        names = [dim_name(d) for d in range(ndim)]
        for k, (e, lvl) in enumerate(levels):
            if not isinstance(e, CoordExpr) or not isinstance(lvl, Level):
                raise TypeError(f"level {k} must be a (CoordExpr, Level) pair, got {(e, lvl)!r}")
            if any(d >= ndim or d < 0 for d in e.dims()):
                raise ValueError(f"level {k} uses a dimension outside 0..{ndim - 1}")
        _check_structure(levels, names)
        inverse = solve_inverse([e for e, _ in levels], ndim, names)
        object.__setattr__(self, "ndim", ndim)
        object.__setattr__(self, "levels", tuple(levels))
        object.__setattr__(self, "_inverse", inverse)
        object.__setattr__(self, "_hash", hash((ndim, self.levels)))
        object.__setattr__(self, "_text", None)  # (str(self), made on first use)
        # what every op asks of its operands' formats, made once (an in-place op on a SparseTensor asked each of
        # them several times through the levels: ~2 us of a ~30 us optimizer op)
        types = tuple(lvl for _, lvl in self.levels)
        sparse = [lvl for lvl in types if not isinstance(lvl, Dense)]
        object.__setattr__(self, "_types", types)
        object.__setattr__(self, "_exprs", tuple(e for e, _ in self.levels))
        object.__setattr__(self, "_padded", any(lvl.padded for lvl in types))
        object.__setattr__(self, "_duplicates", bool(sparse) and sparse[-1].keeps_duplicates)
        object.__setattr__(self, "_dense", not sparse)

    def __setattr__(self, name, value):
        raise AttributeError("Format is immutable")

    def __eq__(self, other):
        return isinstance(other, Format) and self.ndim == other.ndim and self.levels == other.levels

    def __hash__(self):
        return self._hash

    def __reduce__(self):
        return (from_text, (str(self),))

    def __str__(self):
        text = self._text
        if text is None:
            names = ", ".join(dim_name(d) for d in range(self.ndim))
            text = f"({names}) -> ({', '.join(self.level_text(k) for k in range(len(self.levels)))})"
            object.__setattr__(self, "_text", text)
        return text

    def __repr__(self):
        name = self.name
        return f"Format({name!r})" if name else f"Format({str(self)!r})"

    @property
    def name(self) -> str | None:
        """The named format this equals (``'csr'``, ``'bsr(2, 3)'``...), or None."""
        return _name_of(self)

    def level_text(self, k: int) -> str:
        """Level ``k`` as written in the format text, e.g. ``j / 3 : compressed``."""
        e, lvl = self.levels[k]
        return f"{e.render([dim_name(d) for d in range(self.ndim)])} : {lvl}"

    @property
    def exprs(self) -> tuple[CoordExpr, ...]:
        return self._exprs

    @property
    def level_types(self) -> tuple[Level, ...]:
        return self._types

    @property
    def inverse(self):
        """How each dimension is recovered from level coordinates (``expr.Recovery``), in solving order."""
        return self._inverse

    @property
    def is_dense(self) -> bool:
        return self._dense

    @property
    def keeps_duplicates(self) -> bool:
        """Whether equal coordinates stay separate entries (uncoalesced COO) rather than being summed."""
        return self._duplicates

    @property
    def padded(self) -> bool:
        """Whether a level pads its segments (ELL's fixed level): a stored zero may be padding, not an entry."""
        return self._padded

    def level_bounds(self, shape) -> tuple[tuple[int, int], ...]:
        """``(lo, hi)`` of every level's coordinate for a tensor of ``shape``."""
        key = (self, tuple(shape))
        b = BOUNDS.get(key)
        if b is None:
            self.check_shape(shape)
            b = tuple(e.bounds(shape) for e in self.exprs)
            if len(BOUNDS) > 4096:
                BOUNDS.clear()
            BOUNDS[key] = b
        return b

    def check_shape(self, shape) -> None:
        if len(shape) != self.ndim:
            raise ValueError(f"format {self} is for {self.ndim}-d tensors, got shape {tuple(shape)}")
        nmsize = nm_size(self)
        if nmsize is not None and int(shape[1]) % nmsize[1]:  # the clear error for columns not in groups of m
            n, m = nmsize
            raise ValueError(f"format nm({n}, {m}) needs the number of columns to be a multiple of {m}, got shape"
                             f" {tuple(shape)}; pad the columns to a multiple of {m} or pick another format")


def nm_levels(n: int, m: int) -> tuple:
    """The levels of n:m structured sparsity (``named.nm(n, m)``): the rows dense, the groups of ``m`` columns of a
    row dense, and ``n`` (column offset, value) slots in each group."""
    return ((Var(0), Dense()), (Div(1, m), Dense()), (Mod(1, m), Fixed(slots=n)))


def nm_size(fmt: Format):
    """``(n, m)`` when ``fmt`` is ``nm(n, m)``, else None (a cheap structural test)."""
    if fmt.ndim != 2 or len(fmt.levels) != 3:
        return None
    _, (e1, _), (e2, l2) = fmt.levels
    if not (isinstance(l2, Fixed) and l2.slots is not None and isinstance(e2, Mod) and isinstance(e1, Div)):
        return None
    n, m = l2.slots, e2.block
    return (n, m) if n <= m and fmt.levels == nm_levels(n, m) else None


def _check_structure(levels, names):
    if not levels:
        raise ValueError("a format needs at least one level")
    seen = set()
    for k, (e, lvl) in enumerate(levels):
        if e in seen:
            raise ValueError(f"level {k} ({e.render(names)}) repeats an earlier level's coordinate")
        seen.add(e)
        if isinstance(e, (Add, Sub)) and e.a == e.b:
            raise ValueError(f"level {k} ({e.render(names)}) must combine two different dimensions")
        if isinstance(lvl, Singleton) and k == 0:
            raise ValueError(f"level 0 ({e.render(names)} : singleton) has no parent; a singleton level must"
                             " follow another level")


class _Parser:
    def __init__(self, text):
        self.text = text
        self.toks = []
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            if kind == "bad":
                self.fail(f"unexpected character {m.group(kind)!r}", m.start(kind))
            self.toks.append((kind, m.group(kind), m.start(kind)))
        if not text.strip():
            self.fail("empty format text", 0)
        self.i = 0

    def fail(self, msg, col):
        raise ValueError(f"bad format: {msg} at column {col}\n  {self.text}\n  {' ' * col}^")

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "", len(self.text))

    def take(self, kind, value=None, what=None):
        tok = self.peek()
        if tok[0] != kind or (value is not None and tok[1] != value):
            found = "the end" if tok[0] == "end" else repr(tok[1])
            self.fail(f"expected {what or repr(value) or kind}, found {found}", tok[2])
        self.i += 1
        return tok

    def parse(self):
        names, cols = [], {}
        self.take("op", "(")
        while True:
            _, name, col = self.take("name", what="a dimension name")
            if name in cols:
                self.fail(f"dimension {name!r} is declared twice", col)
            cols[name] = col
            names.append(name)
            if self.peek()[1] == ")":
                break
            self.take("op", ",", what="',' or ')'")
        self.take("op", ")")
        self.take("arrow", "->", what="'->'")
        self.take("op", "(")
        levels = []
        while True:
            levels.append(self.level(names))
            if self.peek()[1] == ")":
                break
            self.take("op", ",", what="',' or ')'")
        self.take("op", ")")
        if self.peek()[0] != "end":
            self.fail("unexpected text after the format", self.peek()[2])
        for d, name in enumerate(names):
            if not any(d in e.dims() for e, _ in levels):
                self.fail(f"dimension {name!r} is not stored by any level", cols[name])
        col0 = self.toks[0][2]
        try:
            _check_structure(levels, names)
            solve_inverse([e for e, _ in levels], len(names), names)
        except ValueError as err:
            self.fail(str(err), col0)
        return len(names), tuple(levels)

    def dim(self, names):
        _, name, col = self.take("name", what="a dimension name")
        if name not in names:
            self.fail(f"unknown dimension {name!r} (declared: {', '.join(names)})", col)
        return names.index(name)

    def level(self, names):
        a = self.dim(names)
        op = self.peek()
        if op[1] in ("/", "//", "%"):
            self.i += 1
            _, num, col = self.take("int", what="a block size (a positive integer)")
            if not 0 < int(num) <= MAX_SIZE:
                self.fail(f"the block size must be a positive integer no larger than 2**31 - 1, got {num}", col)
            expr = (Mod if op[1] == "%" else Div)(a, int(num))
        elif op[1] in ("+", "-"):
            self.i += 1
            b = self.dim(names)
            if a == b:
                self.fail(f"{names[a]} {op[1]} {names[b]} must combine two different dimensions", op[2])
            expr = Add(a, b) if op[1] == "+" else Sub(a, b)
        else:
            expr = Var(a)
        self.take("op", ":", what="':' and a level type")
        _, tname, tcol = self.take("name", what="a level type")
        cls = LEVEL_TYPES.get(tname)
        if cls is None:
            self.fail(f"unknown level type {tname!r} (expected one of {', '.join(LEVEL_TYPES)})", tcol)
        props = {}
        if self.peek()[1] == "(":
            self.i += 1
            while True:
                if self.peek()[0] == "int" and "slots" in getattr(cls, "__dataclass_fields__", {}):
                    _, num, col = self.take("int")
                    if not 0 < int(num) <= MAX_SIZE or "slots" in props:
                        self.fail(f"a {tname} level takes one positive number of slots, no larger than 2**31 - 1", col)
                    props["slots"] = int(num)
                    if self.peek()[1] == ")":
                        break
                    self.take("op", ",", what="',' or ')'")
                    continue
                _, p, pcol = self.take("name", what="a level property")
                if p not in _PROPS:
                    self.fail(f"unknown level property {p!r} (expected one of {', '.join(_PROPS)})", pcol)
                key, val = _PROPS[p]
                if key not in getattr(cls, "__dataclass_fields__", {}):
                    if getattr(cls, key) != val:
                        self.fail(f"a {tname} level cannot be {p}", pcol)
                else:
                    props[key] = val
                if self.peek()[1] == ")":
                    break
                self.take("op", ",", what="',' or ')'")
            self.take("op", ")")
        return expr, cls(**props)
