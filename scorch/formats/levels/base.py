"""The capability interface every level type implements, and the storage a level owns.

A level is told its coordinate range ``[lo, hi)`` (from its coordinate expression and the tensor's
shape) and the positions of its parent level; it never learns which format it is part of. This is the only
place the rest of scorch learns how a level is stored (TACO's ``ModeFormatImpl``):

Properties (class or instance attributes)
    ``full``      every coordinate of the range has a position (dense)
    ``ordered``   coordinates of siblings are stored in increasing order
    ``unique``    no two siblings share a coordinate
    ``padded``    some positions are padding (value 0, coordinate repeated) rather than entries
    ``arrays``    the names of the index arrays the level stores (``pos``, ``crd``)

Capabilities (which access paths the compiler may use)
    ``coord_iter``  iterate coordinates ``lo..hi`` and compute positions from them (dense)
    ``pos_iter``    iterate a range of positions and read each one's coordinate (compressed, singleton, fixed)
    ``locate``      find the position of a given coordinate in O(1) (dense)
    ``append``      assemble by appending coordinates in order (compressed, singleton, fixed)
    ``insert``      assemble by writing at a located position (dense)

Vectorized operations (torch tensors of int64 positions/coordinates, one element per parent position):
    ``num_positions``  how many positions the level has under ``parent_count`` parents
    ``iterate``        every child position of the given parents, with its coordinate
    ``locate_pos``     the position of ``coord`` under each parent, and whether it is stored
    ``assemble``       build the level's arrays from sorted entries
    ``validate``       check stored arrays against the invariants, naming the bad position

Code emission (loop-IR expressions, for ``scorch.compiler.lower``; ``sym`` is the level's ``LevelSymbols``)
    ``emit_coord_bounds(sym, parent)``      ``(lo, hi)`` of the coordinates under ``parent`` (coord_iter)
    ``emit_coord_access(sym, parent, c)``   the position of coordinate ``c`` (coord_iter, locate)
    ``emit_pos_bounds(sym, parent)``        ``(begin, end)`` of the positions under ``parent``, or None when
                                            the parent has exactly one child at its own position (pos_iter)
    ``emit_pos_access(sym, p)``             the coordinate stored at position ``p`` (pos_iter)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ... import loopir as L


@dataclass(eq=False)
class LevelStorage:
    """The index arrays of one level (``None`` where the level type stores no such array). ``pos`` and ``crd``
    are the arrays as kernels read them, all of the tensor's one index dtype; ``arrays()`` the arrays the level
    holds, which are the same except in a ``PackedLevel`` (coordinates stored narrower)."""

    pos: Optional[torch.Tensor] = None
    crd: Optional[torch.Tensor] = None

    def arrays(self):
        """The arrays the level holds, by name (what its storage takes, what is saved and copied)."""
        return {k: v for k, v in (("pos", self.pos), ("crd", self.crd)) if v is not None}

    @property
    def stored_crd(self):
        """The coordinates as held (``crd`` itself, except in a ``PackedLevel``): for code that reads them with
        torch (and widens them there), so that it need not make a packed level's wide view."""
        return self.crd

    def dtypes(self) -> set:
        """The dtypes of the arrays as kernels read them (``pos``, ``crd``), without making a packed level's
        wide view."""
        return {a.dtype for a in self.arrays().values()}

    def map(self, fn):
        return LevelStorage(*(None if a is None else fn(a) for a in (self.pos, self.crd)))

    def __repr__(self):
        inner = ", ".join(f"{k}={v.tolist() if v.numel() <= 16 else f'<{v.numel()} x {v.dtype}>'}"
                          for k, v in self.arrays().items())
        return f"{type(self).__name__}({inner})"


class PackedLevel(LevelStorage):
    """A compressed level whose coordinates are stored narrower than its positions: a pruned weight's columns in
    16 bits under 32-bit row pointers (6 bytes a float32 entry instead of 8, 4 instead of 6 in bfloat16). Its
    ``crd`` is the coordinates widened to the positions' dtype, made on first read and kept with the level (so
    once per pattern: every tensor on this pattern shares the level), remade if the stored array is changed in
    place: every kernel, and every piece of code that reads ``crd``, sees one index dtype, as the compiler types
    it (``SparseTensor.index_dtype``, the positions'). Only what asks for the stored array (``arrays()``,
    ``stored_crd``: the weight kernels, which read 16-bit columns natively, the storage's size, saving and copying)
    sees the narrow one. Made with ``packed_level``."""

    def __init__(self, pos: torch.Tensor, crd: torch.Tensor):
        if not isinstance(pos, torch.Tensor) or not isinstance(crd, torch.Tensor):
            raise TypeError("a packed level holds a pos and a crd tensor")
        if pos.dtype not in INDEX_DTYPES or crd.dtype not in NARROW_INDEX_DTYPES or \
                INDEX_DTYPES.index(crd.dtype) >= INDEX_DTYPES.index(pos.dtype):
            raise ValueError(f"a packed level stores int8 or int16 coordinates under wider positions, got pos"
                             f" {pos.dtype} and crd {crd.dtype}")
        if crd.device != pos.device:
            raise ValueError(f"crd is on {crd.device} but pos is on {pos.device}")
        self.pos = pos
        self._narrow = crd

    @property
    def crd(self) -> torch.Tensor:
        narrow = self._narrow
        version = None if narrow.is_inference() else narrow._version  # (no counter: such an array is not changed)
        kept = self.__dict__.get("_wide")
        if kept is None or kept[0] != version:
            with torch.inference_mode(False):  # (a normal array: one an op may save for its backward)
                made = (version, narrow.to(self.pos.dtype))
            if kept is None:  # (two threads reading it first keep one array: a kernel may be reading it already)
                kept = self.__dict__.setdefault("_wide", made)
            else:
                kept = self.__dict__["_wide"] = made
        return kept[1]

    @property
    def stored_crd(self) -> torch.Tensor:
        return self._narrow

    @property
    def widened(self) -> bool:
        """Whether the wide view (``crd``) has been made (a general kernel read this level)."""
        return "_wide" in self.__dict__

    def arrays(self):
        return {"pos": self.pos, "crd": self._narrow}

    def dtypes(self) -> set:
        return {self.pos.dtype}

    def map(self, fn):
        return packed_level(fn(self.pos), fn(self._narrow))

    def __reduce__(self):  # (the arrays held, not the wide view)
        return packed_level, (self.pos, self._narrow)


def packed_level(pos: torch.Tensor, crd: torch.Tensor) -> LevelStorage:
    """A compressed level's storage: a ``PackedLevel`` where ``crd`` is int8 or int16 and narrower than ``pos``,
    else a ``LevelStorage`` (a ``map`` that widened the coordinates to the positions' width gives a plain one)."""
    if crd.dtype in NARROW_INDEX_DTYPES and pos.dtype in INDEX_DTYPES and \
            INDEX_DTYPES.index(crd.dtype) < INDEX_DTYPES.index(pos.dtype):
        return PackedLevel(pos, crd)
    return LevelStorage(pos=pos, crd=crd)


@dataclass(frozen=True)
class LevelSymbols:
    """The loop-IR names the lowering gave one level: its arrays (``pos``, ``crd``: kernel parameter names,
    or None), their element type, and expressions for the coordinate range start ``lo``, the range's
    ``size`` and (fixed levels) the ``width``."""
    pos: Optional[str]
    crd: Optional[str]
    index_type: str
    lo: object
    size: object
    width: object = None

    def load(self, array, index):
        return L.Cast(L.Load(array, index, self.index_type), "i64")


class Level:
    """Base of the level types. Instances are immutable and hashable: they are part of format cache keys."""

    name: ClassVar[str]
    arrays: ClassVar[tuple[str, ...]] = ()
    full: ClassVar[bool] = False
    padded: ClassVar[bool] = False
    coord_iter: ClassVar[bool] = False
    pos_iter: ClassVar[bool] = False
    locate: ClassVar[bool] = False
    append: ClassVar[bool] = False
    insert: ClassVar[bool] = False
    ordered: bool = True
    unique: bool = True

    @property
    def keeps_duplicates(self) -> bool:
        """Whether entries with equal coordinates stay separate when assembled (else they are summed)."""
        return not self.unique and not self.padded

    def props_text(self) -> str:
        """The non-default properties as written in the format text, e.g. ``(nonunique)``."""
        props = [p for p, on in (("nonunique", not self.unique), ("nonordered", not self.ordered)) if on]
        return f"({', '.join(props)})" if props else ""

    def __str__(self) -> str:
        return self.name + self.props_text()

    # vectorized operations; see the module docstring
    def num_positions(self, storage: LevelStorage, parent_count: int, lo: int, hi: int) -> int:
        raise NotImplementedError

    def iterate(self, storage: LevelStorage, parent_pos: torch.Tensor, parent_count: int, lo: int, hi: int):
        """Returns ``(src, child_pos, coord)``: for every child, the index of its parent in ``parent_pos``."""
        raise NotImplementedError

    def locate_pos(self, storage: LevelStorage, parent_pos: torch.Tensor, coord: torch.Tensor, lo: int, hi: int):
        raise NotImplementedError(f"level type {self.name} cannot locate coordinates")

    def assemble(self, parent_pos: torch.Tensor, parent_count: int, coord: torch.Tensor, lo: int, hi: int):
        """Build the level from entries sorted by (parent position, coordinate).

        Returns ``(storage, child_pos, child_count)``, with int64 arrays (the caller narrows the index type).
        """
        raise NotImplementedError

    def validate(self, storage: LevelStorage, parent_count: int, lo: int, hi: int, where: str) -> None:
        """Check array lengths, monotone ``pos`` and coordinate ranges; ``where`` names the level in errors."""

    # code emission; see the module docstring
    def emit_coord_bounds(self, sym: LevelSymbols, parent):
        raise NotImplementedError(f"level type {self.name} cannot iterate coordinates")

    def emit_coord_access(self, sym: LevelSymbols, parent, coord):
        raise NotImplementedError(f"level type {self.name} cannot iterate coordinates")

    def emit_pos_bounds(self, sym: LevelSymbols, parent):
        raise NotImplementedError(f"level type {self.name} cannot iterate positions")

    def emit_pos_access(self, sym: LevelSymbols, pos):
        raise NotImplementedError(f"level type {self.name} cannot iterate positions")

    def emit_is_entry(self, sym: LevelSymbols, begin, pos, coord, value):
        """A padded last level: a bool expression, true where position ``pos`` (of the segment starting at
        ``begin``, coordinate ``coord``, stored value ``value``) is an entry rather than padding."""
        raise NotImplementedError(f"level type {self.name} has no padding")


def ranges(starts: torch.Tensor, counts: torch.Tensor):
    """Expand ``[starts[r], starts[r] + counts[r])`` for every r: returns ``(src, values)`` with ``src`` the row."""
    n = starts.numel()
    src = torch.repeat_interleave(torch.arange(n, device=starts.device), counts)
    offsets = torch.cumsum(counts, 0) - counts
    within = torch.arange(src.numel(), device=starts.device) - offsets[src]
    return src, starts[src] + within


def check_range(crd: torch.Tensor, lo: int, hi: int, where: str, name: str = "crd") -> None:
    if crd.numel() == 0:
        return
    bad = (crd < lo) | (crd >= hi)
    if bool(bad.any()):
        p = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where}: {name}[{p}] = {int(crd[p])} is out of range [{lo}, {hi})")


def check_length(arr: torch.Tensor, n: int, where: str, name: str) -> None:
    if arr.dim() != 1:
        raise ValueError(f"{where}: {name} must be 1-dimensional, got shape {tuple(arr.shape)}")
    if arr.numel() != n:
        raise ValueError(f"{where}: {name} has {arr.numel()} entries, expected {n}")


#: the dtypes of index arrays, narrowest first: int8 and int16 hold small coordinates only (the offsets of an
#: ``nm(n, m)`` group: ``storage.narrow_index_dtype``), int32 where every size fits, else int64
INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
#: the narrow ones, for small coordinates only
NARROW_INDEX_DTYPES = INDEX_DTYPES[:2]


def check_index_dtype(arr: torch.Tensor, where: str, name: str) -> None:
    if arr.dtype not in INDEX_DTYPES:
        raise ValueError(f"{where}: {name} must be int8, int16, int32 or int64, got {arr.dtype}")
