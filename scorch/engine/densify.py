"""Dense tensors from any format's storage by generated kernels: ``out[i,j,...] = T[i,j,...]`` with a dense
output, the einsum ``"ab->ab"`` (``engine.einsum``), one pass over the stored positions adding each value into a
zeroed tensor (duplicates summed, padding adds zero). It replaces listing the entries with vectorized torch
ops and putting them (``storage.unpack``), which walks every level into coordinate arrays first.

Autograd flows through the einsum: the gradient of the values is the dense gradient gathered at the stored
positions."""
from __future__ import annotations

import math

import torch

from ..formats import PackedLevel

_LETTERS = "abcdefghijklmnopqrstuvwxyz"

#: below this many stored values and dense elements, the listing costs less than 1 ms and a kernel's one-time
#: compile (about 0.4 s, per format, types and innermost dense extent) would not pay for itself
MIN_SIZE = 1 << 15


def to_dense(fmt, shape, levels, values, min_size=MIN_SIZE):
    """The dense tensor of a storage by a generated kernel, or None where none applies: another device than
    the CPU, a value type the kernels do not take (bool, complex, int8), more dimensions than letters, values
    that are not a plain 1-d tensor, or fewer than ``min_size`` stored values and dense elements; or a packed level
    whose wide view no kernel has made yet (``PackedLevel``: the listing reads its narrow coordinates, where the
    kernel would keep a wide copy beside a pruned weight for its lifetime, as ``schedule.step``'s every to_dense
    would make one)."""
    from .args import SUPPORTED
    from .evaluate import einsum
    if type(values) is not torch.Tensor or values.device.type != "cpu" or values.dtype not in SUPPORTED \
            or values.dim() != 1 or not 0 < len(shape) <= len(_LETTERS) or \
            max(values.numel(), math.prod(shape)) < min_size or \
            any(type(st) is PackedLevel and not st.widened for st in levels):
        return None
    from ..sparse_tensor import SparseTensor
    letters = _LETTERS[:len(shape)]
    source = SparseTensor(fmt, tuple(shape), levels, values, check=False)
    return einsum(f"{letters}->{letters}", source, format="dense")
