"""n:m weights in depth blocks: ``Y[t, o] = sum_i X[t, i] * W[o, i] (+ bias[o])`` for an n:m weight of float32
values against a float32 activation, the family's panel kernel (tokens in a vector's lanes) with the panel read
from L1.

The family's n:m kernel (``weights._group_rows``) goes over every group of a row pass before the next pass, so
the whole panel (``in`` x ``T`` tokens: 48 KiB at 768 features and 16 tokens) streams from L2 for every pass; on
8-lane vectors (AVX2) a multiply-add then waits on its panel load, and 2:4 ran level with the dense product (AMD
EPYC Zen 3). Here the groups are taken a depth block at a time (``depth`` groups, a panel block of
``DEPTH_PANEL_BYTES``), and every row pass of a store block (``rows`` rows) goes over that block before the next
one: the block stays in L1, and a pass's sums are kept in ``tb`` between blocks (a load and a store of its
accumulators per block). The micro-kernel is ``row_pass`` rows x ``vectors`` vectors of tokens (12 of AVX2's 16
registers), per stored value a broadcast and ``vectors`` multiply-adds with a panel load each.

Read in that order, a row's values would come in short runs (a depth block's worth), which the hardware
prefetchers follow badly (the family measured this slower), so the weight is laid out in the kernel's order:
store block, depth block, row pass, group, row of the pass, value, the rows past the last padded with zeros to a
whole pass. The ``k``-th value of group ``g0 + g`` of row ``rb + p * row_pass + r`` (the store block from row
``rb``, of ``passes`` passes; the depth block of ``gk`` groups from ``g0``) is at
``rb * groups * n + ((g0 * passes + p * gk + g) * row_pass + r) * n + k``, and its in-group column ``c`` is held as
its panel offset, ``c * T - offset_bias`` (a signed byte): the address of a value's panel row is then a load and
an add, where the column would take three more operations a value (measured by hand, 45 against 34 ms). The
values' copy is kept beside the weight (``engine.weights_depth``).

Passes over one plan (``weights.Tiles`` with ``depth`` set):

- ``planned``: the plan of a product: ``vectors`` x ``row_pass``, ``rows`` a store block, ``depth`` groups a block;
- ``rows``: one store block's passes over the depth blocks, into ``tb`` (``weights.block_rows``'s body);
- the family's ``pack``, ``activate`` and ``store`` around them (``weights.forward``).
"""
from __future__ import annotations

from dataclasses import replace

from .. import loopir as L
from .target import Target
from .weights import F32, I64, Tiles, _add, _c, _mul, _nt, _t0, _vloop
from .weights_picks import CONV_SCALARS, conv_parts
from . import weights as family

#: accumulator vectors of the micro-kernel: 12 of AVX2's 16 registers, the others for the broadcast value
DEPTH_ACCUMULATORS = 12
#: vectors of tokens a micro-kernel (6 x 2 rows: 48 tokens on AVX2) where the tokens fill them, else 4 (x 3 rows).
#: Measured by hand (C++, AMD EPYC Zen 3, 1 thread, 2:4 3072 x 768, the kernel alone): rows x vectors 2 x 6
#: 4.4-4.6 G multiply-adds a second (vectors of 8), 3 x 4 4.1-4.3, 2 x 5 4.2, 1 x 8 4.1, 4 x 3 4.1, 2 x 4 3.4;
#: the family's kernel 2.9, the rows-in-lanes one (``weights_picks``) about 3.1
DEPTH_VECTORS = (6, 4)
#: bytes of a depth block's panel: half of a 32 KiB L1 (the rest for the weight's stream and ``tb``). By hand, as
#: above, 3 x 4: 8 KiB 4.1-4.3, 16 KiB 4.2-4.3, 32 KiB 3.5-3.8, no blocks (the panel from L2) 2.1-2.5
DEPTH_PANEL_BYTES = 16 * 1024
#: output rows a store block: the passes that read a depth block's panel from L1 (its ``tb``: 96 x 48 floats, 18
#: KiB); fewer rows a block split the rows among threads more evenly at few tokens
DEPTH_ROWS = 96
#: the fewest tokens the kernel serves: fewer are bound by the weight's bytes (the family's kernel reads them once
#: for 16 tokens, this one for 32 or 48)
DEPTH_MIN_TOKENS = 40


def serves(target: Target, kind: str, group: tuple, vtype: str, xtype: str, tokens: int,
           transposed: bool = False) -> bool:
    """Whether ``planned`` serves a forward product: an n:m weight of float32 values against a float32 activation
    whose in-group offsets fit the kernel's bytes (``fitting``), ``tokens`` tokens or more (``DEPTH_MIN_TOKENS``),
    on a target with 8-lane vectors (AVX2: there the family's panel from L2 bounds it; AVX-512's 32 registers and
    16 lanes were not measured with this kernel)."""
    return bool(target.vectors and target.lanes(F32) == 8 and kind == "nm" and vtype == xtype == F32 and
                not transposed and tokens >= DEPTH_MIN_TOKENS and fitting(group[1], target.lanes(F32)))


def fitting(m: int, lanes: int) -> tuple:
    """The ``DEPTH_VECTORS`` whose tiles keep a group's offsets in a byte: a stored value's offset is its column
    in the group times the tile's tokens (``(m - 1) * T`` at most), less ``offset_bias``, as a signed byte."""
    return tuple(v for v in DEPTH_VECTORS if (m - 1) * v * lanes <= 255)


def offset_bias(plan: Tiles) -> int:
    """What is taken from a stored value's offset in the panel (its column in the group times ``T``) to keep it in
    a signed byte, and added back at the panel's address (a constant the address folds in)."""
    return (plan.group[1] - 1) * plan.T // 2


def vectors_for(tokens: int, lanes: int, m: int) -> int:
    """The micro-kernel's vectors of tokens: the first of ``fitting`` whose tiles leave no more empty lanes than a
    tenth of the tokens over the fewest any of them leaves."""
    padded = {v: -(-tokens // (v * lanes)) * v * lanes for v in fitting(m, lanes)}
    least = min(padded.values())
    return next(v for v in padded if padded[v] - least <= tokens // 10)


def planned(plan: Tiles, tokens: int) -> Tiles:
    """``plan`` (an n:m forward product's of ``tokens`` tokens) as this kernel's: ``vectors`` vectors of tokens by
    ``row_pass`` rows, ``rows`` (a multiple of ``row_pass``) a store block, ``depth`` groups a depth block."""
    if plan.kind != "nm" or plan.transposed or plan.lanes < 2:
        raise ValueError(f"scorch: depth blocks serve an n:m forward product with vectors; got {plan}")
    vectors = vectors_for(tokens, plan.lanes, plan.group[1])
    rpass = DEPTH_ACCUMULATORS // vectors
    depth = max(1, DEPTH_PANEL_BYTES // (plan.group[1] * vectors * plan.lanes * 4))
    return replace(plan, vectors=vectors, unroll=1, row_pass=rpass, rows=DEPTH_ROWS - DEPTH_ROWS % rpass,
                   depth=depth, combos=False, pairs=False, halves=False, picks=0)


def rows(plan: Tiles, rb: L.Expr, re: L.Expr) -> L.Stmt:
    """The store block of rows ``rb .. re`` into ``tb`` (``tb[(o - rb) * T + t]``, the bias added): its passes of
    ``row_pass`` rows over one depth block of groups before the next, each pass's sums carried in ``tb`` from one
    block to the next."""
    T, R, D, lanes = plan.T, plan.row_pass, plan.depth, plan.lanes
    (n, m) = plan.group
    groups = L.Var("groups")
    kd, p, g, o = L.Var("kd"), L.Var("dp"), L.Var("g"), L.Var("o")
    g0, gk, passes, base, at = L.Var("g0"), L.Var("gk"), L.Var("passes"), L.Var("wbase"), L.Var("wat")
    bv = L.Var("bv")

    def tb_at(r):
        return _add(_mul(_add(_mul(p, _c(R)), _c(r)), _c(T)), bv)
    carried = L.If(L.binary("gt", kd, _c(0)), L.block(*(
        _vloop(T, lanes, L.Store("acc", _add(_c(r * T), bv), L.Load("tb", tb_at(r), F32))) for r in range(R))))
    centre = _c(offset_bias(plan))
    entries = []
    for r in range(R):
        for k in range(n):
            pos = _add(at, _c(r * n + k))
            w = L.Cast(L.Load("vals", pos, plan.vtype), F32)
            col = _add(_mul(_add(g0, g), _c(m * T)), centre, L.Cast(L.Load("crd", pos, plan.ctype), "i64"), bv)
            entries.append(_vloop(T, lanes, L.Store("acc", _add(_c(r * T), bv), _mul(w, L.Load("panel", col, F32)),
                                                    "add")))
    a_pass = L.For(p, _c(0), passes, L.block(
        L.Let(base, _add(_mul(_mul(rb, groups), _c(n)), _mul(_add(_mul(g0, passes), _mul(p, gk)), _c(R * n)))),
        L.LocalArray("acc", F32, R * T, L.Const(0.0, F32), vector=lanes), carried,
        L.For(g, _c(0), gk, L.block(L.Let(at, _add(base, _mul(g, _c(R * n)))), *entries)),
        *(_vloop(T, lanes, L.Store("tb", tb_at(r), L.Load("acc", _add(_c(r * T), bv), F32))) for r in range(R))))
    blocks = L.binary("floordiv", _add(groups, _c(D - 1)), _c(D))
    out = [L.Let(passes, L.binary("floordiv", _add(L.binary("sub", re, rb), _c(R - 1)), _c(R))),
           L.For(kd, _c(0), blocks, L.block(
               L.Let(g0, _mul(kd, _c(D))), L.Let(gk, L.binary("min", _c(D), L.binary("sub", groups, g0))), a_pass))]
    if plan.bias:
        out.append(L.For(o, rb, re, L.block(_vloop(T, lanes, L.Store(
            "tb", _add(_mul(L.binary("sub", o, rb), _c(T)), bv), L.Cast(L.Load("bias", o, plan.vtype), F32),
            "add")))))
    return L.block(*out)


def forward(plan: Tiles) -> L.Kernel:
    """``y = x @ W^T (+ bias)`` through depth blocks (a plan of ``planned``), the weight laid out as the module's
    text says."""
    if not plan.depth:
        raise ValueError(f"scorch: weights_depth.forward takes a plan of ``planned``; got {plan}")
    return family.forward(plan, lambda rb, re: rows(plan, rb, re))


def conv_pack(plan: Tiles) -> L.Block:
    """The panel of a tile of a 2-d convolution's output pixels (its tokens): ``panel[(tap * C + c) * T + t] =
    x[at(t0 + t) + taps[tap] + c]``, the input read in place from its padded channels-last buffer
    (``weights_picks.conv_parts``: ``at`` a pixel's start, ``C = 4 * cpg`` channels). The tile's pixels go in runs
    along an output row (consecutive pixels: ``col_stride`` apart in the buffer), each run and tap one transposed
    copy (``loopir.Transpose``: vector tiles); the lanes past ``nt`` zero."""
    T = plan.T
    token_at, _ = conv_parts()
    t, f, tap, ox, run, at = (L.Var(v) for v in ("pt", "pf", "ptap", "pox", "prun", "pat"))
    wo, channels = L.Var("wo"), _mul(L.Var("cpg"), _c(4))
    taps_n = L.binary("floordiv", L.Var("n_in"), channels)
    zero = L.If(L.binary("lt", _nt, _c(T)), L.block(L.For(f, _c(0), L.Var("n_in"), L.block(
        L.For(t, _c(0), _c(T), L.block(L.Store("panel", _add(_mul(f, _c(T)), t), L.Const(0.0, F32))))))))
    copies = L.For(tap, _c(0), taps_n, L.block(L.Transpose(
        "panel", _add(_mul(_mul(tap, channels), _c(T)), t), _c(T), "x", _add(at, L.Load("taps", tap, I64)),
        L.Var("col_stride"), run, channels, F32, F32)))
    runs = L.For(t, _c(0), _nt, L.block(
        L.Let(ox, L.binary("mod", L.binary("mod", _add(_t0, t), L.Var("pixels")), wo)),
        L.If(L.binary("eq", L.binary("min", t, ox), _c(0)), L.block(  # (a run starts: the tile's or a row's first)
            L.Let(run, L.binary("min", L.binary("sub", _nt, t), L.binary("sub", wo, ox))),
            L.Let(at, token_at(_add(_t0, t))), copies))))
    return L.block(zero, runs)


def conv_forward(plan: Tiles) -> L.Kernel:
    """A 2-d convolution of an n:4 weight (its matrix view's columns in the order (kh, kw, in)) as the implicit
    product through depth blocks: ``forward``'s kernel with ``conv_pack``'s panel (the output pixels its tokens),
    the result channels-last (``y``: pixels x out)."""
    if not plan.depth:
        raise ValueError(f"scorch: weights_depth.conv_forward takes a plan of ``planned``; got {plan}")
    params = tuple(L.Param(name, "scalar", I64) for name in CONV_SCALARS) + (L.Param("taps", "array", I64),)
    return family.forward(plan, lambda rb, re: rows(plan, rb, re), conv_pack(plan), params, plan.name + "_conv")
