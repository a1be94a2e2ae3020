"""Contraction order for einsums of three or more operands, with sparse operands costed by their nnz.

A dynamic program over subsets of operands (exhaustive up to ``EXHAUSTIVE`` operands, greedy pairs beyond)
compares, for every subset, evaluating it in one fused kernel against splitting it into two parts contracted
pairwise. Costs are estimated multiply-adds: a kernel driven by sparse operands does work proportional to their
nnz times the extents of the indices they do not store; a dense-only contraction goes to torch (BLAS), whose
multiply-adds are ``DENSE_DISCOUNT`` times as cheap (measured: an SDDMM at 6% density runs faster
fused than as a dense product then sampled, which 0.05 chose). This is opt_einsum's problem with a sparse-aware cost,
which opt_einsum itself cannot take (it knows only dense shapes); dense-only sub-contractions are handed to
``torch.einsum``, which orders them with opt_einsum.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

EXHAUSTIVE = 6
DENSE_DISCOUNT = 0.2


@dataclass(frozen=True)
class Operand:
    indices: tuple
    sparse: bool
    nnz: float
    stored: frozenset  # indices whose pattern a sparse operand restricts (all of them, for our formats)


@dataclass(frozen=True)
class Node:
    """A contraction tree: ``leaves`` are operand numbers; a node with ``parts`` contracts its two parts'
    results pairwise, a node without evaluates all its leaves in one kernel."""
    leaves: tuple
    indices: tuple           # the indices this node's result keeps
    parts: Optional[tuple] = None
    cost: float = 0.0
    sparse: bool = False
    nnz: float = 0.0
    grouped: object = None   # a ``grouped.Grouping`` where the kernel is a grouped product (``grouped.py``)


def kernel_cost(ops, sizes, fused_indices):
    """Estimated multiply-adds of one kernel over ``ops`` touching ``fused_indices``."""
    sparse = [o for o in ops if o.sparse]
    if not sparse:
        return DENSE_DISCOUNT * math.prod(sizes[v] for v in fused_indices)
    work = math.prod(o.nnz for o in sparse)
    counted = {}
    for o in sparse:
        for v in o.stored:
            counted[v] = counted.get(v, 0) + 1
    for v, c in counted.items():  # an index stored by several sparse operands is matched, not multiplied
        work /= max(sizes[v], 1) ** (c - 1)
    stored = set(counted)
    return max(work, 1.0) * math.prod(sizes[v] for v in fused_indices if v not in stored)


def _result(ops, kept, sizes):
    """Is the result of contracting ``ops`` down to ``kept`` sparse, and how many entries does it hold?"""
    for o in ops:
        if o.sparse and set(kept) <= o.stored and set(kept) == set(o.indices):
            return True, o.nnz  # the result lives on that operand's pattern
    return False, float(math.prod(sizes[v] for v in kept))


def best_path(operands, out, sizes) -> Node:
    n = len(operands)
    full = frozenset(range(n))

    def kept(subset):
        outside = set(out)
        for k in full - subset:
            outside |= set(operands[k].indices)
        inside = []
        for k in sorted(subset):
            inside += [v for v in operands[k].indices if v not in inside]
        return tuple(v for v in inside if v in outside)

    def as_operand(node):
        if node.parts is None and len(node.leaves) == 1:
            return operands[node.leaves[0]]
        return Operand(node.indices, node.sparse, node.nnz, frozenset(node.indices) if node.sparse else frozenset())

    memo = {}

    def best(subset):
        if subset in memo:
            return memo[subset]
        if len(subset) == 1:
            (k,) = subset
            o = operands[k]
            node = Node((k,), o.indices, None, 0.0, o.sparse, o.nnz)
        else:
            ops = [operands[k] for k in sorted(subset)]
            idx = {v for o in ops for v in o.indices}
            keep = kept(subset)
            sp, nnz = _result(ops, keep, sizes)
            node = Node(tuple(sorted(subset)), keep, None, kernel_cost(ops, sizes, idx), sp, nnz)
            node = _grouped(node, ops, keep, sizes)
            if len(subset) <= EXHAUSTIVE:
                members = sorted(subset)
                for r in range(1, len(members) // 2 + 1):
                    for left in itertools.combinations(members, r):
                        a = frozenset(left)
                        b = subset - a
                        if r * 2 == len(members) and min(a) > min(b):
                            continue
                        na, nb = best(a), best(b)
                        pair = [as_operand(na), as_operand(nb)]
                        pidx = set(na.indices) | set(nb.indices)
                        psp, pnnz = _result(pair, keep, sizes)
                        cost = na.cost + nb.cost + kernel_cost(pair, sizes, pidx)
                        if cost < node.cost:
                            node = Node(node.leaves, keep, (na, nb), cost, psp, pnnz)
        memo[subset] = node
        return node

    return best(full)


def _grouped(node, ops, keep, sizes):
    """``node`` run as a grouped product (``grouped.py``) where that qualifies and is estimated cheaper."""
    from . import grouped
    if node.sparse:
        return node
    g = grouped.match([o.indices for o in ops], keep, [o.sparse for o in ops], sizes)
    if g is None or ops[g.sparse].nnz < 1:
        return node
    c = grouped.cost(g, [o.indices for o in ops], keep, sizes, ops[g.sparse].nnz, DENSE_DISCOUNT)
    if c >= node.cost:
        return node
    return Node(node.leaves, node.indices, None, c, False, node.nnz, g)


def describe(node, letters) -> str:
    if node.parts is None:
        ops = ",".join("".join(letters[k]) for k in node.leaves)
        how = f" grouped by {''.join(node.grouped.group)}" if node.grouped is not None else ""
        return f"[{ops}->{''.join(node.indices)}{how}]"
    return f"({describe(node.parts[0], letters)} . {describe(node.parts[1], letters)} -> {''.join(node.indices)})"
