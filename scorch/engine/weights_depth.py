"""An n:m weight laid out in the order of ``compiler.weights_depth``'s kernel: store block, depth block, row pass,
group, row of the pass, value (the module's text there), made once per pattern (the in-group offsets) and
per version of the values (their copy kept beside the weight's own, remade when they change)."""
from __future__ import annotations

import functools

import torch

from ..compiler import weights_depth as depth
from ..compiler.caches import register
from ..compiler.weights import Tiles
from ..formats.storage import PatternMemo, ValuesMemo

#: n:m weights' in-group offsets in the depth blocks' order, by the weight's index arrays
_OFFSETS = PatternMemo(1024)
register("weight depth offsets", "the in-group offsets of n:m weights in the order of depth blocks"
         " (``compiler.weights_depth``), by the weight's index arrays", _OFFSETS.__len__, _OFFSETS.clear)
#: their values in the same order, by the values tensor
_VALUES = ValuesMemo(1024)
register("weight depth values", "the values of n:m weights in the order of depth blocks"
         " (``compiler.weights_depth``), by the values tensor (remade when the values change)",
         _VALUES.__len__, _VALUES.clear)


@functools.lru_cache(maxsize=16)
def _order(n_out: int, groups: int, rpass: int, depth: int, rows: int) -> torch.Tensor:
    """The (row, group) pairs of an ``n_out`` x ``groups`` weight in the depth blocks' order (``ordered``), as
    indices into its rows of a group's values (``n_out * groups``: a padding row's zeros), int32; made once per
    shape and plan."""
    padded = -(-n_out // rpass) * rpass
    src = torch.arange(padded * groups, dtype=torch.int32).view(padded, groups)
    src[n_out:] = n_out * groups
    whole, full = padded // rows * rows, groups // depth * depth
    out = torch.empty(padded * groups, dtype=torch.int32)
    for lo, hi in ((0, whole), (whole, padded)):  # (the whole store blocks at once, then the last, shorter one)
        if hi > lo:
            size = min(rows, hi - lo)
            part = src[lo:hi].view(-1, size // rpass, rpass, groups)  # (block, pass, row, group)
            dst = out[lo * groups:hi * groups].view(part.shape[0], -1)
            if full:  # (the whole depth blocks: (block, depth block, pass, group, row))
                dst[:, :size * full].unflatten(1, (full // depth, size // rpass, depth, rpass)).copy_(
                    part[:, :, :, :full].unflatten(3, (full // depth, depth)).permute(0, 3, 1, 4, 2))
            if full < groups:  # (the last, shorter one)
                dst[:, size * full:].unflatten(1, (size // rpass, groups - full, rpass)).copy_(
                    part[:, :, :, full:].permute(0, 1, 3, 2))
    return out


def ordered(t: torch.Tensor, n_out: int, groups: int, plan: Tiles) -> torch.Tensor:
    """``t`` (``n_out`` x ``groups`` x n values, row-major) in the depth blocks' order, the rows padded with zeros
    to a whole pass: ``out[rb * groups * n + ((g0 * passes + p * gk + g) * row_pass + r) * n + k]`` holds the
    ``k``-th value of group ``g0 + g`` of row ``rb + p * row_pass + r``."""
    n = plan.group[0]
    t = t.reshape(n_out * groups, n)
    order = _order(n_out, groups, plan.row_pass, plan.depth, plan.rows)
    if order.numel() > n_out * groups:  # (padding rows: a row of zeros their indices name)
        t = torch.cat([t, t.new_zeros(1, n)])
    return torch.index_select(t, 0, order).view(-1)


def laid(weight, crd: torch.Tensor, plan: Tiles) -> tuple:
    """``(crd, vals)``: an n:m weight's in-group offsets (as panel offsets, ``weights_depth.offset_bias``) and
    values in ``plan``'s depth blocks (``ordered``)."""
    n_out, n_in = weight._shape
    groups = n_in // plan.group[1]
    key = ("depth", plan.row_pass, plan.depth, plan.rows, n_out, groups)
    key = key + (plan.T,)
    offsets = _OFFSETS.lookup(key, weight._levels, lambda: ordered(
        (crd.to(torch.int16) * plan.T - depth.offset_bias(plan)).to(torch.int8), n_out, groups, plan))
    vals = weight._vals
    return offsets, _VALUES.lookup(key, vals, lambda: ordered(vals.detach(), n_out, groups, plan))
