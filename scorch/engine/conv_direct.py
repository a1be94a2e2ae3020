"""A 2-d convolution with a sparse weight by the direct kernel (``compiler.conv_direct``): the input's planes padded
(and split into stride phases) into one flat buffer, each stored weight's offset into it made once per pattern and
geometry, the output computed on the buffer's row width, its ``Wo`` valid columns then unpacked into a compact
result in the input's memory format. The buffer's packing and the unpacking are generated kernels too.

Where the rows' padding to whole vectors costs little (``SHIFT_SLACK``), the planes are shifted: one plane per
row phase and tap column, each row ``Wq`` a multiple of the vector's lanes, so that every entry's offset (its
plane and row shift) is a multiple of the lanes and its pixel vectors are aligned loads. The entries are kept in
channel chunks (``CHUNK_BYTES``) so that the rows of a work item pass over inputs that stay in L1, and, for a
weight of more than a quarter of its entries (``SHIFT_DENSITY``), in lists per block of ``ROWS`` output rows and
subset of them (``_blocked``) so that the rows that read an input share its loads.

``conv2d(weight, x, bias, stride, dilation, pads)`` returns None where the kernel does not serve the call (not
float32, not on the CPU, offsets past 32 bits), and the caller takes the general path (im2col and ``linear``).
Its backward (input and weight gradients) is ``engine.conv_grad``'s.

Where an image's buffer and grid fit ``BAND_BYTES`` and the batch has a few images a thread, one kernel does all
three, an image a work item (``_banded``, ``family.banded``): the image's buffer and grid stay the thread's own,
one parallel region a call.

An eager call without gradients whose batch is one group (three kernel calls, or the one banded call) is kept (``kept_key``, ``run_kept``):
the next call with the same weight and bias arrays (the same objects, unmodified: ``_version``), input shape,
strides, dtype, arguments, thread count and module settings makes the three calls again with the new input's,
the workspaces' and a new result's pointers, skipping the Python between them.
"""
from __future__ import annotations

import functools
import math
import struct
import threading
import weakref

import torch

from .. import loopir as L
from ..compiler import conv_direct as family
from ..compiler.caches import cache, register
from ..compiler.codegen import cpp
from ..compiler.target import CPU
from ..formats import storage
from ..sparse_tensor import SparseTensor, padding_of
from . import weights_kept

_KERNELS = cache("conv-direct", "kernels of the direct sparse convolution per plan")
#: per weight pattern and geometry: the rows' positions, the entries' offsets and their values' order
_ENTRIES = storage.PatternMemo(256)
register("conv-direct entries", "the direct convolution's row positions, offsets and value order per weight pattern"
         " and input geometry", _ENTRIES.__len__, _ENTRIES.clear)
#: the weights' values in the entries' order, per values tensor
_VALUES = storage.ValuesMemo(256)
register("conv-direct values", "sparse conv weights' values in the direct convolution's entry order, per values"
         " tensor", _VALUES.__len__, _VALUES.clear)
#: images at most whose rows the input buffer joins side by side where one image's rows are too short for the
#: aligned (shifted) planes (``_side_by_side``): ResNet-18's 7 x 7 planes, unshifted, cost their kernel 30% in loads
#: that split cache lines (512 channels, batch 8, 1 thread: 18.0 ms against 12.5 on the same offsets aligned);
#: two of them joined are 16 columns, shifted
SIDE_BY_SIDE = 4
#: per thread, the input buffer and output grid of the last calls, kept for the next (``_workspace``)
_WORK = threading.local()


def _workspace_size() -> int:
    return len(getattr(_WORK, "arrays", {}))


register("conv-direct workspaces", "the direct convolution's input buffer and output grid, kept per thread for the"
         " next call", _workspace_size, lambda: getattr(_WORK, "arrays", {}).clear())


def _workspace(name: str, numel: int) -> torch.Tensor:
    """A float32 array of ``numel`` elements (uninitialized), the same memory call after call (grown as needed):
    a fresh buffer of megabytes is mapped from the system and faulted in page by page on every call (ResNet-18's
    128 x 28 x 28 2:4 layer, batch 8, 1 thread: 15.4 ms -> 14.6 with allocations that stay mapped)."""
    arrays = _WORK.__dict__.setdefault("arrays", {})
    have = arrays.get(name)
    if have is None or have.numel() < numel:
        with torch.inference_mode(False):  # (a normal tensor: written in place inside and outside inference mode)
            have = arrays[name] = torch.empty(numel, dtype=torch.float32)
    return have[:numel]


#: work items per thread at least, where the pixel tiles are fewer: the rows are split into chunks
ITEMS_PER_THREAD = 4
#: bytes of input a channel chunk reads around a tile at most (``family.forward``: every row of a work item passes
#: over a chunk while its inputs stay in L1). The multiply-adds, one load each, run at L1's pace only from aligned
#: vectors (``SHIFT_SLACK``) and a small footprint: by hand, the kernel's loop on ResNet-18's 2:4 64-channel 56 x 56
#: entries (AMD Zen 4, 1 thread, best of 30): one chunk 1.94 ms (2.0 G vector FMAs/s), chunks of 16 KiB 1.79,
#: shifted planes alone 2.03, both: 8 KiB 1.96, 16 KiB 1.55, 24 KiB 1.56, 32 KiB 1.58, 48 KiB 1.74 (the same loop
#: on offsets folded into 16 KiB: 1.33, 3.1 G/s, the dense convolution's pace). ResNet-18 2:4, batch 1, 1 thread,
#: interleaved medians: one chunk unshifted 0.99x dense channels_last, chunks of 16 KiB 1.01x, shifted 16 KiB
#: 1.09x, shifted 24 KiB 1.15x
CHUNK_BYTES = 24 * 1024
#: the shifted planes' grid (rows of ``Wo`` rounded up to whole vectors) at most this much larger than the
#: unshifted one's (rows of ``Wo`` plus the taps' column shift) for the shifted planes to be taken: they cost
#: ``kw`` planes per input plane (all but one copied from another, contiguous) and the rows' padding to whole
#: vectors, and give aligned loads (ResNet-18: 28 -> 32 columns, 14 -> 16 taken; 7 -> 16 not; 56 -> 56 and 7 -> 8
#: half aligned, ``HALF_ALIGNED``)
SHIFT_SLACK = 1.15
#: rows of the shifted planes a multiple of half the vector's lanes where that pads them less than whole vectors
#: (``_alignment``): ResNet-18's 56 x 56 planes take rows of 56 columns, not 64 (a tap row's shift of 56 floats
#: splits its loads across cache lines, every other row; the grid, the buffer and the kernel's pixels 12.5% fewer),
#: a 7 x 7 plane at batch 1 rows of 8 (unaligned rows of 9 without; at batch > 1 its images side by side are
#: wholly aligned, ``_side_by_side``). ResNet-18 2:4, batch 8, 1 thread, interleaved medians (AMD Zen 4): 64 x 56
#: x 56 1.14x -> 1.29x dense channels_last, the model 1.142x -> 1.174x; batch 1, 512 x 7 x 7
#: 1.51x -> 1.80x
HALF_ALIGNED = True
#: the shifted planes for a conv strided along the rows where they outnumber its stride phases (a 3 x 3 stride 2:
#: 6 planes, a row phase per tap column, against 4 phases): the pack writes half as many planes again, and the
#: kernel measured no faster on the aligned rows. ResNet-18 2:4, batch 8, 1 thread, thread CPU time, medians of 7,
#: pack / kernel ms, shifted then unshifted: 128 x 28 x 28 stride 2 1.2-1.46 / 6.0-6.2 against 0.65-0.71 / 6.0-6.1
#: (the layer 1.05x -> 1.12x dense channels_last), 64 x 56 x 56 stride 2 1.9-2.0 / 5.6-5.9 against 1.6-1.7 /
#: 6.0-6.1 (even: 1.02x / 1.08x); 256 x 14 x 14 stride 2 was unshifted already (rows of 8 either way)
STRIDED_SHIFT = False
#: the shifted planes for weights of at least this density: they read and write ``kw`` planes per input plane, which
#: a sparser weight's fewer multiply-adds do not repay. ResNet-18, 1 thread, batch 8, interleaved medians: 90% csr
#: 2.26x dense channels_last unshifted, 2.06x shifted; 2:4 0.86x unshifted, 0.91x shifted (batch 1: csr 2.59x
#: unshifted, 2.64x shifted)
SHIFT_DENSITY = 0.25
#: bytes of input buffer at most that a call packs before the kernel reads it: a batch's images a few at a time,
#: packed, convolved and unpacked while their buffer and grid are still in the cache (ResNet-18, 1 thread, batch 8,
#: interleaved medians: 90% csr 1.78x dense channels_last with the whole batch packed at once, 2.06x with 4 MiB,
#: 2.03x image by image; 2:4 0.90x, 0.91x, 0.89x; each group also unpacked at once: csr 2.21x, 2:4 0.88x). 2 MiB
#: measured +1-2% (2:4) and -2..+3% (csr) at 1 thread, and fewer images per parallel region at 2: not taken
BUFFER_BYTES = 4 << 20
#: ``BUFFER_BYTES`` where the call runs on more than one thread: each group of images is three parallel regions
#: (pack, kernel, unpack), and each region's end waits for its slowest thread, which on a machine shared with other
#: processes is one descheduled for a time slice. ResNet-18 2:4 layers, batch 8, 2 threads at a load average of
#: 8.5 on 2 cores, interleaved medians of 25 against dense channels_last, 4 MiB / 64 MiB: 64 x 56 x 56 (24 regions
#: / 3) 0.17x / 1.00x, 128 x 28 x 28 0.29x / 0.90x, 256 x 14 x 14 0.47x / 0.79x. (One thread keeps 4 MiB: no
#: region, and the cache wins there; a quiet 2-thread machine could not be had to measure the cache's side)
PARALLEL_BUFFER_BYTES = 64 << 20
#: output rows a block of the kernel computes together where the weight is dense enough (``SHIFT_DENSITY``):
#: each input vector loaded once for the block's rows that read it (``family.forward``; 2:4 weights: 3 loads for
#: 4 multiply-adds against 4). ResNet-18 2:4, 1 thread, interleaved medians (AMD Zen 4, a shared machine): per
#: layer, batch 1, one row / blocks of 2 / of 3: 128 x 28 x 28 1.00x / 1.16x / - dense channels_last, 512 x 7 x
#: 7 1.42x / 1.52x / 1.51x, 256 x 14 x 14 1.12x / 1.14x / 1.05x, 64 x 56 x 56 0.90x / 0.92x / 0.94x; the model,
#: batch 1, 1.149x / 1.164x (the 90% csr weights keep one row: their rows share few inputs)
#: (ResNet-18 2:4, batch 8, 1 thread, a busy shared machine, interleaved medians of 9, against dense channels_last,
#: blocks of 2 / of 4 rows: 64 x 56 x 56 1.14-1.28x / 1.41-1.42x, 128 x 28 x 28 1.17-1.19x / 1.29-1.47x, 256 x 14 x
#: 14 1.11-1.13x / 1.14-1.21x, the stride-2 3 x 3 layers 1.02-1.16x / 1.09-1.20x, 512 x 7 x 7 (images side by side,
#: a one-vector tile at 4 rows) 1.29-1.42x / 0.98-1.02x: ``NARROW_ROWS`` there)
ROWS = 4
#: whether the kernel's work items (image, pixel tile, row chunk) go to the threads one at a time as they come
#: free (``family.Plan.dynamic``: a shared atomic counter) rather than in equal contiguous shares. Off: on a quiet
#: 2-core AMD EPYC (Zen 4), 2 threads, the whole ResNet-18 ran slower with it (interleaved medians of 9: csr 90%
#: batch 1 / 8 1.87x / 1.71x dense channels_last with it, 2.24x / 2.13x without; 2:4 0.97x / 0.91x against
#: 1.14x / 1.19x): the contiguous share keeps each thread's weights and input in its own cache. It only helped
#: where the cores were shared with other processes (a static share waits for a descheduled thread)
DYNAMIC = False
#: an image's input buffer and grid at most, in bytes, for ``family.banded`` to run the call: the pack, kernel and
#: unpack of one image in one work item, its buffer and grid the thread's own, one parallel region a call, where the
#: batch has ``ITEMS_PER_THREAD`` images a thread (ResNet-18 2:4, batch 8, 2 threads, AMD Zen 4, each layer on the
#: model's own input, rotated medians: 64 x 56 x 56 1.19x -> 1.40x dense channels_last, 128 x 28 x 28 1.21x ->
#: 1.33x, 256 x 14 x 14 1.18x -> 1.25x; the model 1.189x -> 1.249x, at 90% csr 2.29x -> 2.44x). Bands of fewer
#: rows than the image's, each band's buffer in L2, lost: narrower tiles, the taps' rows packed again per band (64
#: x 56 x 56 bands of 6 rows 1.13x, the 56 -> 28 stride-2 layer 0.68x; batch 1, the model in bands of 7 rows 0.90x
#: the three kernels). 0: the three kernels always
BAND_BYTES = 8 << 20
#: the rows of a block where ``ROWS`` rows would leave a tile of fewer than ``BLOCK_VECTORS`` vectors (``_rows``):
#: a block holds every row's accumulators, so more rows narrow the tile (``family.plan``), and each entry's fixed
#: cost (its offset, the loop) is then spread over fewer multiply-adds
NARROW_ROWS = 2
BLOCK_VECTORS = 2


def _loaded(key, make):
    """``(loop IR, loaded kernel)`` of ``make()``, kept under ``key``."""
    entry = _KERNELS.get(key)
    if entry is None:
        kernel = make()
        entry = _KERNELS[key] = (kernel, cpp.load(kernel))
    return entry


@functools.lru_cache(maxsize=256)
def _plan(pixels: int, ptype: torch.dtype, bias: bool, rows: int, batch: int, dynamic: bool = False) -> family.Plan:
    return family.plan(CPU, pixels, L.type_of(ptype), bias, rows, batch, dynamic)


def _rows(pixels: int, batch: int) -> int:
    """The output rows a block of the kernel computes together on a grid of ``pixels`` pixels (a weight dense
    enough for blocks, ``SHIFT_DENSITY``): ``ROWS``, or ``NARROW_ROWS`` where ``ROWS`` rows' tile would have
    fewer than ``BLOCK_VECTORS`` vectors."""
    if ROWS > NARROW_ROWS and _plan(pixels, torch.int32, False, ROWS, batch).vectors < BLOCK_VECTORS:
        return NARROW_ROWS
    return ROWS


def _taps(k: int, s: int, dl: int):
    """Each tap's ``(phase, shift)`` along one dimension: the padded input row ``i * dl + s * h`` of output row
    ``h`` is row ``shift + h`` of the phase ``(i * dl) % s``."""
    return [((i * dl) % s, (i * dl) // s) for i in range(k)]


def output_size(sizes, kernel, stride, dilation, pads) -> tuple:
    """The output's spatial size: per dimension, the padded input's positions the dilated kernel fits at, ``stride``
    apart (``pads``: (before, after) per dimension)."""
    return tuple((n + sum(p) - dl * (k - 1) - 1) // s + 1 for n, k, s, dl, p in zip(sizes, kernel, stride, dilation,
                                                                                    pads))


@functools.lru_cache(maxsize=256)
def _geometry(weight_shape, x_shape, stride, dilation, pads, lanes: int):
    """The flat buffer's layout: ``(phases, Hq, Wq, Ho, Wo, shifted)``, ``phases`` the planes, in order, each
    ``Hq x Wq``: ``(a, b)`` holds the padded input's rows ``a + s * i`` and columns ``b + s * j``. Unshifted
    (``lanes`` 1), the stride phases the taps use, a tap a row and column shift in its phase's plane; ``shifted``,
    one plane per (row phase, tap column), so that a tap is a row shift only, and ``Wq`` a multiple of ``lanes``:
    every entry's vectors of pixels are then aligned (loads that split no cache line)."""
    (kh, kw), (h, w) = weight_shape[2:], x_shape[2:]
    rows, cols = _taps(kh, stride[0], dilation[0]), _taps(kw, stride[1], dilation[1])
    ho, wo = output_size((h, w), (kh, kw), stride, dilation, pads)
    hq = ho + max(s for _, s in rows)
    if lanes > 1:
        phases = tuple(sorted({(a, j * dilation[1]) for a, _ in rows for j in range(kw)}))
        return phases, hq, -(-wo // lanes) * lanes, ho, wo, True
    phases = tuple(sorted({(a, b) for a, _ in rows for b, _ in cols}))
    return phases, hq, wo + max(s for _, s in cols), ho, wo, False


def _lanes() -> int:
    """float32 lanes of the target's vectors (1 where it has none)."""
    return CPU.lanes("f32") if CPU.vectors else 1


@functools.lru_cache(maxsize=256)
def _alignment(weight_shape, x_shape, stride, dilation, pads, dense: bool, lanes: int, slack: float,
               half: bool = False, strided: bool = False) -> int:
    """The lanes the planes' rows are aligned to, ``_geometry``'s ``lanes``: the target's ``lanes`` where the
    weight is ``dense`` enough (``SHIFT_DENSITY``) and the shifted grid wastes little more than the unshifted one
    (``slack``: ``SHIFT_SLACK``), else 1 (unshifted); where ``half`` (``HALF_ALIGNED``), half the lanes where
    that pads the rows less (every other tap row's loads split cache lines, the grid and buffer smaller); a conv
    strided along the rows unshifted where its shifted planes outnumber its phases, unless ``strided``
    (``STRIDED_SHIFT``)."""
    if lanes == 1 or not dense:
        return 1
    phases, hq, wq = _geometry(weight_shape, x_shape, stride, dilation, pads, 1)[:3]
    if tuple(weight_shape[2:]) == (1, 1) and hq * wq % lanes == 0:
        # (a 1 x 1 conv's entries read whole planes: aligned already where a plane is whole vectors; ResNet-18's 64
        #  x 56 x 56 stride 2 downsample, 28 x 28 planes, batch 8: 0.68x dense shifted to rows of 32, 0.87x not)
        return 1
    shifted, _, aligned = _geometry(weight_shape, x_shape, stride, dilation, pads, lanes)[:3]
    if stride[1] > 1 and not strided and len(shifted) > len(phases):
        return 1
    if half and lanes > 2:
        # (taken where it pads the rows less than whole vectors and either shortens the unshifted rows or adds no
        #  planes: a strided 3 x 3 conv to 7 x 7 has rows of 8 either way, 6 shifted planes against 4 phases, and
        #  lost: ResNet-18's 256 x 14 x 14 stride 2, batch 8, 1.09x -> 1.01x dense)
        more, halved = _geometry(weight_shape, x_shape, stride, dilation, pads, lanes // 2)[:3:2]
        if halved < aligned and halved <= slack * wq and (halved < wq or len(more) == len(phases)):
            return lanes // 2
    return lanes if aligned <= slack * wq else 1


def stored(weight: SparseTensor):
    """``(leaf, dims)``: each stored weight's value position and its (out, in / groups, kh, kw) coordinates, a
    padded format's padding left out."""
    leaf, dims, inside = storage.coordinates(weight._format, weight._shape, weight._levels)
    if weight._format.padded:
        inside &= ~padding_of(weight)[leaf]
    return leaf[inside], dims[:, inside]


def _entries(weight: SparseTensor, channels: int, groups: int, geometry, stride, dilation, chunk: int):
    """``(pos, off, order)``: the entries of row ``o`` on the input channels ``kc * chunk .. (kc + 1) * chunk``
    at ``pos[kc * out + o] .. pos[kc * out + o + 1]`` (int32), each entry's offset into an image's buffer (int32),
    and the weight's value position of each entry; None where an offset needs 64 bits."""
    phases, hq, wq, _, _, shifted = geometry
    out, cg = weight._shape[0], weight._shape[1]
    if len(phases) * channels * hq * wq + wq >= 2 ** 31:
        return None
    leaf, dims = stored(weight)
    o, c = dims[0], dims[1] + (dims[0] // (out // groups)) * cg  # (the group's channels)
    r, s = dims[2] * dilation[0], dims[3] * dilation[1]
    phase_of = torch.full((stride[0], 1 + max(b for _, b in phases)), -1, dtype=torch.int64)
    for i, (a, b) in enumerate(phases):
        phase_of[a, b] = i
    if shifted:  # (the tap's column is its plane's)
        plane, shift = phase_of[r % stride[0], s] * channels + c, 0
    else:
        plane, shift = phase_of[r % stride[0], s % stride[1]] * channels + c, s // stride[1]
    off = plane * (hq * wq) + (r // stride[0]) * wq + shift
    row = (c // chunk) * out + o
    order = torch.argsort(row * (len(phases) * channels * hq * wq) + off)
    kchunks = -(-channels // chunk)
    pos = torch.zeros(kchunks * out + 1, dtype=torch.int64)
    pos[1:] = torch.bincount(row, minlength=kchunks * out).cumsum(0)
    return pos.to(torch.int32), off[order].to(torch.int32), leaf[order]


def _blocked(pos: torch.Tensor, off: torch.Tensor, order: torch.Tensor, out: int, rows: int, nnz: int):
    """``_entries``' lists for ``family.forward``'s blocks of ``rows`` output rows: per chunk and block, one list
    per subset of the block's rows (``family.subsets``), each entry an offset that exactly those rows read, in
    offset order; ``(pos, off, order)`` with ``rows`` value positions per entry (``nnz`` where the row has none:
    a zero appended to the values)."""
    count = pos[1:].long() - pos[:-1].long()
    kchunks = count.numel() // out
    row = torch.repeat_interleave(torch.arange(count.numel()), count)
    kc, o = row // out, row % out
    blocks = -(-out // rows)
    block = kc * blocks + o // rows
    span = int(off.max()) + 1 if off.numel() else 1
    # (one group per block and offset: the rows that read it)
    groups, inverse = torch.unique(block * span + off.long(), return_inverse=True)
    mask = torch.zeros(groups.numel(), dtype=torch.int64).index_add_(0, inverse, 1 << (o % rows))
    rank = torch.zeros(1 << rows, dtype=torch.int64)
    for i, m in enumerate(family.subsets(rows)):
        rank[m] = i
    S = len(family.subsets(rows))
    g_block, g_off = groups // span, groups % span
    key = (g_block * S + rank[mask]) * span + g_off
    sort = torch.argsort(key)
    values = torch.full((groups.numel(), rows), nnz, dtype=torch.int64)
    values[inverse, o % rows] = order.long()
    new_pos = torch.zeros(kchunks * blocks * S + 1, dtype=torch.int64)
    new_pos[1:] = torch.bincount(g_block * S + rank[mask], minlength=kchunks * blocks * S).cumsum(0)
    return new_pos.to(torch.int32), g_off[sort].to(torch.int32), values[sort].reshape(-1)


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _sources(phases: tuple, sc: int) -> tuple:
    """``(src, sh)`` per phase: the first phase of the same row phase whose columns are this one's shifted by
    ``sh`` columns (``b = b[src] + sc * sh``), -1 and 0 where there is none (the phase is gathered from the input)."""
    src, sh = [], []
    for a, b in phases:
        first = next(k for k, (a2, b2) in enumerate(phases) if a2 == a and b2 % sc == b % sc)
        src.append(-1 if phases[first][1] == b else first)
        sh.append((b - phases[first][1]) // sc)
    return src, sh


@functools.lru_cache(maxsize=256)
def _phase_arrays(phases: tuple, sc: int, pl: int, w: int, wq: int) -> tuple:
    """The int64 arrays ``family.pack`` reads (made once: never written): each phase's row and column offset, its
    columns ``jlo .. jhi`` that fall inside the input (column ``b + sc * j - pl`` in ``[0, w)``), and the phase it
    is copied from shifted (``_sources``)."""
    jlo = [max(0, -(-(pl - b) // sc)) for _, b in phases]
    jhi = [max(lo, min(wq, (w - 1 + pl - b) // sc + 1)) for lo, (_, b) in zip(jlo, phases)]
    return tuple(torch.tensor(v, dtype=torch.int64) for v in ([a for a, _ in phases], [b for _, b in phases], jlo, jhi,
                                                                *_sources(phases, sc)))


def _buffer(x: torch.Tensor, geometry, stride, pads, slack: int, calls=None) -> torch.Tensor:
    """The flat input buffer: per image, per phase, per channel, the padded plane's rows ``a + s * i`` and columns
    ``b + s * j`` (``Hq x Wq``, zeros outside the input), and ``slack`` zeros at the end (``family.pack``: one
    pass, reading ``x`` through its strides)."""
    phases, hq, wq = geometry[:3]
    n, c = x.shape[:2]
    size = n * len(phases) * c * hq * wq
    buf = _workspace("buffer", size + slack)
    buf[size:] = 0
    cl = _channels_last(x)
    kernel, loaded = _loaded(("pack", cl), lambda: family.pack(cl))
    _call(calls, kernel, loaded, {**_pack_args(x, cl, phases, hq, wq, stride, pads), "buf": buf, "n": n,
                                  "nthreads": torch.get_num_threads()})
    return buf


def _pack_args(x: torch.Tensor, cl: bool, phases, hq: int, wq: int, stride, pads) -> dict:
    """``family.pack``'s arguments that describe ``x`` and the planes (``_pack_row``'s, in ``family.banded`` too):
    the phase arrays, ``x`` (a contiguous copy where NCHW rows are not contiguous: ``pack`` reads them with stride
    1), its sizes and strides, the planes' ``Hq x Wq``, the stride and the top and left padding."""
    x = x.contiguous() if not cl and x.stride(3) != 1 else x
    n, c, h, w = x.shape
    arrays = dict(zip(("pa", "pb", "jlo", "jhi", "src_phase", "src_shift"),
                      _phase_arrays(phases, stride[1], pads[1][0], w, wq)))
    return {**arrays, "x": x, "P": len(phases), "C": c, "H": h, "W": w, "Hq": hq, "Wq": wq, "sr": stride[0],
            "sc": stride[1], "pt": pads[0][0], "pl": pads[1][0], **_strides("xs", x)}


def _strides(prefix: str, t: torch.Tensor) -> dict:
    """``t``'s strides as the kernels' ``<prefix>_n``, ``_c``, ``_h``, ``_w`` arguments."""
    return dict(zip((f"{prefix}_{d}" for d in "nchw"), t.stride()))


def _unpack(y: torch.Tensor, geometry, res: torch.Tensor, cl: bool, calls=None) -> None:
    """The ``Wo`` valid columns of the grid ``y`` (images x channels x grid) into ``res`` (the result's images
    ``y`` holds), compact (``family.unpack``), channels_last where ``cl`` (the input's memory format, as torch's
    convolutions do: torch runs BatchNorm on a strided view of the grid 4x slower than on a contiguous tensor, and
    max pooling on channels_last 20x faster than on NCHW)."""
    _, _, wq, ho, wo, _ = geometry
    n, out, grid = y.shape
    kernel, loaded = _loaded(("unpack", cl), lambda: family.unpack(cl))
    _call(calls, kernel, loaded, {"grid": y, "y": res, "n": n, "O": out, "Ho": ho, "Wo": wo, "Wq": wq, "G": grid,
                                  **_strides("ys", res), "nthreads": torch.get_num_threads()})


@functools.lru_cache(maxsize=256)
def _side_by_side_count(weight_shape, x_shape, stride, dilation, pads, lanes: int, slack: float) -> int:
    """The images (2 .. ``SIDE_BY_SIDE``) whose rows joined side by side take the aligned (shifted) planes where
    one image's rows do not (``_alignment``), else 1: stride 1 along the rows only."""
    if lanes == 1 or stride[1] != 1 or x_shape[0] < 2 or \
            _alignment(weight_shape, x_shape, stride, dilation, pads, True, lanes, slack) > 1:
        return 1
    n, c, h, w = x_shape
    sep = sum(pads[1])
    for k in range(2, min(n, SIDE_BY_SIDE) + 1):
        joint = (-(-n // k), c, h, k * w + (k - 1) * sep)
        if _alignment(weight_shape, joint, stride, dilation, pads, True, lanes, slack) > 1:
            return k
    return 1


def _side_by_side(weight: SparseTensor, x: torch.Tensor, bias, stride, dilation, pads, groups: int, k: int,
                  gather=None):
    """``conv2d`` on ``k`` images at a time joined side by side along the rows, each pair apart by the row
    padding's zeros (the left image's right padding and the right one's left: with stride 1, each image's output
    columns read its own columns and those zeros only), then split."""
    n, c, h, w = x.shape
    seg = w + sum(pads[1])
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    joint = torch.empty(-(-n // k), c, h, k * w + (k - 1) * sum(pads[1]), memory_format=fmt).zero_()
    for j in range(k):
        joint[:len(range(j, n, k)), :, :, j * seg:j * seg + w] = x[j::k]
    out = conv2d(weight, joint, bias, stride, dilation, pads, groups, gather)
    if out is None:
        return None
    wo = w + sum(pads[1]) - dilation[1] * (weight._shape[3] - 1)
    res = torch.empty(n, out.shape[1], out.shape[2], wo, memory_format=fmt)
    for j in range(k):
        res[j::k] = out[:len(range(j, n, k)), :, :, j * seg:j * seg + wo]
    return res


def conv2d(weight: SparseTensor, x: torch.Tensor, bias, stride, dilation, pads, groups: int, gather=None,
           keep=None):
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` for a 4-d ``x`` (``pads``: ((top, bottom),
    (left, right))), or None where the kernel does not serve it. ``gather(order)``: the entries' values from their
    positions in ``weight``'s values (``order``, ``nnz`` where an entry has none: 0), where the caller holds them
    elsewhere (``engine.conv_grad``'s phase weights: one gather from the weight's own values, not two). ``keep``:
    ``kept_key``'s key and guards, under which the call's kernel calls are kept for ``run_kept`` where they can be."""
    vals = weight.__dict__.get("_vals")
    if type(vals) is not torch.Tensor or vals.dtype != torch.float32 or x.dtype != torch.float32 or \
            x.device.type != "cpu" or vals.device.type != "cpu" or x.dim() != 4 or len(weight._shape) != 4 or \
            (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu")) or x.numel() == 0 or \
            weight._shape[0] == 0:
        return None
    shapes = (tuple(weight._shape), tuple(x.shape), tuple(stride), tuple(dilation), tuple(map(tuple, pads)))
    dense = weight._vals.numel() >= SHIFT_DENSITY * math.prod(weight._shape)
    k = _side_by_side_count(*shapes, _lanes(), SHIFT_SLACK) if dense and SIDE_BY_SIDE > 1 else 1
    if k > 1:
        return _side_by_side(weight, x, bias, stride, dilation, pads, groups, k, gather)
    geometry = _geometry(*shapes, _alignment(*shapes, dense, _lanes(), SHIFT_SLACK, HALF_ALIGNED, STRIDED_SHIFT))
    phases, hq, wq, ho, wo, _ = geometry
    out = weight._shape[0]
    n, c = x.shape[:2]
    rows = _rows(ho * wq, n) if dense else 1
    p = _plan(ho * wq, torch.int32, bias is not None, rows, n, DYNAMIC)
    band = _band_rows(geometry, c, out, n, torch.get_num_threads(), p.T) if BAND_BYTES else 0
    if band:
        return _banded(weight, x, bias, stride, dilation, pads, groups, geometry, band, gather, keep, dense)
    span, chunk, found = _lists(weight, c, groups, geometry, stride, dilation, rows, p, gather)
    if found is None:
        return None
    pos, off, ordered = found
    grid = -(-ho * wq // p.T) * p.T
    kernel, loaded = _loaded(p, lambda: family.forward(p))
    image = len(phases) * c * hq * wq
    threads = torch.get_num_threads()
    # (a few images at a time, packed, convolved and unpacked while their buffer and grid are in the cache; with
    #  threads, fewer groups: each is three parallel regions)
    group = max(1, min(n, (BUFFER_BYTES if threads == 1 else PARALLEL_BUFFER_BYTES) // (4 * image)))
    m = p.images  # (a kernel item's images: a group's last item reads zero planes past its images)
    group = -(-group // m) * m
    cl = _channels_last(x)
    res = torch.empty(n, out, ho, wo, dtype=x.dtype, memory_format=torch.channels_last if cl else
                      torch.contiguous_format)
    y = _workspace("grid", group * out * grid).view(group, out, grid)
    blocks = -(-out // rows)
    calls = [] if keep is not None and gather is None and n <= group else None  # (one group: three calls)
    for g0 in range(0, n, group):
        g = min(group, n - g0)
        items = -(-g // m)
        buf = _buffer(x[g0:g0 + g], geometry, stride, pads, (items * m - g) * image + grid - ho * wq + wq, calls)
        tiles = grid // p.T
        chunks = 1 if items * tiles >= ITEMS_PER_THREAD * threads or threads == 1 else \
            min(blocks, -(-ITEMS_PER_THREAD * threads // (items * tiles)))
        row_chunk = -(-blocks // chunks)
        args = {"pos": pos, "off": off, "vals": ordered, "x": buf, "y": y[:items * m], "n": items, "x_image": image,
                "grid": grid, "n_out": out, "kchunks": -(-c // chunk), "chunks": -(-blocks // row_chunk),
                "row_chunk": row_chunk, "nthreads": threads, "C": c, "P": len(phases), "plane": hq * wq,
                "cc": chunk, "span": span}
        if bias is not None:
            args["bias"] = bias.detach().contiguous()
        _call(calls, kernel, loaded, args)
        _unpack(y[:g], geometry, res[g0:g0 + g], cl, calls)
    if calls is not None:
        _keep(keep, x, res, calls, y.numel())
    return res


def _lists(weight: SparseTensor, c: int, groups: int, geometry, stride, dilation, rows: int, p: family.Plan, gather):
    """``(span, chunk, found)``: a tile's inputs in each plane, the entries' channel chunk, and ``(pos, off, values)``
    of the entries on ``geometry``'s buffer, the values in the entries' order (``gather(order)`` where given, see
    ``conv2d``), or None where an offset needs 64 bits."""
    phases, hq, wq, ho, wo, shifted = geometry
    vals = weight._vals
    span = p.T + (hq - ho) * wq + (0 if shifted else wq - wo)  # (a tile's inputs in each plane)
    chunk = max(1, CHUNK_BYTES // (4 * len(phases) * span * p.images))
    key = ("direct", tuple(weight._shape), c, groups, phases, hq, wq, tuple(stride), tuple(dilation), chunk, rows)

    def build():
        with torch.no_grad():
            found = _entries(weight, c, groups, geometry, stride, dilation, chunk)
            return found if found is None or rows == 1 else _blocked(*found, weight._shape[0], rows, vals.numel())
    found = _ENTRIES.lookup(key, weight._levels, build)
    if found is None:
        return span, chunk, None
    pos, off, order = found
    # (``index_select``: half the time of indexing, ResNet-18 2:4's 1.2 M values a layer, 1 thread)
    return span, chunk, (pos, off, gather(order) if gather is not None else _VALUES.lookup(
        key, vals, lambda: torch.cat([vals.detach(), vals.new_zeros(1)]).index_select(0, order), (order,)))


def _band_rows(geometry, c: int, out: int, n: int, threads: int, tile: int) -> int:
    """The output rows of ``family.banded``'s bands: the image's (``ho``) where its buffer and grid (``tile``
    pixels a tile) fit ``BAND_BYTES`` and the batch has ``ITEMS_PER_THREAD`` images a thread, else 0 (the three
    kernels)."""
    phases, hq, wq, ho = geometry[:4]
    grid = -(-ho * wq // tile) * tile
    if n < ITEMS_PER_THREAD * threads or 4 * (len(phases) * c * hq * wq + out * grid) > BAND_BYTES:
        return 0
    return ho


def _banded(weight: SparseTensor, x: torch.Tensor, bias, stride, dilation, pads, groups: int, geometry, rb: int,
            gather, keep, dense: bool):
    """``conv2d`` by ``family.banded`` (one call): bands of ``rb`` output rows, a band's buffer laid out as an image
    of ``rb`` output rows (its entries' offsets made for it); ``dense``: the weight takes blocks of rows."""
    phases, hq, wq, ho, wo, shifted = geometry
    band = (phases, hq - ho + rb, wq, rb, wo, shifted)
    n, c = x.shape[:2]
    out = weight._shape[0]
    rows = _rows(rb * wq, 1) if dense else 1
    p = _plan(rb * wq, torch.int32, bias is not None, rows, 1, True)
    span, chunk, found = _lists(weight, c, groups, band, stride, dilation, rows, p, gather)
    if found is None:
        return None
    pos, off, ordered = found
    grid = -(-rb * wq // p.T) * p.T
    cl = _channels_last(x)
    res = torch.empty(n, out, ho, wo, dtype=x.dtype, memory_format=torch.channels_last if cl else
                      torch.contiguous_format)
    kernel, loaded = _loaded(("banded", p, cl), lambda: family.banded(p, cl))
    image = len(phases) * c * band[1] * wq
    # (an input ``_pack_args`` copies first is not the caller's tensor: ``_keep`` then keeps nothing)
    args = {**_pack_args(x, cl, phases, band[1], wq, stride, pads), "pos": pos, "off": off, "vals": ordered,
            "y": res, "n": n, "bands": -(-ho // rb), "Rb": rb, "buf_size": image + grid - rb * wq + wq,
            "x_image": image, "grid": grid, "n_out": out, "kchunks": -(-c // chunk), "row_chunk": -(-out // rows),
            "plane": band[1] * wq, "cc": chunk, "span": span, "Ho": ho, "Wo": wo, **_strides("ys", res),
            "nthreads": torch.get_num_threads()}
    if bias is not None:
        args["bias"] = bias.detach().contiguous()
    calls = [] if keep is not None and gather is None else None
    _call(calls, kernel, loaded, args)
    if calls is not None:
        _keep(keep, x, res, calls, 0)
    return res


def _call(calls, kernel, loaded, values: dict) -> None:
    """``cpp.call``, appended to ``calls`` where it is a list (a call ``_keep`` may keep)."""
    if calls is not None:
        calls.append((kernel, loaded, values))
    cpp.call(kernel, loaded, values)


#: eager convolutions' kernel calls kept (``_keep``), by ``kept_key``: an eval model's conv call was about 0.09 ms
#: of Python over its three kernel calls (the plan, geometry and memo lookups, the arguments' binding)
_KEPT: dict = {}
#: entries at most (the oldest dropped first): a model's convolutions, one entry each per input shape
KEPT_LIMIT = 512
#: keys whose kept calls went stale (the weight or bias changed in place since, as in a compiled training step, whose
#: forward runs without gradients): ``(times, the guards' versions at the last call not kept)``. After
#: ``CHANGES`` times a key is kept again only once two calls in a row see the same versions (keeping costs about a
#: plain call's Python again)
_CHANGED: dict = {}
CHANGES = 2


def _clear_kept() -> None:
    _KEPT.clear()
    _CHANGED.clear()


register("conv-direct kept calls", "eager sparse convolutions' pack, kernel and unpack calls with their arguments "
         "bound, by the weight's arrays, the bias, the input's shape and strides and the thread count",
         _KEPT.__len__, _clear_kept)


def _settings() -> tuple:
    """The module's choices a call's kernels follow (a kept call is made again only under the same ones)."""
    return (SIDE_BY_SIDE, ITEMS_PER_THREAD, CHUNK_BYTES, SHIFT_SLACK, HALF_ALIGNED, STRIDED_SHIFT, SHIFT_DENSITY,
            BUFFER_BYTES, PARALLEL_BUFFER_BYTES, ROWS, DYNAMIC, NARROW_ROWS, BLOCK_VECTORS, BAND_BYTES, _lanes,
            id(CPU))


def kept_key(d: int, x, weight, bias, stride, padding, dilation, groups):
    """``(key, guards)`` of ``F.conv<d>d(x, weight, bias, ...)``'s kept call, the key made from the arguments as the
    caller gave them, or None where no call is kept for it: not a 2-d float convolution of a plain batched input
    without gradients, or arguments that are not hashable. The guards (``weights_kept.guards``: the weight's arrays
    and values, the bias) are in the key by identity and checked by version at each call."""
    if d != 2 or type(x) is not torch.Tensor or x.layout != torch.strided or x.dim() != 4 or \
            type(weight) is not SparseTensor or \
            (bias is not None and type(bias) not in (torch.Tensor, torch.nn.Parameter)):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or weight._vals.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return None
    guards = weights_kept.guards(weight, bias)
    try:
        key = (tuple(map(id, guards)), weight._format, tuple(weight._shape), x.shape, x.stride(), x.dtype, x.device,
               stride, padding, dilation, groups, torch.get_num_threads(), _settings())
        hash(key)
    except TypeError:  # (a list among the arguments)
        return None
    return key, guards


def run_kept(kept, x: torch.Tensor):
    """The convolution of ``x`` through the calls kept under ``kept`` (``kept_key``'s, by ``_keep``), or None where
    there are none or a guard is no longer the same object, unmodified."""
    key, guards = kept
    entry = _KEPT.get(key)
    if entry is None:
        return None
    refs, versions, steps, size, slack, grid, shape, strides, _ = entry
    if any(r() is not g for r, g in zip(refs, guards)):
        return None
    if any(g._version != v for g, v in zip(guards, versions)):
        del _KEPT[key]
        while len(_CHANGED) >= KEPT_LIMIT:
            del _CHANGED[next(iter(_CHANGED))]
        _CHANGED[key] = (_CHANGED.pop(key, (0,))[0] + 1, None)
        return None
    if size:  # (the three calls' buffer and grid; a banded call has its own)
        buf = _workspace("buffer", size + slack)
        buf[size:] = 0
        pointers = (x.data_ptr(), buf.data_ptr(), _workspace("grid", grid).data_ptr())
    else:
        pointers = (x.data_ptr(), 0, 0)
    res = torch.empty_strided(shape, strides, dtype=x.dtype)
    pointers += (res.data_ptr(),)
    for fn, pack, args, places in steps:
        args = list(args)
        for at, slot in places:
            args[at] = pointers[slot]
        if pack is not None:
            fn(pack(*args))
        else:
            fn(*args)
    return res


def _keep(kept, x, res, calls, grid: int) -> None:
    """Keep, under ``kept`` (``kept_key``'s), the pack, kernel and unpack calls that made ``res`` from ``x``, where
    they are certainly that: the pack read ``x`` itself (not a copy) into the buffer workspace, the kernel read the
    buffer into the grid workspace, the unpack wrote ``res``. The workspaces are looked up again at each call (per
    thread, grown by other calls). Or the one banded call (``_banded``) that read ``x`` itself and wrote ``res``."""
    key, guards = kept
    if len(calls) not in (1, 3) or any(g.is_inference() for g in guards):
        return
    changed = _CHANGED.get(key)
    if changed is not None and changed[0] >= CHANGES:
        versions = [g._version for g in guards]
        if changed[1] != versions:  # (still changing from call to call: not kept this time)
            _CHANGED[key] = (changed[0], versions)
            return
        del _CHANGED[key]
    pv, uv = calls[0][2], calls[-1][2]
    if pv["x"].data_ptr() != x.data_ptr() or pv["x"].stride() != x.stride() or uv["y"].data_ptr() != res.data_ptr():
        return
    slots = {id(pv["x"]): 0, id(uv["y"]): 3}
    size = slack = 0
    if len(calls) == 3:
        buf, y = pv["buf"], calls[1][2]["y"]
        if calls[1][2]["x"] is not buf or uv["grid"].data_ptr() != y.data_ptr():
            return
        size = pv["n"] * pv["P"] * pv["C"] * pv["Hq"] * pv["Wq"]
        slack = buf.numel() - size
        slots.update({id(buf): 1, id(y): 2, id(uv["grid"]): 2})
    steps, held = [], []
    for kernel, loaded, values in calls:
        names = [p.name for p in kernel.params]
        args = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in (values[n] for n in names)]
        places = tuple((i, slots[id(values[n])]) for i, n in enumerate(names) if id(values[n]) in slots)
        held += [v for v in values.values() if isinstance(v, torch.Tensor) and id(v) not in slots]
        packed = getattr(loaded, "packed", None)
        steps.append((loaded.fn, None, tuple(args), places) if packed is None else
                     (packed, struct.Struct(cpp.pack_format(kernel)).pack, tuple(args), places))
    while len(_KEPT) >= KEPT_LIMIT:
        del _KEPT[next(iter(_KEPT))]

    def drop(_ref, key=key, entries=_KEPT):  # (a guard died: its id may be reused)
        entries.pop(key, None)
    _KEPT[key] = ([weakref.ref(g, drop) for g in guards], [g._version for g in guards], steps, size, slack, grid,
                  tuple(res.shape), res.stride(), held)
