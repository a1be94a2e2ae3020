"""2-d convolutions of an n:4 weight through ``compiler.weights_picks``: the implicit product of the weight's matrix
view (``out x kh * kw * in``, columns in the order (kh, kw, in): a group is 4 input channels of one tap) and the
unfolded input, read in place from the input padded once into a channels-last buffer. The output pixels are the
product's tokens and the result is written channels-last, a vector of output channels at a time.

Where the CPU takes the rows-in-lanes kernel (``Target.lane_picks``: AMD with AVX2), this replaces the direct
convolution (``engine.conv_direct``) for these weights: there the output pixels fill the lanes and each stored
value is a broadcast and a load a vector of pixels, load-bound with 8 lanes (ResNet-18 2:4 at 0.8x dense on an
AMD EPYC Zen 3).
"""
from __future__ import annotations

import torch

from ..compiler import weights as family
from ..compiler import weights_depth as depth
from ..compiler import weights_picks as picks
from ..formats.format import nm_size
from ..sparse_tensor import SparseTensor
from . import weights as kernels
from . import weights_kept
from .conv_direct import output_size


def serves(view_format, x: torch.Tensor, groups: int, out_pixels: int) -> bool:
    """Whether ``conv2d`` runs a convolution whose weight's matrix view has ``view_format``: n:4 float32 on the
    channels (a multiple of 4 of them), one group, ``out_pixels`` tokens at least ``PICK_MIN_TOKENS``, the CPU's
    choice (``Target.lane_picks``)."""
    nm = nm_size(view_format)
    return nm is not None and groups == 1 and x.dim() == 4 and x.shape[1] % 4 == 0 and \
        x.dtype == torch.float32 and x.device.type == "cpu" and nm[1] == 4 and \
        (picks.serves(kernels.CPU, "nm", nm, "f32", "f32", out_pixels) or
         kernels._depth(_plan(nm, out_pixels, False), out_pixels))


def _plan(nm: tuple, tokens: int, bias: bool, ctype: str = "i8") -> family.Tiles:
    """The family's plan of an n:4 product of ``tokens`` tokens (before a kernel's own: ``picks.planned``,
    ``depth.planned``)."""
    return family.tiles(kernels.CPU, "nm", tokens, "f32", "f32", "i64", ctype, (1, 1), nm, bias)


def padded_channels_last(x: torch.Tensor, pads) -> torch.Tensor:
    """``x`` (N, C, H, W) as a new contiguous (N, H + top + bottom, W + left + right, C) buffer, zeros around it
    (``pads``: ((top, bottom), (left, right))): the four borders zeroed, the inside one copy. (``F.pad`` of the
    channels-last view and ``.contiguous()`` took 3.9 ms for ResNet-18's 8 x 64 x 56 x 56 input against 0.44.)"""
    n, c, h, w = x.shape
    (pt, pb), (pl, pr) = pads
    buf = torch.empty(n, h + pt + pb, w + pl + pr, c, dtype=x.dtype, device=x.device)
    for border in (buf[:, :pt], buf[:, pt + h:], buf[:, pt:pt + h, :pl], buf[:, pt:pt + h, pl + w:]):
        if border.numel():
            border.zero_()
    buf[:, pt:pt + h, pl:pl + w].copy_(x.permute(0, 2, 3, 1))
    return buf


def conv2d(view: SparseTensor, x: torch.Tensor, bias, kernel: tuple, stride, dilation, pads,
           keep=False) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation)`` given the weight's matrix view ``view`` (n:4,
    ``serves``) and its ``kernel`` (kh, kw); ``pads`` ((top, bottom), (left, right)). The result is channels-last
    where ``x`` is, else contiguous (as torch's convolutions return). ``keep``: the product's kernel call kept
    (``weights_kept``: a later call with the same view arrays and values, bias, buffer shape and threads binds only
    the new buffer and result; an eval model's layers, whose view values are the same tensor from call to call)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    (pt, pb), (pl, pr) = pads
    hp, wp = h + pt + pb, w + pl + pr
    ho, wo = output_size((h, w), kernel, stride, dilation, pads)
    out = view._shape[0]
    tokens = n * ho * wo

    def product(buf):
        taps = torch.tensor([(i * dh * wp + j * dw) * c for i in range(kh) for j in range(kw)], dtype=torch.int64)
        crd = kernels._arrays(view)["crd"]
        plan = _plan(nm_size(view._format), tokens, bias is not None, family.L.type_of(crd.dtype))
        y = torch.empty(tokens, out)
        geometry = {"x": buf, "y": y, "cpg": c // 4, "pixels": ho * wo, "wo": wo, "img_stride": hp * wp * c,
                    "row_stride": sh * wp * c, "col_stride": sw * c}
        if kernels._depth(plan, tokens):  # (depth blocks: the panel packed from the buffer, ``weights_depth``)
            plan = depth.planned(plan, tokens)
            offsets, vals = kernels._depth_laid(view, crd, plan)
            arrays, extra = {"crd": offsets, "vals": vals, "taps": taps}, kernels._bias(bias, torch.float32)
            part = "depth_conv"
        else:
            plan = picks.planned(plan)
            sel, vals = kernels.lane_layout(view, crd, plan.lanes)
            arrays, extra = {"sel": sel, "vals": vals, "taps": taps}, kernels.lane_bias(bias, out, plan.lanes)
            part = "conv"
        kernels._run(part, plan, view._shape, arrays, tokens,
                     *kernels._split(plan, tokens, out, torch.get_num_threads()), **geometry, **extra)
        return y

    buf = padded_channels_last(x, pads)
    if keep:
        tag = ("conv_picks", view._format, tuple(view._shape), tuple(kernel), tuple(stride), tuple(dilation),
               tuple(map(tuple, pads)), kernels.CPU, kernels._depth)  # (the target and depth rule tests change)
        y = weights_kept.kept(tag, weights_kept.guards(view, bias), buf, product)
    else:
        y = product(buf)
    res = y.view(n, ho, wo, out).permute(0, 3, 1, 2)
    return res if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else res.contiguous()
