"""Contraction order for einsums of three or more operands, with sparse operands costed by their nnz.

A dynamic program over subsets of operands (exhaustive up to ``EXHAUSTIVE`` operands, greedy pairs beyond)
compares, for every subset, evaluating it in one fused kernel against splitting it into two parts contracted
pairwise. Costs are estimated multiply-adds: a kernel driven by sparse operands does work proportional to their
nnz times the extents of the indices they do not store; a dense-only contraction goes to torch (BLAS), whose
multiply-adds are ``DENSE_DISCOUNT`` times as cheap, and every intermediate result (a pair's part that is not an
operand) costs ``INTERMEDIATE_COST`` per entry, written and read back (an SDDMM at 6% density ran faster fused than
as a dense product then sampled, which a discount of 0.05 chose; both constants are fitted below). This is
opt_einsum's problem with a sparse-aware cost,
which opt_einsum itself cannot take (it knows only dense shapes); dense-only sub-contractions are handed to
``torch.einsum``, which orders them with opt_einsum.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

EXHAUSTIVE = 6
#: Fitted to where an SDDMM (``ij,ik,kj->ij``) run fused (nnz * K multiply-adds) and as torch's dense product then
#: sampled (n * n * K, and an n x n intermediate) take the same time, on the AMD EPYC host (2 threads, interleaved
#: medians): at K=256 (n 2048) densities above ~47% go faster dense, at K=64 above ~90%, at K=32 none up to 70%;
#: with a discount of 0.2 and no intermediate cost every SDDMM above 20% density went dense, 2-4x slower than
#: fused (the sparse transformer's 512 x 512 attention gradient at 25% density: 250 against 71 us; n=4096, K=64,
#: 30%: 40.4 against 9.2 ms). A dense intermediate of n * n is allocated, faulted in, written and read back.
DENSE_DISCOUNT = 1 / 3
INTERMEDIATE_COST = 32


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


def _stored(node) -> float:
    """The cost of ``node``'s result kept between two steps: none for an operand."""
    return 0.0 if node.parts is None and len(node.leaves) == 1 else INTERMEDIATE_COST * node.nnz


def best_path(operands, out, sizes, compiled=False) -> Node:
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
            node = _grouped(node, ops, keep, sizes, compiled)
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
                        cost = na.cost + nb.cost + kernel_cost(pair, sizes, pidx) + _stored(na) + _stored(nb)
                        if cost < node.cost:
                            node = Node(node.leaves, keep, (na, nb), cost, psp, pnnz)
        memo[subset] = node
        return node

    return best(full)


def _grouped(node, ops, keep, sizes, compiled=False):
    """``node`` run as a grouped product (``grouped.py``) where that qualifies and is estimated cheaper
    (``compiled``: the operands are those the compiled grouped kernels take, float32 on the CPU)."""
    from . import grouped
    if node.sparse:
        return node
    g = grouped.match([o.indices for o in ops], keep, [o.sparse for o in ops], sizes)
    if g is None or ops[g.sparse].nnz < 1:
        return node
    c = grouped.cost(g, [o.indices for o in ops], keep, sizes, ops[g.sparse].nnz, DENSE_DISCOUNT, compiled)
    if c >= node.cost:
        return node
    return Node(node.leaves, node.indices, None, c, False, node.nnz, g)


def describe(node, letters) -> str:
    if node.parts is None:
        ops = ",".join("".join(letters[k]) for k in node.leaves)
        how = f" grouped by {''.join(node.grouped.group)}" if node.grouped is not None else ""
        return f"[{ops}->{''.join(node.indices)}{how}]"
    return f"({describe(node.parts[0], letters)} . {describe(node.parts[1], letters)} -> {''.join(node.indices)})"
