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
#: vector accumulators per dot product (independent sums: the multiply-adds' latency hides behind each other)
SETS = 4


def step(lanes: int) -> int:
    """The grid pixels one pass of ``weight_grad``'s dot product covers: the grid must be a multiple."""
    return SETS * max(lanes, 1)


def weight_grad(lanes: int, ptype: str) -> L.Kernel:
    """The kernel: parameters ``pos`` (``ptype``), ``off`` (i32), ``dy``, ``x``, ``dw`` (f32, added into); scalars
    ``n`` (images), ``x_image`` (input elements per image), ``grid`` (``dy``'s pixels per plane, a multiple of
    ``step(lanes)``), ``n_out``, ``chunks`` and ``row_chunk`` (the rows split for the threads: a thread owns its
    rows' entries), ``nthreads``. Row ``o``'s entries are ``pos[o] .. pos[o + 1]``; ``x`` must be readable up to
    ``grid + max(off)`` past each image's start (the caller pads its end with zeros)."""
    W = step(lanes)
    vec = lanes if lanes > 1 else 0
    item, o, img, e, t, xb, yb, xo = (L.Var(v) for v in ("item", "o", "img", "e", "t", "xb", "yb", "xo"))
    lo, hi, k, whole, first, p = (L.Var(v) for v in ("lo", "hi", "k", "whole", "first", "p"))
    n_out, grid = L.Var("n_out"), L.Var("grid")
    r_lo = _mul(item, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    width = max(lanes, 1)

    def fma(u):
        at = _add(_mul(t, _c(W)), _c(u * width), _bv)
        return _vloop(width, lanes, L.Store("d", _c(u), _mul(L.Load("dy", _add(yb, at), F32),
                                                               L.Load("x", _add(xo, at), F32)), "add"))
    total = L.Load("d", _c(0), F32)
    for u in range(1, SETS):
        total = _add(total, L.Load("d", _c(u), F32))
    one = L.block(
        L.Let(xo, _add(xb, L.Cast(L.Load("off", p, "i32"), I64))),
        L.LocalArray("d", F32, SETS, L.Const(0.0, F32), sums=vec),
        L.For(t, _c(0), L.binary("floordiv", grid, _c(W)), L.block(*(fma(u) for u in range(SETS)))),
        L.Store("dw", p, total, "add"))
    entries = [L.Let(lo, L.Cast(L.Load("pos", o, ptype), I64)),
               L.Let(hi, L.Cast(L.Load("pos", _add(o, _c(1)), ptype), I64))]
    if vec:
        # (``lanes`` entries at a time, each its own vector of partial sums: the grid's vectors outer, the entries
        #  inner and unrolled, so that each output-gradient vector is loaded once for them and their multiply-adds
        #  are independent; the ``lanes`` sums then added across their lanes in one transposed tree (``SumLanes``).
        #  One entry at a time, a small plane's dot (ResNet-18's 7 x 7: 4 vectors) is mostly its lane sum)
        at = _add(_mul(t, _c(lanes)), _bv)
        group = L.block(
            L.Let(first, _add(lo, _mul(k, _c(lanes)))),
            L.LocalArray("dd", F32, lanes, L.Const(0.0, F32), sums=lanes),
            L.For(t, _c(0), L.binary("floordiv", grid, _c(lanes)), L.block(
                L.For(e, _c(0), _c(lanes), L.block(_vloop(lanes, lanes, L.Store("dd", e, _mul(
                    L.Load("dy", _add(yb, at), F32),
                    L.Load("x", _add(xb, L.Cast(L.Load("off", _add(first, e), "i32"), I64), at), F32)), "add"))),
                      unroll=True))),
            L.SumLanes("tot", "dd", F32, lanes),
            L.For(e, _c(0), _c(lanes), L.block(L.Store("dw", _add(first, e), L.Load("tot", e, F32), "add"))))
        entries += [L.Let(whole, L.binary("floordiv", L.binary("sub", hi, lo), _c(lanes))),
                    L.For(k, _c(0), whole, group),
                    L.For(p, _add(lo, _mul(whole, _c(lanes))), hi, one)]
    else:
        entries.append(L.For(p, lo, hi, one))
    rows = L.For(o, r_lo, r_hi, L.block(L.For(img, _c(0), L.Var("n"), L.block(
        L.Let(xb, _mul(img, L.Var("x_image"))),
        L.Let(yb, _mul(_add(_mul(img, n_out), o), grid)),
        *entries))))
    loop = L.For(item, _c(0), L.Var("chunks"), L.block(rows), parallel=L.Parallel("static", None, L.block(), chunk=1))
    params = (L.Param("pos", "array", ptype), L.Param("off", "array", "i32"), L.Param("dy", "array", F32),
              L.Param("x", "array", F32), L.Param("dw", "array", F32, output=True)) + \
        tuple(L.Param(s, "scalar", I64) for s in ("n", "x_image", "grid", "n_out", "chunks", "row_chunk", "nthreads"))
    return L.Kernel(f"scorch_conv_direct_dw_v{lanes}", params, L.block(loop))
