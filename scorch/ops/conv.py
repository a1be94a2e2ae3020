"""Convolutions with a sparse weight: ``F.conv1d`` / ``conv2d`` / ``conv3d`` (``torch.conv*`` are the same functions)
on a dense input and a SparseTensor weight of shape ``(out, in / groups, *kernel)``.

A 2-d float32 convolution runs the direct kernel (``engine.conv_direct``: each stored weight an offset into the
padded input planes, no unfolded copy), its result in the input's memory format; where a gradient is wanted, as
one graph node (``_DirectConv``) whose backward runs direct kernels too (``engine.conv_grad``: the input gradient a
direct convolution with the transposed, flipped weight per stride phase, the weight gradient on the pattern over
the packed input). Every other call (conv1d / conv3d, other dtypes, a double backward) takes the path below.

A convolution is a product of the weight's matrix view ``(out, prod(kernel) * in / groups)``, its columns in the
order ``(*kernel, channel)`` (torch's channels_last weight order), with the unfolded input (im2col: one row per
output position, ``prod(kernel) * in`` columns, each kernel position's channels contiguous), so it runs through
``F.linear``'s sparse-weight kernel family (``engine.weights``: CSR, BSR and n:m) forward and backward: the input
gradient is ``linear``'s, folded back by autograd through the unfolding (a strided view), and the weight gradient is
computed on the view's pattern only, then gathered back onto the weight's own stored positions.

Groups are one product, not one per group: the view of a grouped weight is block diagonal, ``(out,
prod(kernel) * in)``, row ``o``'s entries at its group's channels, which has the weight's nnz.

Channels innermost, because the unfolding then copies runs of contiguous channels from a channels_last input
(the output of the previous convolution is one: the product's rows are its positions), where the (channel,
kernel) order of ``F.unfold`` copies runs of ``kw`` entries (ResNet-18's 64-channel 3x3 layer at 56 x 56, batch 1,
2 threads: 0.12 ms from a channels_last input, 0.18 ms from NCHW, against 1.2 ms for ``F.unfold`` and the copy to
rows).

The view's format is the one ``scorch.schedule`` recorded on the weight (``set_format("csr")``, ``.block(bh,
bw)``, ``NM(n, m)`` name the format of the matrix view: ``_view_format``), else CSR; a view that does not fit
it (an n:m pattern whose groups the block-diagonal shift breaks) runs as CSR. The view's index arrays and the
map from its positions to the weight's are built once per weight pattern (``PatternMemo``); each call gathers
the current values, so optimizer steps are seen.
"""
from __future__ import annotations

import math

import torch

from ..compiler.caches import register
from ..engine import asformat
from ..engine import conv_direct, conv_grad, conv_picks
from ..engine.convert import coo_from_entries
from ..formats import named, storage
from ..sparse_tensor import NoSparseRule, SparseTensor, implements, padding_of
from .linalg import linear

#: the matrix views of conv weights, per pattern, view format and groups
_VIEWS = storage.PatternMemo(128)
register("conv-views", "matrix views of sparse conv weights and their maps to the weights' positions", _VIEWS.__len__,
         _VIEWS.clear)
#: the views' values last made without autograd, per values tensor (remade when the values change)
_VIEW_VALUES = storage.ValuesMemo(128)
register("conv-view values", "the values of sparse conv weights' matrix views made without autograd, per values"
         " tensor", _VIEW_VALUES.__len__, _VIEW_VALUES.clear)


def view_format_of(weight: SparseTensor):
    """The format of ``weight``'s matrix view: the one recorded at ``schedule.apply`` (``_view_format``), else CSR."""
    return weight.__dict__.get("_view_format") or named.resolve("csr", 2)


def _build_view(weight: SparseTensor, fmt, groups: int):
    """``(format, levels, index)`` of the block-diagonal matrix view: the view's stored positions hold the
    weight's values at ``index`` (``nnz``, one past the last, where a position has none: block fill, padding)."""
    out, cg = weight.shape[0], weight.shape[1]
    k = math.prod(weight.shape[2:])
    leaf, dims, inside = storage.coordinates(weight._format, weight._shape, weight._levels)
    if weight._format.padded:
        inside &= ~padding_of(weight)[leaf]
    leaf, dims = leaf[inside], dims[:, inside]
    channel = dims[1] + (dims[0] // (out // groups)) * cg  # (the block-diagonal shift: the group's channels)
    col = storage.linear_index(torch.cat([dims[2:], channel[None]]), tuple(weight.shape[2:]) + (groups * cg,))
    # the weight's positions, counted from 1, as the values of the view: 0 marks a position that has none
    tags = (leaf + 1).to(torch.float64)
    coo = coo_from_entries([dims[0], col], tags, (out, groups * cg * k), False)
    try:
        view = asformat(coo, fmt)
    except ValueError:
        if named.name_of(fmt) == "csr":
            raise
        view = asformat(coo, named.resolve("csr", 2))
    index = view.values().round().long() - 1
    index = torch.where(index < 0, weight.nnz, index)
    return view._format, view._levels, index


def matrix_view(weight: SparseTensor, groups: int = 1) -> SparseTensor:
    """``weight`` (``out x in/groups x *kernel``) as its block-diagonal ``out x prod(kernel) * in`` matrix, on the
    weight's current values (differentiable: the gradient of the view's values reaches the weight's)."""
    fmt = view_format_of(weight)
    key = (fmt, groups, tuple(weight.shape))

    def build():
        with torch.no_grad():
            return _build_view(weight, fmt, groups)
    vfmt, levels, index = _VIEWS.lookup(key, weight._levels, build)
    vals = weight.values()

    def gather():
        return torch.cat([vals, vals.new_zeros(1)])[index]
    if vals.requires_grad and torch.is_grad_enabled():
        view_vals = gather()
    else:  # (inference: the same values tensor, unchanged, gives the same view values, whose packed copies in
        #    engine.weights (ValuesMemo) then stay valid too)
        view_vals = _VIEW_VALUES.lookup(key, vals, gather, (index,))
    k = math.prod(weight.shape[2:])
    return SparseTensor(vfmt, (weight.shape[0], groups * weight.shape[1] * k), levels, view_vals, check=False)


def _tuple(v, d: int, what: str, op: str) -> tuple:
    t = tuple(v) if isinstance(v, (tuple, list)) else (v,) * d
    if len(t) == 1:
        t = t * d
    if len(t) != d or any(isinstance(x, bool) or not isinstance(x, int) for x in t):
        raise ValueError(f"{op}: {what} must be an int or {d} ints, got {v!r}")
    return t


def _pads(padding, d, kernel, stride, dilation, op):
    """``((left, right), ...)`` per spatial dimension; ``"same"`` puts the odd one on the right, as torch does."""
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * d
        if padding != "same":
            raise ValueError(f"{op}: padding must be 'valid', 'same', an int or a tuple of ints, got {padding!r}")
        if any(s != 1 for s in stride):
            raise ValueError(f"{op}: padding='same' is not supported for strided convolutions")
        total = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
        return [(t // 2, t - t // 2) for t in total]
    p = _tuple(padding, d, "padding", op)
    if any(x < 0 for x in p):
        raise ValueError(f"{op}: padding must be non-negative, got {padding!r}")
    return [(x, x) for x in p]


def _unfold(x, kernel, stride, dilation, pads):
    """``x`` (N, C, *spatial) as (N * positions, prod(kernel) * C) rows (im2col, channels innermost), padded by
    ``pads``, and the output's spatial size. Channels last first (a view where ``x`` is channels_last, the one
    copy of the input otherwise), then one strided view (``Tensor.unfold`` per dimension) copied once into rows:
    each row is runs of C contiguous channels."""
    d = len(kernel)
    x = x.movedim(1, -1)
    if any(p for pair in pads for p in pair):
        x = torch.nn.functional.pad(x, [0, 0] + [p for pair in reversed(pads) for p in pair])
    for i, (k, s, dl) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(1 + i, dl * (k - 1) + 1, s)
    if any(dl != 1 for dl in dilation):
        x = x[(...,) + tuple(slice(None, None, dl) for dl in dilation)]
    n, sizes, c = x.shape[0], tuple(x.shape[1:1 + d]), x.shape[1 + d]
    x = x.movedim(1 + d, -1)  # (N, *L, C, *k) -> (N, *L, *k, C)
    return x.reshape(n * math.prod(sizes), math.prod(kernel) * c), sizes


def conv(d: int, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """The ``d``-dimensional convolution of a dense ``input`` with a sparse ``weight`` (see the module docstring)."""
    kept = conv_direct.kept_key(d, input, weight, bias, stride, padding, dilation, groups)
    if kept is not None:  # (a repeated call of an eval model's layer: its kernel calls as the first made them)
        out = conv_direct.run_kept(kept, input)
        if out is not None:
            return out
    op = f"conv{d}d"
    if not isinstance(weight, SparseTensor) or isinstance(input, SparseTensor) or isinstance(bias, SparseTensor) \
            or not isinstance(input, torch.Tensor) or input.layout != torch.strided:
        raise NoSparseRule(f"{op}: only a sparse weight with a dense input and bias runs sparse")
    if len(weight._shape) != d + 2:
        raise ValueError(f"{op}: weight must be {d + 2}-d (out, in / groups, *kernel), got shape"
                         f" {tuple(weight._shape)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(f"{op}: groups must be a positive integer, got {groups!r}")
    batched = input.dim() == d + 2
    if input.dim() not in (d + 1, d + 2):
        raise ValueError(f"{op}: expected a {d + 1}-d (unbatched) or {d + 2}-d (batched) input, got shape"
                         f" {tuple(input.shape)}")
    x = input if batched else input.unsqueeze(0)
    out_ch, cg = weight._shape[0], weight._shape[1]
    kernel = tuple(weight._shape[2:])
    if out_ch % groups:
        raise ValueError(f"{op}: out_channels ({out_ch}) must be divisible by groups ({groups})")
    if x.shape[1] != cg * groups:
        raise ValueError(f"{op}: input of shape {tuple(input.shape)} has {x.shape[1]} channels; the weight of shape"
                         f" {tuple(weight._shape)} with groups={groups} expects {cg * groups}")
    if bias is not None and tuple(bias.shape) != (out_ch,):
        raise ValueError(f"{op}: bias must have shape ({out_ch},), got {tuple(bias.shape)}")
    stride = _tuple(stride, d, "stride", op)
    dilation = _tuple(dilation, d, "dilation", op)
    if any(s <= 0 for s in stride) or any(dl <= 0 for dl in dilation):
        raise ValueError(f"{op}: stride and dilation must be positive, got {stride} and {dilation}")
    pads = _pads(padding, d, kernel, stride, dilation, op)
    if x.dtype != weight._vals.dtype:
        raise TypeError(f"{op}: input ({x.dtype}) and weight ({weight.dtype}) must have the same dtype")
    padded = tuple(n + sum(pair) for n, pair in zip(x.shape[2:], pads))
    if any(n < dl * (k - 1) + 1 for n, k, dl in zip(padded, kernel, dilation)):
        raise ValueError(f"{op}: the (padded) input of spatial size {padded} is smaller than the dilated kernel"
                         f" {tuple(dl * (k - 1) + 1 for k, dl in zip(kernel, dilation))}")
    if d == 2:
        grads = torch.is_grad_enabled() and (x.requires_grad or weight._vals.requires_grad or weight.requires_grad or
                                             (bias is not None and bias.requires_grad))
        with torch.no_grad():
            out = _picks(x, weight, bias, stride, dilation, pads, groups, keep=not grads)
            if out is None:
                out = conv_direct.conv2d(weight, x, bias, stride, dilation, pads, groups, keep=kept)
        if out is not None:
            if grads:  # (the result made above, handed to the graph's node: its backward runs direct kernels too)
                out = _DirectConv.apply(x, weight.values(), bias, (weight, stride, dilation, pads, groups, out))
            return out if batched else out.squeeze(0)
    return _general(x, weight, bias, stride, dilation, pads, groups, batched)


def _picks(x, weight, bias, stride, dilation, pads, groups, keep=False):
    """The 2-d convolution through ``engine.conv_picks`` where it serves (an n:4 matrix view on a CPU that takes
    the rows-in-lanes kernel), else None."""
    kernel = tuple(weight._shape[2:])
    pixels = x.shape[0] * math.prod(conv_direct.output_size(x.shape[2:], kernel, stride, dilation, pads))
    if not conv_picks.serves(view_format_of(weight), x, groups, pixels) or weight._vals.dtype != torch.float32 or \
            (bias is not None and bias.dtype != torch.float32):
        return None
    return conv_picks.conv2d(matrix_view(weight, groups), x, bias, kernel, stride, dilation, pads, keep)


def _general(x, weight, bias, stride, dilation, pads, groups, batched=True):
    """The convolution as the unfolded input times the weight's matrix view (``linear``), differentiable in every
    operand (the module docstring)."""
    kernel, out_ch = tuple(weight._shape[2:]), weight._shape[0]
    rows, sizes = _unfold(x, kernel, stride, dilation, pads)
    out = linear(rows, matrix_view(weight, groups), bias)
    out = out.reshape(x.shape[0], *sizes, out_ch).movedim(-1, 1)
    return out if batched else out.squeeze(0)


@implements(torch.nn.functional.conv1d)
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A sparse weight on a dense input: the unfolded input times the weight's matrix view by the sparse-weight
    ``linear`` kernels (CSR, BSR, n:m), forward and backward; a sparse input or bias runs on the dense form."""
    return conv(1, input, weight, bias, stride, padding, dilation, groups)


@implements(torch.nn.functional.conv2d)
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A sparse weight on a dense input: the unfolded input times the weight's matrix view by the sparse-weight
    ``linear`` kernels (CSR, BSR, n:m), forward and backward; a sparse input or bias runs on the dense form."""
    return conv(2, input, weight, bias, stride, padding, dilation, groups)


@implements(torch.nn.functional.conv3d)
def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A sparse weight on a dense input: the unfolded input times the weight's matrix view by the sparse-weight
    ``linear`` kernels (CSR, BSR, n:m), forward and backward; a sparse input or bias runs on the dense form."""
    return conv(3, input, weight, bias, stride, padding, dilation, groups)


class _DirectConv(torch.autograd.Function):
    """A 2-d convolution by the direct kernel with a backward by direct kernels too (``engine.conv_grad``): the
    input gradient a direct convolution of the output gradient with the transposed, flipped weight (per stride
    phase), the weight gradient a dot product per stored weight over the packed input. The forward's result is
    made by the caller (``spec``'s last item), which takes ``_general`` where the direct kernel does not serve the
    call. A double backward (a graph through the gradients) and any gradient the kernels do not serve take
    ``_general``'s, differentiable."""

    @staticmethod
    def forward(ctx, x, vals, bias, spec):
        ctx.spec = spec[:5]
        ctx.save_for_backward(x, vals)
        return spec[5]

    @staticmethod
    def backward(ctx, dy):
        x, vals = ctx.saved_tensors
        weight, stride, dilation, pads, groups = ctx.spec
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = None
        if not torch.is_grad_enabled():
            w = weight.with_values(vals.detach())
            if need_w:
                dw = conv_grad.weight_grad(w, x.detach(), dy, stride, dilation, pads, groups)
                dw = None if dw is None else dw.to(vals.dtype)
            if need_x:
                fmt = torch.channels_last if conv_direct._channels_last(x) else torch.contiguous_format
                dx = conv_grad.input_grad(w, vals, dy, tuple(x.shape), fmt, stride, dilation, pads, groups)
        if (need_x and dx is None) or (need_w and dw is None):
            with torch.enable_grad():
                w = weight.with_values(vals)
                out = _general(x, w, None, stride, dilation, pads, groups)
                wanted = [t for t, need in ((x, need_x and dx is None), (vals, need_w and dw is None)) if need]
                got = list(torch.autograd.grad(out, wanted, dy, create_graph=torch.is_grad_enabled(),
                                               allow_unused=True))
            if need_x and dx is None:
                dx = got.pop(0)
            if need_w and dw is None:
                dw = got.pop(0)
        db = dy.sum((0, 2, 3)) if need_b else None
        return dx, dw, db, None
