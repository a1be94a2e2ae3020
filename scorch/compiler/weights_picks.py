"""n:4 weights with their rows in a vector's lanes: ``Y[t, o] = sum_i X[t, i] * W[o, i] (+ bias[o])`` for an n:m
weight of groups of 4 columns (1 to 3 kept a group), ``X`` and ``Y`` float32 and row-major, as built by ``plan``.

The family's n:m kernel (``weights._group_rows``) holds tokens in a vector's lanes: each stored value is
broadcast and multiplied by a panel vector of its column, a load per multiply-add. With 8-lane vectors (AVX2) that
kernel is bound by its loads (2:4 ran level with the dense product on an AMD EPYC Zen 3). Here a vector holds
``lanes`` output rows of one token instead, and a row block's stored values are laid out lane by lane
(``vals[((b * groups + g) * n + k) * lanes + r]``: the ``k``-th value of group ``g`` of row ``b * lanes + r``),
their in-group columns as 2-bit fields of a byte a row (``sel[(b * groups + g) * lanes + r]``, field ``k`` at bit
``2k``). For each group and token the token's 4 features are broadcast once and permuted into the rows' lanes,
each lane taking its own row's column (``loopir.LanePick``: ``vpermilps``): per stored value one permute and one
multiply-add, no load; the row block's values are loaded once for ``tokens`` tokens (``PICK_TOKENS``, whose
accumulators fill the registers). ``X`` is read in place and ``Y`` written a vector of rows at a time: no panel,
no transpose.

Passes over one plan (``weights.Tiles`` with ``picks`` set):

- ``planned``: the plan of a product (``PICK_TOKENS`` tokens a micro-kernel, ``picks`` micro-kernels a tile);
- ``accumulate``: the micro-kernel, a row block against ``PICK_TOKENS`` tokens over every group;
- ``finish``: the bias, the activation and the store of the block's rows for the tokens there are.
"""
from __future__ import annotations

from dataclasses import replace

from .. import loopir as L
from .target import Target
from .weights import F32, I64, Tiles, _add, _c, _mul, _params, _vloop, activated

#: tokens of one micro-kernel: their accumulators (a vector of rows each) take 8 of AVX2's 16 registers, the
#: values of a group's ``n`` entries, their fields and the permuted features the rest. Measured by hand (AMD EPYC
#: Zen 3, 1 thread, 2:4, 768 <-> 3072, 128 and 1024 tokens): 8 tokens 1.15-1.48x the dense product, 6 1.18-1.35x,
#: 10 1.02-1.24x, 12 (spilling) 0.75-1.23x
PICK_TOKENS = 8
#: micro-kernels (of ``PICK_TOKENS`` tokens) a tile: a row block's values are read once for the tile's tokens
PICK_SUBTILES = 1
#: the fewest tokens the kernel serves: fewer are bound by the weight's bytes, which the panel kernel reads once for
#: 16 tokens (this one once for 8)
PICK_MIN_TOKENS = 24


def serves(target: Target, kind: str, group: tuple, vtype: str, xtype: str, tokens: int) -> bool:
    """Whether ``planned`` serves a forward product: an n:4 weight of float32 values and activation, ``tokens``
    tokens or more (``PICK_MIN_TOKENS``), on a target whose vectors take the permute (``Target.lane_picks``)."""
    return target.lane_picks and n4(kind, group, vtype, xtype) and tokens >= PICK_MIN_TOKENS and target.vectors


def n4(kind: str, group: tuple, vtype: str, xtype: str) -> bool:
    """Whether a weight is an n:4 one of float32 values against a float32 activation (what the kernels here take)."""
    return n4_groups(kind, group) and vtype == xtype == F32


def n4_groups(kind: str, group: tuple) -> bool:
    """Whether a format is n:4 with 1 to 3 kept a group: its in-group columns fit a byte's 2-bit fields."""
    return kind == "nm" and group[1] == 4 and 1 <= group[0] < 4


def lane_permutes(target: Target) -> bool:
    """Whether ``target``'s float vectors take ``LanePick``'s in-lane permute: 8 or 16 lanes (AVX2, AVX-512)."""
    return target.lanes(F32) in (8, 16)


def grad_serves(target: Target, kind: str, group: tuple, vtype: str, xtype: str) -> bool:
    """Whether ``weight_grad`` serves an n:4 weight's value gradient: on any target with 8 or 16 float lanes
    (AVX2's or AVX-512's permute), whichever kernel its forward takes: the other, a dot per stored value summed
    across lanes, ran 2-3x slower than the dense ``dy^T @ x`` (2:4, 3072 x 768, 1024 tokens, AVX2)."""
    return lane_permutes(target) and n4(kind, group, vtype, xtype)


def planned(plan: Tiles) -> Tiles:
    """``plan`` (an n:4 forward product's) as this kernel's: a row block of ``lanes`` rows a store, ``PICK_TOKENS``
    tokens a micro-kernel (``unroll``), ``PICK_SUBTILES`` of them a tile (``picks``)."""
    if plan.kind != "nm" or plan.group[1] != 4 or plan.transposed or plan.lanes < 2:
        raise ValueError(f"scorch: rows in lanes serve an n:4 forward product with vectors; got {plan}")
    return replace(plan, vectors=1, unroll=PICK_TOKENS, rows=plan.lanes, row_pass=1, combos=False, pairs=False,
                   halves=False, picks=PICK_SUBTILES)


def accumulate(plan: Tiles, b: L.Expr, ts: L.Expr, nt: L.Expr, token_at=None, group_loop=None) -> list:
    """The micro-kernel: ``acc[u * lanes + r] = sum over the row's stored values of value * x[token, column]`` for
    the row block ``b`` (rows ``b * lanes + r``) and the tokens ``ts + u`` (``u`` past ``nt`` repeat the last
    token, their sums dropped by ``finish``). ``token_at(t)``: where token ``t``'s features start in ``x`` (a
    product: ``t * n_in``); ``group_loop(visit)``: the loop over the groups, ``visit(g, at)`` the body of group
    ``g`` whose 4 features are at ``at`` from a token's start (a product: ``g`` over ``groups``, at ``4 g``)."""
    lanes, U, (n, _) = plan.lanes, plan.unroll, plan.group
    g, groups = L.Var("g"), L.Var("groups")
    token_at = token_at or (lambda t: _mul(t, L.Var("n_in")))
    group_loop = group_loop or (lambda visit: L.For(g, _c(0), groups, L.block(*visit(g, _mul(g, _c(4))))))
    rows = [L.Var(f"xr{u}") for u in range(U)]
    last = L.binary("sub", nt, _c(1))
    lets = [L.Let(r, token_at(_add(ts, L.binary("min", _c(u), last)))) for u, r in enumerate(rows)]
    bv, wb = L.Var("bv"), L.Var("wb")

    def visit(gv, at):
        body = [L.Let(wb, _add(_mul(b, groups), gv))]
        for u, row in enumerate(rows):
            for k in range(n):
                term = _mul(L.Load("vals", _add(_mul(_add(_mul(wb, _c(n)), _c(k)), _c(lanes)), bv), F32),
                            L.LanePick("x", _add(row, at), "sel", _add(_mul(wb, _c(lanes)), bv), 2 * k))
                body.append(_vloop(lanes, lanes, L.Store("acc", _add(_c(u * lanes), bv), term, "add")))
        return body
    return lets + [L.LocalArray("acc", F32, U * lanes, L.Const(0.0, F32), vector=lanes), group_loop(visit)]


def finish(plan: Tiles, b: L.Expr, ts: L.Expr, nt: L.Expr) -> list:
    """The sums of ``accumulate`` (and the bias, ``bias[b * lanes + r]``: padded to whole blocks) through the
    activation into ``tb``, then into ``y``'s rows ``ts .. ts + nt``: a vector a token where the block is whole,
    row by row in the last, partial block."""
    lanes, U = plan.lanes, plan.unroll
    bv, u, r, k = L.Var("bv"), L.Var("su"), L.Var("sr"), L.Var("ak")
    n_out = L.Var("n_out")
    value = L.Load("acc", _add(_mul(u, _c(lanes)), bv), F32)
    if plan.bias:
        value = _add(value, L.Load("bias", _add(_mul(b, _c(lanes)), bv), F32))
    out = [L.For(u, _c(0), _c(U), L.block(_vloop(lanes, lanes, L.Store("tb", _add(_mul(u, _c(lanes)), bv), value))),
                 unroll=True)]
    if plan.activation is not None:
        out.append(L.For(k, _c(0), _c(U * lanes), L.block(L.Store("tb", k, activated(plan, L.Load("tb", k, F32)))),
                         simd=True))
    first = _mul(b, _c(lanes))
    whole = L.For(u, _c(0), nt, L.block(_vloop(lanes, lanes, L.Store(
        "y", _add(_mul(_add(ts, u), n_out), first, bv), L.Load("tb", _add(_mul(u, _c(lanes)), bv), F32)))))
    count = L.binary("sub", n_out, first)
    part = L.For(u, _c(0), nt, L.block(L.For(r, _c(0), count, L.block(L.Store(
        "y", _add(_mul(_add(ts, u), n_out), first, r), L.Load("tb", _add(_mul(u, _c(lanes)), r), F32))))))
    return out + [L.If(L.binary("ge", count, _c(lanes)), L.block(whole), L.block(part))]


def forward(plan: Tiles, conv: bool = False) -> L.Kernel:
    """``y = x @ W^T (+ bias)``: work items of a token tile (``picks`` micro-kernels of ``unroll`` tokens) and a
    chunk of ``row_chunk`` rows (a multiple of ``lanes``), each row block of the chunk against the tile's
    micro-kernels in turn (its values read from L1 after the first). ``conv``: the implicit product of a 2-d
    convolution (``conv_parts``)."""
    if not plan.picks:
        raise ValueError(f"scorch: weights_picks.forward takes a plan of ``planned``; got {plan}")
    lanes, U, T = plan.lanes, plan.unroll, plan.T
    n, n_out = L.Var("n"), L.Var("n_out")
    item, tile, chunk, b, s = L.Var("item"), L.Var("tile"), L.Var("chunk"), L.Var("b"), L.Var("s")
    ts, nt = L.Var("ts"), L.Var("nt")
    tiles_n = L.binary("floordiv", _add(n, _c(T - 1)), _c(T))
    r_lo = _mul(chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    micro = L.block(L.Let(nt, L.binary("min", _c(U), L.binary("sub", n, ts))),
                    *accumulate(plan, b, ts, nt, *(conv_parts() if conv else ())), *finish(plan, b, ts, nt))
    blocks = L.For(b, L.binary("floordiv", r_lo, _c(lanes)), L.binary("floordiv", _add(r_hi, _c(lanes - 1)), _c(lanes)),
                   L.block(L.For(s, _c(0), _c(plan.picks), L.block(
                       L.Let(ts, _add(_mul(tile, _c(T)), _mul(s, _c(U)))),
                       L.If(L.binary("lt", ts, n), micro)))))
    work = L.For(item, _c(0), _mul(tiles_n, L.Var("chunks")), L.block(
        L.Let(tile, L.binary("floordiv", item, L.Var("chunks"))),
        L.Let(chunk, L.binary("mod", item, L.Var("chunks"))), blocks),
        parallel=L.Parallel("static", None, L.block(L.Alloc("tb", F32, _c(U * lanes))), chunk=1))
    params = tuple(p for p in _params(plan, "x", "y") if p.name != "crd")
    extra = tuple(L.Param(name, "scalar", I64) for name in CONV_SCALARS) + (L.Param("taps", "array", I64),) \
        if conv else ()
    name = plan.name + ("_picks_conv" if conv else "_picks")
    return L.Kernel(name, (L.Param("sel", "array", "i8"),) + params + extra, L.block(work))


#: row blocks a thread takes at a time in ``decode`` (handed out as threads come free)
DECODE_BLOCKS = 16


def decode_serves(target: Target, kind: str, group: tuple, vtype: str, tokens: int) -> bool:
    """Whether ``decode`` serves a product: one token, an n:4 weight of float32 or bfloat16 values, a target with 8
    or 16 float lanes (AVX2's or AVX-512's in-lane permute). One token is bound by the weight's bytes, which this
    layout keeps at the values and a byte a row and group (2:4 bfloat16: 1.25 bytes a column, dense 2), and it
    reads them with a permute and a multiply-add per stored value: on an AMD EPYC Zen 3 (2 threads, 2:4 bfloat16,
    11008 x 4096) the bitmap kernel (an expand per 8 columns) took 4.8 ms, this layout in hand-written C++ 2.1."""
    return tokens == 1 and lane_permutes(target) and n4_groups(kind, group) and vtype in (F32, "bf16")


def decode_chains(n: int) -> int:
    """Groups a step of ``decode`` takes together, each into its own ``n`` accumulators: 4 multiply-add chains or
    more (3 at 3:4), so that a multiply-add's latency hides behind the others'."""
    return max(1, 4 // n)


def decode(plan: Tiles) -> L.Kernel:
    """One token (decode) through the lane layout (``lane_layout``): ``y[b * lanes + r] = sum over groups g and
    stored values k of vals[((b * groups + g) * n + k) * lanes + r] * x[4 g + (sel[(b * groups + g) * lanes + r]
    >> 2k) & 3] (+ bias)``, ``x`` and ``y`` float32 (a 16-bit token is widened first, and the result rounded
    once). Per row block and group: one broadcast of the group's 4 features; per stored value one permute
    (``LanePick``), one load of a vector of values (bfloat16 widened) and one multiply-add, ``decode_chains``
    groups at a time into their own accumulators. Work items are row blocks, ``DECODE_BLOCKS`` at a time."""
    lanes, (n, _) = plan.lanes, plan.group
    G = decode_chains(n)
    b, gq, g, bv = L.Var("b"), L.Var("gq"), L.Var("g"), L.Var("bv")
    groups = L.Var("groups")

    def step(first: L.Expr, count: int) -> list:
        out = []
        for j in range(count):
            gj = _add(first, _c(j))
            wb = _add(_mul(b, groups), gj)
            for k in range(n):
                value = L.Load("vals", _add(_mul(_add(_mul(wb, _c(n)), _c(k)), _c(lanes)), bv), plan.vtype)
                pick = L.LanePick("x", _mul(gj, _c(4)), "sel", _add(_mul(wb, _c(lanes)), bv), 2 * k)
                term = _mul(value if plan.vtype == F32 else L.Cast(value, F32), pick)
                out.append(_vloop(lanes, lanes, L.Store("acc", _add(_c((j * n + k) * lanes), bv), term, "add")))
        return out
    whole = L.binary("floordiv", groups, _c(G))
    folded = [_vloop(lanes, lanes, L.Store("acc", bv, L.Load("acc", _add(_c(c * lanes), bv), F32), "add"))
              for c in range(1, G * n)]
    body = L.block(L.LocalArray("acc", F32, G * n * lanes, L.Const(0.0, F32), vector=lanes),
                   L.For(gq, _c(0), whole, L.block(*step(_mul(gq, _c(G)), G))),
                   L.For(g, _mul(whole, _c(G)), groups, L.block(*step(g, 1))),
                   *folded, *finish(replace(plan, unroll=1), b, _c(0), _c(1)))
    blocks = L.binary("floordiv", _add(L.Var("n_out"), _c(lanes - 1)), _c(lanes))
    work = L.For(b, _c(0), blocks, body,
                 parallel=L.Parallel("static", None, L.block(L.Alloc("tb", F32, _c(lanes))), chunk=DECODE_BLOCKS))
    params = (L.Param("sel", "array", "i8"), L.Param("vals", "array", plan.vtype)) + \
        ((L.Param("bias", "array", F32),) if plan.bias else ()) + \
        (L.Param("x", "array", F32), L.Param("y", "array", F32, output=True), L.Param("n_out", "scalar", I64),
         L.Param("groups", "scalar", I64), L.Param("nthreads", "scalar", I64))
    return L.Kernel(plan.name + "_picks_decode", params, L.block(work))


#: the scalars of the convolution's kernel (``conv_parts``)
CONV_SCALARS = ("cpg", "pixels", "wo", "img_stride", "row_stride", "col_stride")


def conv_parts() -> tuple:
    """``(token_at, group_loop)`` of a 2-d convolution as the implicit product of its weight's matrix view (columns
    in the order (kh, kw, in): a group is 4 input channels of one tap) and the unfolded input, read in place from a
    padded channels-last buffer ``x`` (images x padded rows x padded columns x channels): token ``t`` is the
    output pixel ``(t / pixels, t % pixels / wo, t % wo)``, its features start at its image's, row's and
    column's strides; the groups run over the taps (``taps[k]``: the tap's offset in the buffer) and, in each, the
    ``cpg`` groups of 4 channels. (No unfolded copy: a 3 x 3 convolution's would be 9 times the input.)"""
    pixels, wo, tap, cb = L.Var("pixels"), L.Var("wo"), L.Var("tap"), L.Var("cb")
    cpg, at = L.Var("cpg"), L.Var("tap_at")

    def token_at(t):
        p = L.binary("mod", t, pixels)
        return _add(_mul(L.binary("floordiv", t, pixels), L.Var("img_stride")),
                    _mul(L.binary("floordiv", p, wo), L.Var("row_stride")),
                    _mul(L.binary("mod", p, wo), L.Var("col_stride")))

    def group_loop(visit):
        return L.For(tap, _c(0), L.binary("floordiv", L.Var("groups"), cpg), L.block(
            L.Let(at, L.Load("taps", tap, I64)),
            L.For(cb, _c(0), cpg, L.block(*visit(_add(_mul(tap, cpg), cb), _add(at, _mul(cb, _c(4))))))))
    return token_at, group_loop


#: tokens a tile of the value gradient (``weight_grad``): the tile's rows of ``x`` are read once per row block
GRAD_TILE = 32
#: groups of a tile's features that every row block goes over before the next: 256 features x 32 tokens, 32 KiB,
#: the L1 data cache, so that only the first row block reads them from L2
GRAD_GROUP_CHUNK = 64


def grad_groups(n: int) -> int:
    """Groups a step of ``weight_grad`` takes together: their ``n`` accumulators and permute controls each, 12 of
    AVX2's 16 registers, the rows' ``dy`` vector and a group's broadcast features the rest."""
    return max(1, 6 // n)


def weight_grad(plan: Tiles) -> L.Kernel:
    """The gradient of an n:4 weight's values with its rows in a vector's lanes: ``dw[((b * groups + g) * n + k) *
    lanes + r] += sum over tokens t of dy[t, b * lanes + r] * x[t, 4 g + (sel[(b * groups + g) * lanes + r] >> 2k)
    & 3]`` (``lane_layout``'s order; ``dy``'s rows padded to whole blocks, ``n_out`` that padded count). Per token and
    group: one vector of ``dy`` (the block's rows of the token, shared by ``grad_groups`` groups), one broadcast of
    the token's 4 features, and per stored value one permute (``LanePick``) and one multiply-add into the value's
    own accumulator, summed over the tokens in registers: no sum across lanes. Work items are chunks of
    ``row_chunk`` rows (whole blocks; a thread owns its blocks' gradients), each over tiles of ``GRAD_TILE``
    tokens, whose features go in chunks of ``GRAD_GROUP_CHUNK`` groups over every row block of the chunk."""
    if not plan.picks:
        raise ValueError(f"scorch: weights_picks.weight_grad takes a plan of ``planned``; got {plan}")
    lanes, (n, _) = plan.lanes, plan.group
    G = grad_groups(n)
    n_out, groups = L.Var("n_out"), L.Var("groups")
    item, tile, b, t, gc, gq, g = (L.Var(v) for v in ("item", "tile", "b", "t", "gc", "gq", "g"))
    gs, ge, t0, t1, bv = L.Var("gs"), L.Var("ge"), L.Var("t0"), L.Var("t1"), L.Var("bv")
    r_lo = _mul(item, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))

    def step(first: L.Expr, count: int) -> L.Block:
        """``count`` groups from ``first``: their accumulators over the tile's tokens, then added into ``dw``."""
        terms, out = [], []
        for j in range(count):
            wb = _add(_mul(b, groups), _add(first, _c(j)))
            for k in range(n):
                acc = _add(_c((j * n + k) * lanes), bv)
                pick = L.LanePick("x", _add(_mul(t, L.Var("n_in")), _mul(_add(first, _c(j)), _c(4))), "sel",
                                  _add(_mul(wb, _c(lanes)), bv), 2 * k)
                rows = L.Load("dy", _add(_mul(t, n_out), _mul(b, _c(lanes)), bv), F32)
                terms.append(_vloop(lanes, lanes, L.Store("acc", acc, _mul(rows, pick), "add")))
                out.append(_vloop(lanes, lanes, L.Store("dw", _add(_mul(_add(_mul(wb, _c(n)), _c(k)), _c(lanes)), bv),
                                                        L.Load("acc", acc, F32), "add")))
        return L.block(L.LocalArray("acc", F32, count * n * lanes, L.Const(0.0, F32), vector=lanes),
                       L.For(t, t0, t1, L.block(*terms)), *out)

    whole = L.binary("floordiv", L.binary("sub", ge, gs), _c(G))
    blocks = L.For(b, L.binary("floordiv", r_lo, _c(lanes)), L.binary("floordiv", r_hi, _c(lanes)), L.block(
        L.For(gq, _c(0), whole, step(_add(gs, _mul(gq, _c(G))), G)),
        L.For(g, _add(gs, _mul(whole, _c(G))), ge, step(g, 1))))
    group_chunks = L.For(gc, _c(0), L.binary("floordiv", _add(groups, _c(GRAD_GROUP_CHUNK - 1)), _c(GRAD_GROUP_CHUNK)),
                         L.block(L.Let(gs, _mul(gc, _c(GRAD_GROUP_CHUNK))),
                                 L.Let(ge, L.binary("min", groups, _add(gs, _c(GRAD_GROUP_CHUNK)))), blocks))
    tiles = L.For(tile, _c(0), L.binary("floordiv", _add(L.Var("n"), _c(GRAD_TILE - 1)), _c(GRAD_TILE)), L.block(
        L.Let(t0, _mul(tile, _c(GRAD_TILE))), L.Let(t1, L.binary("min", L.Var("n"), _add(t0, _c(GRAD_TILE)))),
        group_chunks))
    work = L.For(item, _c(0), L.Var("chunks"), L.block(tiles), parallel=L.Parallel("static", None, L.block(), chunk=1))
    params = (L.Param("sel", "array", "i8"), L.Param("x", "array", F32), L.Param("dy", "array", F32),
              L.Param("dw", "array", F32, output=True)) + tuple(
        L.Param(v, "scalar", I64) for v in ("n", "n_in", "n_out", "groups", "chunks", "row_chunk", "nthreads"))
    return L.Kernel(plan.name + "_picks_dw", params, L.block(work))
