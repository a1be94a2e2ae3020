"""Loop IR -> C++ source (OpenMP), a plain ``extern "C"`` function that takes raw pointers and scalars.

Only identifiers the lowering made reach the source; each is checked against a strict pattern anyway.
ABI: arrays are ``T*`` (``const`` unless output), integer and boolean scalars ``int64_t``, float scalars
``double``; ``argtypes(kernel)`` gives the matching ctypes signature.
"""
from __future__ import annotations

import ctypes
import re

from ... import loopir as L
from .. import runtime
from ..target import CPU
from . import amx
from .prelude import DEPENDS, HELPERS, VECTOR_BYTES

CTYPE = {"bool": "bool", "i8": "int8_t", "i16": "int16_t", "i32": "int32_t", "i64": "int64_t", "f32": "float", "f64": "double", "bf16": "scorch_bf16",
         "f16": "_Float16"}
_FLOATS = ("f32", "f64") + L.NARROW  # (scalars of these pass as double)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&&", "or": "||",
        "add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "/", "mod": "%"}

PRELUDE = """#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif
"""


def _includes(body: str) -> str:
    """Only the headers and helpers the kernel uses: each standard header costs compile time."""
    inc = []
    if any(f"std::{f}" in body for f in ("abs", "sqrt", "sin", "tanh", "exp", "log")) or "NAN" in body or \
            "INFINITY" in body:
        inc.append("#include <cmath>\n")
    needed = {dep for name, dep in DEPENDS.items() if name in body}
    inc += [text for name, text in HELPERS.items() if name in body or name in needed]
    return "".join(inc)


def ident(name: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"refusing to emit identifier {name!r}")
    return name


def load(kernel: L.Kernel):
    """``kernel`` generated and compiled (``runtime.load``: built once, then loaded from the disk cache)."""
    return runtime.load(generate(kernel), kernel.name, argtypes(kernel))


def call(kernel: L.Kernel, compiled, values: dict) -> None:
    """Run ``compiled`` (``load(kernel)``) on ``values`` by ``kernel``'s parameter names, tensors by pointer."""
    compiled(*[v.data_ptr() if hasattr(v, "data_ptr") else v for v in (values[p.name] for p in kernel.params)])


def argtypes(kernel: L.Kernel) -> list:
    out = []
    for p in kernel.params:
        if p.kind == "array":
            out.append(ctypes.c_void_p)
        else:
            out.append(ctypes.c_double if p.type in _FLOATS else ctypes.c_int64)
    return out


def signature(kernel: L.Kernel, restrict=True, ctype=None) -> tuple[list, list]:
    """The parameter declarations of ``kernel`` in the ABI above, and the statements that give each scalar
    its own type (``const int32_t n = (int32_t)n_arg;``). ``ctype``: the C name of each loop-IR type (``CTYPE``
    unless given: CUDA names its 16-bit types otherwise)."""
    names = ctype or CTYPE
    params, casts = [], []
    for p in kernel.params:
        n = ident(p.name)
        if p.kind == "array":
            const = "" if p.output else "const "
            params.append(f"{const}{names[p.type]}*{' __restrict__' if restrict else ''} {n}")
        else:
            abi = "double" if p.type in _FLOATS else "int64_t"
            params.append(f"{abi} {n}_arg")
            casts.append(f"  const {names[p.type]} {n} = ({names[p.type]}){n}_arg;")
    return params, casts


def generate(kernel: L.Kernel) -> str:
    """The complete translation unit for ``kernel``."""
    params, casts = signature(kernel)
    narrow = {p.name: p.type for p in kernel.params if p.type in L.NARROW}
    emitter = _Emitter(any(p.name == "nthreads" for p in kernel.params), narrow)
    emitter.pairs = _lane_pairs(kernel.body, narrow, CPU.lanes("f32"))
    body = emitter.block(kernel.body, 1)
    sig = ",\n    ".join(params)
    text = "\n".join(casts + body)
    return (PRELUDE + _includes(sig + text) + f'\nextern "C" void {ident(kernel.name)}(\n    {sig})\n{{\n'
            + text + "\n}\n" + _packed(kernel))


def _packed(kernel: L.Kernel) -> str:
    """``<name>_packed(const int64_t* a)``: the kernel with its arguments in one buffer of 8-byte words (pointers
    and integers as int64, floats as the bits of a double), so that Python converts one argument, not one per
    parameter (``runtime.Kernel.packed``; ``pack_format`` gives the buffer's ``struct`` format)."""
    name, words = ident(kernel.name), []
    for i, p in enumerate(kernel.params):
        if p.kind == "array":
            words.append(f"({'' if p.output else 'const '}{CTYPE[p.type]}*)(intptr_t)a[{i}]")
        elif p.type in _FLOATS:
            words.append(f"__builtin_bit_cast(double, a[{i}])")
        else:
            words.append(f"a[{i}]")
    return f'extern "C" void {name}_packed(const int64_t* a) {{\n  {name}({", ".join(words)});\n}}\n'


def pack_format(kernel: L.Kernel) -> str:
    """The ``struct`` format of ``<name>_packed``'s buffer (little-endian words: ``q`` integer or pointer, ``d``
    float)."""
    return "<" + "".join("d" if p.kind != "array" and p.type in _FLOATS else "q" for p in kernel.params)


#: the parts of a parallel loop balanced by positions (``Parallel("nnz")``) per thread, handed out dynamically
PARTS_PER_THREAD = 8


class _Emitter:
    def __init__(self, threads: bool, narrow=frozenset()):
        self.n = 0
        self.narrow = narrow   # the arrays of a 16-bit float type (name -> type)
        self.pairs = False     # bfloat16 vectors in lane pairs (``_lane_pairs``)
        self.threads = " num_threads(nthreads)" if threads else ""
        self.vec = None        # inside a ``vector`` loop: (loop variable name, lanes, element type)
        self.mask = None       # in a ``tail`` loop's last vector: the variable counting the lanes that are on
        self.vec_arrays = {}  # local arrays held as vectors: name -> lanes
        self.pinned = set()  # vector local arrays whose stores stay in registers (``LocalArray.pinned``)
        self.sum_arrays = {}  # local arrays held as vector partial results: name -> ("add" or "max", type, lanes)

    def fresh(self, base):
        self.n += 1
        return f"{base}_{self.n}"

    def block(self, b, depth):
        out = []
        for s in b.stmts:
            out.extend(self.stmt(s, depth))
        return out

    def stmt(self, s, d):
        pad = "  " * d
        if isinstance(s, L.Let):
            return [f"{pad}const {CTYPE[s.var.type]} {ident(s.var.name)} = {self.expr(s.value)};"]
        if isinstance(s, L.Decl):
            return [f"{pad}{CTYPE[s.var.type]} {ident(s.var.name)} = {self.expr(s.value)};"]
        if isinstance(s, L.Assign):
            return [f"{pad}{self.update(ident(s.var.name), s.op, self.expr(s.value))};"]
        if isinstance(s, L.Store) and self.vec and isinstance(s.value, L.ExpandPairDot):
            e, (var, lanes, _) = s.value, self.vec
            if s.op != "add" or e.lane != L.Var(var) or lanes != L.BITS or self.mask or \
                    L.coefficient(e.xi, var) != 2 or L.depends(e.start, var) or L.depends(e.bits, var):
                raise ValueError("an expanded pair dot is added into a vector of 16 pairs, its x pairs contiguous")
            target = f"{ident(s.array)}[{self.expr(s.index)}]" if s.array in self.sum_arrays else \
                self.vector_ref(s.array, s.index, const=False)
            x0 = self.expr(L.substitute(e.xi, {var: L.Const(0)}))
            return [f"{pad}{target} = scorch_expand_pair_dot({target}, &{ident(e.vals)}[{self.expr(e.start)}], "
                    f"(uint32_t)({self.expr(e.bits)}), &{ident(e.x)}[{x0}]);"]
        if isinstance(s, L.Store) and s.array in self.sum_arrays:
            combine, t, lanes = self.sum_arrays[s.array]
            target, value = f"{ident(s.array)}[{self.expr(s.index)}]", self.expr(s.value)
            if s.op != combine:
                raise ValueError(f"partial {combine}s {s.array} only take {combine}")
            if self.vec and self.vec[1] != lanes:
                raise ValueError(f"partial {combine}s {s.array} in {lanes} lanes, in a loop of {self.vec[1]}")
            vt, pre = _vectors(t, lanes)
            if combine == "add":
                if not self.vec:
                    raise ValueError(f"partial sums {s.array} are added to in vector loops only")
                return [f"{pad}{target} += {f'{pre}keep({value}, {self.mask})' if self.mask else value};"]
            value = value if self.vec else f"{vt}{{}} + ({value})"  # (a scalar takes part in every lane)
            return [f"{pad}{{ const {vt} u_ = {value}; {target} = u_ > {target} ? u_ : {target}; }}"]
        if isinstance(s, L.Store) and self.mask:
            raise ValueError(f"a store into {s.array} in the partial last vector of a loop")
        if isinstance(s, L.Store) and self.vec and L.depends(s.index, self.vec[0]) and s.array in self.narrow:
            if s.op is not None or self.vec[2] != "f32":
                raise ValueError(f"a vector {s.op or 'store'} into the 16-bit array {s.array}")
            self.vector_ref(s.array, s.index, const=False)  # (checks the access is contiguous)
            if self.pairs:
                return [f"{pad}scorch_narrow_pair(&{ident(s.array)}[{self.expr(s.index)}], {self.expr(s.value)},"
                        f" {ident(self.vec[0])});"]
            return [f"{pad}scorch_narrow(&{ident(s.array)}[{self.expr(s.index)}], {self.expr(s.value)});"]
        if isinstance(s, L.Store) and self.vec and isinstance(s.value, L.PairDot):
            e = s.value
            if s.op != "add" or L.coefficient(e.i, self.vec[0]) != 1 or L.depends(e.j, self.vec[0]) or self.mask:
                raise ValueError("a pair dot is added into a vector, its pairs contiguous in the loop")
            target = self.vector_ref(s.array, s.index, const=False)
            if 0 <= e.lane < 4:  # (the pair from its group of four: ``codegen.bf16``)
                return [f"{pad}{target} = scorch_pair_dot4<{e.lane}>({target}, {self.pair_ref(e.x, e.i)}, "
                        f"&{ident(e.w)}[({self.expr(e.j)}) - {2 * e.lane}]);"]
            return [f"{pad}{target} = scorch_pair_dot({target}, &{ident(e.x)}[2 * ({self.expr(e.i)})], "
                    f"&{ident(e.w)}[{self.expr(e.j)}]);"]
        if isinstance(s, L.Store) and self.vec and L.depends(s.index, self.vec[0]):
            target = self.vector_ref(s.array, s.index, const=False)
            # (a pinned workspace: an empty asm that takes the vector in a register and may change it, so that
            #  its uses cannot go back to the load: ``prelude.PIN``)
            pin = [f'{pad}scorch_pin({target});'] if s.array in self.pinned else []
            return [f"{pad}{self.update(target, s.op, self.expr(s.value))};"] + pin
        if isinstance(s, L.Store):
            target = f"{ident(s.array)}[{self.expr(s.index)}]"
            if s.atomic and s.array in self.narrow:
                if s.op != "add":
                    raise ValueError(f"an atomic {s.op} into the 16-bit array {s.array}")
                return [f"{pad}scorch_atomic_add(&{target}, {self.expr(s.value)});"]
            line = f"{pad}{self.update(target, s.op, self.expr(s.value))};"
            return ([f"{pad}#pragma omp atomic"] if s.atomic else []) + [line]
        if isinstance(s, L.Prefetch):
            hint = "" if s.locality == 3 else f", 0, {s.locality}"
            return [f"{pad}__builtin_prefetch(&{ident(s.array)}[{self.expr(s.index)}]{hint});"]
        if isinstance(s, L.LocalArray) and s.sums:
            n = ident(s.name)
            if s.type not in ("f32", "f64") or s.sums not in (CPU.lanes(s.type), CPU.sum_lanes(s.type)):
                raise ValueError(f"partial sums {s.name}: {s.type} in {s.sums} lanes")
            if s.combine not in ("add", "max") or (s.combine == "max" and s.sums != CPU.lanes(s.type)):
                raise ValueError(f"partial results {s.name}: unknown combination {s.combine!r} in {s.sums} lanes")
            self.sum_arrays[s.name] = (s.combine, s.type, s.sums)
            vt = _vectors(s.type, s.sums)[0]
            if isinstance(s.init, L.Const) and s.init.value == 0:
                return [f"{pad}{vt} {n}[{int(s.size)}] = {{}};"]
            return self.vector_array(n, vt, int(s.size), s.init, pad)
        if isinstance(s, L.Transpose):  # (``codegen.transpose``: square tiles by vector shuffles)
            if self.vec:
                raise ValueError(f"a transpose into {s.dst} inside a vector loop")
            sizes = [f"(int64_t)({self.expr(e)})" for e in (s.rows, s.cols, s.dst_stride, s.src_stride)]
            if s.pairs:  # (pairs as 32-bit words: the float tiles move bits; the barriers keep the 16-bit
                #           accesses before and after in their order, which type-based aliasing would not)
                if s.stype != s.dtype or s.stype not in L.NARROW:
                    raise ValueError(f"a transpose of pairs into {s.dst} copies 16-bit values as they are")
                args = [f"(float*)&{ident(s.dst)}[2 * ({self.expr(s.dst_at)})]",
                        f"(const float*)&{ident(s.src)}[2 * ({self.expr(s.src_at)})]"] + sizes
                barrier = f'{pad}__asm__ volatile("" ::: "memory");'
                return [barrier, f"{pad}scorch_transpose({', '.join(args)});", barrier]
            args = [f"&{ident(s.dst)}[{self.expr(s.dst_at)}]", f"&{ident(s.src)}[{self.expr(s.src_at)}]"] + sizes
            return [f"{pad}scorch_transpose({', '.join(args)});"]
        if isinstance(s, L.TileConfig):
            return [pad + amx.config(s.cols, s.depth, s.tiles, s.mode, self.fresh("tiles"))]
        if isinstance(s, L.TileRow):
            if self.vec or s.c in self.vec_arrays or s.c in self.sum_arrays:
                raise ValueError(f"a tile row stores into the plain array {s.c}, outside vector loops")
            return [f"{pad}{{"] + amx.row(self.expr(s.lo), self.expr(s.hi), ident(s.var.name),
                                          f"&{ident(s.a)}[{self.expr(s.a_at)}]", self.expr(s.a_stride),
                                          f"&{ident(s.b)}[2 * ({self.expr(s.b_at)})]", s.cols,
                                          f"&{ident(s.c)}[{self.expr(s.c_at)}]", s.c_stride, s.tiles, pad + "  ") + \
                [f"{pad}}}"]
        if isinstance(s, L.SumLanes):
            n, src = ident(s.name), ident(s.array)
            if self.sum_arrays.get(s.array, ("",))[0] != "add" or s.type not in ("f32", "f64") or \
                    self.sum_arrays[s.array][2] != CPU.lanes(s.type):
                raise ValueError(f"lane sums of {s.array}: not partial sums of a float type")
            lanes = CPU.lanes(s.type)
            if s.size == lanes:
                return [f"{pad}{CTYPE[s.type]} {n}[{lanes}] __attribute__((aligned({VECTOR_BYTES})));",
                        f"{pad}scorch_tsum({src}, {n});"]
            i = self.fresh("w")
            return [f"{pad}{CTYPE[s.type]} {n}[{int(s.size)}];",
                    f"{pad}for (int64_t {i} = 0; {i} < {int(s.size)}; ++{i}) {n}[{i}] = scorch_hsum({src}[{i}]);"]
        if isinstance(s, L.LocalArray) and s.vector:
            n, lanes = ident(s.name), s.vector
            if s.size % lanes or s.type not in ("f32", "f64"):
                raise ValueError(f"vector workspace {s.name}: {s.size} {s.type} entries in vectors of {lanes}")
            self.vec_arrays[s.name] = lanes
            if s.pinned:
                self.pinned.add(s.name)
            return self.vector_array(n, _vectors(s.type, lanes)[0], s.size // lanes, s.init, pad)
        if isinstance(s, L.LocalArray):
            n, t = ident(s.name), CTYPE[s.type]
            i = self.fresh("w")
            return [f"{pad}{t} {n}[{int(s.size)}];",
                    f"{pad}for (int64_t {i} = 0; {i} < {int(s.size)}; ++{i}) {n}[{i}] = {self.expr(s.init)};"]
        if isinstance(s, L.Alloc):
            n, t = ident(s.name), CTYPE[s.type]
            buf = self.fresh("buf")
            return [f"{pad}scorch_buf {buf}((size_t)({self.expr(s.size)}), sizeof({t}));",
                    f"{pad}{t}* __restrict__ {n} = static_cast<{t}*>({buf}.p);"]
        if isinstance(s, L.Sort):
            a, lo, hi = ident(s.array), self.expr(s.lo), self.expr(s.hi)
            # merges often produce the entries in order already: checking is linear, sorting is not
            n = f"({hi}) - ({lo})"
            return [f"{pad}if (!scorch_is_sorted({a} + {lo}, {n}))"
                    f" scorch_sort({a} + {lo}, {n}, {self.expr(s.bound)}, {ident(s.scratch)});"]
        if isinstance(s, L.SetBit):
            return [f"{pad}scorch_set_bit({ident(s.array)}, {self.expr(s.index)});"]
        if isinstance(s, L.BitKeys):
            return [f"{pad}{ident(s.count.name)} = scorch_bit_keys({ident(s.bits)}, {self.expr(s.words)}, "
                    f"{ident(s.keys)}, {self.expr(s.cap)});"]
        if isinstance(s, L.BitCount):
            return [f"{pad}{ident(s.count.name)} = scorch_bit_count({ident(s.bits)}, {self.expr(s.words)});"]
        if isinstance(s, L.For):
            return self.loop(s, d)
        if isinstance(s, L.While):
            return [f"{pad}while ({self.expr(s.cond)}) {{"] + self.block(s.body, d + 1) + [f"{pad}}}"]
        if isinstance(s, L.If):
            out = [f"{pad}if ({self.expr(s.cond)}) {{"] + self.block(s.then, d + 1)
            if s.orelse.stmts:
                out += [f"{pad}}} else {{"] + self.block(s.orelse, d + 1)
            return out + [f"{pad}}}"]
        if isinstance(s, L.Block):
            return [f"{pad}{{"] + self.block(s, d + 1) + [f"{pad}}}"]
        raise TypeError(f"unknown statement {type(s).__name__}")

    def vector_array(self, n, vt, count, init, pad):
        """The declaration of ``count`` vectors ``n`` of type ``vt``, each lane set to ``init``."""
        i = self.fresh("w")
        return [f"{pad}{vt} {n}[{count}];",
                f"{pad}for (int64_t {i} = 0; {i} < {count}; ++{i}) {n}[{i}] = {vt}{{}} + {self.expr(init)};"]

    def loop(self, s, d):
        pad, v = "  " * d, ident(s.var.name)
        lo, hi = self.expr(s.lo), self.expr(s.hi)
        if s.vector:
            if s.parallel is not None or self.vec:
                raise ValueError("a vector loop is neither parallel nor nested in another vector loop")
            self.vec = (s.var.name, s.vector, _vector_type(s.body))
            end, left = self.fresh("end"), self.fresh("left")
            try:
                body = self.block(s.body, d + 1 + s.tail)
                self.mask = left  # (the last, partial vector of a ``tail`` loop: lanes from ``left`` on are off)
                last = self.block(s.body, d + 2) if s.tail else []
                lead = self.lead(s, v, end, left, d) if s.lead is not None else []
            finally:
                self.vec, self.mask = None, None
            if not s.tail:
                return [f"{pad}#pragma GCC unroll 16",
                        f"{pad}for (int64_t {v} = {lo}; {v} < {hi}; {v} += {s.vector}) {{"] + body + [f"{pad}}}"]
            return [f"{pad}{{", f"{pad}  const int64_t {end} = {hi};", f"{pad}  int64_t {v} = {lo};"] + lead + [
                    f"{pad}  for (; {v} + {s.vector} <= {end}; {v} += {s.vector}) {{"] + body + [
                    f"{pad}  }}", f"{pad}  if ({v} < {end}) {{",
                    f"{pad}    const int64_t {left} = {end} - {v};"] + last + [f"{pad}  }}", f"{pad}}}"]
        if s.parallel is None and s.unroll:
            return [f"{pad}#pragma GCC unroll 64",
                    f"{pad}for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{"] + self.block(s.body, d + 1) + [f"{pad}}}"]
        if s.parallel is None:
            simd = []
            if s.simd:
                reds = "".join(f" reduction({'+' if op == 'add' else op}:{ident(v)})" for op, v in s.reductions)
                simd = [f"{pad}#pragma omp simd{reds}"]
            return simd + [f"{pad}for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{"] + self.block(s.body, d + 1) + [f"{pad}}}"]
        setup = self.block(s.parallel.setup, d + 1) if s.parallel.setup is not None else []
        if s.parallel.kind == "static":
            if not setup:
                return [f"{pad}#pragma omp parallel for schedule(static){self.threads}",
                        f"{pad}for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{"] + self.block(s.body, d + 1) \
                    + [f"{pad}}}"]
            return [f"{pad}#pragma omp parallel{self.threads}", f"{pad}{{"] + setup + [
                f"{pad}  #pragma omp for schedule(dynamic, {int(s.parallel.chunk)})",
                f"{pad}  for (int64_t {v} = {lo}; {v} < {hi}; ++{v}) {{"] + self.block(s.body, d + 2) + \
                [f"{pad}  }}", f"{pad}}}"]
        if s.parallel.kind == "dynamic":
            return self.dynamic(s, v, lo, hi, setup, d)
        if s.parallel.kind != "nnz":
            raise ValueError(f"unknown parallel kind {s.parallel.kind!r}")
        # Balance rows by rows + positions under them: f(r) = (pos[r] - pos[lo]) + (r - lo) is increasing, so
        # part k of n takes the rows where f falls in [total * k / n, total * (k + 1) / n). PARTS_PER_THREAD parts
        # a thread, handed out as threads come free: a thread slowed by another process (or a core still spun
        # by another OpenMP runtime's threads) takes fewer parts instead of holding up the others at the end.
        # (A part's first row: ``scorch_first_row``, prelude.FIRST_ROW.)
        # The parts are handed out through a shared counter (an atomic increment), not ``omp for
        # schedule(dynamic)``: with the same parts, libgomp's dynamic loop cost ~10 us a call more (SpMV uniform
        # 20k, 2 threads, interleaved medians: 155 -> 141 us; ``omp for schedule(static)`` cost the same 10 us).
        pos = ident(s.parallel.pos)
        a, b, part, parts, tot, nxt = (self.fresh(x) for x in ("lo", "hi", "part", "parts", "total", "next"))
        p2, p3 = pad + "  ", pad + "    "
        return [
            f"{pad}{{",
            f"{p2}int64_t {nxt} = 0;",
            f"{p2}#pragma omp parallel{self.threads}",
            f"{p2}{{",
        ] + ["  " + line for line in setup] + [
            f"{p3}const int64_t {a} = {lo}, {b} = {hi};",
            f"{p3}const int64_t {parts} = omp_get_num_threads() > 1 ? omp_get_num_threads() * {PARTS_PER_THREAD}"
            f" : 1;",
            f"{p3}const int64_t {tot} = ((int64_t){pos}[{b}] - (int64_t){pos}[{a}]) + ({b} - {a});",
            f"{p3}for (;;) {{",
            f"{p3}  int64_t {part};",
            f"{p3}  #pragma omp atomic capture",
            f"{p3}  {part} = {nxt}++;",
            f"{p3}  if ({part} >= {parts}) break;",
            f"{p3}  const int64_t r0 = scorch_first_row({pos}, {a}, {b}, {tot}, {part}, {parts}),"
            f" r1 = scorch_first_row({pos}, {a}, {b}, {tot}, {part} + 1, {parts});",
            f"{p3}  for (int64_t {v} = r0; {v} < r1; ++{v}) {{",
        ] + self.block(s.body, d + 4) + [f"{p3}  }}", f"{p3}}}", f"{p2}}}", f"{pad}}}"]

    def dynamic(self, s, v, lo, hi, setup, d):
        """``Parallel("dynamic")``: the iterations handed out ``chunk`` at a time through a shared counter (an
        atomic increment, cheaper than ``omp for schedule(dynamic)``, see the ``nnz`` kind), so that a thread
        slowed by another process takes fewer of them instead of holding up the others at the end."""
        pad = "  " * d
        a, b, part, nxt, end = (self.fresh(x) for x in ("lo", "hi", "part", "next", "end"))
        chunk = int(s.parallel.chunk)
        p2, p3 = pad + "  ", pad + "    "
        return [f"{pad}{{", f"{p2}int64_t {nxt} = 0;", f"{p2}#pragma omp parallel{self.threads}", f"{p2}{{"] + \
            ["  " + line for line in setup] + [
            f"{p3}const int64_t {a} = {lo}, {b} = {hi};",
            f"{p3}for (;;) {{",
            f"{p3}  int64_t {part};",
            f"{p3}  #pragma omp atomic capture",
            f"{p3}  {part} = {nxt}++;",
            f"{p3}  if ({a} + {part} * {chunk} >= {b}) break;",
            f"{p3}  const int64_t {end} = {a} + ({part} + 1) * {chunk} < {b} ? {a} + ({part} + 1) * {chunk} : {b};",
            f"{p3}  for (int64_t {v} = {a} + {part} * {chunk}; {v} < {end}; ++{v}) {{",
        ] + self.block(s.body, d + 4) + [f"{p3}  }}", f"{p3}}}", f"{p2}}}", f"{pad}}}"]

    def lead(self, s, v, end, left, d):
        """A tail loop's ``For.lead`` vectors: the expected trip count ``e`` (a call constant) rounded up to
        vectors, at most 3, run as partial vectors before the loop whatever the row's length (a vector past the
        row's end has no lane on: it reads nothing and adds nothing). A row of up to that many vectors then takes
        no branch on its length, whose outcome the predictor misses on rows of varying length, and the tests on
        the count, the same in every row, are predicted. Rows of ~20 entries (SpMV, 8 lanes, Intel Xeon, one
        process, by hand): 148 -> 137 us; ~4 entries: 505 -> 348 us."""
        pad = "  " * (d + 1)
        n = self.fresh("lead")

        def vector(k):  # one partial vector, ``k`` levels in
            p = pad + "  " * k
            return [f"{p}{{", f"{p}  const int64_t {left} = {end} - {v};"] + self.block(s.body, d + k + 2) + [
                f"{p}}}", f"{p}{v} += {s.vector};"]
        third = [f"{pad}  if ({n} >= 3) {{"] + vector(2) + [f"{pad}  }}"]
        return [f"{pad}const int64_t {n} = ({self.expr(s.lead)} + {s.vector - 1}) / {s.vector};"] + vector(0) + [
            f"{pad}if ({n} >= 2) {{"] + vector(1) + third + [f"{pad}}}"]

    def pair_ref(self, array, index):
        """A pointer to pair ``index`` of the bfloat16 pairs ``array``; an index ``a + b`` as ``&array[2 * a] + 2 * b``:
        where ``a`` does not change in the loop (a tile's start, ``weights_tiled``), that pointer stays in a register
        (``scorch_pair_base``) and each access is one address (base + scaled index), not an add and the address."""
        if isinstance(index, L.Binary) and index.op == "add":
            return f"(scorch_pair_base(&{ident(array)}[2 * ({self.expr(index.a)})]) + 2 * ({self.expr(index.b)}))"
        return f"&{ident(array)}[2 * ({self.expr(index)})]"

    def vector_ref(self, array, index, const):
        """The vector at ``array[index]`` (lanes ``index .. index + lanes - 1``) inside a vector loop."""
        var, lanes, t = self.vec
        if L.coefficient(index, var) != 1:
            raise ValueError(f"vector access to {array} is not contiguous in the vector loop")
        if array in self.vec_arrays:
            if self.vec_arrays[array] != lanes:
                raise ValueError(f"vectors {array} of {self.vec_arrays[array]} lanes in a loop of {lanes}")
            return f"{ident(array)}[({self.expr(index)}) / {lanes}]"
        return f"(*({'const ' if const else ''}{_vectors(t, lanes)[0]}u*)(&{ident(array)}[{self.expr(index)}]))"

    def vector_load(self, e):
        """The vector of ``e``'s lanes inside a vector loop: a contiguous load, or a gather where the position is
        read from an integer array contiguously (``x[crd[p]]``); in a partial last vector, the lanes that are off
        read nothing (and hold 0)."""
        var, lanes, t = self.vec
        pre = _vectors(t, lanes)[1]
        at = L.gathered(e.index, var)
        if at is not None and e.array not in self.sum_arrays and e.array not in self.vec_arrays:
            if e.type != t:
                raise ValueError(f"{e.array} gathered as {t} vectors holds {e.type}")
            args = f"{ident(e.array)}, &{ident(at.array)}[{self.expr(at.index)}]"
            return f"{pre}gathern({args}, {self.mask})" if self.mask else f"{pre}gather({args})"
        ref = self.vector_ref(e.array, e.index, const=True)
        if self.mask and e.array not in self.vec_arrays:
            return f"{pre}loadn(&{ident(e.array)}[{self.expr(e.index)}], {self.mask})"
        return ref

    def update(self, target, op, value):
        if op is None:
            return f"{target} = {value}"
        if op == "add":
            return f"{target} += {value}"
        if op in ("max", "min"):
            cmp = ">" if op == "max" else "<"
            return f"{{ const auto u_ = {value}; if (u_ {cmp} {target}) {target} = u_; }}"
        raise ValueError(f"unknown update {op!r}")

    def expr(self, e):
        if isinstance(e, L.Var):
            return ident(e.name)
        if isinstance(e, L.Const):
            return _literal(e.value, e.type)
        if isinstance(e, L.Load):
            if e.array in self.sum_arrays:
                if self.vec:
                    raise ValueError(f"partial sums {e.array} are read after the vector loop")
                combine, t, lanes = self.sum_arrays[e.array]
                op = "sum" if combine == "add" else "max"
                return f"{_vectors(t, lanes)[1]}h{op}({ident(e.array)}[{self.expr(e.index)}])"
            if self.vec and L.depends(e.index, self.vec[0]):
                return self.vector_load(e)
            return f"{ident(e.array)}[{self.expr(e.index)}]"
        if isinstance(e, L.Binary):
            a, b = self.expr(e.a), self.expr(e.b)
            if e.op in ("min", "max"):
                t = CTYPE[e.type]
                return f"(({t})({a}) {'<' if e.op == 'min' else '>'} ({t})({b}) ? ({t})({a}) : ({t})({b}))"
            if e.op == "shr":
                return f"((int64_t)((uint64_t)({a}) >> ({b})))"
            return f"({a} {_CMP[e.op]} {b})"
        if isinstance(e, L.Unary) and e.op in L.ACTIVATIONS and e.op != "relu":
            if e.type != "f32" or self.vec:  # (the helpers take a float: a scalar loop over them vectorizes)
                raise ValueError(f"{e.op} is computed on float32 scalars, not {e.type}"
                                 f"{' vectors' if self.vec else ''}")
            return f"scorch_{e.op}({self.expr(e.a)})"
        if isinstance(e, L.Unary):
            a, t = self.expr(e.a), CTYPE[e.type]
            if e.type in ("f16", "bf16") and e.op in ("abs", "sqrt", "sin", "tanh", "exp", "log"):
                # (the C++ library has no 16-bit overloads: ``std::tanh(_Float16)`` is ambiguous) in float, rounded once
                return f"{t}({self.expr(L.Unary(e.op, L.Cast(e.a, 'f32'), 'f32'))})"
            return {"neg": f"(-{a})", "abs": f"std::abs({a})", "relu": f"({a} < {t}(0) ? {t}(0) : {a})",
                    "sqrt": f"std::sqrt({a})", "square": f"({a} * {a})", "sin": f"std::sin({a})",
                    "tanh": f"std::tanh({a})", "sign": f"{t}(({t}(0) < {a}) - ({a} < {t}(0)))",
                    "exp": f"scorch_expf({a})" if e.type == "f32" else f"std::exp({a})", "log": f"std::log({a})",
                    "not": f"(!{a})"}[e.op]
        if isinstance(e, L.Cast) and self.vec and isinstance(e.a, L.Load) and e.a.array in self.narrow and \
                L.depends(e.a.index, self.vec[0]):
            if e.type != "f32" or self.vec[2] != "f32":
                raise ValueError(f"16-bit {e.a.array} read as {e.type} vectors")
            self.vector_ref(e.a.array, e.a.index, const=True)  # (checks the access is contiguous)
            if self.mask:
                raise ValueError(f"16-bit {e.a.array} read in the partial last vector of a loop")
            if self.pairs:
                return f"scorch_widen_pair(&{ident(e.a.array)}[{self.expr(e.a.index)}], {ident(self.vec[0])})"
            return f"scorch_widen(&{ident(e.a.array)}[{self.expr(e.a.index)}])"
        if isinstance(e, L.Cast) and self.vec and self.vec[2] == "f32" and e.type == "f32" and \
                isinstance(e.a, L.Load) and self.narrow.get(e.a.array) == "bf16" and e.a.array not in self.sum_arrays:
            return f"scorch_splat_bf16(&{ident(e.a.array)}[{self.expr(e.a.index)}])"  # (a scalar, as a vector)
        if isinstance(e, L.Cast):
            return f"(({CTYPE[e.type]}){self.expr(e.a)})"
        if isinstance(e, L.PairHalf):
            x, i = ident(e.x), self.expr(e.i)
            if not self.vec:  # (the element as a cast bfloat16 load, which each renderer spells its own way)
                return self.expr(L.Cast(L.Load(e.x, L.binary("add", L.binary("mul", L.Const(2), e.i),
                                                            L.Const(e.half)), "bf16"), "f32"))
            if self.vec[2] != "f32" or L.coefficient(e.i, self.vec[0]) != 1 or self.mask:
                raise ValueError("a half of bfloat16 pairs is read as float vectors, its pairs contiguous in the loop")
            return f"scorch_pair_half<{e.half}>(&{x}[2 * ({i})])"
        if isinstance(e, L.PairDot):
            x, w, i, j = ident(e.x), ident(e.w), self.expr(e.i), self.expr(e.j)
            return (f"((float){x}[2 * ({i})] * (float){w}[{j}] + (float){x}[2 * ({i}) + 1] * "
                    f"(float){w}[({j}) + 1])")
        if isinstance(e, L.PopCount):
            mask = "" if e.width == 32 else f" & {hex((1 << e.width) - 1)}u"
            return f"((int64_t)__builtin_popcount((uint32_t)({self.expr(e.a)}){mask}))"
        if isinstance(e, L.LanePick):
            if not self.vec:
                return self.expr(e.scalar())
            var = self.vec[0]
            if self.vec[2] != "f32" or L.depends(e.at, var) or L.coefficient(e.si, var) != 1 or self.mask:
                raise ValueError("a lane pick reads one group of 4 floats for every lane and a byte a lane")
            return f"scorch_lane_pick<{e.shift}>(&{ident(e.x)}[{self.expr(e.at)}], &{ident(e.sel)}[{self.expr(e.si)}])"
        if isinstance(e, L.Splat):
            if not self.vec or e.type != "f32" or self.vec[2] != "f32" or L.depends(e.at, self.vec[0]) or \
                    not 0 <= e.lane < 4:
                return self.expr(e.scalar())
            return f"scorch_splat4<{e.lane}>(&{ident(e.array)}[{self.expr(e.at)}])"
        if isinstance(e, L.Expand):
            start, bits = self.expr(e.start), self.expr(e.bits)
            if not self.vec:
                return f"scorch_expand1(&{ident(e.vals)}[{start}], (uint32_t)({bits}), {self.expr(e.lane)})"
            var, lanes, _ = self.vec
            if e.lane != L.Var(var) or L.BITS % lanes or self.mask or L.depends(e.start, var) or \
                    L.depends(e.bits, var):
                raise ValueError("an expand's lanes are a vector loop's own, in whole vectors of a group")
            if e.whole:
                if e.whole != lanes:
                    raise ValueError(f"an expand read whole in vectors of {e.whole} values, in a loop of {lanes}")
                return f"scorch_expand_whole(&{ident(e.vals)}[{start}], (uint32_t)({bits}), {ident(var)})"
            end = "" if e.end is None else f", &{ident(e.vals)}[{self.expr(e.end)}]"
            return f"scorch_expand(&{ident(e.vals)}[{start}], (uint32_t)({bits}), {ident(var)}{end})"
        if isinstance(e, L.Common):
            a, b = ident(e.a_array), ident(e.b_array)
            alo, blo = self.expr(e.a_lo), self.expr(e.b_lo)
            return (f"scorch_common({a} + {alo}, ({self.expr(e.a_hi)}) - ({alo}), {b} + {blo}, "
                    f"({self.expr(e.b_hi)}) - ({blo}))")
        if isinstance(e, L.Select) and e.eager:  # (both read, then chosen by a mask: no branch)
            return f"scorch_pick<{CTYPE[e.type]}>({self.expr(e.cond)}, {self.expr(e.a)}, {self.expr(e.b)})"
        if isinstance(e, L.Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        raise TypeError(f"unknown expression {type(e).__name__}")


def _lane_pairs(body, narrow: dict, lanes: int) -> bool:
    """Whether the kernel's vector loops can hold bfloat16 in lane pairs (``scorch_widen_pair``): a vector and
    the next one then stand for the even and the odd elements of their 2 * ``lanes`` entries, a permutation of
    the lanes that every vector must share. So: some vector loop reads bfloat16; every vector loop runs whole
    pairs from a multiple of 2 * ``lanes`` (constant bounds); the only arrays a vector loop reads or writes in
    memory are bfloat16 (a float32 or float16 array has its lanes in order); and every register-tile index is
    the loop's index plus a multiple of 2 * ``lanes`` (so a tile vector pairs with the loads of its parity).
    Lane sums and maxima do not see the order of the lanes."""
    local = {s.name for s in L.walk(body) if isinstance(s, L.LocalArray) and (s.vector or s.sums)}
    loops = [s for s in L.walk(body) if isinstance(s, L.For) and s.vector]
    found = False
    for loop in loops:
        v, pair = loop.var.name, 2 * lanes
        if not (isinstance(loop.lo, L.Const) and isinstance(loop.hi, L.Const) and loop.lo.value % pair == 0
                and (loop.hi.value - loop.lo.value) % pair == 0):
            return False
        for array, index in (a for t in L.walk(loop.body) for a in L.accesses(t)):
            if not L.depends(index, v):
                continue
            if array in local:
                if not _offset_by(index, v, pair):
                    return False
            elif narrow.get(array) != "bf16":
                return False
            else:
                found = True
    return found


def _offset_by(e, var: str, m: int) -> bool:
    """Whether the integer expression ``e`` is ``var`` plus terms each a provable multiple of ``m``."""
    def multiple(x):
        if isinstance(x, L.Const):
            return int(x.value) % m == 0
        if isinstance(x, L.Binary) and x.op in ("add", "sub"):
            return multiple(x.a) and multiple(x.b)
        return isinstance(x, L.Binary) and x.op == "mul" and (multiple(x.a) or multiple(x.b))

    if isinstance(e, L.Var):
        return e.name == var
    if isinstance(e, L.Binary) and e.op == "add":
        return (_offset_by(e.a, var, m) and multiple(e.b)) or (_offset_by(e.b, var, m) and multiple(e.a))
    return False


def _vectors(t: str, lanes: int):
    """``(vector type, helper prefix)`` of a vector of ``lanes`` ``t`` (``f32`` / ``f64``): the machine's
    explicit vectors (``scorch_vf32``; ``scorch_gather``, ``scorch_hsum``...) or, where those are 64 bytes, the
    32-byte vectors of a row sum (``scorch_hvf32``; ``scorch_hvgather``, ``scorch_hvhsum``...)."""
    size = 4 if t == "f32" else 8
    if lanes * size == VECTOR_BYTES:
        return f"scorch_v{t}", "scorch_"
    if lanes * size == 32 and VECTOR_BYTES == 64:
        return f"scorch_hv{t}", "scorch_hv"
    raise ValueError(f"no vectors of {lanes} {t} lanes on a machine of {VECTOR_BYTES}-byte vectors")


def _vector_type(body) -> str:
    """The element type of a vector loop's stores (one floating type)."""
    types = {s.value.type for s in L._walk(body) if isinstance(s, L.Store)} - {None}
    if len(types) != 1 or not types <= {"f32", "f64"}:
        raise ValueError(f"a vector loop stores one floating type, got {sorted(types)}")
    return types.pop()


def _literal(v, t):
    if t == "bool":
        return "true" if v else "false"
    if t in L.INTS:
        return f"INT64_C({int(v)})" if t == "i64" else str(int(v))
    v = float(v)
    if v != v:
        return "NAN"
    if v in (float("inf"), float("-inf")):
        return ("-" if v < 0 else "") + "INFINITY"
    return repr(v) + ("f" if t == "f32" else "")
