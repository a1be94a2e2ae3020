"""The loop IR: imperative loop nests over arrays, what lowering produces and the code generators consume.

Nodes are frozen dataclasses. Scalars have a ``Type`` (a small set that every backend can name); arrays are
kernel parameters (or local workspaces) referred to by name. The NumPy interpreter (``interp``) defines
the semantics; the C++ and CUDA generators must agree with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional, Union

import torch

#: loop-IR scalar types, and the torch dtypes that map to them. ``bf16`` and ``f16`` are storage types: arrays
#: hold them, arithmetic is done in their ``compute_type`` (``f32``), and a store into such an array rounds
TYPES = ("bool", "i8", "i16", "i32", "i64", "f32", "f64", "bf16", "f16")
FROM_TORCH = {torch.bool: "bool", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float32: "f32",
              torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
TO_TORCH = {v: k for k, v in FROM_TORCH.items()}
#: the storage-only types
NARROW = ("bf16", "f16")
#: their torch dtypes: values stored in 16 bits, computed (and summed) in float32
HALF_DTYPES = tuple(TO_TORCH[t] for t in NARROW)
#: the integer types (``i8`` and ``i16`` only as index arrays' storage: narrow offsets such as ``nm(n, m)``'s)
INTS = ("i8", "i16", "i32", "i64")


def compute_type(t: str) -> str:
    """The type arithmetic on values of type ``t`` is done in: ``f32`` for the 16-bit floats, else ``t``."""
    return "f32" if t in NARROW else t


def type_of(dtype: torch.dtype) -> str:
    try:
        return FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"scorch kernels support the dtypes {', '.join(str(d) for d in FROM_TORCH)}; got {dtype}")\
            from None


class Expr:
    type: str


@dataclass(frozen=True)
class Var(Expr):
    name: str
    type: str = "i64"


@dataclass(frozen=True)
class Const(Expr):
    value: Union[int, float, bool]
    type: str = "i64"


@dataclass(frozen=True)
class Load(Expr):
    """``array[index]``; the result has the array's element type."""
    array: str
    index: Expr
    type: str = "i64"


#: binary operators: arithmetic (``div`` is true division for floats and truncation for integers;
#: ``floordiv``/``mod`` are used on non-negative integers only), comparisons, logic, min/max, and ``shr``: the
#: 64 bits of an integer shifted right as unsigned (a field of a word that packs several narrow integers)
BINARY = ("add", "sub", "mul", "div", "floordiv", "mod", "min", "max", "lt", "le", "gt", "ge", "eq", "ne",
          "and", "or", "shr")
#: unary maps; every one but ``not`` and ``exp`` maps 0 to 0, so it may run on stored values only (``exp`` serves
#: kernels built as loop IR, such as ``fuse.softmax_rows``, never the lowering of an index expression).
#: ``ACTIVATIONS`` serve the epilogues of kernels built as loop IR (``compiler.weights``), on float32 values.
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
UNARY = ("neg", "abs", "relu", "sqrt", "square", "sin", "tanh", "sign", "not", "exp", "log", "gelu", "gelu_tanh",
         "silu")


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    type: str = "i64"


@dataclass(frozen=True)
class Unary(Expr):
    op: str
    a: Expr
    type: str = "f32"


@dataclass(frozen=True)
class Cast(Expr):
    a: Expr
    type: str


@dataclass(frozen=True)
class Select(Expr):
    """``cond ? a : b``. ``eager``: ``a`` is evaluated whatever ``cond`` is (the lowering knows it is safe: a
    load at a position inside its array), so the choice compiles to a blend rather than a branch; a two-way
    merge's ``f ? vals[q] : 0`` is a coin toss per step for the branch predictor."""
    cond: Expr
    a: Expr
    b: Expr
    type: str = "f32"
    eager: bool = False


@dataclass(frozen=True)
class Common(Expr):
    """How many values the strictly increasing ranges ``a_array[a_lo:a_hi]`` and ``b_array[b_lo:b_hi]`` share:
    the size of two sorted coordinate lists' intersection, counted a block of each at a time rather than by a
    merge, whose every step waits for the load the last one chose."""
    a_array: str
    a_lo: Expr
    a_hi: Expr
    b_array: str
    b_lo: Expr
    b_hi: Expr
    type: str = "i64"


@dataclass(frozen=True)
class PairDot(Expr):
    """``x[2 * i] * w[j] + x[2 * i + 1] * w[j + 1]`` in float32, ``x`` and ``w`` bfloat16 arrays: a pair of adjacent
    values of each multiplied and added. In a vector loop where ``i`` is contiguous and ``w[j]`` the same for every
    lane, a store adding it into a vector compiles to one ``vdpbf16ps`` where the CPU has AVX512-BF16 (two
    multiply-adds per lane: a blocked weight's pair of columns against a panel of token pairs). ``lane``, a hint
    that does not change the meaning: where 0 to 3, ``w[j]`` is pair ``lane`` of four pairs from ``j - 2 * lane``
    (a 16-byte aligned-or-not group) that stores nearby read too: the C++ renderer loads the group once and takes
    the pair from it by a shuffle (``codegen.bf16.PAIR_DOT4``) instead of a broadcast load per pair."""
    x: str
    i: Expr
    w: str
    j: Expr
    type: str = "f32"
    lane: int = -1


@dataclass(frozen=True)
class PairHalf(Expr):
    """``x[2 * i + half]`` (``half`` 0 or 1) as float32, ``x`` a bfloat16 array read as pairs. In a vector loop
    where ``i`` is contiguous it compiles to one load of whole pairs (32-bit lanes) and a shift (``half`` 0) or a
    mask (``half`` 1) of each lane, a bfloat16 being the high half of its float32: a panel of bfloat16 tokens read
    a vector of pairs at a time, its even tokens in one float vector and its odd ones in the next (half the
    bytes of a float32 panel for the same multiply-adds)."""
    x: str
    i: Expr
    half: int
    type: str = "f32"


@dataclass(frozen=True)
class LanePick(Expr):
    """``x[at + ((sel[si] >> shift) & 3)]`` in float32: one of 4 contiguous values ``x[at .. at + 3]``, chosen by a
    2-bit field of the byte ``sel[si]`` (``sel`` int8, its values below 128). In a vector loop where ``si`` is
    contiguous (a byte a lane) and ``at`` the same for every lane it compiles to one broadcast of the 4 values and
    an in-lane permute by the lanes' fields (AVX's ``vpermilps``): an n:4 weight's rows in a vector's lanes, each
    lane taking its own row's column of a token's group of 4 features (``compiler.weights_picks``)."""
    x: str
    at: Expr
    sel: str
    si: Expr
    shift: int
    type: str = "f32"

    def scalar(self) -> Expr:
        """The same value as plain loads (for renderers and lanes without the permute)."""
        field = Binary("mod", binary("shr", Cast(Load(self.sel, self.si, "i8"), "i64"), Const(self.shift)), Const(4),
                       "i64")
        return Load(self.x, binary("add", self.at, field), "f32")


@dataclass(frozen=True)
class Splat(Expr):
    """``array[at + lane]`` (float32, ``lane`` 0 to 3), the same in every lane of a vector loop: one value of the
    group of 4 at ``array[at .. at + 3]``, which the caller reads whole (all 4 in bounds). A hint that does not
    change the meaning: the C++ renderer loads the group once (four such values of one group, rendered together,
    share the load) and takes the value to every lane by shuffles, not a broadcast load each: a CSR row's stored
    weights, whose broadcast loads took a vector load port beside the panel's loads (``compiler.weights``)."""
    array: str
    at: Expr
    lane: int
    type: str = "f32"

    def scalar(self) -> Expr:
        """The same value as a plain load."""
        return Load(self.array, binary("add", self.at, Const(self.lane)), self.type)


#: the columns one word of a bitmap covers (``Expand``, ``PopCount``): a word is 16 bits
BITS = 16


@dataclass(frozen=True)
class Expand(Expr):
    """Lane ``lane`` of a group of ``BITS`` columns whose stored values are ``vals[start:]`` and whose pattern is
    the low 16 bits of ``bits`` (bit ``u`` set: column ``u`` holds the next stored value): ``vals[start +
    PopCount(bits & ((1 << lane) - 1))]`` in float32 where bit ``lane`` is set, else 0. In a vector loop over
    ``lane`` (from 0 in whole vectors) it compiles to a masked load of the group's values and an expand into
    the lanes (AVX-512's ``vexpandps``; a table permute on AVX2): a weight row read through a bitmap, one bit per
    column, instead of a coordinate per value. ``end``, where given: ``vals`` may be read up to there, so that a
    group a vector's values or more before it loads them whole, its lanes past the group's count dropped by the
    expand (AVX2 has no masked 16-bit load, and its masked float load costs more than the rest of the expand).
    ``whole`` (a vector's lanes, where nonzero): the caller has made sure that ``whole`` values from each vector's
    first value are there to read, so every vector's values are loaded whole, with no test of ``end``."""
    vals: str
    start: Expr
    bits: Expr
    lane: Expr
    type: str = "f32"
    end: Expr | None = None
    whole: int = 0


@dataclass(frozen=True)
class ExpandPairDot(Expr):
    """Pair ``lane`` of a group of ``2 * BITS`` columns read through its 32-bit bitmap word ``bits`` (``Expand``:
    each set bit takes the next of ``vals[start:]``, 16-bit floats), against ``x[xi]``, ``x[xi + 1]``: ``e(2 lane) *
    x[xi] + e(2 lane + 1) * x[xi + 1]`` in float32, ``e(c)`` the group's column ``c``. Added into a vector in a
    loop over ``lane`` (16 lanes, ``xi`` advancing by 2 a lane) it compiles to a masked load of the group's
    values, AVX512-VBMI2's ``vpexpandw`` and one ``vdpbf16ps`` against 32 contiguous bfloat16 of ``x``: a 32-column
    group in three instructions."""
    vals: str
    start: Expr
    bits: Expr
    lane: Expr
    x: str
    xi: Expr
    type: str = "f32"


@dataclass(frozen=True)
class PopCount(Expr):
    """The number of bits set among the low ``width`` (16 or 32) of ``a`` (a bitmap word, ``Expand``)."""
    a: Expr
    type: str = "i64"
    width: int = 16


def binary(op, a, b) -> Expr:
    """``Binary`` with the result type inferred (comparisons give bool; arithmetic the wider operand type),
    folding the integer identities the lowering produces (``0 * n``, ``x + 0``, ``x * 1``)."""
    if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or"):
        return Binary(op, a, b, "bool")
    t = wider(a.type, b.type)
    if t in INTS:
        za, zb = _is_const(a, 0), _is_const(b, 0)
        if op == "add" and (za or zb):
            return b if za else a
        if op == "sub" and zb:
            return a
        if op == "mul" and (za or zb):
            return Const(0, t)
        if op == "mul" and (_is_const(a, 1) or _is_const(b, 1)):
            return b if _is_const(a, 1) else a
    return Binary(op, a, b, t)


def _is_const(e, v) -> bool:
    return isinstance(e, Const) and e.value == v


def wider(a: str, b: str) -> str:
    return a if TYPES.index(a) >= TYPES.index(b) else b


class Stmt:
    pass


@dataclass(frozen=True)
class Block(Stmt):
    stmts: tuple = ()


@dataclass(frozen=True)
class Let(Stmt):
    """Declare an immutable local ``var = value``."""
    var: Var
    value: Expr


@dataclass(frozen=True)
class Decl(Stmt):
    """Declare a mutable local (an accumulator) with an initial value."""
    var: Var
    value: Expr


@dataclass(frozen=True)
class Assign(Stmt):
    var: Var
    value: Expr
    op: Optional[str] = None  # None: ``=``; "add": ``+=``; "max"/"min": ``var = max(var, value)``


@dataclass(frozen=True)
class Store(Stmt):
    array: str
    index: Expr
    value: Expr
    op: Optional[str] = None  # as Assign.op
    atomic: bool = False


@dataclass(frozen=True)
class Prefetch(Stmt):
    """A hint that ``array[index]`` will be read soon (a software prefetch of its cache line): no effect on the
    results, and the address is never read here; the index must still be in bounds (it is computed).
    ``locality``: 3 brings the line into the first-level cache (``prefetcht0``), 2 into the second
    (``prefetcht1``: many lines in flight without evicting what the loop works on from L1)."""
    array: str
    index: Expr
    locality: int = 3


@dataclass(frozen=True)
class Transpose(Stmt):
    """``dst[dst_at + j * dst_stride + i] = src[src_at + i * src_stride + j]`` for ``i < rows``, ``j < cols``: a
    block of a row-major matrix copied transposed, converted from ``stype`` to ``dtype`` (through float32: a
    16-bit result rounded once). Its meaning is ``loops()``; a renderer may copy square tiles by vector
    shuffles instead, which compilers do not find in the loops."""
    dst: str
    dst_at: Expr
    dst_stride: Expr
    src: str
    src_at: Expr
    src_stride: Expr
    rows: Expr
    cols: Expr
    stype: str
    dtype: str
    pairs: bool = False  # (16-bit ``stype`` == ``dtype``) positions, strides and counts are of pairs of values,
    #                      each pair copied whole (its 32 bits unchanged): a bfloat16 pairs panel (``PairDot``)

    def loops(self) -> "For":
        """The copy as plain loops (the scalar rendering, and the interpreter's)."""
        i, j = Var("tr_i"), Var("tr_j")
        if self.pairs:
            def at(a, k, stride, q, h):
                return binary("add", binary("mul", binary("add", a, binary("add", binary("mul", k, stride), q)),
                                            Const(2)), Const(h))
            return For(i, Const(0), self.rows, block(For(j, Const(0), self.cols, block(*(Store(
                self.dst, at(self.dst_at, j, self.dst_stride, i, h),
                Load(self.src, at(self.src_at, i, self.src_stride, j, h), self.stype)) for h in (0, 1))))))
        value = Load(self.src, binary("add", self.src_at, binary("add", binary("mul", i, self.src_stride), j)),
                     self.stype)
        if self.stype != "f32" and self.dtype != "f32":
            value = Cast(value, "f32")
        return For(i, Const(0), self.rows, block(For(j, Const(0), self.cols, block(Store(
            self.dst, binary("add", self.dst_at, binary("add", binary("mul", j, self.dst_stride), i)),
            value if self.stype == self.dtype else Cast(value, self.dtype))))))


@dataclass(frozen=True)
class TileConfig(Stmt):
    """Sets up this thread's matrix tiles for the ``TileRow`` statements of its shape that follow in its block
    (``tiles`` result tiles of 16 rows x ``cols`` float32, ``depth`` pairs deep): no effect on values. ``mode``:
    "tiles", the CPU's (AMX: configured here, released at the block's end), or "model", a scalar model of the same
    instructions that checks every tile's shape as the CPU would (tests, on any CPU)."""
    cols: int
    depth: int
    tiles: int
    mode: str = "tiles"


@dataclass(frozen=True)
class TileRow(Stmt):
    """Products of blocks on matrix tiles, in bfloat16 pairs summed in float32: for ``m < 16 * tiles`` and ``n <
    cols``, ``c[c_at + m * c_stride + n] = sum over var in [lo, hi), k < depth, j < 2 of a[a_at + m * a_stride + 2 k
    + j] * b[2 (b_at + k * cols + n) + j]`` (``c`` overwritten). ``a_at`` (an element of ``a``, whose rows are
    ``a_stride`` apart) and ``b_at`` (a pair of ``b``: a block's values as ``depth`` rows of ``cols`` pairs) are
    expressions of ``var``. Its meaning is ``loops()`` (the interpreter's); the C++ renderer keeps the sums in
    tiles (``TileConfig``, which must come before it in the thread)."""
    var: Var
    lo: Expr
    hi: Expr
    a: str
    a_at: Expr
    a_stride: Expr
    b: str
    b_at: Expr
    c: str
    c_at: Expr
    c_stride: int
    cols: int
    depth: int
    tiles: int

    def loops(self) -> Block:
        """The products as plain loops: the sums zeroed, then a ``PairDot`` per block, row, pair and column."""
        m, n, k, rows = Var("tl_m"), Var("tl_n"), Var("tl_k"), Const(16 * self.tiles)
        at = binary("add", self.c_at, binary("add", binary("mul", m, Const(self.c_stride)), n))
        zero = For(m, Const(0), rows, block(For(n, Const(0), Const(self.cols), block(Store(self.c, at, Const(0.0))))))
        pair = binary("add", self.b_at, binary("add", binary("mul", k, Const(self.cols)), n))
        value = binary("add", self.a_at, binary("add", binary("mul", m, self.a_stride), binary("mul", k, Const(2))))
        products = For(self.var, self.lo, self.hi, block(For(m, Const(0), rows, block(
            For(k, Const(0), Const(self.depth), block(For(n, Const(0), Const(self.cols), block(
                Store(self.c, at, PairDot(self.b, pair, self.a, value), "add")))))))))
        return block(zero, products)


@dataclass(frozen=True)
class LocalArray(Stmt):
    """A workspace of compile-time ``size`` (kept in registers or on the stack), filled with ``init``.
    ``vector``: held as vectors of that many lanes (a register tile); only ``vector`` loops index it, at
    positions that are multiples of ``vector``. The values are the same either way."""
    name: str
    type: str
    size: int
    init: Expr
    vector: int = 0
    sums: int = 0  # held as ``sums``-lane partial sums: a vector loop adds a vector into an entry (its
    #              index not depending on the loop), a read outside vector loops adds the lanes up
    combine: str = "add"  # of ``sums``: "add", or "max" (partial maxima: stores with op "max", a read takes
    #                       the lanes' max; a store outside vector loops takes part in every lane)
    pinned: bool = False  # (``vector``) each vector stored is kept in a register, not re-read from where it
    #                       came: a hint (GCC otherwise folds a load with several uses into each use as a memory
    #                       operand, a load per use)


@dataclass(frozen=True)
class SumLanes(Stmt):
    """A new local array ``name`` holding the totals of the partial sums ``array`` (a ``LocalArray`` with
    ``sums``), entry by entry: the same values as reading each entry, but all entries at once, so that a renderer
    can add the lanes of many vectors in one transposed tree (fewer shuffles per entry than one tree each)."""
    name: str
    array: str
    type: str
    size: int


@dataclass(frozen=True)
class Alloc(Stmt):
    """A workspace of run-time ``size`` elements on the heap, zero-filled; freed at the end of its scope.
    Inside a parallel loop's ``setup`` it is private to each thread."""
    name: str
    type: str
    size: Expr


@dataclass(frozen=True)
class Sort(Stmt):
    """Sort ``array[lo:hi]`` ascending in place. The keys are distinct, each in ``[0, bound)``; ``scratch`` names
    an i64 array at least ``hi - lo`` long that the sort may use (a radix sort: comparison sorts mispredict; or,
    keys dense in their range, a bitmap of it)."""
    array: str
    lo: Expr
    hi: Expr
    bound: Expr
    scratch: str


@dataclass(frozen=True)
class SetBit(Stmt):
    """Set bit ``index`` of the bitmap held in the i64 array ``array`` (word ``index >> 6``, bit ``index & 63``)."""
    array: str
    index: Expr


#: distinct keys in [0, bound) are dense where there are more than this many and at least one per ``spread`` 64-bit
#: words of the range: there a bitmap read in order sorts them (the C++ ``scorch_sort``, spread 1: its bitmap must
#: fit in the keys' own scratch) and a row is marked in one (``coiterate``'s ``bitmap_row``, whose bitmap has all
#: its words). The rule: ``dense_keys``, and the prelude's ``SCORCH_BITMAP_MIN_KEYS``
BITMAP_MIN_KEYS = 32


def dense_keys(n: Expr, bound: Expr, spread: int = 1) -> Expr:
    """Whether ``n`` distinct keys in [0, ``bound``) are dense (``BITMAP_MIN_KEYS``): more than that many, and at
    least one per ``spread`` 64-bit words of the range."""
    return binary("and", binary("gt", n, Const(BITMAP_MIN_KEYS)),
                  binary("ge", binary("mul", n, Const(64 * spread)), bound))


@dataclass(frozen=True)
class BitKeys(Stmt):
    """The positions of the set bits of ``bits[0:words]`` (a bitmap in an i64 array, as ``SetBit`` sets), ascending,
    into ``keys`` (room for ``cap`` of them), their number into the variable ``count``; the words read are zeroed.
    Entries of ``keys`` past the count and below ``cap`` may be overwritten (the C++ helper writes a word's first
    4 keys unconditionally)."""
    bits: str
    words: Expr
    keys: str
    cap: Expr
    count: Var


@dataclass(frozen=True)
class BitCount(Stmt):
    """The number of set bits of ``bits[0:words]`` into the variable ``count``; the words read are zeroed."""
    bits: str
    words: Expr
    count: Var


@dataclass(frozen=True)
class Parallel:
    """How a loop runs in parallel. ``kind="static"``: equal iteration counts per thread. ``kind="nnz"``:
    iterations balanced by the work under them, read from the non-decreasing ``pos`` array (positions
    ``pos[lo]..pos[hi]``), so that a few long rows do not serialize a thread. ``kind="dynamic"``: ``chunk``
    iterations at a time to whichever thread comes free (a shared counter), for iterations of even work on
    threads that other processes may slow unevenly."""
    kind: str = "static"
    pos: Optional[str] = None
    setup: "Block" = None  # statements each thread runs once before its iterations (private workspaces)
    #: (``dynamic``, ``static`` with a ``setup``) iterations handed to a thread at a time, as threads come free
    chunk: int = 16


@dataclass(frozen=True)
class For(Stmt):
    """``for var in [lo, hi)``. ``simd``: the iterations may run as vector lanes, with the scalar updates
    named in ``reductions`` (``(op, var name)`` pairs) combined across lanes (so reassociated). ``vector``:
    the code generator emits the body on explicit vectors (loads and stores contiguous in ``var``)."""
    var: Var
    lo: Expr
    hi: Expr
    body: Block
    parallel: Optional[Parallel] = None
    simd: bool = False
    reductions: tuple = ()
    vector: int = 0       # iterations run ``vector`` lanes at a time (hi - lo is a multiple): same results
    unroll: bool = False  # a short constant trip count, unrolled (so a register tile stays in registers)
    tail: bool = False    # (a vector loop) hi - lo need not be a multiple: in the last, partial vector the lanes
    #                       at or past hi are off (they read no memory and add nothing to partial sums)
    lead: Optional[Expr] = None  # (a tail loop) the trip count expected, the same in every run of the loop in a
    #                       call: the code generator runs up to 3 partial vectors before the loop, as many as it
    #                       fills, with no test of hi (a hint: the results are the same whatever its value)


@dataclass(frozen=True)
class While(Stmt):
    cond: Expr
    body: Block


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: Block
    orelse: Block = field(default_factory=Block)


@dataclass(frozen=True)
class Param:
    """A kernel argument: an array (pointer to ``type`` elements) or a scalar of ``type``."""
    name: str
    kind: str  # "array" | "scalar"
    type: str
    output: bool = False


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple
    body: Block

    def param(self, name) -> Param:
        return next(p for p in self.params if p.name == name)


def block(*stmts) -> Block:
    """A Block from statements, flattening nested Blocks and dropping Nones."""
    out = []
    for s in stmts:
        if s is None:
            continue
        if isinstance(s, Block):
            out.extend(s.stmts)
        elif isinstance(s, (list, tuple)):
            out.extend(block(*s).stmts)
        else:
            out.append(s)
    return Block(tuple(out))


def mark_simd(stmt, is_dense_index=lambda name: True):
    """Mark innermost loops (no loop inside) over dense indices as ``simd``, with their scalar reductions."""
    if isinstance(stmt, Block):
        return Block(tuple(mark_simd(s, is_dense_index) for s in stmt.stmts))
    if isinstance(stmt, For):
        body = mark_simd(stmt.body, is_dense_index)
        if not _has_loop(body) and is_dense_index(stmt.var.name):
            reds = tuple(sorted({(s.op, s.var.name) for s in _walk(body) if isinstance(s, Assign) and s.op}))
            return replace(stmt, body=body, simd=True, reductions=reds)
        return replace(stmt, body=body)
    if isinstance(stmt, If):
        return replace(stmt, then=mark_simd(stmt.then, is_dense_index), orelse=mark_simd(stmt.orelse, is_dense_index))
    if isinstance(stmt, While):
        return replace(stmt, body=mark_simd(stmt.body, is_dense_index))
    return stmt


def walk(stmt):
    """``stmt`` and every statement nested in it, parents first."""
    yield stmt
    for child in _children(stmt):
        yield from walk(child)


_walk = walk


def _children(stmt):
    if isinstance(stmt, Block):
        return stmt.stmts
    if isinstance(stmt, (For, While)):
        return (stmt.body,)
    if isinstance(stmt, If):
        return (stmt.then, stmt.orelse)
    return ()


def _has_loop(stmt):
    return any(isinstance(s, (For, While)) for s in _walk(stmt))


def expressions(s):
    """The expressions of the statement ``s`` itself (its value, index, condition, bounds, initial value)."""
    for f in ("value", "index", "cond", "lo", "hi", "init", "lead", "dst_at", "dst_stride", "src_at", "src_stride",
              "rows", "cols"):
        e = getattr(s, f, None)
        if isinstance(e, Expr):
            yield e


def loads(e):
    """Every ``Load`` in the expression ``e``, the loads inside indices too (outer first)."""
    if isinstance(e, Load):
        yield e
    for c in _parts(e).values():
        yield from loads(c)


def accesses(s):
    """``(array, index)`` of every store and load in the statement ``s`` itself (not in nested statements)."""
    out = [(s.array, s.index)] if isinstance(s, Store) else \
        [(s.dst, s.dst_at), (s.src, s.src_at)] if isinstance(s, Transpose) else \
        [(s.a, s.a_at), (s.c, s.c_at)] if isinstance(s, TileRow) else []
    for e in expressions(s):
        out += [(ld.array, ld.index) for ld in loads(e)]
    return out


def _parts(e) -> dict:
    """The sub-expressions of ``e`` by field name."""
    return {f.name: getattr(e, f.name) for f in fields(e) if isinstance(getattr(e, f.name), Expr)}


def uses(e) -> set:
    """The variable names an expression reads."""
    if isinstance(e, Var):
        return {e.name}
    return set().union(set(), *(uses(c) for c in _parts(e).values()))


def depends(e, var) -> bool:
    """Whether the expression ``e`` reads the variable named ``var``."""
    if isinstance(e, Var):
        return e.name == var
    return any(depends(c, var) for c in _parts(e).values())


def substitute(e, env: dict):
    """The expression ``e`` with the variables named in ``env`` replaced by their expressions."""
    if isinstance(e, Var):
        return env.get(e.name, e)
    changes = {f: substitute(c, env) for f, c in _parts(e).items()}
    return replace(e, **changes) if changes else e


def gathered(index, var):
    """The load of positions a vector loop over ``var`` gathers through where ``index`` is one read contiguously
    from an integer array (``crd[p]``, widened or not: SpMV's ``x[crd[p]]``), else None."""
    at = index.a if isinstance(index, Cast) else index
    if isinstance(at, Load) and at.type in INTS and coefficient(at.index, var) == 1:
        return at
    return None


def coefficient(e, var):
    """The coefficient of ``var`` in the integer expression ``e`` when ``e`` is affine in it, else None."""
    if not depends(e, var):
        return 0
    if isinstance(e, Var):
        return 1
    if isinstance(e, Binary) and e.op in ("add", "sub"):
        a, b = coefficient(e.a, var), coefficient(e.b, var)
        return None if a is None or b is None else a + b if e.op == "add" else a - b
    if isinstance(e, Binary) and e.op == "mul":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const) and not depends(y, var):
                c = coefficient(x, var)
                return None if c is None else c * int(y.value)
    return None
