"""Two products of the weight family in one kernel, a token tile at a time: ``y = act2(act1(x W1^T + b1) W2^T + b2)``
(a feed-forward block), the intermediate never leaving the thread's cache.

A work item is one tile of ``T`` tokens: its input panel is packed (``weights.pack``), every row of ``W1`` is run
against it (``weights.block_rows``: entries, bias, activation in the store buffer), each finished block of rows
copied as it is into a per-thread panel ``mid`` (``n_mid x T``, feature-major: the layout a panel has), then every
row of ``W2`` is run against ``mid`` and stored into ``y``'s rows. Two calls of the family instead transpose the
intermediate into rows (``tokens x n_mid``) and pack it back into panels, through memory: 12 MB each way at 1024
tokens and 3072 features. Chaining the two calls through whole panels in memory, read in place by the second,
measured slower than the two calls (768 -> 3072 -> 768 at 90%, 1024 tokens, 1 thread: 20.2 against 18.8 ms): its
entries read a panel that is no longer in L2, at columns no hardware prefetcher foresees; here ``mid`` (``n_mid x T``
floats, 384 KiB at 3072 features) was written by the same thread just before.

The lanes of ``mid`` past a partial last tile's tokens hold the first product of the zero lanes ``pack`` leaves
(the activated bias): finite, and read only into lanes of ``y`` that are not stored.

The second product's arrays are the first's renamed (``pos2``, ``crd2``, ``vals2``, ``bias2``; ``mid`` for its
panel, ``groups2`` for an n:m weight's groups a row): both parts are ``weights.block_rows``, the kernel every
single product runs.
"""
from __future__ import annotations

from dataclasses import replace

from .. import loopir as L
from .fuse import rename
from .weights import F32, I64, Tiles, _add, _c, _mul, _params, _work, block_rows, row_sets, store

#: the second product's names for the arrays and sizes a single product reads
SECOND = {"pos": "pos2", "crd": "crd2", "vals": "vals2", "bias": "bias2", "panel": "mid", "groups": "groups2"}


def serves(p1: Tiles, p2: Tiles) -> bool:
    """Whether two plans chain: float32 panels on both sides (no bfloat16 pairs), tiles of the same tokens, forward
    products."""
    return p1.T == p2.T and not (p1.paired or p2.paired or p1.transposed or p2.transposed) and \
        p1.xtype == p2.xtype == F32


def matched(p1: Tiles, p2: Tiles) -> tuple:
    """The two plans on one tile of tokens where a CSR one and an n:m one differ by it: the CSR plan (whose float32
    tiles are longer, ``weights.CSR_TOKENS``) takes the n:m one's, its accumulator sets as ``weights.tiles`` gives
    them. (Other tiles of different sizes do not chain: ``serves``.)"""
    def to(p: Tiles, other: Tiles) -> Tiles:
        if p.kind != "csr" or other.kind != "nm" or p.lanes != other.lanes or other.T % p.lanes or p.T < other.T:
            return p
        return replace(p, vectors=other.T // p.lanes, unroll=row_sets(other.T // p.lanes))
    return to(p1, p2), to(p2, p1)


def forward_chain(p1: Tiles, p2: Tiles, norm: bool = False) -> L.Kernel:
    """The chained kernel of ``p1`` (``x`` -> ``n_mid`` features) and ``p2`` (-> ``n_out``): work items of one token
    tile each (``chunks`` is 1: a tile's second product needs all of its intermediate). ``norm``: the result is
    ``layer_norm(y + x)`` over its ``n_out`` features (``n_out`` = ``n_in``; ``norm_weight``, ``norm_bias``,
    ``eps``), a feed-forward block's residual and norm (``_norm``)."""
    if not serves(p1, p2):
        raise ValueError(f"scorch: products chain through float32 panels of one tile size; got {p1} and {p2}")
    T, k, n_mid, n_out = p1.T, L.Var("mk"), L.Var("n_mid"), L.Var("n_out")

    def keep(into):  # (a finished block of rows into a panel of the thread's, as it is)
        return lambda rb, count: L.For(k, _c(0), _mul(count, _c(T)), L.block(
            L.Store(into, _add(_mul(rb, _c(T)), k), L.Load("tb", k, F32))), simd=True)
    first = block_rows(p1, _c(0), n_mid, keep("mid"))
    if norm:
        second = L.block(rename(block_rows(p2, _c(0), n_out, keep("out")), SECOND), _norm(T, n_out),
                         store(p2, "y", n_out, _c(0), n_out, buf="out"))
    else:
        second = rename(block_rows(p2, _c(0), n_out, lambda rb, count: store(p2, "y", n_out, rb, count)), SECOND)
    arrays2 = tuple(replace(p, name=SECOND[p.name]) for p in _params(p2, "x", "y")
                    if p.name in SECOND and p.kind == "array")
    scalars = (L.Param("n_mid", "scalar", I64), L.Param("groups2", "scalar", I64))
    if norm:
        scalars += (L.Param("norm_weight", "array", F32), L.Param("norm_bias", "array", F32),
                    L.Param("eps", "scalar", F32))
    extra = L.block(L.Alloc("mid", F32, _mul(n_mid, _c(T))), *((L.Alloc("out", F32, _mul(n_out, _c(T))),
                                                                 L.Alloc("mu", F32, _c(T)),
                                                                 L.Alloc("rs", F32, _c(T))) if norm else ()))
    work = _work(p1, L.Var("n_in"), "x", [first, second], extra)
    return L.Kernel(p1.name + "_chain_" + p2.kind + ("_norm" if norm else ""),
                    (*_params(p1, "x", "y"), *arrays2, *scalars), L.block(work))


def _norm(T: int, n: L.Expr) -> L.Block:
    """``out = layer_norm(out + panel)`` over the ``n`` features of each of the tile's ``T`` tokens: both panels
    feature-major (``out``: the second product's rows, ``panel``: the tile's input, the residual), so each step is a
    loop over the tokens' lanes with no sum across lanes; the mean, then the variance of the deviations (two
    passes, as torch's), over the panels while they are in the thread's cache."""
    t, f = L.Var("nt_"), L.Var("nf")

    def at(a):
        return L.Load(a, _add(_mul(f, _c(T)), t), F32)

    def lanes(*body):
        return L.For(t, _c(0), _c(T), L.block(*body), simd=True)

    def features(*body):
        return L.For(f, _c(0), n, L.block(lanes(*body)))
    inv = L.binary("div", L.Const(1.0, F32), L.Cast(n, F32))
    here = _add(_mul(f, _c(T)), t)
    dev = L.binary("sub", at("out"), L.Load("mu", t, F32))
    scale = L.binary("div", L.Const(1.0, F32), L.Unary("sqrt", _add(_mul(L.Load("rs", t, F32), inv),
                                                                     L.Var("eps", F32)), F32))
    return L.block(
        lanes(L.Store("mu", t, L.Const(0.0, F32)), L.Store("rs", t, L.Const(0.0, F32))),
        features(L.Store("out", here, _add(at("out"), at("panel"))), L.Store("mu", t, at("out"), "add")),
        lanes(L.Store("mu", t, _mul(L.Load("mu", t, F32), inv))),
        features(L.Store("rs", t, _mul(dev, dev), "add")),
        lanes(L.Store("rs", t, scale)),
        features(L.Store("out", here, _add(_mul(_mul(dev, L.Load("rs", t, F32)), L.Load("norm_weight", f, F32)),
                                             L.Load("norm_bias", f, F32)))))
