"""The reference semantics of the loop IR: a (slow, scalar) NumPy interpreter, used as the oracle in tests.

Every array access is bounds-checked, so a kernel that would read or write out of bounds in C++ raises
``IndexError`` here.
"""
from __future__ import annotations

import math

import numpy as np

from .. import loopir as L

NP = {"bool": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "f32": np.float32, "f64": np.float64,
      # bfloat16 arrays are held as float32 (NumPy has no bfloat16): the interpreter does not model the
      # rounding of a store, so a program is checked on values that bfloat16 holds exactly
      "bf16": np.float32}


def run(kernel: L.Kernel, args: dict) -> None:
    """Execute ``kernel`` with ``args`` (parameter name -> NumPy array or Python scalar); arrays are updated
    in place."""
    env = {}
    arrays = {}
    for p in kernel.params:
        if p.name not in args:
            raise KeyError(f"missing argument {p.name!r} for kernel {kernel.name}")
        v = args[p.name]
        if p.kind == "array":
            if not isinstance(v, np.ndarray) or v.ndim != 1:
                raise TypeError(f"argument {p.name!r} must be a 1-d NumPy array")
            arrays[p.name] = v
        else:
            env[p.name] = _cast(v, p.type)
    _Interp(arrays).block(kernel.body, env)


def _cast(v, t):
    if t == "bool":
        return bool(v)
    if t in L.INTS:  # (wrapped to the type's width, as C++ converts)
        bits = {"i8": 8, "i16": 16, "i32": 32, "i64": 64}[t]
        return (int(v) + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)
    return NP[t](v)


class _Interp:
    def __init__(self, arrays):
        self.arrays = arrays

    def block(self, b, env):
        for s in b.stmts:
            self.stmt(s, env)

    def stmt(self, s, env):
        if isinstance(s, L.Let) or isinstance(s, L.Decl):
            env[s.var.name] = _cast(self.expr(s.value, env), s.var.type)
        elif isinstance(s, L.Assign):
            v = _cast(self.expr(s.value, env), s.var.type)
            env[s.var.name] = v if s.op is None else _cast(_combine(s.op, env[s.var.name], v), s.var.type)
        elif isinstance(s, L.Store):
            arr = self.arrays[s.array]
            i = self._index(s.array, s.index, env)
            v = self.expr(s.value, env)
            arr[i] = v if s.op is None else _combine(s.op, arr[i], v)
        elif isinstance(s, L.For):
            if s.parallel is not None and s.parallel.setup is not None:
                self.block(s.parallel.setup, env)  # one "thread": its private workspaces
            lo, hi = self.expr(s.lo, env), self.expr(s.hi, env)
            for x in range(int(lo), int(hi)):
                inner = dict(env)
                inner[s.var.name] = x
                self.block(s.body, inner)
                _writeback(env, inner)
        elif isinstance(s, L.While):
            inner = dict(env)
            while self.expr(s.cond, inner):
                self.block(s.body, inner)
            _writeback(env, inner)
        elif isinstance(s, L.If):
            inner = dict(env)
            self.block(s.then if self.expr(s.cond, env) else s.orelse, inner)
            _writeback(env, inner)
        elif isinstance(s, L.Alloc):
            self.arrays[s.name] = np.zeros(int(self.expr(s.size, env)), dtype=NP[s.type])
        elif isinstance(s, L.Sort):
            arr = self.arrays[s.array]
            lo, hi = int(self.expr(s.lo, env)), int(self.expr(s.hi, env))
            if not 0 <= lo <= hi <= arr.shape[0]:
                raise IndexError(f"sort of {s.array}[{lo}:{hi}] is out of bounds (length {arr.shape[0]})")
            bound, scratch = int(self.expr(s.bound, env)), self.arrays[s.scratch]
            if scratch.shape[0] < hi - lo:
                raise IndexError(f"sort of {s.array}[{lo}:{hi}] needs {hi - lo} scratch entries, {s.scratch} has"
                                 f" {scratch.shape[0]}")
            if hi > lo and not (0 <= arr[lo:hi].min() and arr[lo:hi].max() < bound):
                raise IndexError(f"sort of {s.array}[{lo}:{hi}]: a key lies outside [0, {bound})")
            arr[lo:hi] = np.sort(arr[lo:hi])
        elif isinstance(s, L.SetBit):
            arr, i = self.arrays[s.array], int(self.expr(s.index, env))
            if not 0 <= i < 64 * arr.shape[0]:
                raise IndexError(f"bit {i} of {s.array} is out of bounds ({64 * arr.shape[0]} bits)")
            arr.view(np.uint64)[i >> 6] |= np.uint64(1) << np.uint64(i & 63)
        elif isinstance(s, L.BitKeys):
            bits, keys = self.arrays[s.bits], self.arrays[s.keys]
            words, cap = int(self.expr(s.words, env)), int(self.expr(s.cap, env))
            if not 0 <= words <= bits.shape[0] or cap > keys.shape[0]:
                raise IndexError(f"bit keys of {s.bits}[0:{words}] into {s.keys}[0:{cap}] are out of bounds")
            found = np.flatnonzero(np.unpackbits(bits[:words].view(np.uint8), bitorder="little"))
            if found.size > cap:
                raise IndexError(f"{found.size} bits set in {s.bits}, room for {cap} keys")
            keys[:found.size] = found
            bits[:words] = 0
            env[s.count.name] = _cast(found.size, s.count.type)
        elif isinstance(s, L.BitCount):
            bits, words = self.arrays[s.bits], int(self.expr(s.words, env))
            if not 0 <= words <= bits.shape[0]:
                raise IndexError(f"bit count of {s.bits}[0:{words}] is out of bounds")
            found = int(np.unpackbits(bits[:words].view(np.uint8)).sum())
            bits[:words] = 0
            env[s.count.name] = _cast(found, s.count.type)
        elif isinstance(s, L.Prefetch):
            self._index(s.array, s.index, env)  # (a hint: only the bounds of its address are checked)
        elif isinstance(s, L.LocalArray):
            self.arrays[s.name] = np.full(s.size, self.expr(s.init, env), dtype=NP[s.type])
        elif isinstance(s, (L.Transpose, L.TileRow)):
            self.stmt(s.loops(), env)
        elif isinstance(s, L.TileConfig):
            pass  # (the tiles' setup: no effect on values)
        elif isinstance(s, L.SumLanes):
            self.arrays[s.name] = self.arrays[s.array][:s.size].astype(NP[s.type])
        elif isinstance(s, L.Block):
            inner = dict(env)
            self.block(s, inner)
            _writeback(env, inner)
        else:
            raise TypeError(f"unknown statement {type(s).__name__}")

    def _index(self, name, index, env):
        arr = self.arrays[name]
        i = int(self.expr(index, env))
        if not 0 <= i < arr.shape[0]:
            raise IndexError(f"{name}[{i}] is out of bounds (length {arr.shape[0]})")
        return i

    def expr(self, e, env):
        if isinstance(e, L.Var):
            return env[e.name]
        if isinstance(e, L.Const):
            return _cast(e.value, e.type)
        if isinstance(e, L.Load):
            v = self.arrays[e.array][self._index(e.array, e.index, env)]
            return _cast(v, e.type)
        if isinstance(e, L.Binary):
            if e.op in ("and", "or"):  # (left to right, as C's && and ||: the right side may read out of range)
                a = bool(self.expr(e.a, env))
                return a if a == (e.op == "or") else bool(self.expr(e.b, env))
            return _cast(_binary(e.op, self.expr(e.a, env), self.expr(e.b, env), e.type), e.type)
        if isinstance(e, L.Unary):
            return _cast(_unary(e.op, self.expr(e.a, env), e.type), e.type)
        if isinstance(e, L.Cast):
            return _cast(self.expr(e.a, env), e.type)
        if isinstance(e, L.Select):
            return self.expr(e.a, env) if self.expr(e.cond, env) else self.expr(e.b, env)
        if isinstance(e, L.PairDot):
            x, w = self.arrays[e.x], self.arrays[e.w]
            i, j = 2 * int(self.expr(e.i, env)), int(self.expr(e.j, env))
            if not (0 <= i and i + 1 < x.shape[0] and 0 <= j and j + 1 < w.shape[0]):
                raise IndexError(f"pair {e.x}[{i}:{i + 2}] x {e.w}[{j}:{j + 2}] is out of bounds")
            return _cast(np.float32(x[i]) * np.float32(w[j]) + np.float32(x[i + 1]) * np.float32(w[j + 1]), e.type)
        if isinstance(e, L.PairHalf):
            x, i = self.arrays[e.x], 2 * int(self.expr(e.i, env)) + e.half
            if not 0 <= i < x.shape[0]:
                raise IndexError(f"{e.x}[{i}] is out of bounds (length {x.shape[0]})")
            return _cast(np.float32(x[i]), e.type)
        if isinstance(e, (L.LanePick, L.Splat)):
            return self.expr(e.scalar(), env)
        if isinstance(e, L.Expand):
            vals, lane = self.arrays[e.vals], int(self.expr(e.lane, env))
            word = int(self.expr(e.bits, env)) & 0xFFFF
            if not 0 <= lane < L.BITS:
                raise IndexError(f"lane {lane} of a {L.BITS}-column group")
            if e.whole:  # (each vector's values read whole: ``whole`` from the vector's first)
                first = int(self.expr(e.start, env)) + bin(word & ((1 << (lane - lane % e.whole)) - 1)).count("1")
                if first + e.whole > vals.shape[0]:
                    raise IndexError(f"{e.vals}[{first}:{first + e.whole}] read whole is out of bounds (length "
                                     f"{vals.shape[0]})")
            if not word >> lane & 1:
                return _cast(0.0, e.type)
            i = int(self.expr(e.start, env)) + bin(word & ((1 << lane) - 1)).count("1")
            if not 0 <= i < vals.shape[0]:
                raise IndexError(f"{e.vals}[{i}] is out of bounds (length {vals.shape[0]})")
            return _cast(vals[i], e.type)
        if isinstance(e, L.PopCount):
            return _cast(bin(int(self.expr(e.a, env)) & ((1 << e.width) - 1)).count("1"), e.type)
        if isinstance(e, L.ExpandPairDot):
            vals, x, lane = self.arrays[e.vals], self.arrays[e.x], int(self.expr(e.lane, env))
            word, start = int(self.expr(e.bits, env)) & 0xFFFFFFFF, int(self.expr(e.start, env))
            xi = int(self.expr(e.xi, env))
            if not (0 <= lane < L.BITS and 0 <= xi and xi + 1 < x.shape[0]):
                raise IndexError(f"pair {lane} against {e.x}[{xi}:{xi + 2}] is out of bounds")
            total = np.float32(0.0)
            for c in (2 * lane, 2 * lane + 1):
                if word >> c & 1:
                    i = start + bin(word & ((1 << c) - 1)).count("1")
                    if not 0 <= i < vals.shape[0]:
                        raise IndexError(f"{e.vals}[{i}] is out of bounds (length {vals.shape[0]})")
                    total = total + np.float32(vals[i]) * np.float32(x[xi + c - 2 * lane])
            return _cast(total, e.type)
        if isinstance(e, L.Common):
            ranges = []
            for name, lo, hi in ((e.a_array, e.a_lo, e.a_hi), (e.b_array, e.b_lo, e.b_hi)):
                arr, lo, hi = self.arrays[name], int(self.expr(lo, env)), int(self.expr(hi, env))
                if not 0 <= lo <= hi <= arr.shape[0] and lo < hi:
                    raise IndexError(f"{name}[{lo}:{hi}] is out of bounds (length {arr.shape[0]})")
                ranges.append(arr[lo:hi] if lo < hi else arr[:0])
            return _cast(np.intersect1d(*ranges).size, e.type)
        raise TypeError(f"unknown expression {type(e).__name__}")


def _writeback(env, inner):
    # mutable locals declared outside a scope are updated by it; locals declared inside stay inside
    for k in env:
        env[k] = inner[k]


def _combine(op, old, new):
    if op == "add":
        return old + new
    if op == "max":
        return max(old, new)
    if op == "min":
        return min(old, new)
    raise ValueError(f"unknown update {op!r}")


def _binary(op, a, b, t):
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        if t in L.INTS or t == "bool":
            q = abs(int(a)) // abs(int(b))
            return q if (a >= 0) == (b >= 0) else -q
        return a / b
    if op == "floordiv":
        return a // b
    if op == "mod":
        return a % b
    if op == "shr":  # (the 64 bits as unsigned, the result read back as a signed 64-bit integer)
        r = (int(a) % 2 ** 64) >> int(b)
        return r - 2 ** 64 if r >= 2 ** 63 else r
    if op == "min":
        return min(a, b)
    if op == "max":
        return max(a, b)
    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b,
            "and": bool(a) and bool(b), "or": bool(a) or bool(b)}[op]


def _unary(op, a, t):
    if op == "neg":
        return -a
    if op == "abs":
        return abs(a)
    if op == "relu":
        return _cast(0, t) if a < 0 else a  # NaN stays NaN, as in torch
    if op == "sqrt":
        return np.sqrt(a) if not isinstance(a, (int, bool)) else math.sqrt(a)
    if op == "square":
        return a * a
    if op == "sin":
        return np.sin(a)
    if op == "tanh":
        return np.tanh(a)
    if op == "exp":
        return np.exp(a)
    if op == "log":
        return np.log(a)
    if op == "sign":
        return (a > 0) - (a < 0)
    if op == "not":
        return not a
    if op in L.ACTIVATIONS:  # (relu: above) in float64, then rounded to the expression's type by the caller
        return _activation(op, float(a))
    raise ValueError(f"unknown unary op {op!r}")


def _activation(op, a: float) -> float:
    """GELU (erf), GELU (tanh) and SiLU of ``a``, as torch defines them (NaN stays NaN)."""
    if a != a:
        return a
    if op == "gelu":
        return 0.5 * a * (1.0 + math.erf(a / math.sqrt(2.0)))
    if op == "gelu_tanh":
        if abs(a) > 1e10:  # (tanh is +-1 there; the cube would overflow a float)
            return a if a > 0 else -0.0
        return 0.5 * a * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))
    # silu: a * sigmoid(a), the exponential taken of a non-positive number (no overflow)
    e = math.exp(-abs(a))
    return a / (1.0 + e) if a >= 0 else a * e / (1.0 + e)
