"""The fixed level (ELL): every parent has the same number W of positions, so no ``pos`` array is needed.

W is the largest number of entries under one parent, and follows from the storage: ``len(crd) / parents``.
``Fixed(slots=n)`` (text ``fixed(n)``) pins W to n: the storage always has n positions per parent (n:m
sparsity stores n per group of m), and assembling more than n entries under one parent is an error
(``SlotsExceeded``, which ``storage.pack`` turns into a message naming the parent's coordinates).
Shorter segments are padded at their end with the segment's last coordinate (0 in an empty segment) and
value 0, so coordinates stay in range and in non-decreasing order and a kernel can run without a branch.
Where the fixed level is the last one, padding is read off the coordinates (``storage.padding``: a slot that
repeats the coordinate before it), so a stored zero of a real slot stays an entry; only a segment whose every
slot is at coordinate 0 (empty, or one entry at 0) reads its first slot as padding where it holds 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...loopir import Const, binary
from .base import Level, LevelStorage, check_index_dtype, check_range
from .compressed import new_groups


class SlotsExceeded(ValueError):
    """More entries under one parent than a ``Fixed(slots=n)`` level stores: ``entry`` is the index (in the
    sorted entries given to ``assemble``) of the first entry of the first such parent, ``count`` its entries."""

    def __init__(self, slots: int, entry: int, count: int):
        super().__init__(f"a fixed({slots}) level stores at most {slots} entries under each parent, got {count}")
        self.slots, self.entry, self.count = slots, entry, count


@dataclass(frozen=True)
class Fixed(Level):
    #: positions per parent; None: the largest number of entries under one parent (ELL)
    slots: Optional[int] = None

    name = "fixed"
    arrays = ("crd",)
    padded = True
    unique = False  # padding repeats coordinates
    pos_iter = True
    append = True

    def __post_init__(self):
        if self.slots is not None and (isinstance(self.slots, bool) or not isinstance(self.slots, int)
                                       or not 0 < self.slots <= 2**31 - 1):
            raise ValueError(f"a fixed level's number of slots must be a positive integer no larger than 2**31 - 1, got"
                             f" {self.slots!r}")

    def props_text(self):
        return "" if self.slots is None else f"({self.slots})"

    @staticmethod
    def width(storage, parent_count):
        return storage.crd.numel() // parent_count if parent_count else 0

    def num_positions(self, storage, parent_count, lo, hi):
        return storage.crd.numel()

    def iterate(self, storage, parent_pos, parent_count, lo, hi):
        w = self.width(storage, parent_count)
        n = parent_pos.numel()
        src = torch.arange(n, device=parent_pos.device).repeat_interleave(w)
        child = parent_pos[src] * w + torch.arange(w, device=parent_pos.device).repeat(n)
        return src, child, storage.crd[child].long()

    def emit_pos_bounds(self, sym, parent):
        begin = binary("mul", parent, sym.width)
        return begin, binary("add", begin, sym.width)

    def emit_pos_access(self, sym, pos):
        return sym.load(sym.crd, pos)

    def emit_is_entry(self, sym, begin, pos, coord, value):
        # as ``storage.padding`` reads it: a later slot is padding where it repeats the coordinate before it; the
        # first where it holds 0 and the segment's last coordinate (so all of them: they do not decrease) is 0
        # (``&&`` and ``||`` evaluate left to right: no load leaves the segment)
        last = sym.load(sym.crd, binary("sub", binary("add", begin, sym.width), Const(1)))
        later = binary("and", binary("ne", pos, begin),
                       binary("ne", coord, sym.load(sym.crd, binary("sub", pos, Const(1)))))
        first = binary("and", binary("eq", pos, begin),
                       binary("or", binary("ne", value, Const(0, value.type)), binary("ne", last, Const(0))))
        return binary("or", later, first)

    def assemble(self, parent_pos, parent_count, coord, lo, hi):
        dev = coord.device
        new = new_groups(parent_pos, coord)
        entry = torch.cumsum(new.long(), 0) - 1  # index of each entry's distinct (parent, coord)
        parents, crd_u = parent_pos[new], coord[new]
        counts = torch.bincount(parents, minlength=parent_count)
        w = int(counts.max()) if counts.numel() else 0
        if self.slots is not None:
            if w > self.slots:
                over = torch.nonzero(counts[parents] > self.slots)[0, 0]  # first entry under a full parent
                raise SlotsExceeded(self.slots, int(torch.nonzero(entry == over)[0, 0]),
                                    int(counts[parents[over]]))
            w = self.slots
        first = torch.cumsum(counts, 0) - counts  # index in crd_u of each parent's first entry
        slot = torch.arange(crd_u.numel(), device=dev) - first[parents]
        child_u = parents * w + slot
        # padding repeats the last coordinate of the segment (lo in an empty one)
        if crd_u.numel():
            s = torch.arange(w, device=dev)
            src = first[:, None] + torch.minimum(s[None, :], (counts - 1).clamp(min=0)[:, None])
            crd = torch.where(counts[:, None] > 0, crd_u[src.clamp(max=crd_u.numel() - 1)], lo).reshape(-1)
        else:
            crd = torch.full((parent_count * w,), lo, dtype=torch.int64, device=dev)
        return LevelStorage(crd=crd), child_u[entry], parent_count * w

    def validate(self, storage, parent_count, lo, hi, where):
        crd = storage.crd
        if crd is None:
            raise ValueError(f"{where}: a fixed level needs a crd array")
        check_index_dtype(crd, where, "crd")
        if crd.dim() != 1:
            raise ValueError(f"{where}: crd must be 1-dimensional, got shape {tuple(crd.shape)}")
        if parent_count and crd.numel() % parent_count:
            raise ValueError(f"{where}: crd has {crd.numel()} entries, not a multiple of the {parent_count} parents")
        if not parent_count and crd.numel():
            raise ValueError(f"{where}: crd has {crd.numel()} entries but the level has no parents")
        if self.slots is not None and crd.numel() != parent_count * self.slots:
            raise ValueError(f"{where}: crd has {crd.numel()} entries, expected {self.slots} for each of the"
                             f" {parent_count} parents")
        check_range(crd, lo, hi, where)
