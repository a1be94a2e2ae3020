"""The gradients of a 2-d convolution with a sparse weight run by the direct kernel (``engine.conv_direct``), so a
training step takes no unfolded (im2col) copy of the input either.

- The input gradient is a convolution of the output gradient with the transposed, spatially flipped weight: for
  stride 1 one direct convolution with that weight (``(in, out / groups, kh, kw)``, its taps reversed, padding
  ``dilation * (k - 1) - padding``); for stride ``s``, one per phase ``(a, b)`` of the input's pixels (rows ``a +
  s * i``, columns ``b + s * j``), each with the taps that reach that phase (``(a + padding - kh * dilation)`` a
  multiple of ``s``), which are evenly spaced: a stride-1 convolution with a dilation of their own, on a slice (or
  a padding) of the output gradient. No zeros inserted into the output gradient, so no multiply-add is wasted.
  These phase weights are sparse tensors made once per weight pattern and geometry (``_PHASES``); each call
  gathers the weight's current values into them.
- The weight gradient, at the stored weights only (``compiler.conv_grad``): per stored weight one dot product of
  the output gradient's plane with the packed input buffer shifted by the weight's offset, the buffer the forward
  packs (its unshifted layout).

Each returns None where the kernels do not serve the call (the caller then takes the general path)."""
from __future__ import annotations

import math

import torch

from ..compiler import conv_grad as family
from ..compiler.caches import register
from ..compiler.codegen import cpp
from ..formats import named, storage
from ..sparse_tensor import SparseTensor
from . import conv_direct
from .convert import coo_from_entries

#: per weight pattern and geometry: each input phase's weight (values unread), its value positions and slices
_PHASES = storage.PatternMemo(128)
register("conv-grad phases", "the transposed, flipped phase weights of sparse conv weights' input gradients, per"
         " pattern and geometry", _PHASES.__len__, _PHASES.clear)
#: per phase weight and direct-kernel entry order: the entries' positions in the weight's own values
_COMPOSED = storage.ValuesMemo(256)
register("conv-grad orders", "the direct kernel's entry order of input-gradient phase weights in the weight's"
         " values", _COMPOSED.__len__, _COMPOSED.clear)


def _taps(k: int, s: int, dl: int, p: int, a: int):
    """The taps of one dimension reaching the input phase ``a``: ``(kernel index -> tap, size, dilation, first)``:
    input pixel ``a + s * i`` takes output-gradient pixel ``i + first + tap * dilation`` times the weight at that
    kernel index (flipped: the last kernel index is tap 0)."""
    offs = {kh: (a + p - kh * dl) // s for kh in range(k) if (a + p - kh * dl) % s == 0}
    if not offs:
        return {}, 0, 1, 0
    step = dl // math.gcd(dl, s)
    first = min(offs.values())
    return {kh: (v - first) // step for kh, v in offs.items()}, len(offs), step, first


def _span(n_in: int, n_out: int, first: int, size: int, step: int):
    """``(lo, hi, pad_before, pad_after)``: the output-gradient slice ``lo .. hi`` and its zero padding that the
    phase's ``n_in`` pixels read (pixel ``i`` reads ``i + first + tap * step``), or None where it reads none."""
    need = n_in + (size - 1) * step  # (the padded length: pixels first .. first + need)
    lo, hi = max(0, first), min(n_out, first + need)
    if lo >= hi:
        return None
    return lo, hi, lo - first, first + need - hi


def _build_phases(weight: SparseTensor, out_hw, in_hw, stride, dilation, pads, groups: int):
    """Each input phase's ``((a, b), format, shape, levels, index, rows, cols, pads, dilation)``: the phase's weight
    holds the weight's values at ``index``; it reads the output gradient's ``rows`` and ``cols`` slices."""
    out, cg, kh, kw = weight._shape
    og = out // groups
    leaf, dims = conv_direct.stored(weight)
    phases = []
    for a in range(stride[0]):
        for b in range(stride[1]):
            n_h, n_w = -(-(in_hw[0] - a) // stride[0]), -(-(in_hw[1] - b) // stride[1])
            th, sh, dh, fh = _taps(kh, stride[0], dilation[0], pads[0][0], a)
            tw, sw, dw, fw = _taps(kw, stride[1], dilation[1], pads[1][0], b)
            if n_h <= 0 or n_w <= 0 or not th or not tw:
                continue
            rows, cols = _span(n_h, out_hw[0], fh, sh, dh), _span(n_w, out_hw[1], fw, sw, dw)
            if rows is None or cols is None:
                continue
            map_h = torch.full((kh,), -1, dtype=torch.int64)
            map_h[list(th)] = torch.tensor(list(th.values()), dtype=torch.int64)
            map_w = torch.full((kw,), -1, dtype=torch.int64)
            map_w[list(tw)] = torch.tensor(list(tw.values()), dtype=torch.int64)
            t_h, t_w = map_h[dims[2]], map_w[dims[3]]
            keep = (t_h >= 0) & (t_w >= 0)
            o, c = dims[0][keep], dims[1][keep]
            shape = (groups * cg, og, sh, sw)
            coo = coo_from_entries([c + (o // og) * cg, o % og, t_h[keep], t_w[keep]], leaf[keep].to(torch.float64),
                                   shape, False)
            # (the phase weight's values are never read: ``conv_direct.conv2d`` takes them by ``gather``)
            w = SparseTensor(coo._format, shape, coo._levels, torch.zeros(coo.nnz, dtype=weight._vals.dtype),
                             check=False)
            index = torch.cat([coo.values().round().long(), torch.tensor([weight._vals.shape[0]])])
            phases.append(((a, b), w, index, rows, cols, ((rows[2], rows[3]), (cols[2], cols[3])), (dh, dw)))
    return phases


def input_grad(weight: SparseTensor, vals: torch.Tensor, dy: torch.Tensor, x_shape, memory_format, stride,
               dilation, pads, groups: int):
    """The gradient of ``F.conv2d`` by its (N, C, H, W) input of ``x_shape``, in ``memory_format``, from ``dy``,
    the weight's values being ``vals``; None where the direct kernel does not serve a phase."""
    key = ("dx", tuple(weight._shape), tuple(dy.shape[2:]), tuple(x_shape[2:]), tuple(stride), tuple(dilation),
           tuple(map(tuple, pads)), groups)

    def build():
        with torch.no_grad():
            return _build_phases(weight, tuple(dy.shape[2:]), tuple(x_shape[2:]), stride, dilation, pads, groups)
    phases = _PHASES.lookup(key, weight._levels, build)
    vals = torch.cat([vals.detach(), vals.new_zeros(1)])
    whole = len(phases) == 1 and phases[0][0] == (0, 0) and tuple(stride) == (1, 1)
    dx = None if whole else torch.empty(x_shape, dtype=dy.dtype, memory_format=memory_format).zero_()
    for (a, b), w, index, rows, cols, ppads, dil in phases:
        def gather(order, index=index):  # (the kernel's entry order composed with the phase's value positions)
            return vals.index_select(0, _COMPOSED.lookup(id(index), order, lambda: index[order], (index,)))
        part = conv_direct.conv2d(w, dy[:, :, rows[0]:rows[1], cols[0]:cols[1]], None, (1, 1), dil, ppads, groups,
                                  gather)
        if part is None:
            return None
        if whole:
            return part if part.is_contiguous(memory_format=memory_format) else part.contiguous(
                memory_format=memory_format)
        dx[:, :, a::stride[0], b::stride[1]] = part
    if dx is None:  # (no phase at all: a weight with no entries)
        dx = torch.empty(x_shape, dtype=dy.dtype, memory_format=memory_format).zero_()
    return dx


def _dy_grid(dy: torch.Tensor, wq: int, grid: int) -> torch.Tensor:
    """``dy`` (N, O, Ho, Wo) on the forward's grid: (N, O, ``grid``), row ``h`` at ``h * wq``, zeros elsewhere."""
    n, o, ho, wo = dy.shape
    g = conv_direct._workspace("dy grid", n * o * grid).view(n, o, grid)
    g[:, :, ho * wq:] = 0
    rows = g[:, :, :ho * wq].view(n, o, ho, wq)
    rows[..., wo:] = 0
    rows[..., :wo] = dy
    return g


def weight_grad(weight: SparseTensor, x: torch.Tensor, dy: torch.Tensor, stride, dilation, pads, groups: int):
    """The gradient of ``F.conv2d`` by the weight's values (their layout, float32), or None where the kernel does
    not serve the call (offsets past 32 bits)."""
    shapes = (tuple(weight._shape), tuple(x.shape), tuple(stride), tuple(dilation), tuple(map(tuple, pads)))
    geometry = conv_direct._geometry(*shapes, 1)  # (unshifted: every entry's offset into one plane set)
    phases, hq, wq, ho, wo, _ = geometry
    n, c = x.shape[:2]
    out = weight._shape[0]
    lanes = conv_direct._lanes()
    tp, tiles = family.tile(ho * wq, lanes)
    grid = tp * tiles
    # (channels whose inputs around a tile, in every phase plane, fill ``CHUNK_BYTES``: the forward's L1 budget)
    span = tp + (hq - ho) * wq + wq
    chunk = max(1, conv_direct.CHUNK_BYTES // (4 * len(phases) * span))
    key = ("dw", tuple(weight._shape), c, groups, phases, hq, wq, tuple(stride), tuple(dilation), chunk)

    def build():
        with torch.no_grad():
            return conv_direct._entries(weight, c, groups, geometry, stride, dilation, chunk)
    found = conv_direct._ENTRIES.lookup(key, weight._levels, build)
    if found is None:
        return None
    pos, off, order = found
    dvals = torch.zeros(weight._vals.shape[0], dtype=torch.float32)
    if off.numel() == 0 or n == 0:
        return dvals
    image = len(phases) * c * hq * wq
    dyg = _dy_grid(dy, wq, grid)
    buf = conv_direct._buffer(x, geometry, stride, pads, grid - ho * wq + wq)
    threads = torch.get_num_threads()
    chunks = min(out, 4 * threads) if threads > 1 else 1
    row_chunk = -(-out // chunks)
    kernel, loaded = conv_direct._loaded(("dw", lanes), lambda: family.weight_grad(lanes, "i32"))
    dw = torch.zeros(off.numel(), dtype=torch.float32)
    args = {"pos": pos, "off": off, "dy": dyg, "x": buf, "dw": dw, "n": n, "x_image": image, "grid": grid, "tp": tp,
            "tiles": tiles, "n_out": out, "kchunks": -(-c // chunk), "chunks": -(-out // row_chunk),
            "row_chunk": row_chunk, "nthreads": threads}
    cpp.call(kernel, loaded, args)
    dvals.index_copy_(0, order, dw)
    return dvals
