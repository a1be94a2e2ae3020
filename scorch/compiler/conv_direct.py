"""A direct convolution with a sparse weight, as loop IR: no unfolded (im2col) copy of the input, no transposed panel.

The input is held channel-major (NCHW), each channel's plane zero-padded and flattened with a row width ``Wq``;
a strided convolution's planes are first split into their stride phases (``x[a::s, b::s]`` for the phases the
kernel's taps use), so that every tap is a stride-1 shift of one plane. The output is computed on the same grid,
``Ho`` rows of ``Wq`` pixels (the columns past ``Wo`` are thrown away by the caller), so the output pixel ``q``
of a stored weight ``(o, c, kh, kw)`` reads ``x[q + off]`` with one offset per stored weight (its plane and its
row and column shift): consecutive output pixels read consecutive inputs, and a vector of pixels is one
unaligned load.

``y[img, o, q] = sum_p vals[p] * x[img, q + off[p]] (+ bias[o])`` over the entries ``p`` of row ``o``
(``pos[o] .. pos[o + 1]``): per stored weight, one broadcast and, per vector of the tile's pixels, a load and a
multiply-add into accumulators that stay in registers for the whole row, ``unroll`` sets of them so that the
multiply-adds' latency hides behind each other. The work items are (image, pixel tile, row chunk), tile-major:
a tile's inputs (every channel's plane around the tile) stay in the cache while the rows pass.

``banded``: the input buffer's pack (``pack``), the tiles and the result's unpack (``unpack``) of a band of output
rows of one image in one work item, the band's buffer and grid each thread's own.

Against im2col and the sparse-weight ``linear`` family (``compiler.weights``), this reads each input once per
stored weight from the cache instead of copying ``prod(kernel)`` shifted copies of the input into rows and then
transposing them into a panel: those copies cost as much as the sparse product itself at 90% sparsity.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import loopir as L
from .target import Target
from .weights import _add, _bv, _c, _mul, _vloop, sets_total, unrolled

I64, F32 = "i64", "f32"
#: accumulator vectors a row holds at least (``vectors`` x ``unroll``), of the 16 (AVX2) / 32 (AVX-512) registers
ACCUMULATORS = 8
#: pixel vectors per tile at most, by the target's registers (AVX-512's 32 hold 16 accumulators and the loads;
#: AVX2's 16 would spill them). Measured (AMD Zen 4, 1 thread, 90% csr, minimum of 40 interleaved calls):
#: 64 channels at 56 x 56, vectors x sets 16 x 1 0.51 ms, 12 x 1 0.51, 10 x 1 0.54, 8 x 1 0.56-0.59, 6 x 2 0.62,
#: 4 x 1/2/3 0.66-0.67, 3 x 3 0.70, 2 x 4 0.78 (at 50%: 16 x 1 1.95, 12 x 1 1.94, 8 x 1 2.06, 4 x 2 2.34, 2 x 4
#: 2.85): the sets do not matter, the entries' fixed cost (value, offset, broadcast) over more vectors does; 512
#: channels at 7 x 7 (63 grid pixels), 8 x 1 0.99 against 4 x 2 0.60: most of the tile off the grid
MAX_VECTORS = {64: 16, 32: 8}
#: the widest tile (of 16, 12, 8 vectors) is taken that pads the grid at most this much more than one of 4
GRID_SLACK = 1.05
#: float32 elements per cache line, and the next chunk's prefetches into L2 (``_prefetch``)
LINE, PREFETCH_LOCALITY = 16, 2
@dataclass(frozen=True)
class Plan:
    """``lanes`` per vector, ``vectors`` per tile (``T = lanes * vectors`` output pixels), ``unroll`` accumulator
    sets; ``ptype`` the row positions' type; ``bias``: added in the epilogue; ``rows`` output rows a block
    computes together (``forward``); ``images`` a tile's images (blocks of rows only: the tile's pixels in each);
    ``dynamic``: the work items handed to the threads one at a time as they come free, else split in equal
    contiguous shares."""
    lanes: int
    vectors: int
    unroll: int
    ptype: str
    bias: bool
    rows: int = 1
    images: int = 1
    dynamic: bool = False

    @property
    def T(self) -> int:
        return self.lanes * self.vectors

    @property
    def name(self) -> str:
        return "scorch_conv_direct" + (f"_r{self.rows}" if self.rows > 1 else "") + \
            (f"_i{self.images}" if self.images > 1 else "") + ("_dyn" if self.dynamic else "")


def subsets(rows: int) -> list:
    """The nonempty subsets of a block's ``rows`` as bit masks, in the order of a block's entry lists: the most
    rows first (``forward``)."""
    return sorted(range(1, 1 << rows), key=lambda m: (-bin(m).count("1"), m))


def plan(target: Target, pixels: int, ptype: str, bias: bool, rows: int = 1, batch: int = 1,
         dynamic: bool = False) -> Plan:
    """The tile for an output plane of ``pixels`` (grid) pixels: the widest of 16, 12, 8 vectors (at most the
    target's ``MAX_VECTORS`` over ``rows``: a block holds every row's accumulators) that pads the grid little more
    than 4 do, else as many as it fills up to 4; ``unroll`` sets so that ``ACCUMULATORS`` vectors are in flight.
    Blocks of rows take the widest of any vector count that pads the grid little more than the least does.
    Blocks of rows on a narrower tile than the widest take the same pixels of several of the ``batch``'s images
    (``images``), so that each entry's value and offset serve as many multiply-adds (small planes: 512 x 7 x 7)."""
    lanes = target.lanes(F32) if target.vectors else 1

    def padded(v):
        return -(-pixels // (v * lanes)) * v * lanes
    widest = MAX_VECTORS.get(target.vector_bytes, 4 * rows) // rows
    wide = [v for v in (16, 12, 8) if v <= widest and padded(v) <= GRID_SLACK * padded(4)]
    vectors = wide[0] if wide else max(1, min(4, -(-pixels // lanes)))
    unroll = max(1, ACCUMULATORS // vectors) if rows == 1 else 1
    if rows == 1 or not target.vectors:
        return Plan(lanes, vectors, unroll, ptype, bias, rows, 1, dynamic)

    def images(v):
        return max(1, min(batch, widest // v))
    # (blocks of rows: the widest tile that pads the grid little more than the least does, any vector count: a
    #  256 x 14 x 14 layer's 224 grid pixels take 7 vectors, not 8 (256 pixels); batch 8, 1 thread, the kernel
    #  13.9 ms -> 12.0, batch 1 1.69 -> 1.50. Narrower tiles over more images lose: 2 vectors x 4 images 15.3)
    least = min(padded(v) for v in range(1, widest + 1))
    vectors = max(v for v in range(1, widest + 1) if padded(v) <= GRID_SLACK * least)
    return Plan(lanes, vectors, unroll, ptype, bias, rows, images(vectors), dynamic)


def _div(a, b):
    return L.binary("floordiv", a, b)


def forward(p: Plan) -> L.Kernel:
    """The kernel: parameters ``pos``, ``off`` (i32), ``vals``, [``bias``], ``x``, ``y``; scalars ``n`` (images),
    ``x_image`` (input elements per image), ``grid`` (output pixels per plane, a multiple of ``T``), ``n_out``,
    ``kchunks`` (the entries' channel chunks), ``chunks`` and ``row_chunk`` (the rows split for the threads),
    ``nthreads``. Row ``o``'s entries of channel chunk ``kc`` are ``pos[kc * n_out + o] .. pos[kc * n_out + o +
    1]``: a tile goes over the chunks, every row of the item per chunk, so that the chunk's inputs around the tile
    stay in L1 while the rows pass (the rows' sums so far read back from ``y``, which the chunks after the first
    add to). ``x`` must be readable up to ``grid + max(off)`` past each image's start (the caller pads its end)."""
    return L.Kernel(p.name + ("_bias" if p.bias else ""), _params(p), L.block(_items(p, _tile(p, "x", "y"))))


def _tile(p: Plan, xa: str, ya: str) -> L.Stmt:
    """``forward``'s work on one tile (``xb``, ``yb``: its starts in the input buffer ``xa`` and the grid ``ya``)
    for the rows ``chunk * row_chunk ..`` (blocks of rows where ``p.rows`` > 1), over every channel chunk."""
    T, U = p.T, p.unroll
    xb, yb, o, lo, hi, q, k, e, kc, at = (L.Var(v) for v in ("xb", "yb", "o", "lo", "hi", "q", "k", "e", "kc", "at"))
    chunk, n_out, grid = L.Var("chunk"), L.Var("n_out"), L.Var("grid")
    r_lo = _mul(chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", n_out, _add(r_lo, L.Var("row_chunk")))
    vector = p.lanes if p.lanes > 1 else 0

    def entry(at_, u):
        w = L.Load("vals", at_, F32)
        src = _add(xb, L.Cast(L.Load("off", at_, "i32"), I64), _bv)
        return _vloop(T, p.lanes, L.Store("acc", _add(_c(u * T), _bv), _mul(w, L.Load(xa, src, F32)), "add"))

    first = L.binary("eq", kc, _c(0))
    if p.rows > 1:
        return _blocks(p, first, xa, ya)
    y_at = _add(yb, _mul(o, grid), _bv)
    start = _vloop(T, p.lanes, L.Store("acc", _bv, L.Load("bias", o, F32), "add")) if p.bias else None
    row = L.block(
        L.Let(at, _add(_mul(kc, n_out), o)),
        L.Let(lo, L.Cast(L.Load("pos", at, p.ptype), I64)),
        L.Let(hi, L.Cast(L.Load("pos", _add(at, _c(1)), p.ptype), I64)),
        # (a row with no entries in a later chunk is left as it is: a grouped weight's rows have entries in
        #  their group's chunks only)
        L.If(L.binary("or", first, L.binary("lt", lo, hi)), L.block(
            L.LocalArray("acc", F32, U * T, L.Const(0.0, F32), vector=vector),
            # (the sums so far, or the bias where the row starts)
            L.If(first, L.block(start), L.block(_vloop(T, p.lanes, L.Store("acc", _bv, L.Load(ya, y_at, F32))))),
            *unrolled(lo, hi, U, entry, k, q, e),
            _vloop(T, p.lanes, L.Store(ya, y_at, sets_total("acc", U, T))))))
    return L.For(kc, _c(0), L.Var("kchunks"), L.block(_prefetch(p, xa), L.For(o, r_lo, r_hi, row)))


def _prefetch(p: Plan, xa: str) -> L.Stmt:
    """Hints for the next channel chunk's inputs around the tile, into L2 (``PREFETCH_LOCALITY``), issued before
    the chunk's rows pass: the first row of a chunk otherwise waits on each line from L3 (a layer's buffer is
    larger than L2: ResNet-18's 64 x 56 x 56 shifted planes, 2.9 MB). The chunk's channels ``(kc + 1) * cc ..``
    of every phase plane (``plane`` elements apart; channel ``c`` of phase ``ph`` is plane ``ph * C + c``),
    ``span`` elements from the tile's start each, a line (16 floats) at a time. Kernel alone, batch 8, 1 thread:
    64 x 56 x 56 1.43 -> 1.38 ms, 128 x 28 x 28 2.76 -> 2.85, 256 x 14 x 14 even."""
    kc, c, ph, j = L.Var("kc"), L.Var("pc"), L.Var("pph"), L.Var("pj")
    cc, C = L.Var("cc"), L.Var("C")
    c_lo = _mul(_add(kc, _c(1)), cc)
    return L.block(*(L.For(c, c_lo, L.binary("min", C, _add(c_lo, cc)), L.block(L.For(ph, _c(0), L.Var("P"), L.block(
        L.For(j, _c(0), _div(L.Var("span"), _c(LINE)), L.block(L.Prefetch(xa, _add(
            L.Var("xb"), _mul(_c(i), L.Var("x_image")), _mul(_add(_mul(ph, C), c), L.Var("plane")),
            _mul(j, _c(LINE))), PREFETCH_LOCALITY))))))) for i in range(p.images)))


def _entry_params(p: Plan) -> tuple:
    """The entries' arrays (``pos``, ``off``, ``vals``, the bias where ``p.bias``), then the input and the output."""
    return (L.Param("pos", "array", p.ptype), L.Param("off", "array", "i32"), L.Param("vals", "array", F32)) + \
        ((L.Param("bias", "array", F32),) if p.bias else ()) + \
        (L.Param("x", "array", F32), L.Param("y", "array", F32, output=True))


def _params(p: Plan) -> tuple:
    return _entry_params(p) + (
         L.Param("n", "scalar", I64), L.Param("x_image", "scalar", I64), L.Param("grid", "scalar", I64),
         L.Param("n_out", "scalar", I64), L.Param("kchunks", "scalar", I64), L.Param("chunks", "scalar", I64),
         L.Param("row_chunk", "scalar", I64), L.Param("nthreads", "scalar", I64), L.Param("C", "scalar", I64),
         L.Param("P", "scalar", I64), L.Param("plane", "scalar", I64), L.Param("cc", "scalar", I64),
         L.Param("span", "scalar", I64))


def _items(p: Plan, body: L.Stmt) -> L.For:
    """The work items (image, pixel tile, row chunk), tile-major, each ``body`` with ``img``, ``chunk``, the
    tile's input and output starts ``xb`` and ``yb`` bound (``p.images`` images an item: ``n`` counts them)."""
    item, img, rest, tile, chunk, xb, yb = (L.Var(v) for v in ("item", "img", "rest", "tile", "chunk", "xb", "yb"))
    per_img = _mul(_div(L.Var("grid"), _c(p.T)), L.Var("chunks"))
    return L.For(item, _c(0), _mul(L.Var("n"), per_img), L.block(
        L.Let(img, _div(item, per_img)),
        L.Let(rest, L.binary("mod", item, per_img)),
        L.Let(tile, _div(rest, L.Var("chunks"))),
        L.Let(chunk, L.binary("mod", rest, L.Var("chunks"))),
        L.Let(xb, _add(_mul(_mul(img, _c(p.images)), L.Var("x_image")), _mul(tile, _c(p.T)))),
        L.Let(yb, _add(_mul(_mul(_mul(img, _c(p.images)), L.Var("n_out")), L.Var("grid")), _mul(tile, _c(p.T)))),
        body), parallel=L.Parallel("dynamic" if p.dynamic else "static", None, L.block(), chunk=1))


def _blocks(p: Plan, first: L.Expr, xa: str, ya: str) -> L.Stmt:
    """The kernel where a block of ``p.rows`` output rows shares its loads: its entries of a channel chunk come in
    one list per subset of its rows (``subsets``: an entry of a list holds the value of each row, 0 where the
    row has none, and one offset), so that an input vector is loaded once for every row of the block that reads
    it, into accumulators that stay in registers for the whole block. Block ``b``'s list ``s`` of chunk ``kc``
    is ``pos[(kc * blocks + b) * S + s] .. pos[... + s + 1]`` (``S`` lists, ``blocks = ceil(n_out / rows)``); its
    entry ``e``'s values ``vals[e * rows + r]``. With half of the rows' entries on every input (2:4), a block
    of two loads 3 vectors for 4 multiply-adds on average against 4; rows past ``n_out`` (the last block's) are
    computed on row ``n_out - 1``'s sums and not stored."""
    R, T, S, M = p.rows, p.T, len(subsets(p.rows)), p.images
    kc, b, at, lo, hi, e = (L.Var(v) for v in ("kc", "b", "at", "lo", "hi", "e"))
    xb, yb, grid, n_out = L.Var("xb"), L.Var("yb"), L.Var("grid"), L.Var("n_out")
    blocks = _div(_add(n_out, _c(R - 1)), _c(R))
    vector = p.lanes if p.lanes > 1 else 0
    rows = [_add(_mul(b, _c(R)), _c(r)) for r in range(R)]
    kept = [L.binary("min", o, L.binary("sub", n_out, _c(1))) for o in rows]

    def y_at(r, i):  # (row ``r``'s pixels in the tile's image ``i``)
        return _add(yb, _mul(_c(i), _mul(n_out, grid)), _mul(kept[r], grid), _bv)

    def acc(r, i):
        return _add(_c((r * M + i) * T), _bv)
    start = [_vloop(T, p.lanes, *(L.Store("acc", acc(r, i), L.Load("bias", kept[r], F32), "add")
                                  for r in range(R))) for i in range(M)] if p.bias else []
    resume = [_vloop(T, p.lanes, *(L.Store("acc", acc(r, i), L.Load(ya, y_at(r, i), F32)) for r in range(R)))
              for i in range(M)]
    lists = []
    for s, mask in enumerate(subsets(R)):
        def fmas(i):
            x_v = L.Load(xa, _add(xb, _mul(_c(i), L.Var("x_image")), L.Cast(L.Load("off", e, "i32"), I64), _bv),
                         F32)
            # (an input that several rows read goes through a register of its own: left as one expression per
            #  row, GCC folds it into each multiply-add as a memory operand, a load per multiply-add again)
            shared = bin(mask).count("1") > 1
            kept_x = L.Load("xs", _bv, F32) if shared else x_v
            return ([L.Store("xs", _bv, x_v)] if shared else []) + [
                L.Store("acc", acc(r, i), _mul(L.Load("vals", _add(_mul(e, _c(R)), _c(r)), F32), kept_x), "add")
                for r in range(R) if mask >> r & 1]
        lists.append(L.For(e, L.Cast(L.Load("pos", _add(at, _c(s)), p.ptype), I64),
                           L.Cast(L.Load("pos", _add(at, _c(s + 1)), p.ptype), I64),
                           L.block(*(_vloop(T, p.lanes, *fmas(i)) for i in range(M)))))

    def store(r):
        return [_vloop(T, p.lanes, L.Store(ya, y_at(r, i), L.Load("acc", acc(r, i), F32))) for i in range(M)]
    stores = [L.If(L.binary("lt", rows[r], n_out), L.block(*store(r))) if r else L.block(*store(r))
              for r in range(R)]
    block = L.block(
        L.Let(at, _mul(_add(_mul(kc, blocks), b), _c(S))),
        L.Let(lo, L.Cast(L.Load("pos", at, p.ptype), I64)),
        L.Let(hi, L.Cast(L.Load("pos", _add(at, _c(S)), p.ptype), I64)),
        L.If(L.binary("or", first, L.binary("lt", lo, hi)), L.block(
            L.LocalArray("acc", F32, R * M * T, L.Const(0.0, F32), vector=vector),
            L.LocalArray("xs", F32, T, L.Const(0.0, F32), vector=vector, pinned=True),
            L.If(first, L.block(*start), L.block(*resume)),
            *lists, *stores)))
    chunk = L.Var("chunk")
    r_lo = _mul(chunk, L.Var("row_chunk"))
    r_hi = L.binary("min", blocks, _add(r_lo, L.Var("row_chunk")))
    return L.For(kc, _c(0), L.Var("kchunks"), L.block(_prefetch(p, xa), L.For(b, r_lo, r_hi, block)))


#: (channels_last packs and unpacks: a row of every channel transposed by ``loopir.Transpose``'s vector tiles.
#: Measured (64 x 56 x 56, batch 8, 1 thread): pack 1.60 ms a channel's column at a time, 0.76 in blocks of 16
#: channels with the planes' rows inner; unpack 0.58 in such blocks; a torch channels_last <-> NCHW copy 1.0-1.1.
#: The tiles, batch 1, 1 thread, kernels alone: 128 x 28 x 28 pack 0.42 -> 0.24 ms, 64 x 56 x 56 unpack 0.19 ->
#: 0.13)


def pack(channels_inner: bool) -> L.Kernel:
    """The input buffer, in one pass: ``buf[img, phase, c, i, j] = x[img, c, pa[phase] + sr * i - pt, pb[phase] +
    sc * j - pl]``, 0 outside the input (the padding). ``x`` is read through its strides (``xs_*``), so NCHW and
    channels_last inputs take no copy first; each work item is one row ``i`` of every channel of every phase, so a
    channels_last input's row stays in the cache. The columns ``jlo[phase] .. jhi[phase]`` read the input (the
    caller computes them), the rest are zeros: no test per element. ``channels_inner``: channels_last (``xs_c`` must
    be 1), every channel's row transposed by vector tiles; else NCHW (``xs_w`` must be 1).
    A phase whose ``src_phase`` is not -1 is that phase (an earlier one) shifted left by ``src_shift`` columns
    (the shifted planes of ``engine.conv_direct._geometry``: ``pb = pb[src] + sc * shift``): its rows are copied from that
    phase's rows just written, contiguous, instead of gathered from ``x`` again; its last ``sh`` columns gathered
    (zeros past the input)."""
    item, img, i = L.Var("item"), L.Var("img"), L.Var("i")
    loop = L.For(item, _c(0), _mul(L.Var("n"), L.Var("Hq")), L.block(
        L.Let(img, _div(item, L.Var("Hq"))), L.Let(i, L.binary("mod", item, L.Var("Hq"))),
        _pack_row(channels_inner, img, img, i, i)), parallel=L.Parallel("static", None, L.block(), chunk=1))
    scalars = ("n", "P", "C", "H", "W", "Hq", "Wq", "sr", "sc", "pt", "pl", "xs_n", "xs_c", "xs_h", "xs_w",
               "nthreads")
    return L.Kernel("scorch_conv_pack" + ("_cl" if channels_inner else ""), _pack_params() + (
        L.Param("x", "array", F32), L.Param("buf", "array", F32, output=True)) +
        tuple(L.Param(s, "scalar", I64) for s in scalars), L.block(loop))


def _pack_params() -> tuple:
    return tuple(L.Param(a, "array", I64) for a in ("pa", "pb", "jlo", "jhi", "src_phase", "src_shift"))


def _pack_row(channels_inner: bool, img: L.Expr, b_img: L.Expr, i: L.Expr, i_in: L.Expr) -> L.Stmt:
    """``pack``'s work item: row ``i`` of every phase's planes of image ``b_img`` in ``buf`` (planes ``Hq x Wq``),
    from the input rows of phase row ``i_in`` of ``x``'s image ``img`` (``banded``: a band's own buffer, image 0,
    its rows ``i`` those of the image's phase rows ``i_in``)."""
    ph, c, j, r, col, base, lo, hi, src, sh, sbase = (L.Var(v) for v in (
        "ph", "c", "j", "r", "col", "base", "lo", "hi", "src", "sh", "sbase"))
    P, C, H, Hq, Wq = (L.Var(v) for v in ("P", "C", "H", "Hq", "Wq"))
    inside = L.binary("and", L.binary("ge", r, _c(0)), L.binary("lt", r, H))
    # (NCHW: the columns' stride 1, known here)
    at = _add(_mul(img, L.Var("xs_n")), _mul(c, L.Var("xs_c")), _mul(r, L.Var("xs_h")), col)
    plane = _add(base, _mul(c, _mul(Hq, Wq)))
    copy = L.Store("buf", _add(plane, j), L.Load("x", at, F32))
    col_let = L.Let(col, L.binary("sub", _add(L.Cast(L.Load("pb", ph, I64), I64), _mul(L.Var("sc"), j)), L.Var("pl")))
    if channels_inner:  # (the row's columns ``lo .. hi`` by every channel, a block transposed by vector tiles)
        first = L.binary("sub", _add(L.Cast(L.Load("pb", ph, I64), I64), _mul(L.Var("sc"), lo)), L.Var("pl"))
        src_at = _add(_mul(img, L.Var("xs_n")), _mul(r, L.Var("xs_h")), _mul(first, L.Var("xs_w")))
        copies = L.Transpose("buf", _add(base, lo), _mul(Hq, Wq), "x", src_at, _mul(L.Var("sc"), L.Var("xs_w")),
                             L.binary("sub", hi, lo), C, F32, F32)
    else:
        copies = L.For(c, _c(0), C, L.block(L.For(j, lo, hi, L.block(col_let, copy))))
    zero = L.Const(0.0, F32)
    # (the padding columns a column at a time, every channel inner: a channel's few columns inner were a memset
    #  call each, which cost as much as the rest of the pack: 128 x 28 x 28, batch 8, 1 thread)
    def zero_columns(j_lo, j_hi):
        return L.For(j, j_lo, j_hi, L.block(L.For(c, _c(0), C, L.block(L.Store("buf", _add(plane, j), zero)))))
    zeros = L.block(zero_columns(_c(0), lo), zero_columns(hi, Wq))
    # (at least 0: a shift wider than the row (a dilated tap on a narrow grid: 3 taps 6 apart onto rows of 4) copies
    #  nothing, every column gathered; a negative start wrote the row before this one)
    kept = L.binary("max", L.binary("sub", Wq, sh), _c(0))
    # (the last ``sh`` columns, past the source row's end, gathered: inputs where the row's input reaches them,
    #  images side by side (``engine.conv_direct._side_by_side``); read at clamped positions, then selected)
    W = L.Var("W")

    def clamp(v, size):
        return L.binary("min", L.binary("max", v, _c(0)), L.binary("sub", size, _c(1)))
    in_col = L.binary("and", inside, L.binary("and", L.binary("ge", col, _c(0)), L.binary("lt", col, W)))
    tail_at = _add(_mul(img, L.Var("xs_n")), _mul(c, L.Var("xs_c")), _mul(clamp(r, H), L.Var("xs_h")),
                   _mul(clamp(col, W), L.Var("xs_w")))
    tail = L.For(j, kept, Wq, L.block(col_let, L.For(c, _c(0), C, L.block(L.Store(
        "buf", _add(plane, j), L.Select(in_col, L.Load("x", tail_at, F32), zero, F32))))))
    shifted = L.block(L.For(c, _c(0), C, L.block(
        L.For(j, _c(0), kept, L.block(L.Store("buf", _add(plane, j), L.Load(
            "buf", _add(sbase, _mul(c, _mul(Hq, Wq)), j, sh), F32)))))), tail)

    def row_start(phase):
        return _add(_mul(_mul(_add(_mul(b_img, P), phase), C), _mul(Hq, Wq)), _mul(i, Wq))
    phase = L.block(
        L.Let(src, L.Load("src_phase", ph, I64)),
        L.Let(base, row_start(ph)),
        L.Let(r, L.binary("sub", _add(L.Cast(L.Load("pa", ph, I64), I64), _mul(L.Var("sr"), i_in)), L.Var("pt"))),
        L.If(L.binary("lt", src, _c(0)), L.block(
            # (a row outside the input: every column zero)
            L.Let(lo, L.Select(inside, L.Load("jlo", ph, I64), Wq, I64)),
            L.Let(hi, L.Select(inside, L.Load("jhi", ph, I64), Wq, I64)),
            zeros, copies), L.block(
            L.Let(sh, L.Load("src_shift", ph, I64)),
            L.Let(sbase, row_start(src)),
            shifted)))
    return L.For(ph, _c(0), P, phase)


def unpack(channels_inner: bool) -> L.Kernel:
    """The result from the grid, in one pass: ``y[img, o, h, w] = grid[img, o, h * Wq + w]`` for the ``Wo`` valid
    columns, ``y`` written through its strides (``ys_*``: NCHW or channels_last), one output row ``h`` of every
    channel a work item. ``channels_inner``: channels_last (``ys_c`` 1), the channels' rows transposed by vector
    tiles; else NCHW (``ys_w`` 1), the columns inner."""
    item, img, h, Ho = L.Var("item"), L.Var("img"), L.Var("h"), L.Var("Ho")
    loop = L.For(item, _c(0), _mul(L.Var("n"), Ho), L.block(
        L.Let(img, _div(item, Ho)), L.Let(h, L.binary("mod", item, Ho)), _unpack_row(channels_inner, img, img, h, h)),
        parallel=L.Parallel("static", None, L.block(), chunk=1))
    scalars = ("n", "O", "Ho", "Wo", "Wq", "G", "ys_n", "ys_c", "ys_h", "ys_w", "nthreads")
    params = (L.Param("grid", "array", F32), L.Param("y", "array", F32, output=True)) + \
        tuple(L.Param(s, "scalar", I64) for s in scalars)
    return L.Kernel("scorch_conv_unpack" + ("_cl" if channels_inner else ""), params, L.block(loop))


def _unpack_row(channels_inner: bool, img: L.Expr, g_img: L.Expr, h: L.Expr, h_out: L.Expr, ga="grid") -> L.Stmt:
    """``unpack``'s work item: output row ``h_out`` of image ``img`` of ``y``, every channel, from row ``h`` of the
    grid ``ga``'s image ``g_img`` (``banded``: a band's own grid, image 0, its row ``h`` the image's ``h_out``)."""
    o, w = L.Var("o"), L.Var("w")
    O, Wo, G = L.Var("O"), L.Var("Wo"), L.Var("G")
    value = L.Load(ga, _add(_mul(_add(_mul(g_img, O), o), G), _mul(h, L.Var("Wq")), w), F32)
    # (the inner loop's stride 1, known here: the writes are contiguous, a plain vectorized copy)
    store = L.Store("y", _add(_mul(img, L.Var("ys_n")), _mul(o, L.Var("ys_c")), _mul(h_out, L.Var("ys_h")), w),
                    value)
    if not channels_inner:
        return L.For(o, _c(0), O, L.block(L.For(w, _c(0), Wo, L.block(store))))
    # (channels_last: every channel's row transposed by vector tiles)
    return L.Transpose("y", _add(_mul(img, L.Var("ys_n")), _mul(h_out, L.Var("ys_h"))), L.Var("ys_w"), ga,
                       _add(_mul(_mul(g_img, O), G), _mul(h, L.Var("Wq"))), G, O, Wo, F32, F32)


def banded(p: Plan, channels_inner: bool) -> L.Kernel:
    """``pack``, ``forward`` and ``unpack`` in one kernel, a band of ``Rb`` output rows of one image a work item:
    the band's input buffer (its phase rows ``band * Rb ..``, ``Hq`` of them: the band's rows and the taps' extra
    ones) and its grid (``n_out`` planes of ``grid`` pixels) are each thread's own, so that the buffer is written,
    read by every tile and the grid unpacked by one thread in one parallel region, not the whole batch's buffer
    written by one region and read back through L3 by the next (``engine.conv_direct.BAND_BYTES``: the engine
    takes bands of whole images). ``p`` is the band's plan (``p.images`` 1); the entries' offsets are into the band's buffer
    (its planes ``Hq x Wq``); ``Ho`` is the image's output rows (the last band's rows past it are computed on zero
    inputs and not stored). ``buf_size``: the band buffer's elements, the tiles' reads past its planes included
    (zeros)."""
    assert p.images == 1
    item, img, band, i, h, tile, r0 = (L.Var(v) for v in ("item", "img", "band", "i", "h", "tile", "r0"))
    Rb, grid = L.Var("Rb"), L.Var("grid")
    body = L.block(
        L.Let(img, _div(item, L.Var("bands"))),
        L.Let(band, L.binary("mod", item, L.Var("bands"))),
        L.Let(r0, _mul(band, Rb)),
        L.Let(L.Var("chunk"), _c(0)),
        L.Let(L.Var("O"), L.Var("n_out")),
        L.Let(L.Var("G"), grid),
        L.For(i, _c(0), L.Var("Hq"), L.block(_pack_row(channels_inner, img, _c(0), i, _add(r0, i)))),
        L.For(tile, _c(0), _div(grid, _c(p.T)), L.block(
            L.Let(L.Var("xb"), _mul(tile, _c(p.T))), L.Let(L.Var("yb"), _mul(tile, _c(p.T))),
            _tile(p, "buf", "bgrid"))),
        L.For(h, _c(0), L.binary("min", Rb, L.binary("sub", L.Var("Ho"), r0)), L.block(
            _unpack_row(channels_inner, img, _c(0), h, _add(r0, h), "bgrid"))))
    setup = L.block(L.Alloc("buf", F32, L.Var("buf_size")), L.Alloc("bgrid", F32, _mul(L.Var("n_out"), grid)))
    loop = L.For(item, _c(0), _mul(L.Var("n"), L.Var("bands")), body,
                 parallel=L.Parallel("dynamic", None, setup, chunk=1))
    scalars = ("n", "bands", "Rb", "buf_size", "P", "C", "H", "W", "Hq", "Wq", "sr", "sc", "pt", "pl", "xs_n",
               "xs_c", "xs_h", "xs_w", "x_image", "grid", "n_out", "kchunks", "row_chunk", "plane", "cc", "span",
               "Ho", "Wo", "ys_n", "ys_c", "ys_h", "ys_w", "nthreads")
    params = _pack_params() + _entry_params(p) + tuple(L.Param(s, "scalar", I64) for s in scalars)
    return L.Kernel(p.name + "_banded" + ("_cl" if channels_inner else "") + ("_bias" if p.bias else ""), params,
                    L.block(loop))
