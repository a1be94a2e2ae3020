"""The weight gradient of a direct sparse convolution (``compiler.conv_direct``), as loop IR: only at the stored
weights, read from the same packed input buffer the forward reads, no unfolded (im2col) copy.

The forward computes ``y[img, o, q] = sum_p vals[p] * x[img, q + off[p]]`` over the output grid ``q`` (rows of
``Wq`` pixels). Its gradient at a stored weight ``p`` of row ``o`` is then a dot product over the grid:
``dw[p] = sum_img sum_q dy[img, o, q] * x[img, q + off[p]]``, where ``dy`` is the output gradient laid out on
the same grid with zeros at the columns past ``Wo`` and the rows past ``Ho`` (those pixels' products vanish). An
SDDMM on the weight's pattern: each stored weight one dot product of a plane, its ``dy`` plane (the row's) in L1
for all the row's entries, its input plane shifted by the entry's offset.
"""
from __future__ import annotations

from .. import loopir as L
from .weights import _add, _bv, _c, _mul, _vloop

I64, F32 = "i64", "f32"
#: vector accumulators per dot product of one entry (the entries past a row's last whole group of ``lanes``)
SETS = 2
#: grid pixels a tile holds about (``tile``): the tile's inputs of a channel chunk stay in L1 while its rows pass
TILE = 256


def step(lanes: int) -> int:
    """The tile's pixels must be a multiple of this (one entry's dot product: ``SETS`` vectors a pass)."""
    return SETS * max(lanes, 1)


def tile(pixels: int, lanes: int) -> tuple:
    """``(tile pixels, tiles)`` covering an output plane of ``pixels`` grid pixels, tiles of about ``TILE``."""
    tiles = -(-pixels // TILE)
    w = step(lanes)
    return -(-(-(-pixels // tiles)) // w) * w, tiles


def weight_grad(lanes: int, ptype: str) -> L.Kernel:
    """The kernel: parameters ``pos`` (``ptype``), ``off`` (i32), ``dy``, ``x``, ``dw`` (f32, added into); scalars
    ``n`` (images), ``x_image`` (input elements per image), ``grid`` (``dy``'s pixels per plane, ``tiles`` tiles of
    ``tp`` pixels, ``tp`` a multiple of ``step(lanes)``), ``n_out``, ``kchunks`` (the entries' channel chunks),
    ``chunks`` and ``row_chunk`` (the rows split for the threads: a thread owns its rows' entries), ``nthreads``.
    Row ``o``'s entries of chunk ``kc`` are ``pos[kc * n_out + o] .. pos[kc * n_out + o + 1]``. Per image, tile and
    channel chunk, every row of the thread's: the chunk's inputs around the tile stay in L1 while the rows pass (a
    whole plane per entry streamed each row's inputs from L2: ResNet-18 2:4's weight gradients took twice the
    forward's time). ``x`` must be readable up to ``grid + max(off)`` past each image's start (the caller pads its
    end with zeros)."""
    vec = lanes if lanes > 1 else 0
    width = max(lanes, 1)
    item, o, img, t, tl, kc, at, xb, yb, xo = (L.Var(v) for v in (
        "item", "o", "img", "t", "tl", "kc", "at", "xb", "yb", "xo"))
    lo, hi, k, whole, first, p, e = (L.Var(v) for v in ("lo", "hi", "k", "whole", "first", "p", "e"))
    n_out, grid, tp = L.Var("n_out"), L.Var("grid"), L.Var("tp")
    r_lo = _mul(item, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))

    def fma(u):
        pixel = _add(_mul(t, _c(SETS * width)), _c(u * width), _bv)
        return _vloop(width, lanes, L.Store("d", _c(u), _mul(L.Load("dy", _add(yb, pixel), F32),
                                                               L.Load("x", _add(xo, pixel), F32)), "add"))
    total = L.Load("d", _c(0), F32)
    for u in range(1, SETS):
        total = _add(total, L.Load("d", _c(u), F32))
    one = L.block(
        L.Let(xo, _add(xb, L.Cast(L.Load("off", p, "i32"), I64))),
        L.LocalArray("d", F32, SETS, L.Const(0.0, F32), sums=vec),
        L.For(t, _c(0), L.binary("floordiv", tp, _c(SETS * width)), L.block(*(fma(u) for u in range(SETS)))),
        L.Store("dw", p, total, "add"))
    entries = [L.Let(at, _add(_mul(kc, n_out), o)),
               L.Let(lo, L.Cast(L.Load("pos", at, ptype), I64)),
               L.Let(hi, L.Cast(L.Load("pos", _add(at, _c(1)), ptype), I64)),
               L.Let(yb, _add(_mul(_add(_mul(img, n_out), o), grid), _mul(tl, tp)))]
    if vec:
        # (``lanes`` entries at a time, each its own vector of partial sums: the tile's vectors outer, the entries
        #  inner and unrolled, so that each output-gradient vector is loaded once for them and their multiply-adds
        #  are independent; the ``lanes`` sums then added across their lanes in one transposed tree (``SumLanes``).
        #  One entry at a time, a small plane's dot (ResNet-18's 7 x 7: 4 vectors) is mostly its lane sum)
        pixel = _add(_mul(t, _c(lanes)), _bv)
        group = L.block(
            L.Let(first, _add(lo, _mul(k, _c(lanes)))),
            L.LocalArray("dd", F32, lanes, L.Const(0.0, F32), sums=lanes),
            L.For(t, _c(0), L.binary("floordiv", tp, _c(lanes)), L.block(
                L.For(e, _c(0), _c(lanes), L.block(_vloop(lanes, lanes, L.Store("dd", e, _mul(
                    L.Load("dy", _add(yb, pixel), F32),
                    L.Load("x", _add(xb, L.Cast(L.Load("off", _add(first, e), "i32"), I64), pixel), F32)), "add"))),
                      unroll=True))),
            L.SumLanes("tot", "dd", F32, lanes),
            L.For(e, _c(0), _c(lanes), L.block(L.Store("dw", _add(first, e), L.Load("tot", e, F32), "add"))))
        entries += [L.Let(whole, L.binary("floordiv", L.binary("sub", hi, lo), _c(lanes))),
                    L.For(k, _c(0), whole, group),
                    L.For(p, _add(lo, _mul(whole, _c(lanes))), hi, one)]
    else:
        entries.append(L.For(p, lo, hi, one))
    rows = L.For(img, _c(0), L.Var("n"), L.block(L.For(tl, _c(0), L.Var("tiles"), L.block(
        L.Let(xb, _add(_mul(img, L.Var("x_image")), _mul(tl, tp))),
        L.For(kc, _c(0), L.Var("kchunks"), L.block(L.For(o, r_lo, r_hi, L.block(*entries))))))))
    loop = L.For(item, _c(0), L.Var("chunks"), L.block(rows), parallel=L.Parallel("static", None, L.block(), chunk=1))
    params = (L.Param("pos", "array", ptype), L.Param("off", "array", "i32"), L.Param("dy", "array", F32),
              L.Param("x", "array", F32), L.Param("dw", "array", F32, output=True)) + \
        tuple(L.Param(s, "scalar", I64) for s in ("n", "x_image", "grid", "tp", "tiles", "n_out", "kchunks", "chunks",
                                                  "row_chunk", "nthreads"))
    return L.Kernel(f"scorch_conv_direct_dw_v{lanes}", params, L.block(loop))
