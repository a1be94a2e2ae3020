"""The singleton level: exactly one coordinate per parent position, stored in ``crd`` (COO's later columns)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Level, LevelStorage, check_index_dtype, check_length, check_range


@dataclass(frozen=True)
class Singleton(Level):
    unique: bool = True
    ordered: bool = True

    name = "singleton"
    arrays = ("crd",)
    pos_iter = True
    append = True

    def num_positions(self, storage, parent_count, lo, hi):
        return parent_count

    def iterate(self, storage, parent_pos, parent_count, lo, hi):
        src = torch.arange(parent_pos.numel(), device=parent_pos.device)
        return src, parent_pos, storage.crd[parent_pos].long()

    def emit_pos_bounds(self, sym, parent):
        return None  # one child, at the parent's own position

    def emit_pos_access(self, sym, pos):
        return sym.load(sym.crd, pos)

    def assemble(self, parent_pos, parent_count, coord, lo, hi):
        if parent_pos.numel() > 1 and bool((parent_pos[1:] == parent_pos[:-1]).any()):
            raise ValueError("a singleton level can store only one coordinate per parent position, but two entries"
                             " share a parent; make the level above it compressed(nonunique)")
        crd = torch.full((parent_count,), lo, dtype=torch.int64, device=coord.device)
        crd[parent_pos] = coord
        return LevelStorage(crd=crd), parent_pos, parent_count

    def validate(self, storage, parent_count, lo, hi, where):
        if storage.crd is None:
            raise ValueError(f"{where}: a singleton level needs a crd array")
        check_index_dtype(storage.crd, where, "crd")
        check_length(storage.crd, parent_count, where, "crd")
        check_range(storage.crd, lo, hi, where)
