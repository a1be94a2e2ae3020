"""One token of the sparse-weight family (``compiler.weights``) read through the weight's bitmap: ``row_bits``.

A CSR or n:m weight's row as a bit per column and its values in order (``engine.weights._bitmap``), expanded a
16-column word at a time (``loopir.Expand``), instead of a coordinate per value: fewer bytes a stored value where
at least about a third of the columns are kept, which is what bounds a product at one token.
"""
from __future__ import annotations

from .. import loopir as L
from .target import Target
from .weights import F32, I64, Tiles, _add, _bounds, _c, _f32, _mul, activated


def bits(kind: str, vtype: str, tokens: int, target: Target) -> bool:
    """Whether ``tokens`` may run as ``row_bits``: one token, a CSR or n:m weight of float32 or bfloat16 values,
    a target with vectors of whole parts of a bitmap word. (Whether it pays, the weight's density says: the
    engine chooses.)"""
    return tokens == 1 and kind in ("csr", "nm") and vtype in (F32, "bf16") and target.vectors and \
        L.BITS % target.lanes(F32) == 0


#: bitmap words a ``row_bits`` row takes at a time, each into its own accumulator (a multiply-add's latency hidden
#: behind the others'): the words of a row are padded to a multiple
BIT_WORDS = 4


def row_bits(plan: Tiles) -> L.Kernel:
    """One token through the weight's bitmap (``loopir.Expand``): ``y[o] = sum_g expand(vals[p:], bits[o, g]) .
    x[16 g: 16 g + 16] (+ bias[o])``, ``p`` advancing by each word's set bits from ``pos[o]``. The weight is read
    as its values and one bit per column, not a coordinate per value: at half the columns kept, 2.1 bytes a column
    in float32 and 1.1 in bfloat16 against 4 and 2 dense, where 16-bit coordinates take 3 and 2. ``words`` (16-bit
    words a row) is a multiple of ``2 * BIT_WORDS`` (zero words past the input's columns); ``x`` holds ``words *
    16`` columns, zeros past the input's: float32, or (``pairs``: bfloat16 values and token, 16-lane vectors)
    bfloat16, the bitmap then read in 32-bit words, each group of 32 columns one ``ExpandPairDot``."""
    o, g, c = L.Var("o"), L.Var("g"), L.Var("c")
    words = L.Var("words")
    bias = _f32(L.Load("bias", o, plan.vtype)) if plan.bias else L.Const(0.0, F32)
    ps = [L.Var(f"p{u}") for u in range(BIT_WORDS + 1)]
    width = 2 * L.BITS if plan.pairs else L.BITS
    per_row = L.binary("floordiv", words, _c(2)) if plan.pairs else words
    nnz = L.Cast(L.Load("pos", L.Var("n_out"), plan.ptype), I64)  # (the values' end: every slot is an entry)

    def groups(whole: bool) -> L.For:
        """The row's groups; ``whole``: every vector's values loaded whole (the row ends a vector's values or
        more before the values' end), else each load tested against the end."""
        body = []
        for u in range(BIT_WORDS):
            b, word = L.Var(f"b{u}", "i32"), _add(_mul(g, _c(BIT_WORDS)), _c(u))
            at = _add(_mul(o, per_row), word)
            if plan.pairs:
                term = L.ExpandPairDot("vals", ps[u], b, c, "x", _add(_mul(word, _c(width)), _mul(c, _c(2))))
                load = L.Load("bits", at, "i32")
            else:
                expand = L.Expand("vals", ps[u], b, c, F32, whole=plan.lanes) if whole else \
                    L.Expand("vals", ps[u], b, c, F32, end=nnz)
                term = _mul(expand, L.Load("x", _add(_mul(word, _c(width)), c), F32))
                load = L.Cast(L.Load("bits", at, "i16"), "i32")
            body += [L.Let(b, load), L.For(c, _c(0), _c(L.BITS), L.block(L.Store("vsum", _c(u), term, "add")),
                                           vector=plan.lanes),
                     L.Let(ps[u + 1], _add(ps[u], L.PopCount(b, width=width)))]
        return L.For(g, _c(0), L.binary("floordiv", per_row, _c(BIT_WORDS)), L.block(
            L.Let(ps[0], L.Var("p")), *body, L.Assign(L.Var("p"), ps[-1])))
    # (a row whose values end a vector's values or more before the values' end reads every group's whole: no test
    #  of the end a group, ~4 of its ~13 instructions on AVX2; the last rows test it)
    safe = L.binary("le", _add(_bounds(plan, o)[1], _c(plan.lanes)), nnz)
    loop = groups(False) if plan.pairs or plan.lanes < 2 else \
        L.If(safe, L.block(groups(True)), L.block(groups(False)))
    total = _add(*[L.Load("vsum", _c(u), F32) for u in range(BIT_WORDS)])
    row = L.block(
        L.LocalArray("vsum", F32, BIT_WORDS, L.Const(0.0, F32), sums=plan.lanes),
        L.Decl(L.Var("p"), _bounds(plan, o)[0]), loop,
        L.Store("y", o, activated(plan, _add(total, bias))))
    params = (L.Param("pos", "array", plan.ptype), L.Param("bits", "array", "i32" if plan.pairs else "i16"),
              L.Param("vals", "array", plan.vtype)) + ((L.Param("bias", "array", plan.vtype),) if plan.bias else ()) + \
        (L.Param("x", "array", plan.vtype if plan.pairs else F32), L.Param("y", "array", F32, output=True),
         L.Param("n_out", "scalar", I64), L.Param("words", "scalar", I64))
    return L.Kernel("scorch_weights_bits" + ("_pairs" if plan.pairs else ""), params,
                    L.block(L.For(o, _c(0), L.Var("n_out"), row, parallel=L.Parallel("static"))))
