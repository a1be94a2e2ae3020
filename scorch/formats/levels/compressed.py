"""The compressed level: ``pos`` delimits each parent's segment of ``crd`` (CSR's row pointers and columns)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...loopir import Const, binary
from .base import Level, LevelStorage, check_index_dtype, check_length, check_range, ranges


def new_groups(parent_pos: torch.Tensor, coord: torch.Tensor) -> torch.Tensor:
    """True where a sorted entry starts a new (parent position, coordinate) pair."""
    new = torch.ones_like(coord, dtype=torch.bool)
    if coord.numel() > 1:
        new[1:] = (parent_pos[1:] != parent_pos[:-1]) | (coord[1:] != coord[:-1])
    return new


@dataclass(frozen=True)
class Compressed(Level):
    unique: bool = True
    ordered: bool = True

    name = "compressed"
    arrays = ("pos", "crd")
    pos_iter = True
    append = True

    def num_positions(self, storage, parent_count, lo, hi):
        return storage.stored_crd.numel()

    def iterate(self, storage, parent_pos, parent_count, lo, hi):
        pos = storage.pos.long()
        starts = pos[parent_pos]
        src, child = ranges(starts, pos[parent_pos + 1] - starts)
        return src, child, storage.stored_crd[child].long()

    def emit_pos_bounds(self, sym, parent):
        return sym.load(sym.pos, parent), sym.load(sym.pos, binary("add", parent, Const(1)))

    def emit_pos_access(self, sym, pos):
        return sym.load(sym.crd, pos)

    def assemble(self, parent_pos, parent_count, coord, lo, hi):
        if self.unique:
            new = new_groups(parent_pos, coord)
            child = torch.cumsum(new.long(), 0) - 1
            parents, crd = parent_pos[new], coord[new]
        else:
            child = torch.arange(coord.numel(), device=coord.device)
            parents, crd = parent_pos, coord
        counts = torch.bincount(parents, minlength=parent_count)
        pos = torch.zeros(parent_count + 1, dtype=torch.int64, device=coord.device)
        torch.cumsum(counts, 0, out=pos[1:])
        return LevelStorage(pos=pos, crd=crd), child, crd.numel()

    def validate(self, storage, parent_count, lo, hi, where):
        pos, crd = storage.pos, storage.stored_crd  # (a packed level's as held: ``PackedLevel`` checks the widths)
        if pos is None or crd is None:
            raise ValueError(f"{where}: a compressed level needs pos and crd arrays")
        check_index_dtype(pos, where, "pos")
        check_index_dtype(crd, where, "crd")
        check_length(pos, parent_count + 1, where, "pos")
        if crd.dim() != 1:
            raise ValueError(f"{where}: crd must be 1-dimensional, got shape {tuple(crd.shape)}")
        if int(pos[0]) != 0:
            raise ValueError(f"{where}: pos[0] = {int(pos[0])}, expected 0")
        dec = (pos[1:] < pos[:-1]).nonzero()
        if dec.numel():
            p = int(dec[0, 0]) + 1
            raise ValueError(f"{where}: pos decreases at pos[{p}] ({int(pos[p])} after {int(pos[p - 1])})")
        if int(pos[-1]) != crd.numel():
            raise ValueError(f"{where}: pos[-1] = {int(pos[-1])} but crd has {crd.numel()} entries")
        check_range(crd, lo, hi, where)
