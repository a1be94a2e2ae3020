"""Index notation: what every sparse op is expressed in before it is scheduled and lowered.

``out[i, k] = sum_j A[i, j] * B[j, k]`` is ``Assignment(out=("i", "k"), rhs=Mul((Access(0, ("i", "j")),
Access(1, ("j", "k")))), operands=(TensorType(...), TensorType(...)))``. Indices absent from ``out`` are
reduced with ``reduce``. Operands are typed placeholders, never tensors, so one compiled kernel serves all
tensors of the same types; sizes are run-time arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..formats import Format


@dataclass(frozen=True)
class TensorType:
    """What a kernel needs to know of an operand: rank, value dtype, format (None: dense strided), index
    dtype and device type."""
    ndim: int
    dtype: torch.dtype
    format: Optional[Format] = None
    index_dtype: Optional[torch.dtype] = None
    device: str = "cpu"

    @property
    def sparse(self) -> bool:
        return self.format is not None

    def __str__(self):
        where = "dense" if self.format is None else (self.format.name or str(self.format))
        idx = "" if self.index_dtype is None else f", {str(self.index_dtype).replace('torch.', '')}"
        return f"{where}[{str(self.dtype).replace('torch.', '')}{idx}]"


class IndexExpr:
    def accesses(self):
        raise NotImplementedError


@dataclass(frozen=True)
class Access(IndexExpr):
    """Operand ``operand`` indexed by the index variables ``indices`` (one per dimension)."""
    operand: int
    indices: tuple

    def accesses(self):
        return (self,)

    def __str__(self):
        return f"T{self.operand}[{','.join(self.indices)}]"


@dataclass(frozen=True)
class Mul(IndexExpr):
    factors: tuple

    def accesses(self):
        return tuple(a for f in self.factors for a in f.accesses())

    def __str__(self):
        return " * ".join(str(f) for f in self.factors)


@dataclass(frozen=True)
class Add(IndexExpr):
    terms: tuple

    def accesses(self):
        return tuple(a for t in self.terms for a in t.accesses())

    def __str__(self):
        return "(" + " + ".join(str(t) for t in self.terms) + ")"


@dataclass(frozen=True)
class Map(IndexExpr):
    """A unary map applied elementwise (``loops.UNARY``: all but ``not`` map 0 to 0)."""
    op: str
    arg: IndexExpr

    def accesses(self):
        return self.arg.accesses()

    def __str__(self):
        return f"{self.op}({self.arg})"


@dataclass(frozen=True)
class Scalar(IndexExpr):
    """A run-time scalar argument (e.g. ``alpha``)."""
    name: str

    def accesses(self):
        return ()

    def __str__(self):
        return self.name


def reindexed(e: IndexExpr, operand: int, old: tuple, new: tuple) -> IndexExpr:
    """``e`` with operand ``operand``'s accesses by ``old`` indexed by ``new`` instead (its dimensions stored in
    another order); raises ``ValueError`` where it is accessed otherwise."""
    if isinstance(e, Access):
        if e.operand != operand:
            return e
        if tuple(e.indices) != tuple(old):
            raise ValueError(f"T{operand} is accessed as {e}, not by {old}")
        return Access(operand, tuple(new))
    if isinstance(e, Mul):
        return Mul(tuple(reindexed(f, operand, old, new) for f in e.factors))
    if isinstance(e, Add):
        return Add(tuple(reindexed(t, operand, old, new) for t in e.terms))
    if isinstance(e, Map):
        return Map(e.op, reindexed(e.arg, operand, old, new))
    return e


@dataclass(frozen=True)
class Assignment:
    out: tuple
    rhs: IndexExpr
    operands: tuple
    reduce: str = "sum"
    out_format: Optional[Format] = None  # requested by the caller; None: inferred

    def __post_init__(self):
        for a in self.rhs.accesses():
            if not 0 <= a.operand < len(self.operands):
                raise ValueError(f"access {a} names no operand")
            if len(a.indices) != self.operands[a.operand].ndim:
                raise ValueError(f"access {a} has {len(a.indices)} indices for a"
                                 f" {self.operands[a.operand].ndim}-d operand")
        if self.reduce not in ("sum", "max", "min"):
            raise ValueError(f"unknown reduction {self.reduce!r}")

    @property
    def indices(self) -> tuple:
        """Every index variable, in order of first appearance (output first)."""
        seen = list(self.out)
        for a in self.rhs.accesses():
            seen += [v for v in a.indices if v not in seen]
        return tuple(seen)

    @property
    def reduced(self) -> tuple:
        return tuple(v for v in self.indices if v not in self.out)

    def __str__(self):
        red = f"{self.reduce}_{{{','.join(self.reduced)}}} " if self.reduced else ""
        return f"out[{','.join(self.out)}] = {red}{self.rhs}"
