"""Softmax over the segments of a compressed level: the softmax of a CSR matrix along its rows (of CSC along
its columns, of any format whose last level is compressed and stores the softmax dimension). A segment is one
``[pos[s], pos[s + 1])`` range of the values array, so the kernel walks the values in place: no coordinates,
no sort, one pass for the maximum, one for the sum, one to normalize, parallel over segments.

The backward pass is a kernel too: ``dx = y * (dy - sum(dy * y))`` (softmax) or ``dx = dy - exp(y) * sum(dy)``
(log-softmax), per segment. Both are loop IR (``compiler/fuse.py``: ``softmax_rows``, ``softmax_backward_rows``),
the kernels ``scorch.compile`` fuses into sparse attention, generated and compiled like the others (each segment
a row of a CSR-like row loop, balanced over threads by entries).
"""
from __future__ import annotations

import torch

from .. import loopir as L
from ..compiler import fuse
from ..compiler.codegen import cpp

_kernels: dict = {}


def _run(backward: bool, log_space: bool, pos, **arrays):
    """The row softmax kernel (``fuse.softmax_rows``, or ``fuse.softmax_backward_rows``: loop IR, the same that
    ``scorch.compile`` fuses into attention) over the segments of ``pos``, on ``arrays`` by parameter name.
    16-bit values run the float32 kernel on widened copies, its result rounded once (stored in 16 bits, the
    exponentials the kernel reads back to normalize would be rounded twice)."""
    result = "dx" if backward else "y"
    if arrays[result].dtype in L.HALF_DTYPES:
        wide = {name: a.float() if name != result else torch.empty(a.shape, dtype=torch.float32)
                for name, a in arrays.items()}
        _run(backward, log_space, pos, **wide)
        arrays[result].copy_(wide[result])
        return
    vtype, itype = L.type_of(next(iter(arrays.values())).dtype), L.type_of(pos.dtype)
    key = (backward, log_space, vtype, itype)
    entry = _kernels.get(key)
    if entry is None:
        kernel = (fuse.softmax_backward_rows(vtype, itype, log=log_space, short=fuse.SHORT_ROW) if backward else
                  fuse.softmax_rows(vtype, itype, log=log_space, short=fuse.SHORT_ROW))
        entry = _kernels[key] = (kernel, cpp.load(kernel))
    cpp.call(*entry, {"t0_l0_lo": 0, "t0_l0_ext": pos.numel() - 1, "t0_l1_pos": pos, "scale": 1.0,
                      "nthreads": torch.get_num_threads(), **arrays})


SUPPORTED = (torch.float32, torch.float64) + L.HALF_DTYPES


def _check(pos, values):
    if values.dtype not in SUPPORTED or pos.dtype not in (torch.int32, torch.int64) or values.device.type != "cpu":
        raise TypeError("segment softmax: float (64, 32 or 16-bit) values and int32/int64 positions on the CPU")


class SegmentSoftmax(torch.autograd.Function):
    """``softmax`` (or ``log_softmax``) of ``values`` within each segment ``[pos[s], pos[s + 1])``."""

    @staticmethod
    def forward(ctx, values, pos, log_space):
        values = values.contiguous()
        ctx.log_space = log_space
        if values.device.type != "cpu":  # on a GPU: torch's segment reductions
            y = forward_ops(values, pos, log_space)
            ctx.save_for_backward(y, pos)
            return y
        _check(pos, values)
        y = torch.empty_like(values)
        _run(False, log_space, pos.contiguous(), x=values, y=y)
        ctx.save_for_backward(y, pos)
        ctx.log_space = log_space
        return y

    @staticmethod
    def backward(ctx, dy):
        y, pos = ctx.saved_tensors
        return softmax_backward(y, dy, pos, ctx.log_space), None, None


def softmax_backward(y, dy, pos, log_space=False):
    """The gradient of the segment softmax's input from its output ``y`` and the output's gradient ``dy``."""
    pos = _positions(pos)
    if torch.is_grad_enabled() or y.device.type != "cpu":  # double backward, or a GPU: torch ops, differentiable
        return backward_ops(y, dy, pos, log_space)
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    _run(True, log_space, pos.contiguous(), y=y.contiguous(), g=dy, dx=dx)
    return dx


def forward_ops(x, pos, log_space):
    """The forward pass in torch ops (any device): per segment, subtract the maximum, exponentiate, normalize.
    Public for tests: the reference the kernel is checked against."""
    seg = _segment_of_each(pos)
    if x.numel() == 0:
        return x.clone()
    dtype, x = x.dtype, _wide(x)  # (16-bit values: computed in float32, as the kernels do, and rounded once)
    peak = torch.full((pos.numel() - 1,), float("-inf"), dtype=x.dtype, device=x.device)
    peak = peak.scatter_reduce(0, seg, x, "amax")
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # an all -inf segment: NaN out
    shifted = x - peak[seg]
    total = torch.zeros_like(peak).index_add(0, seg, shifted.exp())
    if log_space:
        return (shifted - total.log()[seg]).to(dtype)
    return (shifted.exp() / total[seg]).to(dtype)


def _wide(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _segment_of_each(pos):
    """The segment index of every value: ``s`` repeated ``pos[s + 1] - pos[s]`` times."""
    return torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff())


def backward_ops(y, dy, pos, log_space):
    """The backward pass in torch ops (any device, differentiable): ``softmax_backward``'s formulas per segment.
    Public for tests: the reference the backward kernel is checked against."""
    seg = _segment_of_each(pos)
    dtype, y, dy = dy.dtype, _wide(y), _wide(dy)
    total = torch.zeros(pos.numel() - 1, dtype=y.dtype, device=y.device)
    if log_space:
        return (dy - y.exp() * total.index_add(0, seg, dy)[seg]).to(dtype)
    return (y * (dy - total.index_add(0, seg, dy * y)[seg])).to(dtype)


def softmax(values: torch.Tensor, pos: torch.Tensor, log_space: bool = False) -> torch.Tensor:
    """Softmax of ``values`` within each segment of ``pos`` (differentiable)."""
    return SegmentSoftmax.apply(values, _positions(pos), log_space)


def _positions(pos):
    """``pos`` as the kernels take it: an int8 or int16 one (a tensor with narrow indices) widened to int32."""
    return pos.to(torch.int32) if pos.dtype in (torch.int8, torch.int16) else pos
