"""Dense activations x sparse weights: the kernel family of ``F.linear`` with a sparse weight, built as loop IR.

``Y[t, o] = sum_i X[t, i] * W[o, i] (+ bias[o])`` with ``X`` (tokens x in) and ``Y`` (tokens x out) row-major, as
torch lays them out, and ``W`` (out x in) in CSR, BSR or n:m. The general lowering computes this product as
``W @ X^T`` on a relaid-out copy of the whole activation and returns a transposed view; here the activation is
read in its own layout, a tile of tokens at a time, and the result is written row-major.

The kernel is the composition of named passes over one plan (``Tiles``), each producing its part of the loop
IR, so that every decision is made in one place and the NumPy interpreter runs the same program:

- ``tiles``: the tile shape for the target's vectors: ``T`` tokens (``vectors`` machine vectors) per tile,
  ``unroll`` independent accumulator sets per row (an FMA's latency hidden behind others), ``rows`` per store;
- ``pack``: a tile of ``X`` transposed into a per-thread panel (in x T, contiguous per input feature): the
  entries of a weight row read whole vectors of tokens from it, the panel staying in the L2 cache while every
  row of ``W`` streams past;
- ``accumulate``: the micro-kernel, one broadcast multiply-add per stored weight per vector of tokens, with
  ``prefetch`` asking for the panel row of an entry further on (the order only the weight knows);
- ``epilogue``: the row's accumulators summed and the bias added, into a small buffer;
- ``store``: the buffer transposed into ``Y``'s rows (``rows`` outputs of a token contiguous).

``pack`` and ``store`` copy through ``loopir.Transpose``, which the C++ renderer does in square tiles of vector
shuffles (``codegen.transpose``): as plain loops GCC left them scalar, and they took as long as the products (a
768 x 768 weight of one stored entry 1.72 ms, 10% dense 2.98 ms, at 1024 tokens, 1 thread; with the tiles 0.88 and
2.37 ms). (Only the bfloat16 pairs of ``pairs`` and ``combos`` panels are still packed lane by lane.)

The backward's input gradient (``dX = dY @ W``, ``transposed``) is the same family with the roles of the panels
swapped: a panel of ``dY`` rows is scattered into a per-thread panel of ``dX`` columns, which is then stored.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import loopir as L
from .prefetch import PREFETCH_LOCALITY, prefetch_distance
from .target import Target

#: accumulator vectors a micro-kernel may hold (of the 16 AVX2 / 32 AVX-512 registers: the rest hold the panel
#: loads and the broadcast weights)
ACCUMULATORS = 12
#: accumulator vectors of a CSR or n:m row (``unroll`` sets of ``vectors``)
ROW_ACCUMULATORS = 8
#: tokens per tile at most, in machine vectors: a panel of ``in`` x 2 vectors (768 features, AVX-512: 96 KiB)
#: stays in L2 while the weight streams past it. CSR at 90%, interleaved medians (AMD Zen 4, 2 threads): 2
#: vectors x 4 sets 1.00-1.20x faster than 4 x 2 at BERT shapes (768 <-> 3072, 128 and 1024 tokens)
MAX_VECTORS = 2
#: tokens per tile of a float32 CSR weight at most, where vectors are narrower than AVX-512's: ``MAX_VECTORS`` 16-lane
#: vectors hold 32 tokens, and so do 4 of AVX2's 8 (2 accumulator sets a row, not 4). Interleaved medians, 90%, 2
#: threads, AMD EPYC Zen 3: 2 x 8 tokens / 4 x 8, one Linear at 1024 tokens 3072 x 768 8.69 / 7.24 ms, 768 x 3072
#: 7.95 / 8.03; at 128 tokens 1.20 / 1.13, 1.31 / 1.38; BERT-base 90% csr batch 1 84.6 / 79.8 ms, batch 8 552 / 507
CSR_TOKENS = 32
#: tokens per tile of an n:m weight, in vectors, whose rows go over the groups ``row_pass`` at a time
#: (``_group_rows``). Measured at BERT shapes (768 <-> 3072, 128 and 1024 tokens, 2 threads, AMD Zen 4), 2:4
#: float32, vectors x rows a pass: 2 x 4 1.36-1.49x the dense Linear, 4 x 3 1.24-1.47x, 4 x 2 1.09-1.31x,
#: 1 x 8 1.16-1.17x, 4 x 1 (one row at a time) 0.91-1.07x; 2:4 bfloat16 (``combos``, whose panel holds 6 pairs
#: a group: 6 * in * T bytes, 1.2 MiB at 3072 features and 64 tokens) 2 x 4 1.63-1.82 ms, 4 x 2 1.75-2.68
GROUP_VECTORS = 2
#: a BSR tile's rows a pass and vectors of tokens where the vectors are 16 registers (AVX2 and narrower): a block
#: row of 16 one vector of tokens each, as on AVX-512, kept 16 accumulators there and GCC spilled three of them
#: (a load and a store a block column). Interleaved medians, 90% bsr(16, 16), 2 threads, AMD EPYC Zen 3, rows x
#: vectors against dense, 3072 x 768 / 768 x 3072 at 128 and 1024 tokens: 16 x 1 6.1x 6.3x 3.6x 4.9x (another run
#: 4.5x 5.5x 4.6x 4.9x), 8 x 1 7.0x 6.5x 4.7x 5.7x, 4 x 2 7.1x 6.2x 5.0x 5.7x, 4 x 3 8.5x 8.2x 5.2x 7.0x (6.6x 8.1x
#: 6.0x 6.9x), 2 x 4 7.4x 7.9x 6.0x 6.1x, 2 x 6 4.9x 4.6x 4.1x 4.1x
BSR_NARROW_ROWS = 4
BSR_NARROW_VECTORS = 3
#: a CSR row's float32 weights read this many at a time where vectors are 8 floats (``Tiles.splat``): one 16-byte
#: load a group, each weight taken to the lanes by shuffles instead of a broadcast load each (the row's loop is
#: bound by its vector loads: 4 of the panel and the weight's broadcast a stored weight). C++ copies of the loop,
#: AMD EPYC Zen 3, 90%, 1024 tokens, 2 threads, broadcast loads / groups of 4: 3072 x 768 6.44 / 5.20 ms, 768 x
#: 3072 7.68 / 6.90, 768 x 768 1.62 / 1.31; at 128 tokens 3072 x 768 0.91 / 0.78
SPLAT = 4
#: rows of the output gathered in the buffer before they are stored into ``Y``: 16 floats of a token, one line
STORE_ROWS = 16
#: tokens per tile of a bfloat16 BSR weight on matrix tiles (``weights_amx``): two result tiles of 16 tokens, so
#: that a block's values are loaded once for both (not measured: no CPU here has AMX)
AMX_TOKENS = 32


def serves(target: Target, kind: str, tokens: int) -> bool:
    """Whether the family is the faster kernel for ``tokens`` tokens. A BSR tile holds a vector of tokens, so with
    fewer tokens than half a vector most of its lanes are zeros, and the general lowering's kernel, vectorized
    along the blocks' columns, is faster there (by hand, 3072 x 768 at 90%, AVX-512: BSR 16 x 16 at 1 and 4
    tokens 0.13 -> 0.42 ms, at 16 tokens 0.26 -> 0.11 ms). CSR and n:m take one token as row dots (``dots``)."""
    if kind == "bsr":
        return tokens >= max(1, target.lanes("f32") // 2)
    return True


def dots(kind: str, vtype: str, tokens: int, target: Target) -> bool:
    """Whether ``tokens`` run as ``row_dots``: one token, CSR or n:m, float32 values or (n:m) bfloat16 ones (the
    token is read as float32), a target with vectors. (A CSR row's last vector is partial, and the renderer reads no
    16-bit array in a partial vector.)"""
    return tokens == 1 and target.vectors and (vtype == F32 and kind in ("csr", "nm") or
                                               vtype == "bf16" and kind == "nm")


@dataclass(frozen=True)
class Tiles:
    """The plan of one kernel of the family (``tiles``): ``kind`` "csr", "bsr" or "nm"; ``vtype`` the weight's
    values, ``xtype`` the activation's and the result's, ``ptype``/``ctype`` the positions' and coordinates'
    (n:m: the in-group offsets'); ``lanes`` per vector and ``vectors`` per tile (``T = lanes * vectors``
    tokens); ``unroll`` accumulator sets per row (CSR, n:m); ``block`` (bh, bw) for BSR, ``group`` (n, m) for
    n:m; ``rows`` per store (BSR: the block's rows), ``row_pass`` rows accumulated at once (BSR); ``bias``: added
    in the epilogue; ``transposed``: the input gradient ``dX = dY @ W``; ``activation``: one of
    ``loopir.ACTIVATIONS`` applied after the bias, in float32, before the store (``activate``)."""
    kind: str
    vtype: str
    xtype: str
    ptype: str
    ctype: str
    lanes: int
    vectors: int
    unroll: int = 1
    block: tuple = (1, 1)
    group: tuple = (1, 1)
    rows: int = STORE_ROWS
    row_pass: int = 1
    bias: bool = False
    transposed: bool = False
    pairs: bool = False  # (BSR, bfloat16) the panel holds pairs of features, multiplied by ``PairDot``
    combos: bool = False  # (2:4, bfloat16) the panel holds every pair of a group's features (``COMBOS``)
    halves: bool = False  # (CSR, bfloat16, 2 vectors) the panel holds bfloat16 tokens, read a pair at a time
    activation: str | None = None
    picks: int = 0  # (n:4, float32) rows in a vector's lanes: micro-kernels of ``unroll`` tokens a tile
    #                 (``weights_picks``)
    depth: int = 0  # (n:m, float32) groups a depth block: the rows' passes over the panel a block of groups at a
    #                 time, the weight laid out in that order (``weights_depth``)
    splat: bool = False  # (CSR, float32 values, 8-lane vectors) a row's weights read 4 at a time, each taken to
    #                      the lanes by shuffles (``loopir.Splat``), not a broadcast load each
    amx: str = ""  # (BSR, ``pairs``) the products on matrix tiles (``weights_amx``, ``loopir.TileRow``): the
    #                Target's ``amx``, "tiles" or "model"

    @property
    def T(self) -> int:
        """Tokens a tile."""
        return self.unroll * self.picks if self.picks else self.lanes * self.vectors

    @property
    def paired(self) -> bool:
        """Whether the panel holds bfloat16 pairs (``PairDot``), not float32."""
        return self.pairs or self.combos

    @property
    def name(self) -> str:
        return "scorch_weights_" + ("dx_" if self.transposed else "") + self.kind + ("_depth" if self.depth else "")


def row_sets(vectors: int) -> int:
    """Accumulator sets of a CSR or n:m row with tiles of ``vectors`` vectors: ``ROW_ACCUMULATORS`` vectors in
    flight, at most 4 sets."""
    return max(1, min(4, ROW_ACCUMULATORS // vectors))


def tiles(target: Target, kind: str, tokens: int, vtype: str, xtype: str, ptype: str, ctype: str,
          block=(1, 1), group=(1, 1), bias=False, transposed=False, activation=None) -> Tiles:
    """The tile shape for ``tokens`` tokens on ``target``: as many vectors of tokens as the tokens fill (at most
    ``MAX_VECTORS``: one token still takes one vector, whose other lanes hold zeros); CSR and n:m rows keep
    ``unroll`` sets of accumulators so that ``ROW_ACCUMULATORS`` vectors are in flight; a BSR tile holds one vector
    of tokens for each of ``row_pass`` block rows, whose panel load it shares."""
    if activation is not None and (activation not in L.ACTIVATIONS or transposed):
        raise ValueError(f"scorch: an activation epilogue is one of {', '.join(L.ACTIVATIONS)} on a forward product;"
                         f" got {activation!r}{' on the input gradient' if transposed else ''}")
    lanes = target.lanes("f32") if target.vectors else 1
    if kind == "bsr":
        bh = block[0]
        pairs = vtype == xtype == "bf16" and block[1] % 2 == 0 and lanes > 1 and not transposed
        if pairs and target.amx and bh <= 16 and block[1] <= 32:  # (a block is a tile: ``weights_amx``)
            return Tiles(kind, vtype, xtype, ptype, ctype, lanes, AMX_TOKENS // lanes, 1, tuple(block), (1, 1), bh,
                         bh, bias, transposed, pairs, activation=activation, amx=target.amx)
        if target.vectors and target.vector_bytes <= 32 and not pairs and not transposed:  # (16 registers)
            row_pass = max(r for r in range(1, min(bh, BSR_NARROW_ROWS) + 1) if bh % r == 0)
            vectors = max(1, min(ACCUMULATORS // row_pass, BSR_NARROW_VECTORS, -(-tokens // lanes)))
        else:
            row_pass, vectors = max(r for r in range(1, bh + 1) if bh % r == 0 and r <= ACCUMULATORS + 4), 1
        return Tiles(kind, vtype, xtype, ptype, ctype, lanes, vectors, 1, tuple(block), (1, 1), bh, row_pass, bias,
                     transposed, pairs, activation=activation)
    grouped = kind == "nm" and lanes > 1 and not transposed  # (rows in passes over the groups: ``_group_rows``)
    combos = grouped and tuple(group) == (2, 4) and vtype == xtype == "bf16"
    most = GROUP_VECTORS if grouped else \
        max(MAX_VECTORS, min(4, CSR_TOKENS // lanes)) if kind == "csr" and vtype == "f32" else MAX_VECTORS
    vectors = max(1, min(most, -(-tokens // lanes)))
    unroll = row_sets(vectors)
    # (rows a pass: a power of 2 dividing the store's rows, 8 x 1 vector, 4 x 2)
    row_pass = max(r for r in (1, 2, 4, 8) if r * vectors <= ROW_ACCUMULATORS) if grouped else 1
    halves = kind == "csr" and vtype == xtype == "bf16" and lanes > 1 and vectors == 2 and not transposed
    splat = kind == "csr" and vtype == F32 and not halves and target.vectors and target.vector_bytes == 32
    return Tiles(kind, vtype, xtype, ptype, ctype, lanes, vectors, unroll, (1, 1), tuple(group), STORE_ROWS,
                 row_pass, bias, transposed, combos=combos, halves=halves, activation=activation, splat=splat)


# -- the parts ------------------------------------------------------------------------------------------------

I64, F32 = "i64", "f32"
_t0, _nt, _tile, _chunk = L.Var("t0"), L.Var("nt"), L.Var("tile"), L.Var("chunk")
_bv, _cur = L.Var("bv"), L.Var("cur")


def _c(v):
    return L.Const(v)


def _add(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = L.binary("add", out, x)
    return out


def _mul(a, b):
    return L.binary("mul", a, b)


def _f32(e: L.Expr) -> L.Expr:
    """``e`` as float32 (16-bit values widen; a float32 expression stays as it is, a vector as well)."""
    return e if e.type == F32 else L.Cast(e, F32)


def _bounds(plan: Tiles, row: L.Expr) -> tuple:
    """``(pos[row], pos[row + 1])``: the positions of a compressed row's entries."""
    return L.Cast(L.Load("pos", row, plan.ptype), I64), L.Cast(L.Load("pos", _add(row, _c(1)), plan.ptype), I64)


def _vloop(T, lanes, *body):
    """``for bv in [0, T)`` as explicit vectors of ``lanes`` (a plain loop where the target has none)."""
    return L.For(_bv, _c(0), _c(T), L.block(*body), vector=lanes if lanes > 1 else 0)


def pack(plan: Tiles, panel: str, src: str, width: L.Expr) -> L.Block:
    """``panel[f * T + t] = src[(t0 + t) * width + f]`` for the tile's ``nt`` tokens and every feature ``f`` of
    ``width``; the lanes past ``nt`` zero (a partial last tile adds nothing from them)."""
    T, t, f = plan.T, L.Var("pt"), L.Var("pf")
    if plan.combos:
        return _pack_combos(plan, panel, src, width)
    if plan.pairs:  # (bfloat16 pairs of features: panel[(f / 2) * 2T + 2t + f % 2], as ``PairDot`` reads them)
        def at(f_, t_):
            return _add(_mul(L.binary("floordiv", f_, _c(2)), _c(2 * T)), _mul(t_, _c(2)), L.binary("mod", f_, _c(2)))
        zero, value = L.Const(0.0, plan.xtype), (lambda e: e)
    else:
        def at(f_, t_):
            return _add(_mul(f_, _c(T)), t_)
        zero, value = L.Const(0.0, plan.xtype if plan.halves else F32), (lambda e: L.Cast(e, F32))
    fill = L.For(t, _c(0), _c(T), L.block(L.Store(panel, at(f, t), zero)))
    if plan.pairs:  # (an even width: the tokens' pairs as 32-bit words, transposed in vector tiles)
        half = L.binary("floordiv", width, _c(2))
        copy = L.If(L.binary("eq", L.binary("mod", width, _c(2)), _c(0)), L.block(
            L.Transpose(panel, _c(0), _c(T), src, _mul(_t0, half), half, _nt, half, plan.xtype, plan.xtype, True)),
            L.block(L.For(t, _c(0), _nt, L.block(L.For(f, _c(0), width, L.block(
                L.Store(panel, at(f, t), value(L.Load(src, _add(_mul(_add(_t0, t), width), f), plan.xtype)))))))))
    else:  # (tokens x features -> features x T: vector tiles, ``loopir.Transpose``)
        copy = L.Transpose(panel, _c(0), _c(T), src, _mul(_t0, width), width, _nt, width, plan.xtype,
                           plan.xtype if plan.halves else F32)
    out = [L.If(L.binary("lt", _nt, _c(T)), L.block(L.For(f, _c(0), width, L.block(fill)))), copy]
    if plan.pairs:  # (an odd width's last pair: its second feature zero, a stored zero's partner in ``PairDot``)
        out.append(L.If(L.binary("eq", L.binary("mod", width, _c(2)), _c(1)), L.block(
            L.For(t, _c(0), _c(T), L.block(L.Store(panel, at(width, t), zero))))))
    return L.block(*out)


#: the pairs of a 2:4 group's columns, in the order ``combo`` numbers them: ``(a, b)`` -> ``a * (5 - a) / 2 + b - 1``
COMBOS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
#: groups ahead that a 2:4 bfloat16 row prefetches its values and pair numbers (``_group_rows``): a pass reads
#: ``row_pass`` rows' streams at once, more than the hardware prefetcher follows
COMBOS_AHEAD = 64


def _pack_combos(plan: Tiles, panel: str, src: str, width: L.Expr) -> L.Block:
    """The panel of a 2:4 bfloat16 weight: for each group of 4 features and each of its 6 pairs ``(a, b)``, the
    tile's tokens as pairs ``(x[t, 4g + a], x[t, 4g + b])``: ``panel[2 ((6 g + c) T + t) + {0, 1}]``. A row's
    group (two stored values, their pair numbered ``c``) is then one ``PairDot`` per vector of tokens: half the
    multiply-adds of the dense product, which takes a pair of features per ``vdpbf16ps`` too."""
    T, t, g = plan.T, L.Var("pt"), L.Var("pg")
    zero = L.Const(0.0, plan.xtype)

    def stores(value):
        out = []
        for c, (a, b) in enumerate(COMBOS):
            at = _mul(_add(_mul(_add(_mul(g, _c(len(COMBOS))), _c(c)), _c(T)), t), _c(2))
            out += [L.Store(panel, at, value(a)), L.Store(panel, _add(at, _c(1)), value(b))]
        return out
    groups = L.binary("floordiv", width, _c(4))
    fill = L.For(g, _c(0), groups, L.block(L.For(t, _nt, _c(T), L.block(*stores(lambda _: zero)))))
    copy = L.For(t, _c(0), _nt, L.block(L.For(g, _c(0), groups, L.block(*stores(
        lambda a: L.Load(src, _add(_mul(_add(_t0, t), width), _mul(g, _c(4)), _c(a)), plan.xtype))))))
    return L.block(L.If(L.binary("lt", _nt, _c(T)), L.block(fill)), copy)


def _group_rows(plan: Tiles, rb: L.Expr, re: L.Expr) -> L.Stmt:
    """The rows ``rb .. re`` of an n:m weight, ``row_pass`` rows at a time going over the groups together, so
    that the rows of a pass read a group's panel lines (its ``m`` features) while they are in L1, where one row at
    a time fetched them from L2 for each row: per group and row, its ``n`` stored values against the panel rows of
    their columns (2:4 bfloat16, ``combos``: the pair number read from ``combo`` and one ``PairDot`` of the two
    values against the panel's vectors of that pair). A pass past ``re`` repeats the last row and drops its
    sums. (Chunks of groups whose panel stays in L1 for many rows, as a dense product blocks its depth, measured
    slower: the rows' weights are then read in short runs.)"""
    T, R = plan.T, plan.row_pass
    (n, m), op, g = plan.group, L.Var("op"), L.Var("g")
    groups = L.Var("groups")
    first = _add(rb, _mul(op, _c(R)))
    rows = [L.Var(f"or{r}") for r in range(R)]
    lets = [L.Let(o, L.binary("min", _add(first, _c(r)), L.binary("sub", re, _c(1)))) for r, o in enumerate(rows)]
    body = []
    for r, o in enumerate(rows):
        at = _add(_mul(o, groups), g)
        if plan.combos:
            cb = L.Var(f"cb{r}")
            term = L.PairDot("panel", _add(_mul(_add(_mul(g, _c(len(COMBOS))), cb), _c(T)), _bv), "vals",
                             _mul(at, _c(2)))
            body += [L.Let(cb, L.Cast(L.Load("combo", at, "i8"), I64)),
                     _vloop(T, plan.lanes, L.Store("acc", _add(_c(r * T), _bv), term, "add"))]
            continue
        for k in range(n):
            p = L.Var(f"p{r}_{k}")
            body += [L.Let(p, _add(_mul(at, _c(n)), _c(k))),
                     _entry(plan, "acc", r, L.Load("vals", p, plan.vtype),
                            _add(_mul(g, _c(m)), L.Cast(L.Load("crd", p, plan.ctype), I64)), "panel")]
    if plan.combos:  # (each row's values and pair numbers a line ahead of every 16 groups: ``COMBOS_AHEAD``)
        last = L.binary("sub", _mul(L.Var("n_out"), groups), _c(1))
        ahead = [L.binary("min", _add(_mul(o, groups), g, _c(COMBOS_AHEAD)), last) for o in rows]
        body = [L.If(L.binary("eq", L.binary("mod", g, _c(16)), _c(0)), L.block(
            *(L.Prefetch("vals", _mul(a, _c(2)), 3) for a in ahead),
            *(L.Prefetch("combo", a, 3) for a in ahead)))] + body
    out = [L.If(L.binary("lt", _add(first, _c(r)), re), L.block(
        epilogue(plan, "acc", 1, o, _mul(L.binary("sub", o, rb), _c(T)), _c(r * T)))) for r, o in enumerate(rows)]
    passes = L.binary("floordiv", _add(L.binary("sub", re, rb), _c(R - 1)), _c(R))
    return L.For(op, _c(0), passes, L.block(
        *lets, L.LocalArray("acc", F32, R * T, L.Const(0.0, F32), vector=plan.lanes if plan.lanes > 1 else 0),
        L.For(g, _c(0), groups, L.block(*body)), *out))


def unrolled(lo: L.Expr, hi: L.Expr, sets: int, entry, k: L.Var, q: L.Var, p: L.Var) -> list:
    """The entries ``lo .. hi``: ``sets`` at a time, each into its own accumulator set (``entry(position, set)``:
    the multiply-adds of one set hide behind the others'), then the rest into set 0."""
    body = []
    for u in range(sets):
        pu = L.Var(f"{p.name}{u}")
        body += [L.Let(pu, _add(lo, _mul(k, _c(sets)), _c(u))), entry(pu, u)]
    return [L.Let(q, L.binary("floordiv", L.binary("sub", hi, lo), _c(sets))), L.For(k, _c(0), q, L.block(*body)),
            L.For(p, _add(lo, _mul(q, _c(sets))), hi, L.block(entry(p, 0)))]


def sets_total(acc: str, sets: int, T: int) -> L.Expr:
    """The sum of the accumulator sets ``acc[u * T + bv]`` at the vector loop's ``bv``."""
    total = L.Load(acc, _bv, F32)
    for u in range(1, sets):
        total = _add(total, L.Load(acc, _add(_c(u * T), _bv), F32))
    return total


def prefetch(plan: Tiles, panel: str, coordinate: L.Expr) -> L.Stmt:
    """A hint for the panel row of the entry ``prefetch_distance`` entries on (``coordinate`` is its column,
    read in bounds by the caller)."""
    return L.Prefetch(panel, _mul(coordinate, _c(plan.T)), PREFETCH_LOCALITY)


def _entry(plan: Tiles, acc: str, u: int, w: L.Expr, col: L.Expr, panel: str) -> L.Stmt:
    """One stored weight ``w`` at column ``col``: ``acc[u] += w * panel[col]`` over the tile's tokens. (``halves``:
    the panel row's bfloat16 tokens as pairs, the even tokens into the set's first vector and the odd ones into
    its second, ``store`` putting them back in order.)"""
    T = plan.T
    if plan.halves:
        return L.block(*(_vloop(plan.lanes, plan.lanes, L.Store(
            acc, _add(_c(u * T + h * plan.lanes), _bv),
            _mul(L.Cast(w, F32), L.PairHalf(panel, _add(_mul(col, _c(plan.lanes)), _bv), h)), "add")) for h in (0, 1)))
    return _vloop(T, plan.lanes, L.Store(acc, _add(_c(u * T), _bv),
                                         _mul(_f32(w), L.Load(panel, _add(_mul(col, _c(T)), _bv), F32)),
                                         "add"))


def accumulate_row(plan: Tiles, o: L.Expr, acc: str, panel: str) -> L.Block:
    """The micro-kernel of one output row ``o`` (CSR or n:m): its stored weights, ``unroll`` at a time into
    separate accumulator sets, then the rest into the first."""
    U = plan.unroll
    p, k, lo, hi, q = L.Var("p"), L.Var("k"), L.Var("lo"), L.Var("hi"), L.Var("q")
    if plan.kind == "nm":
        n, m = plan.group
        groups = L.Var("groups")
        lo_e, hi_e = _mul(_mul(o, groups), _c(n)), _mul(_mul(_add(o, _c(1)), groups), _c(n))

        def col(pe):  # group (pe / n) within the row, times m, plus the stored offset
            return _add(_mul(L.binary("sub", L.binary("floordiv", pe, _c(n)), _mul(o, groups)), _c(m)),
                        L.Cast(L.Load("crd", pe, plan.ctype), I64))
    else:
        lo_e, hi_e = _bounds(plan, o)

        def col(pe):
            return L.Cast(L.Load("crd", pe, plan.ctype), I64)
    ahead = prefetch_distance(plan.T * 4)
    step = SPLAT if plan.splat else U  # (entries an iteration: a group of 4 weights, or one a set)
    body = []
    for u in range(step):
        pu, first = L.Var(f"p{u}"), _add(lo, _mul(k, _c(step)))
        w = L.Splat("vals", first, u) if plan.splat else L.Load("vals", pu, plan.vtype)
        body += [L.Let(pu, _add(first, _c(u))), _entry(plan, acc, u % U, w, col(pu), panel)]
    last = L.binary("sub", hi, _c(1))
    body.append(prefetch(plan, panel, col(L.binary("min", _add(lo, _mul(k, _c(step)), _c(ahead)), last))))
    return L.block(
        L.Let(lo, lo_e), L.Let(hi, hi_e), L.Let(q, L.binary("floordiv", L.binary("sub", hi, lo), _c(step))),
        L.For(k, _c(0), q, L.block(*body)),
        L.For(p, _add(lo, _mul(q, _c(step))), hi, L.block(_entry(plan, acc, 0, L.Load("vals", p, plan.vtype), col(p),
                                                              panel))))


def epilogue(plan: Tiles, acc: str, sets: int, row: L.Expr, at: L.Expr, base: L.Expr = L.Const(0)) -> L.Stmt:
    """``tb[at + t] = sum of the accumulator sets from acc[base] (+ bias[row])`` over the tile's tokens."""
    T = plan.T
    value = L.Load(acc, _add(base, _bv), F32)
    for u in range(1, sets):
        value = _add(value, L.Load(acc, _add(base, _c(u * T), _bv), F32))
    if plan.bias:
        value = _add(value, L.Cast(L.Load("bias", row, plan.vtype), F32))
    return _vloop(T, plan.lanes, L.Store("tb", _add(at, _bv), value))


def activated(plan: Tiles, value: L.Expr) -> L.Expr:
    """``value`` (float32) through the plan's activation, if any."""
    return value if plan.activation is None else L.Unary(plan.activation, value, F32)


def activate(plan: Tiles, count: L.Expr, buf: str = "tb") -> L.Stmt | None:
    """The activation on the buffer's ``count`` rows of ``T`` (finished sums, bias added) before they are stored:
    a plain loop the C++ compiler vectorizes over the branch-free helpers (``codegen.prelude.ACTIVATIONS``), on
    the buffer while it is in L1. (In the epilogue's explicit vectors it would need vector forms of the helpers;
    per value in the store's transposed loop it would not vectorize.)"""
    if plan.activation is None:
        return None
    k = L.Var("ak")
    return L.For(k, _c(0), _mul(count, _c(plan.T)), L.block(L.Store(buf, k, activated(plan, L.Load(buf, k, F32)))),
                 simd=True)


def store(plan: Tiles, out: str, width: L.Expr, first: L.Expr, count: L.Expr, buf: str = "tb") -> L.Stmt:
    """``out[(t0 + t) * width + first + r] = buf[r * T + t]`` for the tile's tokens and ``count`` rows: the
    buffer transposed into the result's rows (16-bit results rounded once, here). (``halves``: the buffer's rows
    hold the even tokens, then the odd ones: two transposes into every other row of the result.)"""
    if plan.halves:
        lanes, step = plan.lanes, _mul(width, _c(2))
        return L.block(*(L.Transpose(out, _add(_mul(_add(_t0, _c(h)), width), first), step, buf, _c(h * lanes),
                                     _c(plan.T), count, L.binary("floordiv", _add(_nt, _c(1 - h)), _c(2)), F32,
                                     plan.xtype) for h in (0, 1)))
    return L.Transpose(out, _add(_mul(_t0, width), first), width, buf, _c(0), _c(plan.T), count, _nt, F32, plan.xtype)


# -- the kernels ----------------------------------------------------------------------------------------------

def _params(plan: Tiles, x: str, y: str) -> tuple:
    pos = () if plan.kind == "nm" else (L.Param("pos", "array", plan.ptype),)
    index = L.Param("combo", "array", "i8") if plan.combos else L.Param("crd", "array", plan.ctype)
    return pos + (index, L.Param("vals", "array", plan.vtype)) + \
        ((L.Param("bias", "array", plan.vtype),) if plan.bias else ()) + \
        (L.Param(x, "array", plan.xtype), L.Param(y, "array", plan.xtype, output=True),
         L.Param("n", "scalar", I64), L.Param("n_in", "scalar", I64), L.Param("n_out", "scalar", I64),
         L.Param("groups", "scalar", I64), L.Param("chunks", "scalar", I64),
         L.Param("row_chunk", "scalar", I64), L.Param("nthreads", "scalar", I64))


def _work(plan: Tiles, width_in: L.Expr, src: str, body, extra=None, packer=None) -> L.For:
    """The parallel loop over work items (token tile x row chunk), tile-major: each thread packs a tile's
    panel when its item's tile is not the one its panel holds (``packer``: the pack's statement, where it is not
    ``pack``'s: a convolution's, ``weights_depth.conv_pack``)."""
    T = plan.T
    tiles_n = L.binary("floordiv", _add(L.Var("n"), _c(T - 1)), _c(T))
    item = L.Var("item")
    # (combos: 12 per group of 4; pairs: an odd width's last pair whole)
    size = _mul(width_in, _c(T * 3)) if plan.combos else _mul(_add(width_in, _c(1)) if plan.pairs else width_in,
                                                                _c(T))
    panel = L.Alloc("panel", plan.xtype if plan.paired or plan.halves else F32, size)
    setup = L.block(panel, L.Alloc("tb", F32, _c(plan.rows * T)), extra, L.Decl(_cur, _c(-1)))
    packed = L.If(L.binary("ne", _tile, _cur), L.block(packer if packer is not None else
                                                        pack(plan, "panel", src, width_in), L.Assign(_cur, _tile)))
    return L.For(item, _c(0), _mul(tiles_n, L.Var("chunks")), L.block(
        L.Let(_tile, L.binary("floordiv", item, L.Var("chunks"))),
        L.Let(_chunk, L.binary("mod", item, L.Var("chunks"))),
        L.Let(_t0, _mul(_tile, _c(T))),
        L.Let(_nt, L.binary("min", _c(T), L.binary("sub", L.Var("n"), _t0))),
        packed, *body), parallel=L.Parallel("static", None, setup, chunk=1))


def forward(plan: Tiles, rows_body=None, packer=None, params=(), name=None) -> L.Kernel:
    """``y = x @ W^T (+ bias)``, ``W`` out x in: work items of a token tile and a chunk of ``row_chunk`` rows
    (``rows_body``: as ``block_rows``'s; ``packer``: as ``_work``'s, ``params`` the parameters it reads besides a
    product's, ``name`` the kernel's where it is not the plan's)."""
    n_out = L.Var("n_out")
    r_lo = _mul(_chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    rows = block_rows(plan, r_lo, r_hi, lambda rb, count: store(plan, "y", n_out, rb, count), rows_body)
    return L.Kernel(name or plan.name, _params(plan, "x", "y") + tuple(params),
                    L.block(_work(plan, L.Var("n_in"), "x", [rows], packer=packer)))


def block_rows(plan: Tiles, r_lo: L.Expr, r_hi: L.Expr, finish, rows_body=None) -> L.For:
    """The output rows ``r_lo .. r_hi`` of the tile, a store block (``rows``) at a time: each row's stored weights
    against ``panel`` summed into ``tb`` with the bias, the activation, then ``finish(rb, count)`` (the store of
    the block's ``count`` rows from ``rb``). ``rows_body(rb, re)``: the sums of the block's rows into ``tb``, where
    another module's kernel makes them (``weights_depth``)."""
    T, R = plan.T, plan.rows
    ob, o, rb, re = L.Var("ob"), L.Var("o"), L.Var("rb"), L.Var("re")
    if rows_body is not None:
        body = rows_body(rb, re)
    elif plan.kind == "bsr":
        body = _bsr_rows(plan, rb)
    elif plan.row_pass > 1:
        body = _group_rows(plan, rb, re)
    else:
        sets = plan.unroll
        body = L.For(o, rb, re, L.block(
            L.LocalArray("acc", F32, sets * T, L.Const(0.0, F32), vector=plan.lanes if plan.lanes > 1 else 0),
            accumulate_row(plan, o, "acc", "panel"),
            epilogue(plan, "acc", sets, o, _mul(L.binary("sub", o, rb), _c(T)))))
    blocks = L.binary("floordiv", _add(L.binary("sub", r_hi, r_lo), _c(R - 1)), _c(R))
    count = L.binary("sub", re, rb)
    return L.For(ob, _c(0), L.binary("max", blocks, _c(0)), L.block(
        L.Let(rb, _add(r_lo, _mul(ob, _c(R)))), L.Let(re, L.binary("min", r_hi, _add(rb, _c(R)))),
        body, activate(plan, count), finish(rb, count)))


def _bsr_rows(plan: Tiles, rb: L.Expr) -> L.Stmt:
    """One block row (``rows`` = bh output rows from ``rb``): ``row_pass`` rows at a time, each block's column
    read from the panel once for all of them."""
    T, (bh, bw), Rt = plan.T, plan.block, plan.row_pass
    br, rp, p, c, r = L.Var("br"), L.Var("rp"), L.Var("p"), L.Var("c"), L.Var("r")
    c0 = L.Var("c0")
    at = _add(_mul(_add(_mul(p, _c(bh)), _mul(rp, _c(Rt)), r), _c(bw)), c)
    if plan.pairs:  # (c steps over pairs of the block's columns: one vdpbf16ps per pair and row)
        at = _add(_mul(_add(_mul(p, _c(bh)), _mul(rp, _c(Rt)), r), _c(bw)), _mul(c, _c(2)))
        term = L.PairDot("panel", _add(_mul(_add(L.binary("floordiv", c0, _c(2)), c), _c(T)), _bv), "vals", at)
    else:
        term = _mul(L.Cast(L.Load("vals", at, plan.vtype), F32),
                    L.Load("panel", _add(_mul(_add(c0, c), _c(T)), _bv), F32))
    steps = bw // 2 if plan.pairs else bw

    def blocks(width):  # (the sums of the tile's first ``width`` tokens: whole vectors)
        entry = L.For(r, _c(0), _c(Rt), L.block(_vloop(width, plan.lanes, L.Store(
            "acc", _add(_mul(r, _c(T)), _bv), term, "add"))), unroll=True)
        return L.For(p, *_bounds(plan, br),
                     L.block(L.Let(c0, _mul(L.Cast(L.Load("crd", p, plan.ctype), I64), _c(bw))),
                             L.For(c, _c(0), _c(steps), L.block(entry), unroll=steps <= 16)))
    # a partial last tile multiplies only the vectors its tokens fill (the others' lanes stay 0): 128 tokens in
    # tiles of 24 made a sixth tile of 8 tokens cost a whole one. AMD EPYC Zen 3, 2 threads, 90% bsr(16, 16),
    # interleaved against the whole tile: 768 x 768, 3072 x 768, 768 x 3072 at 128 tokens 1.04x, 1.07x, 1.10x
    # faster; at 1024 1.06x each
    sums = blocks(T)
    if plan.lanes > 1 and not plan.pairs:
        for v in range(plan.vectors - 1, 0, -1):
            sums = L.If(L.binary("le", _nt, _c(v * plan.lanes)), L.block(blocks(v * plan.lanes)), L.block(sums))
    out_rows = L.For(r, _c(0), _c(Rt), L.block(epilogue(plan, "acc", 1, _add(rb, _mul(rp, _c(Rt)), r),
                                                        _mul(_add(_mul(rp, _c(Rt)), r), _c(T)), _mul(r, _c(T)))),
                     unroll=True)
    return L.block(L.Let(br, L.binary("floordiv", rb, _c(bh))), L.For(rp, _c(0), _c(bh // Rt), L.block(
        L.LocalArray("acc", F32, Rt * T, L.Const(0.0, F32), vector=plan.lanes if plan.lanes > 1 else 0),
        sums, out_rows)))



def _row_entries(plan: Tiles, o: L.Expr, visit) -> L.Stmt:
    """The stored weights of row ``o`` (CSR or n:m), one at a time: ``visit(w, col)`` gives the body."""
    p = L.Var("p")
    if plan.kind == "nm":
        n, m = plan.group
        g, s = L.Var("g"), L.Var("s")
        pe = _add(_mul(_add(_mul(o, L.Var("groups")), g), _c(n)), s)
        return L.For(g, _c(0), L.Var("groups"), L.block(L.For(s, _c(0), _c(n), L.block(
            L.Let(p, pe), visit(L.Load("vals", p, plan.vtype),
                                _add(_mul(g, _c(m)), L.Cast(L.Load("crd", p, plan.ctype), I64)))), unroll=True)))
    return L.For(p, *_bounds(plan, o),
                 L.block(visit(L.Load("vals", p, plan.vtype), L.Cast(L.Load("crd", p, plan.ctype), I64))))


def row_dots(plan: Tiles) -> L.Kernel:
    """One token (decode): ``y[o] = sum_p vals[p] * x[col(p)] (+ bias[o])``, ``x`` and ``y`` float32 (a 16-bit
    token is widened first: it is one row), the row's entries taken a vector at a time (CSR: ``x`` gathered at
    the coordinates; n:m: a loop the compiler vectorizes over the row's slots), ``x``
    staying in L1 while the weight streams past: the call is bound by the weight's bytes, which narrow indices
    make fewer. A tile of tokens would hold one token in a vector's lanes."""
    o, p, q, s = L.Var("o"), L.Var("p"), L.Var("q"), L.Var("s", F32)
    lanes = plan.lanes
    bias = _f32(L.Load("bias", o, plan.vtype)) if plan.bias else L.Const(0.0, F32)
    if plan.kind == "csr":
        lo, hi = _bounds(plan, o)
        term = _mul(_f32(L.Load("vals", p, plan.vtype)), L.Load("x", L.Cast(L.Load("crd", p, plan.ctype), I64),
                                                               plan.xtype))
        row = L.block(L.LocalArray("vsum", F32, 1, L.Const(0.0, F32), sums=lanes),
                      L.For(p, lo, hi, L.block(L.Store("vsum", _c(0), term, "add")), vector=lanes, tail=True),
                      L.Store("y", o, activated(plan, _add(L.Load("vsum", _c(0), F32), bias))))
        parallel = L.Parallel("nnz", "pos")
    else:
        n, m = plan.group
        slots = _mul(L.Var("groups"), _c(n))
        # (the column in 32 bits, as the input width allows: the compiler then gathers 16 lanes a vector, not 8)
        q32 = L.Cast(q, "i32")
        col = _add(_mul(L.binary("floordiv", q32, L.Const(n, "i32")), L.Const(m, "i32")),
                   L.Cast(L.Load("crd", p, plan.ctype), "i32"))
        row = L.block(L.Decl(s, L.Const(0.0, F32)), L.For(q, _c(0), slots, L.block(
            L.Let(p, _add(_mul(o, slots), q)),
            L.Assign(s, _mul(_f32(L.Load("vals", p, plan.vtype)), _f32(L.Load("x", col, plan.xtype))), "add")),
            simd=True, reductions=(("add", "s"),)), L.Store("y", o, activated(plan, _add(s, bias))))
        parallel = L.Parallel("static")
    return L.Kernel(plan.name + "_dots", _params(plan, "x", "y"), L.block(L.For(o, _c(0), L.Var("n_out"), row,
                                                                                 parallel=parallel)))
