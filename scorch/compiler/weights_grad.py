"""The backward kernels of the dense-activation x sparse-weight family (``compiler.weights``): ``dX = dY @ W`` for a
BSR weight at a few tokens (``backward_input``: its blocks scattered into a panel of ``dX``; CSR and n:m weights,
and BSR from half a vector of tokens, run the forward kernel on their transpose instead, ``engine.weights_grad``),
and the gradient of the stored values, an SDDMM on the weight's pattern: ``weight_grad`` (each stored weight's dot
over a tile of tokens read through panels, CSR's in longer tiles: ``grad_tiles``) and ``block_weight_grad`` (a BSR
block a register slice at a time, over tokens laid out by block strips)."""
from __future__ import annotations

from dataclasses import replace

from .. import loopir as L
from .weights import ACCUMULATORS, F32, I64, Tiles, _add, _bounds, _bv, _c, _chunk, _f32, _mul, _nt, _params, \
    _row_entries, _t0, _tile, _vloop, _work, pack, store

#: tokens per tile of a CSR weight's gradient (``weight_grad``, ``grad_tiles``) at most: each stored weight's dot
#: over the tile ends in a sum across lanes and an add into ``dw``, paid once a tile, so the tile is longer than the
#: forward's. CSR 90% at BERT shapes (768 <-> 3072, 1024 tokens, AMD Zen 3, AVX2, 2 threads), 16 / 24 / 32 / 48 /
#: 64 tokens: 3072 x 768 17.8 / 15.8 / 12.7 / 12.7 / 19.1 ms, 768 x 3072 20.4 / 15.6 / 14.0 / 16.1 / 14.2 ms
#: (the dense ``dy^T @ x`` 46 and 37 ms); at 128 tokens 32 against 16: 1.3-1.4x
GRAD_TOKENS = 32


def grad_tiles(plan: Tiles, tokens: int) -> Tiles:
    """``plan`` (``tiles``) for the gradient of a CSR weight's values at ``tokens`` tokens: tiles of up to
    ``GRAD_TOKENS`` tokens (whole vectors), where the forward's hold ``MAX_VECTORS`` vectors."""
    if plan.kind != "csr" or plan.lanes == 1:
        return plan
    vectors = min(max(1, GRAD_TOKENS // plan.lanes), -(-tokens // plan.lanes))
    return replace(plan, vectors=max(plan.vectors, vectors))


def backward_input(plan: Tiles) -> L.Kernel:
    """``dx = dy @ W`` for a BSR weight (``dy`` tokens x out, ``dx`` tokens x in, row-major): a panel of ``dy``'s
    tile, each block's columns summed over its rows in registers and scattered into a per-thread panel of ``dx``'s
    columns, which is then stored. Work items are token tiles only (``chunks`` 1): a thread owns its tile's columns.
    (CSR and n:m weights run ``forward`` on their transposed pattern instead: ``engine.weights_grad.input_grad``.)"""
    if plan.kind != "bsr":
        raise ValueError(f"scorch: backward_input scatters BSR blocks; a {plan.kind} weight runs forward on its"
                         " transpose")
    T, n_in, n_out = plan.T, L.Var("n_in"), L.Var("n_out")
    f = L.Var("zf")
    vec = plan.lanes if plan.lanes > 1 else 0
    zero = L.For(f, _c(0), _mul(n_in, _c(T)), L.block(L.Store("z", f, L.Const(0.0, F32))))
    (bh, bw), br, p, c, r, c0 = plan.block, L.Var("br"), L.Var("p"), L.Var("c"), L.Var("r"), L.Var("c0")
    w = L.Load("vals", _add(_mul(_add(_mul(p, _c(bh)), r), _c(bw)), c), plan.vtype)
    column = L.For(c, _c(0), _c(bw), L.block(
        L.LocalArray("acc", F32, T, L.Const(0.0, F32), vector=vec),
        L.For(r, _c(0), _c(bh), L.block(_vloop(T, plan.lanes, L.Store(
            "acc", _bv, _mul(L.Cast(w, F32), L.Load("panel", _add(_mul(_add(_mul(br, _c(bh)), r), _c(T)), _bv),
                                                    F32)), "add"))), unroll=bh <= 16),
        _vloop(T, plan.lanes, L.Store("z", _add(_mul(_add(c0, c), _c(T)), _bv), L.Load("acc", _bv, F32), "add"))))
    rows = L.For(br, _c(0), L.binary("floordiv", n_out, _c(bh)), L.block(L.For(
        p, *_bounds(plan, br),
        L.block(L.Let(c0, _mul(L.Cast(L.Load("crd", p, plan.ctype), I64), _c(bw))), column))))
    setup_z = L.Alloc("z", F32, _mul(n_in, _c(T)))
    work = _work(plan, n_out, "dy", [zero, rows, store(plan, "dx", n_in, _c(0), n_in, buf="z")], extra=setup_z)
    return L.Kernel(plan.name, _params(plan, "dy", "dx"), L.block(work))


def weight_grad(plan: Tiles) -> L.Kernel:
    """``dw[p] = sum over tokens of dy[t, row(p)] * x[t, col(p)]`` at every stored weight ``p`` (the gradient of the
    values: an SDDMM on the weight's pattern), ``x`` and ``dy`` read in their row-major layouts through panels.
    Work items are chunks of ``row_chunk`` output rows (a thread owns its rows' gradients), each running every
    token tile: a panel of ``x``'s tile and one of its rows of ``dy``'s, a dot product of ``T`` lanes per weight."""
    plan = replace(plan, pairs=False, combos=False, halves=False)  # (float32 panels: pairs serve the forward only)
    T, n_in, n_out, n = plan.T, L.Var("n_in"), L.Var("n_out"), L.Var("n")
    vec = plan.lanes if plan.lanes > 1 else 0
    r_lo = _mul(_chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    o, item = L.Var("o"), L.Var("item")

    def dot(index, row, col):
        """``dw[index] += dot(q[row - r_lo], panel[col])`` over the tile's lanes."""
        d = L.Var("d", F32)
        product = _mul(L.Load("q", _add(_mul(L.binary("sub", row, r_lo), _c(T)), _bv), F32),
                       L.Load("panel", _add(_mul(col, _c(T)), _bv), F32))
        return L.block(
            L.LocalArray("d", F32, 1, L.Const(0.0, F32), sums=vec) if vec else L.Decl(d, L.Const(0.0, F32)),
            _vloop(T, plan.lanes, L.Store("d", _c(0), product, "add")) if vec else
            L.For(_bv, _c(0), _c(T), L.block(L.Assign(d, product, "add"))),
            L.Store("dw", index, L.Load("d", _c(0), F32) if vec else d, "add"))

    if plan.kind == "bsr":
        (bh, bw), br, p, c, r, c0 = plan.block, L.Var("br"), L.Var("p"), L.Var("c"), L.Var("r"), L.Var("c0")
        cells = L.For(r, _c(0), _c(bh), L.block(L.For(c, _c(0), _c(bw), L.block(
            dot(_add(_mul(_add(_mul(p, _c(bh)), r), _c(bw)), c), _add(_mul(br, _c(bh)), r), _add(c0, c))))))
        blocks = L.For(p, *_bounds(plan, br),
                       L.block(L.Let(c0, _mul(L.Cast(L.Load("crd", p, plan.ctype), I64), _c(bw))), cells))
        rows = L.For(br, L.binary("floordiv", r_lo, _c(bh)), L.binary("floordiv", r_hi, _c(bh)), L.block(blocks))
    elif plan.kind == "csr" and vec:
        rows = L.For(o, r_lo, r_hi, L.block(_csr_dots(plan, o, r_lo, dot)))
    else:
        pv = L.Var("p")
        rows = L.For(o, r_lo, r_hi, L.block(_row_entries(plan, o, lambda w, col: dot(pv, o, col))))
    tiles_n = L.binary("floordiv", _add(n, _c(T - 1)), _c(T))
    tf, tt = L.Var("qf"), L.Var("qt")
    # the chunk's rows of dy's tile, transposed: q[(row - r_lo) * T + t]
    pack_q = L.block(
        L.If(L.binary("lt", _nt, _c(T)), L.block(L.For(tf, _c(0), L.binary("sub", r_hi, r_lo), L.block(
            L.For(tt, _c(0), _c(T), L.block(L.Store("q", _add(_mul(tf, _c(T)), tt), L.Const(0.0, F32)))))))),
        L.Transpose("q", _c(0), _c(T), "dy", _add(_mul(_t0, n_out), r_lo), n_out, _nt, L.binary("sub", r_hi, r_lo),
                    plan.xtype, F32))
    setup = L.block(L.Alloc("panel", F32, _mul(n_in, _c(T))), L.Alloc("q", F32, _mul(L.Var("row_chunk"), _c(T))))
    body = L.For(item, _c(0), L.Var("chunks"), L.block(
        L.Let(_chunk, item),
        L.For(_tile, _c(0), tiles_n, L.block(
            L.Let(_t0, _mul(_tile, _c(T))), L.Let(_nt, L.binary("min", _c(T), L.binary("sub", n, _t0))),
            pack(plan, "panel", "x", n_in), pack_q, rows))), parallel=L.Parallel("static", None, setup, chunk=1))
    params = (() if plan.kind == "nm" else (L.Param("pos", "array", plan.ptype),)) + (
        L.Param("crd", "array", plan.ctype), L.Param("x", "array", plan.xtype), L.Param("dy", "array", plan.xtype),
        L.Param("dw", "array", F32, output=True), L.Param("n", "scalar", I64), L.Param("n_in", "scalar", I64),
        L.Param("n_out", "scalar", I64), L.Param("groups", "scalar", I64), L.Param("chunks", "scalar", I64),
        L.Param("row_chunk", "scalar", I64), L.Param("nthreads", "scalar", I64))
    return L.Kernel("scorch_weights_dw_" + plan.kind, params, L.block(body))


def _csr_dots(plan: Tiles, o: L.Expr, r_lo: L.Expr, dot) -> L.Block:
    """The dots of a CSR row's weights (``weight_grad``), ``lanes`` weights at a time: each weight's products
    added into its own vector of partial sums, the ``lanes`` vectors then summed across their lanes in one
    transposed tree (``SumLanes``: about one shuffle a weight, where a tree per weight takes ``log2(lanes)``);
    the rest of the row one weight at a time (``dot``)."""
    T, lanes = plan.T, plan.lanes
    lo, hi, k, e, q, p = L.Var("lo"), L.Var("hi"), L.Var("k"), L.Var("e"), L.Var("whole"), L.Var("p")
    first = _add(lo, _mul(k, _c(lanes)))
    row_q = _add(_mul(L.binary("sub", o, r_lo), _c(T)), _bv)
    group = L.block(
        L.LocalArray("dd", F32, lanes, L.Const(0.0, F32), sums=lanes),
        L.For(e, _c(0), _c(lanes), L.block(_vloop(T, lanes, L.Store("dd", e, _mul(
            L.Load("q", row_q, F32),
            L.Load("panel", _add(_mul(L.Cast(L.Load("crd", _add(first, e), plan.ctype), I64), _c(T)), _bv), F32)),
            "add"))), unroll=True),
        L.SumLanes("tot", "dd", F32, lanes),
        L.For(e, _c(0), _c(lanes), L.block(L.Store("dw", _add(first, e), L.Load("tot", e, F32), "add"))))
    return L.block(
        L.Let(lo, _bounds(plan, o)[0]), L.Let(hi, _bounds(plan, o)[1]),
        L.Let(q, L.binary("floordiv", L.binary("sub", hi, lo), _c(lanes))),
        L.For(k, _c(0), q, group),
        L.For(p, _add(lo, _mul(q, _c(lanes))), hi, L.block(dot(p, o, L.Cast(L.Load("crd", p, plan.ctype), I64)))))


def blocks_by_columns(plan: Tiles) -> bool:
    """Whether a BSR weight's gradient runs ``block_weight_grad``: a block's row is whole vectors."""
    return plan.kind == "bsr" and plan.lanes > 1 and plan.block[1] % plan.lanes == 0


def block_slices(plan: Tiles) -> tuple:
    """``(rows, vectors)`` of the slice of a block that ``block_weight_grad`` holds in registers at a time: whole
    vectors of a row (up to 4, dividing the row's) and as many rows (dividing the block's) as keep the accumulators
    within the registers left for a row's loads and a broadcast (``ACCUMULATORS`` of AVX2's 16, 16 of AVX-512's 32).
    AVX2, 16 x 16: 4 rows x 2 vectors; AVX-512, 16 x 16: the whole block."""
    bh, bw = plan.block
    vectors = bw // plan.lanes
    budget = ACCUMULATORS + 4 if plan.lanes >= 16 else ACCUMULATORS
    cv = max(d for d in range(1, min(vectors, 4) + 1) if vectors % d == 0)
    rs = max(d for d in range(1, bh + 1) if bh % d == 0 and d * cv <= max(budget, cv))
    return rs, cv


def block_weight_grad(plan: Tiles) -> L.Kernel:
    """A BSR weight's values' gradient, block by block: ``dw[block] = dy[:, rows]^T @ x[:, cols]`` over every token,
    a slice of the block at a time (``block_slices``: ``rs`` rows x ``cv`` vectors of columns) held in registers,
    each token adding one row-slice of ``x`` (contiguous loads) times ``rs`` broadcasts of ``dy``: no panels, no dot
    products to sum across lanes. ``x`` and ``dy`` are read as strips of the block's columns and rows, each strip's
    tokens contiguous (``engine.weights_grad.block_columns``: ``x[(strip * n + t) * bw + c]``). Work items: chunks
    of ``row_chunk`` output rows (whole block rows). (A slice re-reads its block's strip of ``x`` over the tokens,
    from cache: a 16 x 16 block on AVX2 in 4 slices, 1024 tokens, 90%, 2 threads: 3072 x 768 21.4 -> 10.9 ms,
    where each value's dot product over the tokens, summed across lanes, took 21.4.)"""
    (bh, bw), n_out, n = plan.block, L.Var("n_out"), L.Var("n")
    br, p, r, t, c0, item = L.Var("br"), L.Var("p"), L.Var("r"), L.Var("t"), L.Var("c0"), L.Var("item")
    rsl, csl = L.Var("rs"), L.Var("cs")
    r_lo = _mul(item, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    lanes = plan.lanes
    rs, cv = block_slices(plan)
    width = cv * lanes
    row0, col0 = _mul(rsl, _c(rs)), _mul(csl, _c(width))
    update = L.For(r, _c(0), _c(rs), L.block(L.For(_bv, _c(0), _c(width), L.block(L.Store(
        "acc", _add(_mul(r, _c(width)), _bv),
        _mul(L.Cast(L.Load("dy", _add(_mul(_add(_mul(br, n), t), _c(bh)), row0, r), plan.xtype), F32),
             _f32(L.Load("x", _add(_mul(_add(_mul(c0, n), t), _c(bw)), col0, _bv), plan.xtype))), "add")),
        vector=lanes)),
        unroll=True)
    out = L.For(r, _c(0), _c(rs), L.block(L.For(_bv, _c(0), _c(width), L.block(L.Store(
        "dw", _add(_mul(_add(_mul(p, _c(bh)), row0, r), _c(bw)), col0, _bv),
        L.Load("acc", _add(_mul(r, _c(width)), _bv), F32))), vector=lanes)), unroll=True)
    piece = L.block(L.LocalArray("acc", F32, rs * width, L.Const(0.0, F32), vector=lanes),
                    L.For(t, _c(0), n, L.block(update)), out)
    block = L.For(p, *_bounds(plan, br), L.block(
        L.Let(c0, L.Cast(L.Load("crd", p, plan.ctype), I64)),
        L.For(rsl, _c(0), _c(bh // rs), L.block(L.For(csl, _c(0), _c(bw // width), piece)))))
    body = L.For(item, _c(0), L.Var("chunks"), L.block(L.For(
        br, L.binary("floordiv", r_lo, _c(bh)), L.binary("floordiv", r_hi, _c(bh)), L.block(block))),
        parallel=L.Parallel("static", None, L.block(), chunk=1))
    params = (L.Param("pos", "array", plan.ptype), L.Param("crd", "array", plan.ctype),
              L.Param("x", "array", plan.xtype), L.Param("dy", "array", plan.xtype),
              L.Param("dw", "array", F32, output=True), L.Param("n", "scalar", I64), L.Param("n_in", "scalar", I64),
              L.Param("n_out", "scalar", I64), L.Param("groups", "scalar", I64), L.Param("chunks", "scalar", I64),
              L.Param("row_chunk", "scalar", I64), L.Param("nthreads", "scalar", I64))
    return L.Kernel("scorch_weights_dw_blocks", params, L.block(body))
