"""A CSR weight of bfloat16 values against a few bfloat16 tokens: the weight's columns in tiles, its entries in pairs.

``compiler.weights``'s CSR micro-kernel multiplies each stored weight by a vector of tokens loaded from a panel
row picked by the weight's column: a panel of ``in`` features holds ``in * T`` floats (4096 features, 16 tokens:
256 KiB), so nearly every entry's load misses L1 and waits for L2, and a ``vdpbf16ps`` takes two features per
lane where the entry brings one. At a few tokens (a decode batch of 16: a Llama projection 4096 x 11008 at 50%)
that ran at ~4 cycles an entry, half the dense bfloat16 product's speed. Here:

- the panel holds the tile's tokens as pairs of features (``PairDot``'s layout), and a row's entries are taken
  as *pair operations*: each pair of features ``(2k, 2k + 1)`` of which the row keeps one or both is one
  ``PairDot`` with the pair of values (a zero where one is not kept): 0.75 operations a stored weight at 50%,
  0.85 at 30%;
- the columns are cut into tiles of ``tile_pairs(T)`` pairs (a 16 KiB slice of the panel: in L1), and each
  block of ``rows`` output rows goes over the tiles in turn, every row of the block taking its operations in
  that tile before the next tile: the slice is read from L2 once per block, not once per entry;
- the operations are packed once per pattern (``engine.weights``): each one's pair as its offset in the tile's
  panel (pair number times ``T``, 16 bits, four operations' to a 64-bit word of ``idx``) and its two values
  (``words``, bfloat16, the values' copy refreshed when they change), in segments of one row and one tile padded
  to whole groups of ``UNROLL`` operations, ``seg[((block * tiles) + tile) * rows + row]`` their first (empty rows
  past the weight's last pad its last block); a group's pair offsets are one load and its values one 16-byte
  load, and both streams are prefetched, ``AHEAD`` operations on, the arrays running that far past the last
  segment (no bound to compute an operation);
- an operation's panel vector is one address, the tile's start (a pointer kept in a register,
  ``codegen.bf16.PAIR_BASE``) plus its offset times 4 bytes: the loop is bound by the instructions it issues
  (~1.7 cycles an operation on Zen 4, where ``vdpbf16ps`` takes 1), and the pair number's multiply and the
  tile's add were 2 of ~9 an operation;
- a 2:4 weight (``plan.combos``) runs the same loop over the panel of every pair of a group's features
  (``weights.COMBOS``): an operation a row's group with its two stored values, tiles of whole groups
  (``tile_units``), blocks of ``COMBO_ROWS`` rows.

Measured in place (4096 -> 11008, 16 tokens, 1 thread, interleaved medians, AMD Zen 4): against the float32
panel's kernel 1.87x at 50%, 1.62x at 30% (64 tokens); tiles of 8, 16, 32 KiB and one tile of the whole panel
13.4, 12.7, 15.4 and 19.7 ms at 50% (the dense bfloat16 Linear 12.6 ms). Combining a group of 4 features' entries
two at a time (every pair of the group in the panel, as ``weights.COMBOS``: 17% fewer operations) measured
slower (13.6 ms at 16 KiB): a tile then holds a third of the features. Offsets for pair numbers, the tile's start
in a register and prefetches without a bound: against the dense bfloat16 Linear 1.23 -> 1.34x at 50%, 1.68 ->
1.92x at 30% (same shape and machine). Eight accumulator sets rather than four (two groups a step) gained 2-4%
in a C++ model, and the values broadcast by ``vdpbf16ps``'s embedded broadcast rather than a shuffle lost 7%.
"""
from __future__ import annotations

from dataclasses import replace

from .. import loopir as L
from .weights import COMBOS, F32, I64, Tiles, _add, _bv, _c, _chunk, _mul, _params, _vloop, _work, activate, epilogue, \
    sets_total, store

#: bytes of a panel's tile of columns: half of a 32 KiB L1 (the weight's operations stream through the rest)
TILE_BYTES = 16384
#: pairs of a tile at most (their offsets, pair number times ``T``, are below ``TILE_BYTES / 4``: 16 bits)
MAX_PAIRS = 1 << 15
#: operations a segment takes at a time, each into its own accumulator set (a ``vdpbf16ps``'s latency hidden);
#: their 16-bit pair numbers are one 64-bit word (``idx``), read by one load and taken apart by shifts: the loop
#: is bound by its loads (a 64-byte panel vector takes both of Zen 4's vector load ports for a cycle), and a
#: load per pair number cost as much as the shifts save (C++ model, in L1: 0.59 -> 0.46 ns an operation)
UNROLL = 4
#: operations ahead that a segment's loop prefetches the operations' values and pair numbers: the two streams
#: (6 bytes an operation) come from memory, and the hardware prefetcher alone left the loop waiting on them
#: (4096 -> 11008 at 16 tokens, 1 thread, AMD Zen 4: 70% 9.9 -> 8.6 ms; 128, 256, 512, 1024 ahead: 8.3, 8.0,
#: 7.8, 8.2 ms in one series). ``engine.weights`` runs both arrays this many operations past the last segment
AHEAD = 256

#: rows of a block of a 2:4 weight: a row reads one of each group's 6 panel vectors, so a block's rows read each
#: vector of a tile they bring from L2 ``rows / 6`` times (a CSR row at 50% reads 0.75 of its pairs): 16 rows
#: (``STORE_ROWS``) read 24 bytes of panel from L2 an operation, 64 rows 6 (4096 -> 11008, 16 tokens, 1 thread,
#: AMD Zen 4, against the dense bfloat16 Linear: 16 rows 1.51x, 64 rows 1.56-1.71x, 128 rows 1.79x but 1.62x the
#: other way; tiles of 8 and 32 KiB within the noise of 16)
COMBO_ROWS = 64


def tile_pairs(T: int) -> int:
    """Pairs of features in a tile for ``T`` tokens: a pair takes ``T`` lanes of two bfloat16."""
    return max(1, min(MAX_PAIRS, TILE_BYTES // (4 * T)))


def tile_units(T: int, combos: bool = False) -> int:
    """Panel vectors (``T`` pairs of tokens each) in a tile: ``tile_pairs``; a 2:4 weight's panel of
    combinations (``combos``) whole groups of ``len(COMBOS)`` of them, a multiple of ``UNROLL`` groups (each
    row keeps one of a group's pairs: its segments are then whole groups of operations, unpadded)."""
    units = tile_pairs(T)
    if not combos:
        return units
    return len(COMBOS) * max(1, units // len(COMBOS) // UNROLL * UNROLL)


def planned(plan: Tiles) -> Tiles:
    """``plan`` (CSR or 2:4, bfloat16 values and tokens) as this kernel runs it: a panel of pairs (2:4: of every
    pair of a group's features, ``weights.COMBOS``, in blocks of ``COMBO_ROWS`` rows), ``UNROLL`` sets."""
    return replace(plan, pairs=not plan.combos, halves=False, unroll=UNROLL,
                   rows=COMBO_ROWS if plan.combos else plan.rows)


def forward(plan: Tiles) -> L.Kernel:
    """``y = act(x @ W^T (+ bias))`` for a ``planned`` plan: work items of a token tile and a chunk of ``row_chunk``
    rows (whole blocks of ``rows``), each block's rows summed tile by tile into ``ta``, then the epilogue and the
    store."""
    T, R, U, TP = plan.T, plan.rows, plan.unroll, tile_units(plan.T, plan.combos)
    if U != 4:  # (a group's pair numbers are the four 16-bit fields of one 64-bit word, its values 16 bytes)
        raise ValueError(f"scorch: the pair-tile kernel takes its operations 4 at a time, not {U}")
    n_out, tiles = L.Var("n_out"), L.Var("tiles")
    vec = plan.lanes if plan.lanes > 1 else 0
    r_lo = _mul(_chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    ob, rb, re, c, r = L.Var("ob"), L.Var("rb"), L.Var("re"), L.Var("c"), L.Var("r")
    k, lo, hi, s = L.Var("k"), L.Var("lo"), L.Var("hi"), L.Var("s")
    g, word, tile = L.Var("g"), L.Var("word"), L.Var("tile")

    def op(u):  # (operation ``u`` of group ``g`` into accumulator set ``u``: its pair's offset is field ``u``)
        field = L.Cast(L.Cast(L.binary("shr", word, _c(16 * u)), "i16"), I64)
        return _vloop(T, plan.lanes, L.Store("acc", _add(_c(u * T), _bv), L.PairDot(
            "panel", _add(tile, _add(field, _bv)), "words", _mul(_add(_mul(g, _c(U)), _c(u)), _c(2)),
            lane=u), "add"))
    ahead = _add(g, _c(AHEAD // U))  # (in bounds: the arrays run ``AHEAD`` operations past the last segment)
    groups = L.For(k, _c(0), L.binary("floordiv", L.binary("sub", hi, lo), _c(U)), L.block(
        L.Let(g, _add(L.binary("floordiv", lo, _c(U)), k)), L.Let(word, L.Load("idx", g, I64)),
        L.Prefetch("words", _mul(ahead, _c(2 * U)), 3), L.Prefetch("idx", ahead, 3), *(op(u) for u in range(U))))
    segment = L.block(
        L.Let(s, _add(_mul(_add(_mul(L.binary("floordiv", rb, _c(R)), tiles), c), _c(R)), r)),
        L.Let(tile, _mul(c, _c(TP * T))),
        L.Let(lo, L.Cast(L.Load("seg", s, plan.ptype), I64)),
        L.Let(hi, L.Cast(L.Load("seg", _add(s, _c(1)), plan.ptype), I64)),
        L.LocalArray("acc", F32, U * T, L.Const(0.0, F32), vector=vec),
        groups,
        _vloop(T, plan.lanes, L.Store("ta", _add(_mul(r, _c(T)), _bv), sets_total("acc", U, T), "add")))
    zero = L.For(k, _c(0), _c(R * T), L.block(L.Store("ta", k, L.Const(0.0, F32))))
    count = L.binary("sub", re, rb)
    block = L.block(
        L.Let(rb, _add(r_lo, _mul(ob, _c(R)))), L.Let(re, L.binary("min", r_hi, _add(rb, _c(R)))), zero,
        L.For(c, _c(0), tiles, L.block(L.For(r, _c(0), count, segment))),
        L.For(r, _c(0), count, L.block(epilogue(plan, "ta", 1, _add(rb, r), _mul(r, _c(T)), _mul(r, _c(T))))),
        activate(plan, count), store(plan, "y", n_out, rb, count))
    blocks = L.binary("floordiv", _add(L.binary("sub", r_hi, r_lo), _c(R - 1)), _c(R))
    rows = L.For(ob, _c(0), L.binary("max", blocks, _c(0)), block)
    params = (L.Param("seg", "array", plan.ptype), L.Param("idx", "array", I64),
              L.Param("words", "array", plan.vtype)) + \
        tuple(p for p in _params(plan, "x", "y") if p.name not in ("pos", "crd", "combo", "vals")) + \
        (L.Param("tiles", "scalar", I64),)
    return L.Kernel("scorch_weights_pair_tiles", params,
                    L.block(_work(plan, L.Var("n_in"), "x", [rows], extra=L.Alloc("ta", F32, _c(R * T)))))

