"""``F.linear`` with a sparse weight: the weight's arrays bound to the kernel family of ``compiler.weights``.

``applies(weight, x)`` says whether the family serves a product (a CSR, BSR or n:m weight on the CPU, values of
the activation's float type); ``linear(weight, x, bias)`` runs it, ``x`` (tokens x in) row-major in, the result
(tokens x out) row-major out. Kernels are generated per plan (``compiler.weights.Tiles``: the format, types, the
tile shape the target's vectors and the token count pick, the epilogue) and kept.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from .. import loopir as L
from ..compiler import weights as family
from ..compiler import weights_amx as tile_kernels
from ..compiler import weights_bits as bitmap
from ..compiler import weights_chain as chain
from ..compiler import weights_depth as depth
from ..compiler import weights_grad as grads
from ..compiler import weights_picks as picks
from ..compiler import weights_tiled as tiled
from ..compiler.caches import cache, register
from ..compiler.codegen import cpp
from ..compiler.target import CPU, cpu_flags
from ..formats import named
from ..formats.format import nm_size
from ..formats.storage import PatternMemo, ValuesMemo, coordinates
from ..sparse_tensor import SparseTensor
from . import amx
from .weights_depth import laid as _depth_laid
from .weights_kept import call as _call, guards as _guards, kept as _kept

_KERNELS = cache("weights", "kernels of the dense-activation x sparse-weight family per plan")
#: the float types the family computes in (16-bit values widened in the panel and at each weight)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: work items per thread at least, where the token tiles are fewer: the rows are split into chunks
ITEMS_PER_THREAD = 4


def kind_of(weight: SparseTensor):
    """``(kind, block, group)`` of a weight the family reads, else None."""
    return _kind(weight._format)


@functools.lru_cache(maxsize=256)
def _kind(fmt):
    """(``kind_of``, once per format: naming a format builds the named ones to compare with)"""
    name = named.name_of(fmt)
    if name == "csr":
        return "csr", (1, 1), (1, 1)
    if name and name.startswith("bsr"):
        return "bsr", named.block_size(fmt), (1, 1)
    nm = nm_size(fmt)
    if nm is not None:
        return "nm", (1, 1), nm
    return None


def applies(weight, x) -> bool:
    """Whether ``linear(weight, x)`` runs here: a 2-d sparse weight the family reads, whose values are a plain
    tensor of ``x``'s float dtype, both on the CPU (BSR: its blocks tiling the shape)."""
    if type(weight) is not SparseTensor or type(x) is not torch.Tensor or x.dim() != 2:
        return False
    vals = weight.__dict__.get("_vals")
    if type(vals) is not torch.Tensor or vals.dtype != x.dtype or x.dtype not in DTYPES or \
            vals.device.type != "cpu" or x.device.type != "cpu" or len(weight._shape) != 2:
        return False
    kind = kind_of(weight)
    if kind is None or not family.serves(CPU, kind[0], x.shape[0]):
        return False
    if kind[0] == "bsr":
        (bh, bw), (o, i) = kind[1], weight._shape
        return o % bh == 0 and i % bw == 0
    return True


def plan_for(weight: SparseTensor, tokens: int, bias: bool, transposed=False, arrays=None,
             activation=None) -> family.Tiles:
    """The plan of a product with ``weight`` at ``tokens`` tokens; ``arrays``: its ``_arrays`` where the caller
    has them (the index types are read from them); ``activation``: the epilogue's (``loopir.ACTIVATIONS``)."""
    kind, block, group = kind_of(weight)
    arrays = _arrays(weight) if arrays is None else arrays
    ptype = L.type_of(arrays["pos"].dtype) if "pos" in arrays else "i64"
    vtype = L.type_of(weight._vals.dtype)
    tiles = amx.mode() if kind == "bsr" and vtype == "bf16" and not transposed else ""
    return family.tiles(replace(CPU, amx=tiles) if tiles else CPU, kind, tokens, vtype, vtype, ptype,
                        L.type_of(arrays["crd"].dtype), block, group, bias, transposed, activation)


def _kernel(plan: family.Tiles, part: str = "forward"):
    """``(loop IR, loaded kernel)`` of ``part`` ("forward", "input_grad", "weight_grad") for ``plan``, kept."""
    entry = _KERNELS.get((plan, part))
    if entry is None:
        build = {"forward": picks.forward if plan.picks else depth.forward if plan.depth else
                 tile_kernels.forward if plan.amx else family.forward,
                 "dots": family.row_dots, "depth_conv": depth.conv_forward,
                 "bits": bitmap.row_bits, "pair_tiles": tiled.forward,
                 "conv": functools.partial(picks.forward, conv=True), "picks_dw": picks.weight_grad,
                 "decode": picks.decode,
                 "input_grad": grads.backward_input,
                 "weight_grad": grads.block_weight_grad if grads.blocks_by_columns(plan) else grads.weight_grad}
        kernel = build[part](plan)
        entry = _KERNELS[(plan, part)] = (kernel, cpp.load(kernel))
    return entry


def _arrays(weight: SparseTensor) -> dict:
    """The weight's index arrays the kernels read: ``pos`` and ``crd`` of its compressed level as held (n:m: the
    offsets, as ``crd``; a packed weight's 16-bit columns as they are, ``storage.packed_coordinates``, not the
    level's wide view), other coordinates narrowed (``narrow``)."""
    arrays = [lv for lv in weight._levels if lv.arrays()][-1].arrays()
    out = {k: arrays[k] for k in ("pos", "crd") if k in arrays}
    if "pos" in out:
        out["crd"] = narrow(out["crd"], weight._shape[1], weight._levels)
    return out


#: 16-bit copies of weights' coordinates (``narrow``), by the weight's index arrays
_NARROW = PatternMemo(1024)
register("narrow coordinates", "16-bit copies of sparse weights' coordinates, by the weight's index arrays",
         _NARROW.__len__, _NARROW.clear)
#: the largest extent whose coordinates are stored in 16 bits
NARROW_EXTENT = 2 ** 15


def narrow(crd: torch.Tensor, extent: int, levels) -> torch.Tensor:
    """``crd`` as int16 where ``extent`` (the largest coordinate + 1) allows it, made once per pattern: the product's
    speed at a few tokens is bound by the weight's bytes, 8 a stored value with int32 coordinates, 6 with int16
    (and 4 with bfloat16 values). The int16 copy is kept beside the tensor's own coordinates: a weight stored
    packed (``scorch.nn``'s sparsifiers and schedules make them so) holds int16 columns itself and needs none."""
    if crd.dtype == torch.int16 or extent > NARROW_EXTENT or crd.device.type != "cpu":
        return crd
    return _NARROW.lookup(("crd", extent), levels, lambda: crd.to(torch.int16))


def _run(part: str, plan: family.Tiles, shape, arrays: dict, n: int, chunks: int, row_chunk: int, **args):
    """Run ``part`` of ``plan`` on a weight of ``shape`` held in ``arrays`` (``pos``, ``crd``, ``vals``)."""
    kernel, loaded = _kernel(plan, part)
    n_out, n_in = shape
    _call(kernel, loaded, {**arrays, "n": n, "n_in": n_in, "n_out": n_out, "groups": n_in // plan.group[1],
                           "chunks": chunks, "row_chunk": row_chunk, "nthreads": torch.get_num_threads(), **args})


def _bias(bias, dtype) -> dict:
    """The kernels' bias argument: ``{"bias": bias}`` in ``dtype``, contiguous; nothing without a bias."""
    return {} if bias is None else {"bias": bias.to(dtype).contiguous()}


def _forward(plan: family.Tiles, weight: SparseTensor, arrays: dict, n: int, extra: dict, **args) -> None:
    """``plan``'s forward kernel over ``n`` tokens and every row of ``weight`` (``arrays``: its index arrays and
    values as the plan reads them; ``extra``: ``_bias``), the rows split among the threads (``_split``)."""
    _run("forward", plan, weight._shape, arrays, n, *_split(plan, n, weight._shape[0], torch.get_num_threads()),
         **args, **extra)


#: bitmaps of weights' patterns (``_bitmap``), by the weight's index arrays
_BITMAPS = PatternMemo(1024)
register("weight bitmaps", "a bit per column of sparse weights' patterns, with each row's first value, by the"
         " weight's index arrays (one token's product, ``compiler.weights.row_bits``)", _BITMAPS.__len__,
         _BITMAPS.clear)
#: the least density at which one token reads a weight through its bitmap rather than its coordinates, by the
#: values' type. Measured on Llama-MLP shapes (11008 x 4096 both ways, 2 threads, AMD Zen 4): float32 through
#: 16-bit coordinates and gathers was faster at 10% and level at 30%, the bitmap faster at 50% and 2:4 (the
#: expand of each group of 16 columns costs more than a gather of 16 entries where few columns are kept);
#: bfloat16 has no gather path (the general kernel), and the bitmap was faster down to 10%. With AVX2's vectors
#: (8 lanes: a table permute or byte shuffle per 8 columns, not one expand per 16) on an AMD Zen 3, 4096 -> 11008,
#: 2 threads: float32 the same (bitmap at 50% 5.8 ms against 6.5, level at 40%, coordinates faster at 30%),
#: bfloat16 the bitmap faster at 20% (3.3 against 3.9 ms), the coordinates from 15% down (3.4 against 4.5).
#: Again after the bitmap's rows that end a vector's values before the values' end read every group whole (no
#: test of the end a group; AVX2, the same machine and shape): float32 level at 30% (3.7 against 3.9 ms), the
#: coordinates faster at 20% (3.2 against 4.7); bfloat16 the bitmap faster at 20% (2.6 against 4.3 ms), level at 10%.
BITS_DENSITY = {"f32": 0.35, "bf16": 0.06 if CPU.lanes(family.F32) >= 16 else 0.12}


def _row_ordered(weight: SparseTensor):
    """``(rows, cols)`` of the stored values where they are in row order with increasing columns and every stored
    slot is an entry (the values' own order, no padding or repeated coordinate), else None."""
    n_in = weight._shape[1]
    leaf, dims, inside = coordinates(weight._format, weight._shape, weight._levels)
    rows, cols = dims[0], dims[1]
    flat = rows * max(n_in, 1) + cols
    if not (bool(inside.all()) and bool((leaf == torch.arange(leaf.numel())).all()) and
            bool((flat[1:] > flat[:-1]).all())):
        return None
    return rows, cols


def _bitmap(weight: SparseTensor):
    """``(pos, bits)``: each row's first stored value and a 16-bit word per 16 columns of each row (bit ``u``: the
    column holds the row's next value), or None where the values are not in that order (a coordinate repeated, as
    an n:m format's padding repeats its row's last one, or out of order). Made once per pattern."""
    def make():
        n_out, n_in = weight._shape
        found = _row_ordered(weight)
        if found is None:
            return None
        rows, cols = found
        words = _words(n_in)
        word = torch.zeros(n_out * words, dtype=torch.int32)
        word.index_add_(0, rows * words + cols // L.BITS, torch.ones_like(cols, dtype=torch.int32)
                        << (cols % L.BITS).to(torch.int32))
        itype = torch.int32 if rows.numel() < 2 ** 31 else torch.int64
        pos = torch.zeros(n_out + 1, dtype=torch.int64)
        pos[1:] = torch.bincount(rows, minlength=n_out).cumsum(0)
        return pos.to(itype), word.to(torch.int16)
    return _BITMAPS.lookup(("bits", weight._format, tuple(weight._shape)), weight._levels, make)


#: the pair numbers of 2:4 weights' groups (``_combos``), by the weight's index arrays
_COMBOS = PatternMemo(1024)
register("weight pair numbers", "the pair of columns each group of a 2:4 weight keeps, numbered (the bfloat16"
         " kernel's panel of pairs, ``compiler.weights.COMBOS``), by the weight's index arrays", _COMBOS.__len__,
         _COMBOS.clear)


def _combos(weight: SparseTensor, crd: torch.Tensor):
    """An int8 per group of 4 columns of a 2:4 weight: which pair of its columns the group keeps (``COMBOS``), or
    None where a group is padded (fewer than 2 entries: its offsets repeat). Made once per pattern."""
    def make():
        a, b = crd[0::2].long(), crd[1::2].long()
        return ((a * (5 - a)) // 2 + b - 1).to(torch.int8) if bool((a < b).all()) else None
    return _COMBOS.lookup(("combos", tuple(weight._shape)), weight._levels, make)


def _words(n_in: int) -> int:
    """16-bit bitmap words of a row of ``n_in`` columns: a multiple of ``row_bits``'s words at a time, in 16 or 32
    bits (its rows then start on a 32-bit word)."""
    step = 2 * bitmap.BIT_WORDS
    return -(-n_in // (L.BITS * step)) * step


def _by_bits(weight: SparseTensor, x: torch.Tensor, bias, kind: str, activation=None):
    """One token's product read through the weight's bitmap (``row_bits``), or None where that is not the faster
    path (the weight below ``BITS_DENSITY``) or the values are not in bitmap order."""
    n_out, n_in = weight._shape
    vtype = L.type_of(weight._vals.dtype)
    if not bitmap.bits(kind, vtype, x.shape[0], CPU) or weight._vals.numel() < BITS_DENSITY[vtype] * n_out * n_in:
        return None
    found = _bitmap(weight)
    if found is None:
        return None
    pos, words = found
    count = _words(n_in)
    # (bfloat16 values and token on 16-lane vectors: 32-column groups dotted in pairs, the token as it is)
    pairs = vtype == "bf16" and x.dtype == torch.bfloat16 and CPU.lanes(family.F32) == L.BITS
    xp = torch.zeros(count * L.BITS, dtype=torch.bfloat16 if pairs else torch.float32)
    xp[:n_in] = x[0]
    plan = family.tiles(CPU, "csr", 1, vtype, "bf16" if pairs else family.F32, L.type_of(pos.dtype), "i16",
                        bias=bias is not None, activation=activation)
    plan = replace(plan, pairs=pairs)
    words = words.view(torch.int32) if pairs else words
    kernel, loaded = _kernel(plan, "bits")
    y = torch.empty(1, n_out)
    extra = _bias(bias, weight._vals.dtype)
    _call(kernel, loaded, {"pos": pos, "bits": words, "vals": weight._vals, "x": xp, "y": y, "n_out": n_out,
                           "words": count, **extra})
    return y if x.dtype == torch.float32 else y.to(x.dtype)


#: the pair operations of CSR weights in column tiles (``_pair_tiles``), by the weight's index arrays
_PAIR_TILES = PatternMemo(1024)
register("weight pair tiles", "CSR weights' entries as pair operations in column tiles (bfloat16 at a few tokens,"
         " ``compiler.weights_tiled``), by the weight's index arrays", _PAIR_TILES.__len__, _PAIR_TILES.clear)
#: the values of those operations (two a pair, a zero where the row keeps one feature), by the values tensor
_PAIR_WORDS = ValuesMemo(1024)
register("weight pair values", "the bfloat16 values of CSR weights' pair operations, by the values tensor (remade"
         " when the values change)", _PAIR_WORDS.__len__, _PAIR_WORDS.clear)
#: the least density at which a bfloat16 CSR weight takes ``pair_tiles``. Measured against the float32 panel's
#: kernel (1 thread, interleaved medians, AMD Zen 4): 4096 -> 11008 at 16 tokens 50% 1.87x, 30% (64 tokens)
#: 1.62x, 20% 1.00x, 10% 0.83x; 768 -> 3072 at 20% 1.03-1.08x, at 10% 0.83-0.95x (3072 -> 768 at 1024 tokens,
#: whose float32 panel is 384 KiB, 1.23x): below ~20% too many pairs hold one entry
PAIR_TILES_DENSITY = 0.2


#: whether bfloat16 CSR products may take ``pair_tiles``: None lets the CPU decide (``pair_tiles_serve``), True or
#: False forces it (tests, and the sanitizer run, on any CPU)
PAIR_TILES = None


def pair_tiles_serve(kind: str, vtype: str, xtype: str, tokens: int, density: float) -> bool:
    """Whether a product runs as ``weights_tiled.forward``: a CSR weight of bfloat16 values at ``PAIR_TILES_DENSITY``
    or more or a 2:4 one, a bfloat16 activation, at least two tokens, a CPU whose vectors hold 16 floats and that
    multiplies bfloat16 pairs (AVX512-BF16: elsewhere a ``PairDot`` is lane by lane, slower than the float32
    panel)."""
    if not (kind in ("csr", "nm") and vtype == xtype == "bf16" and tokens >= 2 and density >= PAIR_TILES_DENSITY):
        return False
    return PAIR_TILES if PAIR_TILES is not None else \
        CPU.lanes(family.F32) == 16 and "avx512_bf16" in (cpu_flags() or ())


def _pair_tiles(weight: SparseTensor, T: int):
    """``(seg, idx, dest, operations, tiles)`` of ``weights_tiled``'s layout for tiles of ``T`` tokens, ``dest``
    taking each stored value to its place in the operations' values (``2 * operation + column % 2``), or None where
    the values are not in row order with increasing columns (``_row_ordered``); ``_tile_segments`` the rest. Made
    once per pattern."""
    def make():
        n_out, n_in = weight._shape
        found = _row_ordered(weight)
        if found is None:
            return None
        rows, cols = found
        pairs = (n_in + 1) // 2
        keys, op = torch.unique_consecutive(rows * pairs + cols // 2, return_inverse=True)
        seg, idx, at, total, tiles = _tile_segments(keys // pairs, keys % pairs, n_out, pairs,
                                                    tiled.tile_pairs(T), T, family.STORE_ROWS)
        return seg, idx, 2 * at[op] + cols % 2, total, tiles
    return _PAIR_TILES.lookup(("pair tiles", T, weight._format, tuple(weight._shape)), weight._levels, make)


def _combo_tiles(weight: SparseTensor, T: int, combo: torch.Tensor):
    """``_pair_tiles`` of a 2:4 weight whose groups each keep two columns (``combo``: the pair's number in
    ``COMBOS``, ``_combos``): an operation a row's group, against the panel vector of the group's pair (``6 * group
    + combo``) with the group's two values as they are stored. Made once per pattern."""
    def make():
        n_out, n_in = weight._shape
        groups = n_in // 4
        o = torch.arange(n_out).repeat_interleave(groups)
        g = torch.arange(groups).repeat(n_out)
        seg, idx, at, total, tiles = _tile_segments(o, g * len(family.COMBOS) + combo.long(), n_out,
                                                    len(family.COMBOS) * groups, tiled.tile_units(T, True), T,
                                                    tiled.COMBO_ROWS)
        return seg, idx, (2 * at).repeat_interleave(2) + torch.arange(2).repeat(at.numel()), total, tiles
    return _PAIR_TILES.lookup(("combo tiles", T, tuple(weight._shape)), weight._levels, make)


def _tile_segments(o: torch.Tensor, k: torch.Tensor, n_out: int, units: int, TP: int, T: int, R: int) -> tuple:
    """``(seg, idx, at, operations, tiles)``: operations of rows ``o`` against panel vectors ``k`` (``units`` of
    them, in tiles of ``TP``; the rows in blocks of ``R``), in row order and increasing ``k``, laid out as
    ``weights_tiled`` reads them; ``at`` each operation's place. Each operation's 16-bit field is its vector's
    offset in the tile's panel (``k % TP`` times ``T``: the kernel adds it to the tile's start, no multiply an
    operation). Each segment is padded to whole groups of ``UNROLL`` operations (values zero, the vector of the
    segment's last operation: no feature the row does not read already), so that a group's fields are one 64-bit
    word of ``idx``, as the kernel reads them; ``idx`` (and the values, ``_by_pair_tiles``) run ``AHEAD``
    operations past the last segment, which the kernel's prefetches reach without a bound."""
    tiles, blocks = max(1, -(-units // TP)), -(-n_out // R)
    segment = ((o // R) * tiles + k // TP) * R + o % R
    order = torch.argsort(segment, stable=True)
    counts = torch.bincount(segment, minlength=blocks * tiles * R)
    U = tiled.UNROLL
    seg, first = (torch.zeros(blocks * tiles * R + 1, dtype=torch.int64) for _ in range(2))
    seg[1:] = ((counts + U - 1) // U * U).cumsum(0)
    first[1:] = counts.cumsum(0)
    ordered = segment[order]
    at = torch.empty_like(order)  # (each operation's place, in the padded segments)
    at[order] = seg[ordered] + torch.arange(order.numel()) - first[ordered]
    total = int(seg[-1])
    idx = torch.zeros(total + tiled.AHEAD, dtype=torch.int16)
    idx[at] = ((k % TP) * T).to(torch.int16)
    pad = torch.zeros(total + tiled.AHEAD, dtype=torch.bool)
    pad[:total] = True
    pad[at] = False
    owner = torch.repeat_interleave(torch.arange(counts.numel()), seg.diff())
    idx[pad] = idx[(seg[:-1] + counts - 1)[owner[pad[:total]]]]
    itype = torch.int32 if 2 * total < 2 ** 31 else torch.int64
    return seg.to(itype), idx.view(torch.int64), at, total, tiles


def _by_pair_tiles(weight: SparseTensor, x: torch.Tensor, plan: family.Tiles, extra: dict, combo=None):
    """``linear`` through ``weights_tiled`` where it serves, else None; ``combo``: a 2:4 weight's pair numbers
    (``_combos``), its groups then the operations (``_combo_tiles``)."""
    n_out, n_in = weight._shape
    vals = weight._vals
    if not pair_tiles_serve(plan.kind, plan.vtype, plan.xtype, x.shape[0], vals.numel() / max(n_out * n_in, 1)):
        return None
    found = _pair_tiles(weight, plan.T) if combo is None else _combo_tiles(weight, plan.T, combo)
    if found is None:
        return None
    seg, idx, dest, count, tiles = found

    def words():
        out = torch.zeros(2 * (count + tiled.AHEAD), dtype=vals.dtype)
        out[dest] = vals.detach()
        return out
    plan = replace(tiled.planned(plan), ptype=L.type_of(seg.dtype))
    y = torch.empty(x.shape[0], n_out, dtype=x.dtype)
    chunks, row_chunk = _split(plan, x.shape[0], n_out, torch.get_num_threads())
    kernel, loaded = _kernel(plan, "pair_tiles")
    packed = _PAIR_WORDS.lookup(("pairs", plan.T), vals, words, (dest,))
    _call(kernel, loaded, {"seg": seg, "idx": idx, "words": packed,
                           "x": x, "y": y, "n": x.shape[0], "n_in": n_in, "n_out": n_out, "groups": n_in,
                           "chunks": chunks, "row_chunk": row_chunk, "nthreads": torch.get_num_threads(),
                           "tiles": tiles, **extra})
    return y


#: n:4 weights' in-group columns as ``weights_picks`` reads them, by the weight's index arrays
_PICK_FIELDS = PatternMemo(1024)
register("weight lane fields", "the in-group columns of n:4 weights, 2 bits a stored value, a byte a row and group,"
         " in row blocks of a vector's lanes (``compiler.weights_picks``), by the weight's index arrays",
         _PICK_FIELDS.__len__, _PICK_FIELDS.clear)
#: their values in the same layout, by the values tensor
_PICK_VALUES = ValuesMemo(1024)
register("weight lane values", "the values of n:4 weights in row blocks of a vector's lanes"
         " (``compiler.weights_picks``), by the values tensor (remade when the values change)",
         _PICK_VALUES.__len__, _PICK_VALUES.clear)


def _lane_blocks(t: torch.Tensor, rows: int, lanes: int) -> torch.Tensor:
    """``t`` (``rows`` x groups x k, row-major) with its rows padded with zeros to whole blocks of ``lanes`` and
    each block laid out lane by lane: ``out[block, group, k, lane]``."""
    blocks = -(-rows // lanes)
    padded = torch.zeros((blocks * lanes,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[:rows] = t
    return padded.view(blocks, lanes, *t.shape[1:]).movedim(1, -1).contiguous().view(-1)


def lane_values(t: torch.Tensor, rows: int, lanes: int, per_row: int) -> torch.Tensor:
    """The inverse of ``_lane_blocks``: ``t`` (row blocks of ``lanes`` rows laid out lane by lane, ``per_row``
    values a row) back in row order, the padding rows dropped: ``rows * per_row`` values."""
    blocks = -(-rows // lanes)
    return t.view(blocks, per_row, lanes).transpose(1, 2).reshape(blocks * lanes, per_row)[:rows].reshape(-1)


def _own_layout(plan: family.Tiles, n: int) -> bool:
    """Whether ``plan``'s product of ``n`` tokens reads the weight in a layout of its kernel's own: its rows in a
    vector's lanes (``_by_picks``) or in depth blocks (``_depth``); then also outside a chain or a stack of
    products, whose kernels read the weight's own arrays."""
    return _depth(plan, n) or picks.serves(CPU, plan.kind, plan.group, plan.vtype, plan.xtype, n)


def _depth(plan: family.Tiles, n: int) -> bool:
    """Whether ``plan``'s product of ``n`` tokens runs in depth blocks (``compiler.weights_depth``)."""
    return depth.serves(CPU, plan.kind, plan.group, plan.vtype, plan.xtype, n, plan.transposed)


def lane_fields(weight: SparseTensor, crd: torch.Tensor, lanes: int) -> torch.Tensor:
    """An n:4 weight's in-group columns, 2 bits a stored value and a byte a row and group, in row blocks of
    ``lanes`` rows (``lane_layout``), made once per pattern."""
    (n_out, n_in), n = weight._shape, kind_of(weight)[2][0]

    def fields():
        k = crd.reshape(n_out, n_in // 4, n).to(torch.int8)
        shifted = k << (2 * torch.arange(n, dtype=torch.int8))
        return _lane_blocks(shifted.sum(-1, dtype=torch.int8).unsqueeze(-1), n_out, lanes)
    return _PICK_FIELDS.lookup(("lanes", lanes, tuple(weight._shape)), weight._levels, fields)


def lane_layout(weight: SparseTensor, crd: torch.Tensor, lanes: int) -> tuple:
    """``(sel, vals)``: an n:4 weight's in-group columns (2 bits a stored value, a byte a row and group) and values
    in row blocks of ``lanes`` rows, as ``weights_picks`` reads them; made once per pattern and per version of the
    values (the values' copy is kept beside the weight's own)."""
    (n_out, n_in), n = weight._shape, kind_of(weight)[2][0]
    groups = n_in // 4
    sel = lane_fields(weight, crd, lanes)
    vals = weight._vals
    laid = _PICK_VALUES.lookup(("lanes", lanes, n_out), vals,
                               lambda: _lane_blocks(vals.detach().reshape(n_out, groups, n), n_out, lanes))
    return sel, laid


def lane_bias(bias, rows: int, lanes: int) -> dict:
    """The kernels' bias argument for ``weights_picks``: float32, padded with zeros to whole blocks of ``lanes``."""
    if bias is None:
        return {}
    padded = torch.zeros(-(-rows // lanes) * lanes, dtype=torch.float32)
    padded[:rows] = bias
    return {"bias": padded}


def _by_picks(weight: SparseTensor, x: torch.Tensor, y: torch.Tensor, plan: family.Tiles, crd: torch.Tensor,
              bias) -> None:
    """``y = x @ weight.T (+ bias)`` (activation as planned) through ``weights_picks`` (``lane_layout``)."""
    plan = picks.planned(plan)
    sel, laid = lane_layout(weight, crd, plan.lanes)
    n_out = weight._shape[0]
    _run("forward", plan, weight._shape, {"sel": sel, "vals": laid}, x.shape[0],
         *_split(plan, x.shape[0], n_out, torch.get_num_threads()), x=x, y=y, **lane_bias(bias, n_out, plan.lanes))


def _decode_picks(weight: SparseTensor, x: torch.Tensor, plan: family.Tiles, crd: torch.Tensor, bias) -> torch.Tensor:
    """One token's product with an n:4 weight through ``weights_picks.decode`` (``lane_layout``), in float32 (a
    16-bit token widened, the result rounded once)."""
    plan = replace(picks.planned(plan), xtype=family.F32, unroll=1)
    sel, laid = lane_layout(weight, crd, plan.lanes)
    n_out, n_in = weight._shape
    y = torch.empty(1, n_out)
    kernel, loaded = _kernel(plan, "decode")
    _call(kernel, loaded, {"sel": sel, "vals": laid, "x": x.float(), "y": y, "n_out": n_out,
                           "groups": n_in // 4, "nthreads": torch.get_num_threads(),
                           **lane_bias(bias, n_out, plan.lanes)})
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _split(plan: family.Tiles, n: int, rows: int, threads: int) -> tuple:
    """``(chunks, row_chunk)``: the output rows in chunks of whole store blocks, enough of them that the work items
    (token tiles x chunks) keep every thread busy."""
    tiles = -(-n // plan.T)
    if tiles >= ITEMS_PER_THREAD * threads or threads == 1:
        return 1, max(rows, 1)
    chunks = -(-ITEMS_PER_THREAD * threads // tiles)
    row_chunk = -(-rows // chunks)
    row_chunk = -(-row_chunk // plan.rows) * plan.rows
    return -(-rows // row_chunk) if rows else 1, max(row_chunk, plan.rows)


def kept_linear(weight: SparseTensor, x: torch.Tensor, bias=None) -> torch.Tensor:
    """``linear(weight, x, bias)`` through its one kernel call kept from an earlier call with the same weight
    arrays (unmodified), bias, input shape and thread count (``weights_kept``): an eager model's inference makes
    each layer's product again and again, and the plan, the kernel's lookup and the arguments' binding took about
    0.1 ms of Python a call (AMD EPYC Zen 3: a 768 x 768 bsr(16, 16) layer at 128 tokens 0.33 ms a call, its
    kernel 0.22)."""
    return _kept(("linear", weight._format, tuple(weight._shape)), _guards(weight, bias), x,
                 lambda x_: linear(weight, x_, bias))


def linear(weight: SparseTensor, x: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """``activation(x @ weight.T + bias)``, ``x`` 2-d (tokens x in): a new row-major tensor (tokens x out).
    ``activation``: None or one of ``loopir.ACTIVATIONS`` ("relu", "gelu", "gelu_tanh": GELU's tanh form,
    "silu"), computed in the kernel's store from the float32 sum (a 16-bit result rounded once, after it)."""
    x = x.contiguous()
    n, n_out = x.shape[0], weight._shape[0]
    arrays = _arrays(weight)
    plan = plan_for(weight, n, bias is not None, arrays=arrays, activation=activation)
    y = torch.empty(n, n_out, dtype=x.dtype)
    if n == 0 or n_out == 0:
        return y
    if n == 1:
        if picks.decode_serves(CPU, plan.kind, plan.group, plan.vtype, n):
            return _decode_picks(weight, x, plan, arrays["crd"], bias)
        y1 = _by_bits(weight, x, bias, plan.kind, activation)
        if y1 is not None:
            return y1
    arrays["vals"] = weight._vals
    extra = _bias(bias, x.dtype)
    if family.dots(plan.kind, plan.vtype, n, CPU) and weight._shape[1] < 2 ** 31:  # (n:m columns: 32 bits)
        # (one token: read as float32 whatever the values' type, the sum rounded once into the result)
        wide = y if x.dtype == torch.float32 else torch.empty(n, n_out)
        _run("dots", replace(plan, xtype="f32", combos=False), weight._shape, arrays, n, 1, n_out, x=x.float(),
             y=wide, **extra)
        return y if wide is y else y.copy_(wide)
    if plan.kind == "csr":
        found = _by_pair_tiles(weight, x, plan, extra)
        if found is not None:
            return found
    if _depth(plan, n):
        plan = depth.planned(plan, n)
        _forward(plan, weight, dict(zip(("crd", "vals"), _depth_laid(weight, arrays["crd"], plan))), n, extra, x=x,
                 y=y)
        return y
    if _own_layout(plan, n):  # (depth blocks went above: the rows in lanes)
        _by_picks(weight, x, y, plan, arrays["crd"], bias)
        return y
    if plan.combos:
        combo = _combos(weight, arrays["crd"])
        if combo is None:
            plan = replace(plan, combos=False)
        else:
            found = _by_pair_tiles(weight, x, plan, extra, combo)
            if found is not None:
                return found
            arrays = {"combo": combo, "vals": weight._vals}
    if plan.amx:  # (the blocks as matrix tiles: ``compiler.weights_amx``)
        bh, bw = plan.block
        arrays["vals"] = _TILE_VALUES.lookup(("tiles", bh, bw), weight._vals, lambda: weight._vals.detach().reshape(
            -1, bh, bw // 2, 2).permute(0, 2, 1, 3).contiguous().reshape(-1))
    _forward(plan, weight, arrays, n, extra, x=x, y=y)
    return y


#: bfloat16 BSR weights' values as matrix tiles' B operands (``compiler.weights_amx``)
_TILE_VALUES = ValuesMemo(1024)
register("weight tile values", "the bfloat16 values of BSR weights as AMX tiles (each block's pairs of columns as"
         " rows), by the values tensor (remade when the values change)", _TILE_VALUES.__len__, _TILE_VALUES.clear)


def linear_chain(w1: SparseTensor, x: torch.Tensor, b1, act1, w2: SparseTensor, b2=None, act2=None,
                 norm=None) -> torch.Tensor:
    """``linear(w2, linear(w1, x, b1, act1), b2, act2)`` (a feed-forward block) in one kernel, a tile of tokens at a
    time (``compiler.weights_chain``): the intermediate stays in the thread's cache as the panel the second product
    reads, never laid out in rows (at 1024 tokens and 3072 features, 12 MB written and read back each way). Both
    products in float32 on the same tile of tokens, neither through pairs or one token's kernels, and tiles enough
    for the threads; else the two calls. ``norm``: ``(weight, bias, eps)``, the result is ``F.layer_norm(y + x,
    (out,), weight, bias, eps)`` (the block's residual and norm; in the kernel's tile where it runs)."""
    x = x.contiguous()
    n, (n_mid, n_in), n_out = x.shape[0], w1._shape, w2._shape[0]
    if w2._shape[1] != n_mid or x.shape[1] != n_in or (norm is not None and n_out != n_in):
        raise ValueError(f"scorch: linear_chain of shapes {tuple(x.shape)}, {tuple(w1._shape)}, {tuple(w2._shape)}"
                         f"{' with the residual and norm' if norm is not None else ''}")
    a1, a2 = _arrays(w1), _arrays(w2)
    p1 = plan_for(w1, n, b1 is not None, arrays=a1, activation=act1)
    p2 = plan_for(w2, n, b2 is not None, arrays=a2, activation=act2)
    p1, p2 = chain.matched(p1, p2)
    threads = torch.get_num_threads()
    norm_arrays = _norm_arrays(norm, n_out)
    if n < 2 or x.dtype != torch.float32 or not chain.serves(p1, p2) or not n_mid or not n_out or \
            _own_layout(p1, n) or _own_layout(p2, n) or \
            (threads > 1 and -(-n // p1.T) < CHAIN_TILES_PER_THREAD * threads) or \
            (norm is not None and norm_arrays is None):
        y = linear(w2, linear(w1, x, b1, act1), b2, act2)
        return y if norm is None else torch.nn.functional.layer_norm(y + x, (n_out,), *norm)
    y = torch.empty(n, n_out)
    key = ((p1, p2), "chain" if norm is None else "chain_norm")
    entry = _KERNELS.get(key)
    if entry is None:
        kernel = chain.forward_chain(p1, p2, norm is not None)
        entry = _KERNELS[key] = (kernel, cpp.load(kernel))
    second = {"pos2": a2.get("pos"), "crd2": a2["crd"], "vals2": w2._vals, "bias2": _bias(b2, x.dtype).get("bias")}
    second = {k: v for k, v in second.items() if v is not None}
    _call(*entry, {**a1, "vals": w1._vals, **_bias(b1, x.dtype), **second, "x": x, "y": y, "n": n, "n_in": n_in,
                   "n_mid": n_mid, "n_out": n_out, "groups": n_in // p1.group[1], "groups2": n_mid // p2.group[1],
                   "chunks": 1, "row_chunk": n_mid, "nthreads": threads, **(norm_arrays or {})})
    return y


def _norm_arrays(norm, n: int):
    """``linear_chain``'s norm arguments: float32 weight and bias of ``n`` each (None: ones, zeros) and ``eps``, or
    None where the kernel does not take them (another dtype, shape or device: torch's norm then)."""
    if norm is None:
        return None
    weight, bias, eps = norm
    parts = [torch.ones(n) if weight is None else weight, torch.zeros(n) if bias is None else bias]
    if any(p.dtype != torch.float32 or p.shape != (n,) or p.device.type != "cpu" for p in parts):
        return None
    return {"norm_weight": parts[0].contiguous(), "norm_bias": parts[1].contiguous(), "eps": float(eps)}


#: token tiles per thread at least for ``linear_chain``'s one kernel: its work items are whole tiles (the second
#: product needs all of a tile's intermediate), so with fewer the threads would idle where the two calls split rows
CHAIN_TILES_PER_THREAD = 2


def linear_stacked(weights, x: torch.Tensor, biases, activation=None) -> torch.Tensor:
    """``torch.cat([linear(w, x, b, activation) for ...], 1)``: products of one input (a layer's query, key and value)
    as one product with the weights' rows stacked (``stacked``), so the input is packed into panels once for all of
    them. float32 weights of one plan (format, types), two tokens or more; else the separate calls."""
    x = x.contiguous()
    n = x.shape[0]
    if not weights or any(w._shape[1] != x.shape[1] for w in weights) or len(biases) != len(weights):
        raise ValueError(f"scorch: linear_stacked of an input {tuple(x.shape)} and weights of shapes "
                         f"{[tuple(w._shape) for w in weights]} (biases: {len(biases)})")
    bias, parts = any(b is not None for b in biases), [_arrays(w) for w in weights]
    plans = {plan_for(w, n, bias, arrays=a, activation=activation) for w, a in zip(weights, parts)}
    if n < 2 or x.dtype != torch.float32 or len(plans) != 1 or next(iter(plans)).paired or \
            _own_layout(next(iter(plans)), n) or sum(w._vals.numel() for w in weights) >= 2 ** 31:
        return torch.cat([linear(w, x, b, activation) for w, b in zip(weights, biases)], 1)
    plan, (arrays, shape) = plans.pop(), stacked(weights, parts)
    extra = {} if not bias else {"bias": torch.cat([torch.zeros(w._shape[0], dtype=x.dtype) if b is None else
                                                    b.to(x.dtype) for w, b in zip(weights, biases)])}
    y = torch.empty(n, shape[0], dtype=x.dtype)
    if y.numel():
        _run("forward", plan, shape, arrays, n, *_split(plan, n, shape[0], torch.get_num_threads()), x=x, y=y,
             **extra)
    return y


def stacked(weights, parts=None) -> tuple:
    """``(arrays, shape)``: the index arrays and values (``_arrays`` and ``vals``) of the weights' rows stacked, one
    weight of ``(sum of rows, in)`` (``parts``: each weight's ``_arrays``, where the caller has them). The index
    arrays made once per set of patterns, the values once per version of each weight's values (a weight changed in
    place is gathered again)."""
    def make():
        nonlocal parts
        parts = parts or [_arrays(w) for w in weights]
        if "pos" not in parts[0]:  # (n:m: a row's entries at a fixed stride, nothing to offset)
            return {"crd": torch.cat([a["crd"] for a in parts])}
        ends = torch.tensor([0] + [int(a["pos"][-1]) for a in parts]).cumsum(0)
        pos = torch.cat([parts[0]["pos"][:1]] + [a["pos"][1:] + at for a, at in zip(parts, ends[:-1].tolist())])
        return {"pos": pos.to(parts[0]["pos"].dtype), "crd": torch.cat([a["crd"] for a in parts])}
    levels = [lv for w in weights for lv in w._levels]
    arrays = _STACKED.lookup(("stacked", tuple(tuple(w._shape) for w in weights), weights[0]._format), levels, make)
    vals = [w._vals for w in weights]
    if any(v.is_inference() for v in vals):  # (no version counters: nothing kept)
        stacked_vals = torch.cat(vals)
    else:
        stacked_vals = _STACKED_VALUES.lookup(("stacked", tuple(v._version for v in vals[1:])), vals[0],
                                              lambda: torch.cat(vals).detach(), vals[1:])
    return {**arrays, "vals": stacked_vals}, (sum(w._shape[0] for w in weights), weights[0]._shape[1])


#: the stacked index arrays of weights of one input (``stacked``), by the weights' index arrays
_STACKED = PatternMemo(256)
register("stacked weights", "the index arrays of sparse weights' rows stacked (the query, key and value products of"
         " one input as one), by the weights' index arrays", _STACKED.__len__, _STACKED.clear)
#: their values stacked, by the first weight's values (the others' identity and versions in the key)
_STACKED_VALUES = ValuesMemo(256)
register("stacked weight values", "the values of sparse weights' rows stacked, by the first weight's values tensor"
         " (remade when any of them changes)", _STACKED_VALUES.__len__, _STACKED_VALUES.clear)
