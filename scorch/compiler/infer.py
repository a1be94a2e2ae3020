"""Format inference: the output format of an assignment, from its operands' formats and the algebra.

Rules (DESIGN.md section 3.2), on the set of index variables where an expression's nonzeros are restricted
by a sparse level ("sparse indices"):

* an access to a sparse operand is sparse on the indices of its non-full levels (CSR ``A[i,j]``: ``{j}``;
  DCSR and COO: ``{i, j}``; BSR(2,2): ``{j}``, through ``j / 2``); a dense operand is sparse nowhere;
* a product is sparse where any factor is (intersection of patterns): ``A[i,j] * X[j,k]`` is sparse on j;
* a sum is sparse only where every term is (union of patterns);
* a zero-preserving map keeps its argument's pattern.

The output is then:

1. dense (a plain torch tensor) when none of its indices is sparse and the right side is not a product of sparse
   operands (rule 5): ``"ij,jk->ik"`` with CSR ``A`` and dense ``X``;
2. the pattern of the driving sparse operand when the output indices are exactly that operand's and the
   operand is a factor of the product (the result can only be nonzero where the operand is stored):
   ``"ij,ij->ij"`` (sparse * dense), SDDMM ``"ij,ik,kj->ij"``, ``relu(A)``; transposed indices give the
   transposed format: ``"ij->ji"`` of CSR is CSC, sharing the arrays;
3. a prefix of the driver's levels when the output indices are exactly the ones those levels store:
   ``"ij->i"`` of DCSR is ``(i : compressed)``, sharing level 0;
4. dense when a dense operand (one with an index) is a factor and the output sums over an index of a sparse
   operand: the stored pattern projected onto fewer indices covers (nearly) every remaining coordinate (the rows
   of a matrix with a nonzero are nearly all rows), and the dense operand fills each such coordinate's fiber, so
   a sparse result would store a dense tensor with index arrays besides: COO ``"ij,jk->ik"`` (SpMM), the mixture
   of experts' ``"bnd,bn->bd"`` with one-hot gates. PyTorch's convention (sparse x dense -> dense) says the same;
5. a product of two or more sparse operands and no dense operand with an index is sparse, whatever the level
   types (CSR ``"ij,kj->ik"``, the Gram matrix, stores ``i`` and ``k`` in dense levels, yet its rows are as sparse
   as the products make them): one level per output index in the order of a loop nest concordant with every
   sparse operand, ``compressed`` for sparse indices and for the last level (CSR @ CSC.T is CSR, CSC @ CSC is CSC);
6. otherwise one level per output index, in the first sparse operand's level order (so the loops stay
   concordant): ``compressed`` for sparse indices, ``dense`` for the others (CSC + CSC is CSC; COO
   ``"ij,jd->ijd"``, every stored entry times a dense row, keeps the pattern whole: COO with a dense level).

``format=`` on the call overrides all of this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..formats import Compressed, Dense, Format, Var
from .ir import Access, Add, Assignment, IndexExpr, Map, Mul, Scalar


def sparse_indices(e: IndexExpr, operands) -> frozenset:
    """The index variables on which ``e``'s nonzero pattern is restricted by a sparse level."""
    if isinstance(e, Access):
        t = operands[e.operand]
        if not t.sparse:
            return frozenset()
        return frozenset(e.indices[d] for ex, lvl in t.format.levels if not lvl.full for d in ex.dims())
    if isinstance(e, Mul):
        return frozenset().union(*(sparse_indices(f, operands) for f in e.factors))
    if isinstance(e, Add):
        sets = [sparse_indices(t, operands) for t in e.terms]
        return frozenset.intersection(*sets) if sets else frozenset()
    if isinstance(e, Map):
        return sparse_indices(e.arg, operands)
    if isinstance(e, Scalar):
        return frozenset()
    raise TypeError(f"unknown index expression {type(e).__name__}")


@dataclass(frozen=True)
class OutputFormat:
    """The inferred output: ``format`` (None: a dense torch tensor) and, when the output shares a prefix of
    the driver's levels, ``shared_levels`` (how many) so the kernel writes values at the driver's positions."""
    format: Optional[Format]
    shared_levels: int = 0
    rule: str = "dense"


def factors(e: IndexExpr):
    return e.factors if isinstance(e, Mul) else (e,)


def driver_access(asg: Assignment) -> Optional[Access]:
    """The sparse access that drives the loops: the first sparse operand among the product's factors."""
    for f in factors(asg.rhs):
        inner = f
        while isinstance(inner, Map):
            inner = inner.arg
        if isinstance(inner, Access) and asg.operands[inner.operand].sparse:
            return inner
    return None


def prefix_levels(fmt: Format, access: Access, out) -> int:
    """The smallest m such that the first m levels of ``fmt`` store exactly the output's indices and
    determine them (an invertible prefix); 0 if there is none."""
    known = set()
    for m in range(1, len(fmt.levels) + 1):
        known |= {access.indices[d] for d in fmt.exprs[m - 1].dims()}
        if not known <= set(out):
            return 0
        lvl = fmt.level_types[m - 1]
        # a non-unique level repeats coordinates of different entries; a padded one only repeats padding,
        # whose value (zero) a product with the driver keeps zero
        if known == set(out) and (lvl.unique or lvl.padded):
            try:
                remap(fmt, access, out, m)
                return m
            except ValueError:  # e.g. ``j - i`` alone determines neither i nor j
                continue
    return 0


def remap(fmt: Format, access: Access, out, levels: int) -> Format:
    """The first ``levels`` levels of ``fmt``, with dimensions renumbered from the access to the output."""
    new = {d: out.index(v) for d, v in enumerate(access.indices) if v in out}
    return Format.from_levels(len(out), [(e.renumber(new), lvl) for e, lvl in fmt.levels[:levels]])


def projected_by_dense_factor(asg: Assignment) -> bool:
    """Rule 4: a dense operand with an index takes part, and the output sums over an index of a sparse operand
    (so the result's pattern would be a projection of the stored one, each of its coordinates a dense fiber)."""
    accesses = asg.rhs.accesses()
    dense = any(not asg.operands[a.operand].sparse and a.indices for a in accesses)
    return dense and any(asg.operands[a.operand].sparse and not set(a.indices) <= set(asg.out) for a in accesses)


def infer(asg: Assignment) -> OutputFormat:
    if asg.out_format is not None:
        f = asg.out_format
        if f.is_dense and all(isinstance(e, Var) and e.dim == k for k, e in enumerate(f.exprs)):
            return OutputFormat(None, 0, "requested: dense")
        # a requested format that the rules would pick anyway keeps what they share with the driver: the
        # gradient of ``S @ X`` with respect to S is an SDDMM requested in S's format, on S's own pattern
        natural = _inferred(asg)
        if natural.format == f and natural.shared_levels:
            return OutputFormat(f, natural.shared_levels, f"requested, which is {natural.rule}")
        return OutputFormat(f, 0, "requested")
    return _inferred(asg)


def sparse_product(asg: Assignment) -> bool:
    """Whether the right-hand side is a product of two or more sparse operands and no dense operand with an index
    (a scalar may scale it): SpGEMM ``"ij,jk->ik"``, the Gram matrix ``"ij,kj->ik"``, whatever the level types."""
    accesses = asg.rhs.accesses()
    n = 0
    for f in factors(asg.rhs):
        while isinstance(f, Map):
            f = f.arg
        n += isinstance(f, Access) and asg.operands[f.operand].sparse
    return isinstance(asg.rhs, Mul) and n >= 2 and \
        all(asg.operands[a.operand].sparse or not a.indices for a in accesses)


def level_letters(fmt: Format, access: Access) -> list:
    """The index letters of a sparse access's levels, in storage order (a letter once, at its first level)."""
    out = []
    for e in fmt.exprs:
        for d in sorted(e.dims()):
            v = access.indices[d]
            if v not in out:
                out.append(v)
    return out


def topological(vars_, constraints, priority):
    """A loop order respecting every (before, after) constraint, best priority first; None on a cycle."""
    order, left = [], list(vars_)
    while left:
        ready = [v for v in left if not any(b == v and a in left for a, b in constraints)]
        if not ready:
            return None
        v = min(ready, key=priority)
        order.append(v)
        left.remove(v)
    return tuple(order)


def _product_order(asg: Assignment) -> list:
    """The output indices of a product of sparse operands in the order of a loop nest concordant with all of them
    (output indices as early as the levels allow, in output order), or in the first sparse operand's level order
    where no loop order is concordant with all: CSC @ CSC runs column by column, so its result is CSC."""
    sparse = [a for a in asg.rhs.accesses() if asg.operands[a.operand].sparse]
    constraints = []
    for a in sparse:
        vs = level_letters(asg.operands[a.operand].format, a)
        constraints += list(zip(vs, vs[1:]))
    order = topological(asg.indices, constraints, lambda v: (0, asg.out.index(v)) if v in asg.out else
                        (1, asg.indices.index(v)))
    if order is None:
        order = level_letters(asg.operands[sparse[0].operand].format, sparse[0])
    return [v for v in order if v in asg.out] + [v for v in asg.out if v not in order]


def _first_level_indices(asg: Assignment) -> set:
    """The indices that a sparse operand stores in a first level that restricts them (DCSR's and COO's rows)."""
    out = set()
    for a in asg.rhs.accesses():
        t = asg.operands[a.operand]
        if t.sparse and not t.format.level_types[0].full:
            out |= {a.indices[d] for d in t.format.exprs[0].dims()}
    return out


def _inferred(asg: Assignment) -> OutputFormat:
    sparse = sparse_indices(asg.rhs, asg.operands) & set(asg.out)
    product = bool(asg.out) and sparse_product(asg)
    if not sparse and not product:
        return OutputFormat(None, 0, "dense: no output index is sparse")
    drv = driver_access(asg)
    if drv is not None and len(set(drv.indices)) == len(drv.indices):
        fmt = asg.operands[drv.operand].format
        m = prefix_levels(fmt, drv, asg.out)
        if m:
            out = remap(fmt, drv, asg.out, m)
            if not (out.is_dense and all(isinstance(e, Var) and e.dim == k for k, e in enumerate(out.exprs))):
                rule = "the driver's pattern" if m == len(fmt.levels) else f"the driver's first {m} level(s)"
                return OutputFormat(out, m, rule)
            if not product:  # (CSR @ a sparse vector is a product of sparse operands: sparse, below)
                return OutputFormat(None, m, "dense: the driver's dense prefix")
    if projected_by_dense_factor(asg):
        return OutputFormat(None, 0, "dense: a dense factor over a projected pattern")
    if product:
        # a product of sparse operands is sparse whatever their level types: a row of the result holds the
        # entries its stored terms reach. Its levels follow the loops that compute it (CSC @ CSC is CSC), and its
        # last level is compressed even where no operand restricts that index alone (CSR @ CSC.T is CSR: the rows
        # of a Gram matrix or a 2-hop graph are as sparse as the products make them, not dense). Its first level,
        # the rows the kernel assembles, is compressed only where an operand's own first level is (DCSR, COO: rows
        # that may be mostly empty); CSC.T @ CSR is CSR, written straight from its rows
        order = _product_order(asg)
        hyper = _first_level_indices(asg)
        levels = [(Var(asg.out.index(v)), Compressed() if k == len(order) - 1 or (v in sparse and (k or v in hyper))
                   else Dense()) for k, v in enumerate(order)]
        return OutputFormat(Format.from_levels(len(asg.out), levels), 0, "a product of sparse operands")
    # levels in the first sparse operand's level order (so its loops stay concordant), then the rest
    first = next((a for a in asg.rhs.accesses() if asg.operands[a.operand].sparse), None)
    order = []
    if first is not None:
        for e in asg.operands[first.operand].format.exprs:
            for d in e.dims():
                v = first.indices[d]
                if v in asg.out and v not in order:
                    order.append(v)
    order += [v for v in asg.out if v not in order]
    levels = [(Var(asg.out.index(v)), Compressed() if v in sparse else Dense()) for v in order]
    return OutputFormat(Format.from_levels(len(asg.out), levels), 0, "levels by sparse indices")
