"""The dense level: stores only its size; every coordinate in range has a position."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...loopir import binary
from .base import Level, LevelStorage


@dataclass(frozen=True)
class Dense(Level):
    name = "dense"
    full = True
    coord_iter = True
    locate = True
    insert = True

    def props_text(self):
        return ""

    def num_positions(self, storage, parent_count, lo, hi):
        return parent_count * (hi - lo)

    def iterate(self, storage, parent_pos, parent_count, lo, hi):
        n, ext = parent_pos.numel(), hi - lo
        src = torch.arange(n, device=parent_pos.device).repeat_interleave(ext)
        c = torch.arange(ext, device=parent_pos.device).repeat(n)
        return src, parent_pos[src] * ext + c, c + lo

    def locate_pos(self, storage, parent_pos, coord, lo, hi):
        found = (coord >= lo) & (coord < hi)
        return parent_pos * (hi - lo) + (coord - lo), found

    def emit_coord_bounds(self, sym, parent):
        return sym.lo, binary("add", sym.lo, sym.size)

    def emit_coord_access(self, sym, parent, coord):
        return binary("add", binary("mul", parent, sym.size), binary("sub", coord, sym.lo))

    def assemble(self, parent_pos, parent_count, coord, lo, hi):
        ext = hi - lo
        return LevelStorage(), parent_pos * ext + (coord - lo), parent_count * ext
