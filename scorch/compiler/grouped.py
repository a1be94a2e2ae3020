"""Grouped products: a sparse operand selecting slices of a dense one, run as one dense product per slice.

In ``y[b, h] = sum_{n, d} G[b, n] x[b, d] E[n, d, h]`` (a mixture of experts with sparse gates ``G``) every stored
entry ``(b, n)`` of ``G`` asks for the product of ``x``'s row ``b`` with the matrix ``E[n]``. A loop nest driven by
``G`` computes exactly those entries, but as one matrix-vector product per entry: ``E[n]`` streams past once per
token, without reuse. Grouping the entries by ``n`` (the sparse operand's *group* index: shared with the dense
operands that hold the large slices) turns the same work into one matrix product per distinct ``n``: the rows
``b`` of the group are gathered from ``x`` (weighted by ``G``'s values), multiplied by ``E[n]`` in BLAS, and added
into ``y``'s rows ``b``. Only the stored entries are computed; each slice is read once per group.

The contraction planner (``contract.best_path``) costs this against the generated kernel and picks it where the
per-entry dense work is large and the groups are few (``cost``); the execution layer runs it in torch ops
(``engine/grouped.py``), so autograd differentiates it as it stands (the gradients are grouped products too).

Which einsums qualify (``match``): one sparse operand ``S`` with distinct indices, split into group indices (held
by the sliced dense operands) and row indices (held by the gathered ones) so that every dense operand and the
output hold only one kind; an output holding row indices gets one row per entry (added at the entry's
coordinates), an output holding group indices one result per group (the rows summed inside the product).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: estimated cost of one group (a few torch calls: a slice, a product, a copy), in kernel multiply-adds
GROUP_OVERHEAD = 1.0e5
#: the grouped product's calls whatever the groups (the sort, the gathers, the placement), in kernel multiply-adds
CALL_OVERHEAD = 1.0e7
#: one group's slice of the sliced operands, in elements, up to which a generated kernel reads it from the cache
#: for every entry at about BLAS's rate: grouping then gains nothing per multiply-add and only adds its calls.
#: Measured (2 threads, 16 experts, float32, no gradients): 2048 tokens x 128 wide, 0.7 ms by the kernel against
#: 1.0-1.8 ms grouped; 1024 x 128, 0.35 against 1.1; 4096 x 128, 1.35 against 2.8; 2048 x 256 (a slice of 64K
#: elements) equal; at 512 wide (1 MiB a slice) the kernel is 10-20x slower.
SLICE_IN_CACHE = 1 << 16
#: the same for the mixture-of-experts form in float32 on the CPU, which the compiled grouped kernels run
#: (``grouped_gemm.py``: no torch call per group). Measured (1 thread, 16 experts, thread CPU time, without
#: gradients): 2048 tokens x 128 wide (a slice of 16K elements), 1.03 ms grouped against 1.46 by the kernel;
#: 4096 x 128, 2.5 against 3.0; 2048 x 256, 3.8 against 8.1; 2048 x 64 (4K) 0.34 against 0.32; 512 x 64 0.18
#: against 0.09
SLICE_IN_CACHE_COMPILED = 1 << 13


@dataclass(frozen=True)
class Grouping:
    sparse: int        # the sparse operand's position
    group: tuple       # its group indices (the sliced dense operands hold them)
    rows: tuple        # its row indices (the gathered dense operands hold them)


def match(inputs, out, sparse, sizes) -> "Grouping | None":
    """The cheapest grouping of an einsum (``inputs``: index letters per operand, ``sparse``: which operands are
    sparse) with a dense output, or None where none qualifies: one sparse operand with distinct indices, split into
    group and row indices so that each dense operand and the output hold only one kind. Among the splits, the one
    gathering the least (the gathered operands are copied once per stored entry)."""
    ks = [k for k, s in enumerate(sparse) if s]
    if len(ks) != 1 or len(inputs) < 2:
        return None
    k = ks[0]
    s = inputs[k]
    if len(set(s)) != len(s) or any(len(set(i)) != len(i) for i in inputs) or len(set(out)) != len(out):
        return None
    best, best_cost = None, None
    for mask in range(1, (1 << len(s)) - 1):
        group = tuple(v for b, v in enumerate(s) if mask >> b & 1)
        rows = tuple(v for v in s if v not in group)
        holders = [set(i) for j, i in enumerate(inputs) if j != k] + [set(out)]
        if any(h & set(group) and h & set(rows) for h in holders):
            continue
        if not any(h & set(group) for h in holders):
            continue  # nothing is sliced: no reuse to gain
        gathered = _per_entry(inputs, out, k, rows, sizes)
        if best is None or gathered < best_cost:
            best, best_cost = Grouping(k, group, rows), gathered
    return best


def moe_operands(grouping: Grouping, inputs, out):
    """``(xj, wj)``, the positions of ``x`` and ``W`` where the einsum is the mixture-of-experts form
    ``y[r, h] = sum S[r, g] x[r, d] W[g, d, h]`` (any operand order), else None."""
    k = grouping.sparse
    if len(inputs) != 3 or len(grouping.rows) != 1 or len(grouping.group) != 1:
        return None
    (r,), (g,) = grouping.rows, grouping.group
    others = [j for j in range(3) if j != k]
    xj = next((j for j in others if r in inputs[j]), None)
    wj = next((j for j in others if g in inputs[j]), None)
    if xj is None or wj is None:
        return None
    xi, wi = inputs[xj], inputs[wj]
    if len(xi) != 2 or xi[0] != r or len(wi) != 3 or wi[0] != g or xi[1] != wi[1] or tuple(out) != (r, wi[2]):
        return None
    return xj, wj


def _per_entry(inputs, out, k, rows, sizes):
    """Elements copied per stored entry: the gathered operands' rows, and the result's where it keeps the rows."""
    held = [i for j, i in enumerate(inputs) if j != k and set(i) & set(rows)]
    if set(out) & set(rows):
        held.append(out)
    return sum(math.prod(sizes[v] for v in i if v not in inputs[k]) for i in held)


def cost(grouping: Grouping, inputs, out, sizes, nnz, dense_discount, compiled=False) -> float:
    """Estimated cost (kernel multiply-adds): the work for the stored entries (at BLAS's rate where one group's
    slice is too large for a kernel to keep in the cache, ``SLICE_IN_CACHE``, or ``SLICE_IN_CACHE_COMPILED`` for
    the mixture-of-experts form when its operands are those of the compiled grouped kernels, ``compiled``; at the
    kernel's otherwise), the gathers, a per-group overhead and the calls every grouped product makes."""
    idx = {v for i in inputs for v in i}
    work = max(nnz, 1.0) * math.prod(sizes[v] for v in idx if v not in inputs[grouping.sparse])
    gathered = _per_entry(inputs, out, grouping.sparse, grouping.rows, sizes)
    groups = min(nnz, math.prod(sizes[v] for v in grouping.group))
    sliced = [i for j, i in enumerate(inputs) if j != grouping.sparse and set(i) & set(grouping.group)]
    slice_ = max((math.prod(sizes[v] for v in i if v not in grouping.group) for i in sliced), default=0)
    fits = SLICE_IN_CACHE_COMPILED if compiled and moe_operands(grouping, inputs, out) else SLICE_IN_CACHE
    rate = 1.0 if slice_ <= fits else dense_discount
    return rate * work + nnz * gathered + GROUP_OVERHEAD * groups + CALL_OVERHEAD
