"""bfloat16 BSR weights on matrix tiles (Intel AMX): ``Y = X @ W^T (+ bias)`` with the tokens as the tiles' rows.

The vector kernels of ``compiler.weights`` put tokens in a vector's lanes: they pack a tile of ``X`` transposed
into a panel (features x tokens) and transpose the sums back into ``Y``'s rows, two passes over every input and
output value besides the products. A matrix tile holds 16 rows of up to 64 bytes, and ``TDPBF16PS`` multiplies an
A tile (M x K pairs) by a B tile (K pairs x N) into C (M x N float32), so here the tokens are the rows M:

- A: 16 tokens x a block's ``bw`` input features, loaded straight from ``X``'s rows (row stride ``n_in``): no
  pack (a partial last tile of tokens is copied into a zero-padded buffer first, so no load reads past ``X``);
- B: a block's values as ``bw / 2`` rows of ``bh`` pairs (``B[k][2 n + j] = W_block[n][2 k + j]``: the weight's
  values laid out once per version, ``engine.weights``), one load per block for every token tile;
- C: 16 tokens x the block row's ``bh`` outputs, summed over the row's blocks in the tile, then stored once into
  a small buffer whose rows are ``Y``'s rows: the bias, the activation and the rounding to bfloat16 on the way
  into ``Y`` (contiguous ``bh`` values a token, no transpose).

Work items are a tile of ``T`` tokens (``AMX_TOKENS``: two C tiles sharing each block's B) x a chunk of rows, as in
``compiler.weights._work``. The loop IR's ``TileRow`` says what the tiles compute; the NumPy interpreter runs its
plain loops, and the C++ renderer the CPU's instructions or their model (``codegen.amx``).
"""
from __future__ import annotations

from .. import loopir as L
from .weights import F32, I64, Tiles, _add, _bounds, _c, _mul, _params, activated


def forward(plan: Tiles) -> L.Kernel:
    """``y = activation(x @ W^T + bias)`` for a ``plan`` with ``amx`` set (``compiler.weights.tiles``): ``vals``
    laid out as B tiles (``engine.weights``), ``x`` and ``y`` bfloat16 row-major."""
    T, (bh, bw) = plan.T, plan.block
    depth, tiles = bw // 2, T // 16
    n, n_in, n_out = L.Var("n"), L.Var("n_in"), L.Var("n_out")
    item, tile, chunk, t0, nt = L.Var("item"), L.Var("tile"), L.Var("chunk"), L.Var("t0"), L.Var("nt")
    t, f, br, p, r = L.Var("t"), L.Var("f"), L.Var("br"), L.Var("p"), L.Var("r")
    partial = L.binary("lt", nt, _c(T))
    # (a partial last tile: its tokens into the padded buffer, the rows past them zero)
    pad = L.If(partial, L.block(
        L.For(t, _c(0), nt, L.block(L.For(f, _c(0), n_in, L.block(L.Store(
            "xpad", _add(_mul(t, n_in), f), L.Load("x", _add(_mul(_add(t0, t), n_in), f), plan.xtype)))))),
        L.For(t, nt, _c(T), L.block(L.For(f, _c(0), n_in, L.block(L.Store(
            "xpad", _add(_mul(t, n_in), f), L.Const(0.0, plan.xtype))))))))
    col = _mul(L.Cast(L.Load("crd", p, plan.ctype), I64), _c(bw))

    def row_tiles(a: str, first: L.Expr) -> L.Stmt:
        return L.TileRow(p, *_bounds(plan, br), a, _add(first, col), n_in, "vals", _mul(p, _c(depth * bh)),
                         "cb", _c(0), bh, bh, depth, tiles)
    products = L.If(partial, L.block(row_tiles("xpad", _c(0))), L.block(row_tiles("x", _mul(t0, n_in))))
    value = L.Load("cb", _add(_mul(t, _c(bh)), r), F32)
    if plan.bias:
        value = _add(value, L.Cast(L.Load("bias", _add(_mul(br, _c(bh)), r), plan.vtype), F32))
    store = L.For(t, _c(0), nt, L.block(L.For(r, _c(0), _c(bh), L.block(L.Store(
        "y", _add(_mul(_add(t0, t), n_out), _mul(br, _c(bh)), r), L.Cast(activated(plan, value), plan.xtype))),
        simd=True)))
    r_lo = _mul(chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    rows = L.For(br, L.binary("floordiv", r_lo, _c(bh)), L.binary("floordiv", _add(r_hi, _c(bh - 1)), _c(bh)),
                 L.block(products, store))
    setup = L.block(L.Alloc("xpad", plan.xtype, _mul(n_in, _c(T))), L.Alloc("cb", F32, _c(T * bh)),
                    L.TileConfig(bh, depth, tiles, plan.amx))
    chunks = L.Var("chunks")
    body = L.For(item, _c(0), _mul(L.binary("floordiv", _add(n, _c(T - 1)), _c(T)), chunks), L.block(
        L.Let(tile, L.binary("floordiv", item, chunks)), L.Let(chunk, L.binary("mod", item, chunks)),
        L.Let(t0, _mul(tile, _c(T))), L.Let(nt, L.binary("min", _c(T), L.binary("sub", n, t0))),
        pad, rows), parallel=L.Parallel("static", None, setup, chunk=1))
    return L.Kernel(plan.name + "_amx", _params(plan, "x", "y"), L.block(body))

