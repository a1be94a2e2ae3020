"""Grouped products, run (the planning is ``compiler/grouped.py``): the sparse operand's entries sorted by their
group coordinates, then per group one dense product in torch (a slice of the sliced operands, the group's rows
gathered from the others), placed into the result's rows. Autograd differentiates it as it stands, except the
mixture-of-experts form (``moe_operands``), which is its own autograd Function: the entries sorted by group once,
one gather of the rows, the groups' products written into contiguous row ranges of one buffer (``mm(out=)``), and
a backward that reuses that order and the gathered rows.
"""
from __future__ import annotations

import math

import torch

from ..compiler import grouped_gemm, relayout
from ..compiler.einsum import equation as einsum_string
from ..compiler.grouped import Grouping, moe_operands
from ..formats.storage import linear_index


def entries(x, grouping: Grouping, letters):
    """``(dims, values, starts)`` of sparse ``x``'s stored entries sorted by their group coordinates:
    ``dims`` ``(ndim, M)`` in ``letters``' order; ``starts`` the first entry of each group, plus the end."""
    from ..formats import storage
    dims, vals = storage.unpack(x.format, x.shape, x.levels, x.values())
    gpos = [letters.index(v) for v in grouping.group]
    key = storage.linear_index(dims[gpos], [x.shape[p] for p in gpos])
    key, order = torch.sort(key, stable=True)
    counts = torch.unique_consecutive(key, return_counts=True)[1]
    return dims[:, order], vals[order], [0] + torch.cumsum(counts, 0).tolist()


def evaluate(grouping: Grouping, inputs, out, ops, sizes):
    """The einsum ``inputs -> out`` over ``ops`` (torch tensors and the one SparseTensor), group by group."""
    k = grouping.sparse
    letters = inputs[k]
    dtype = ops[k].dtype
    for j, t in enumerate(ops):
        if j != k:
            dtype = torch.promote_types(dtype, t.dtype)
    form = moe_operands(grouping, inputs, out)
    if form is not None:
        return _moe_product(grouping, form, inputs, ops, sizes, dtype)
    dims, vals, starts = entries(ops[k], grouping, letters)
    vals = vals.to(dtype)
    coords = {v: dims[letters.index(v)] for v in letters}
    used = {v for i in inputs for v in i}
    p = next(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used)  # the entry

    def sub(idx):  # the row indices replaced by p, at the first one's place
        first = next((v for v in idx if v in grouping.rows), None)
        return tuple(p if v == first else v for v in idx if v == first or v not in grouping.rows)

    # dense operands holding row indices are gathered at the entries' rows; the others are sliced per group
    gathered, sliced = [], []
    for j, (idx, t) in enumerate(zip(inputs, ops)):
        if j == k:
            continue
        t = t.to(dtype)
        if set(idx) & set(grouping.rows):
            gathered.append((_gather(t, idx, grouping.rows, coords), sub(idx)))
        else:
            sliced.append((t, idx))
    if gathered:  # the values weigh the first gathered operand (a gathered copy: weighed in place)
        t, idx = gathered[0]
        w = vals.reshape([-1 if v == p else 1 for v in idx])
        if torch.is_grad_enabled() and (t.requires_grad or vals.requires_grad):
            gathered[0] = (t * w, idx)
        elif not bool((vals == 1).all()):  # (gates of ones, as a one-hot: nothing to weigh)
            gathered[0] = (t.mul_(w), idx)
    else:
        gathered.append((vals, (p,)))
    keep_p = bool(set(out) & set(grouping.rows))
    res_idx = sub(out) if keep_p else tuple(v for v in out if v not in grouping.group)
    idx_g = [idx for _, idx in gathered] + [tuple(v for v in idx if v not in grouping.group) for _, idx in sliced]
    eq = einsum_string(idx_g, res_idx)
    held = [v for v in out if v in letters]  # the output's dimensions the entries address
    rest = [v for v in out if v not in letters]
    product = matrix_product(idx_g, res_idx, p) or (lambda a: torch.einsum(eq, *a))
    parts, firsts = [], []
    for lo, hi in zip(starts[:-1], starts[1:]):
        key = [int(coords[v][lo]) for v in grouping.group]
        ops_g = [t.narrow(idx.index(p), lo, hi - lo) for t, idx in gathered]
        ops_g += [_select(t, idx, grouping.group, key) for t, idx in sliced]
        parts.append(product(ops_g))
        firsts.append(lo)
    shape = [math.prod(sizes[v] for v in held)] + [sizes[v] for v in rest]
    if not firsts:
        result = torch.zeros(shape, dtype=dtype, device=vals.device)
    elif keep_p:  # one row of the result per entry: added at the entry's coordinates
        part = torch.cat(parts, res_idx.index(p)) if len(parts) > 1 else parts[0]
        part = part.permute([res_idx.index(v) for v in [p] + rest])
        at = _linear([coords[v] for v in held], [sizes[v] for v in held], part.shape[0], vals.device)
        result = placed(part, at, shape)
    else:  # one result per group: added at the group's coordinates
        part = torch.stack([q.permute([res_idx.index(v) for v in rest]) for q in parts])
        first = torch.tensor(firsts, dtype=torch.long, device=vals.device)
        at = _linear([coords[v][first] for v in held], [sizes[v] for v in held], len(firsts), vals.device)
        result = placed(part, at, shape)
    shape = [sizes[v] for v in held + rest]
    return result.reshape(shape).permute([(held + rest).index(v) for v in out])


def matrix_product(idx_g, res_idx, p):
    """A group's einsum as one ``torch.mm`` where it is a plain matrix product (measured faster than einsum's
    dispatch, and than ``mm(out=)`` into a slice): ``"pa,ab->pb"`` (the forward of a mixture of experts) or
    ``"pa,pb->ab"`` and ``"pa,pb->ba"`` (the gradient of its expert weights: the group's rows contracted);
    None otherwise. Public for tests (``tests/compiler/test_grouped.py`` checks which forms it takes)."""
    if len(idx_g) != 2 or len(idx_g[0]) != 2 or len(idx_g[1]) != 2 or len(res_idx) != 2:
        return None
    (a0, a1), (b0, b1) = idx_g
    if a0 == p and a1 == b0 and res_idx == (p, b1):
        return lambda ops: torch.mm(ops[0], ops[1])
    if a0 == p and b0 == p and a1 != b1:
        if res_idx == (a1, b1):
            return lambda ops: torch.mm(ops[0].t(), ops[1])
        if res_idx == (b1, a1):
            return lambda ops: torch.mm(ops[1].t(), ops[0])
    return None


class Routing:
    """The sparse operand's entries sorted by group once, for the forward and the backward alike: ``rows`` the
    entries' rows in that order, ``starts`` each group's first entry (and the end: ``starts[g]:starts[g + 1]``
    is group g's range), ``ranges`` ``(group, lo, hi)`` of each group with entries, ``covered`` whether every
    group has some; ``once`` whether each of the ``n`` rows is named exactly once (top-1 gates), and then
    ``inverse``, the entry of each row: the result is gathered in row order (faster than a scatter, and no zero
    fill), else ``inverse`` is None and the entries are added into zeros. ``route`` makes one."""

    __slots__ = ("rows", "starts", "n", "ranges", "covered", "once", "_inverse")

    def __init__(self, rows, starts, n, once):
        self.rows, self.starts, self.n, self.once, self._inverse = rows, starts, n, once, None
        bounds = starts.tolist()
        self.ranges = [(g, lo, hi) for g, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo]
        self.covered = len(self.ranges) == len(bounds) - 1

    @property
    def inverse(self):
        if self.once and self._inverse is None:
            self._inverse = torch.empty_like(self.rows).scatter_(0, self.rows, torch.arange(
                self.n, device=self.rows.device))
        return self._inverse if self.once else None


def route(groups, rows, n_groups, n):
    """``(Routing, order)``: the entries (their groups and rows, in storage order) sorted by group, stably
    (``order`` the permutation of the entries), by a compiled counting sort that also says whether every one of
    the ``n`` rows is named once (on the CPU; torch's sort elsewhere)."""
    groups, rows = groups.to(torch.int64), rows.to(torch.int64)
    if groups.device.type != "cpu":
        keys, order = torch.sort(groups, stable=True)
        starts = torch.cat([keys.new_zeros(1), torch.cumsum(torch.bincount(keys, minlength=n_groups), 0)])
        rows = rows[order]
        return Routing(rows, starts, n, _once_each(rows, n)), order
    groups, rows = groups.contiguous(), rows.contiguous()
    starts = torch.empty(n_groups + 1, dtype=torch.int64)
    sorted_rows, order = torch.empty_like(rows), torch.empty_like(rows)
    once = grouped_gemm.kernel("route")(groups.numel(), groups.data_ptr(), rows.data_ptr(), n_groups, n,
                                        starts.data_ptr(), sorted_rows.data_ptr(), order.data_ptr())
    if once < 0:
        raise IndexError(f"a sparse operand's entry names group {-once - 1}, past its {n_groups} groups")
    return Routing(sorted_rows, starts, n, bool(once)), order


def _mm_ranges(routing, a, b_of, cols, transpose_a=False, out=None):
    """Per group ``g`` the product of ``a``'s rows ``lo:hi`` (transposed when ``transpose_a``) with
    ``b_of(g, lo, hi)``, each written straight into its place in one result (no per-group allocation, no
    concatenation; measured as fast as a fresh product per group): the rows ``lo:hi`` of an (entries x ``cols``)
    matrix, or with ``transpose_a`` the slice ``out[g]`` (groups without entries zero). Under a recorded graph
    (double backward) the same products as differentiable ops."""
    if torch.is_grad_enabled():  # (inside a Function only under create_graph)
        if transpose_a:
            parts = {g: a[lo:hi].t() @ b_of(g, lo, hi) for g, lo, hi in routing.ranges}
            return torch.stack([parts[g] if g in parts else a.new_zeros(a.shape[1], cols)
                                for g in range(out.shape[0])])
        parts = [a[lo:hi] @ b_of(g, lo, hi) for g, lo, hi in routing.ranges]
        return torch.cat(parts) if parts else a.new_zeros(0, cols)
    if transpose_a:
        if not routing.covered:
            out.zero_()
        for g, lo, hi in routing.ranges:
            torch.mm(a[lo:hi].t(), b_of(g, lo, hi), out=out[g])
        return out
    res = a.new_empty(a.shape[0], cols)
    for g, lo, hi in routing.ranges:
        torch.mm(a[lo:hi], b_of(g, lo, hi), out=res[lo:hi])
    return res


def _place(routing, part, cols):
    """The entries' rows ``part`` added into the ``n`` result rows at ``routing.rows`` (gathered in row order
    where each row is named once)."""
    if routing.inverse is not None:
        return part.index_select(0, routing.inverse)
    return part.new_zeros(routing.n, cols).index_add_(0, routing.rows, part)


class _GroupedProduct(torch.autograd.Function):
    """``y[r, h] = sum_e v[e] x[rows[e], d] W[g(e), d, h]`` over the entries ``e`` sorted by group. float32 on the
    CPU: the compiled kernels (``compiled_forward``, ``compiled_backward``). Otherwise torch ops: one gather of
    ``x``'s rows, one matrix product per group over its contiguous range, the weighted rows placed into ``y``; the
    backward reuses the sorted order and the gathered rows: ``dW[g] = X_g^T (v dY_g)``, ``dx`` the products
    ``(v dY_g) W[g]^T`` placed back, the values' gradient each entry's row of ``dY`` against its product."""

    @staticmethod
    def forward(ctx, routing, vals, x, w):
        ctx.routing = routing
        if compiled(vals, x, w):
            # the gate values' gradient needs each entry's product unweighted: ``y``'s row over the weight where
            # each row has one entry and no weight is too small to divide by (no second result written), else
            # the products kept
            ctx.p_in_y = ctx.needs_input_grad[1] and routing.once and bool((vals.abs() >= DIVISIBLE).all())
            y, p = compiled_forward(routing, vals, x, w, keep=ctx.needs_input_grad[1] and not ctx.p_in_y)
            ctx.save_for_backward(vals, x, w, None, y if ctx.p_in_y else p)
            return y
        xs = x.index_select(0, routing.rows)
        p = _mm_ranges(routing, xs, lambda g, lo, hi: w[g], w.shape[2])
        ctx.save_for_backward(vals, x, w, xs, p)
        if routing.inverse is not None:  # (gathered first, then weighed in place: one result-sized allocation)
            return p.index_select(0, routing.inverse).mul_(vals.index_select(0, routing.inverse)[:, None])
        return _place(routing, p * vals[:, None], w.shape[2])

    @staticmethod
    def backward(ctx, dy):
        routing = ctx.routing
        vals, x, w, xs, p = ctx.saved_tensors
        if xs is None and not torch.is_grad_enabled() and compiled(vals, x, w, dy):
            return (None,) + compiled_backward(routing, vals, x, w, p, ctx.p_in_y, dy, ctx.needs_input_grad[1:])
        if torch.is_grad_enabled() or xs is None:  # a graph of the backward (the products again, as
            xs = x.index_select(0, routing.rows)    # differentiable ops), or the compiled forward's inputs
            p = _mm_ranges(routing, xs, lambda g, lo, hi: w[g], w.shape[2])
        dys = dy.index_select(0, routing.rows)
        gv = (dys * p).sum(1) if ctx.needs_input_grad[1] else None
        dps = dys * vals[:, None] if torch.is_grad_enabled() else dys.mul_(vals[:, None])  # (dys: a gathered copy)
        gx = gw = None
        if ctx.needs_input_grad[2]:
            dxs = _mm_ranges(routing, dps, lambda g, lo, hi: w[g].t(), w.shape[1])
            gx = _place(routing, dxs, w.shape[1])
        if ctx.needs_input_grad[3]:
            gw = _mm_ranges(routing, xs, lambda g, lo, hi: dps[lo:hi], w.shape[2], transpose_a=True,
                            out=torch.empty_like(w))
        return None, gv, gx, gw


def compiled(*ts) -> bool:
    """Whether the compiled kernels (``compiler/grouped_gemm.py``) serve: float32 CPU tensors, and ``x`` and ``W``
    not empty (the others take the torch ops below)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts) and ts[1].numel() > 0 and \
        ts[2].numel() > 0


def compiled_operands(ops) -> bool:
    """Whether an einsum over ``ops`` computes in float32 on the CPU (its operands' promoted type), so that a
    mixture-of-experts product among them runs by the compiled kernels (the planner's ``compiled``)."""
    dtype = ops[0].dtype
    for t in ops[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype == torch.float32 and all(t.device.type == "cpu" for t in ops)


def compiled_forward(routing, vals, x, w, keep):
    """``(y, p)``: ``y[r] = sum_e v[e] x[rows[e]] W[g(e)]`` by the compiled kernel, and with ``keep`` the sorted
    entries' products unweighted ``p`` (else None). Where rows repeat (top-k > 1) the kernel writes the entries'
    products and torch adds them into ``y``'s rows."""
    x, w, vals = x.contiguous(), w.contiguous(), vals.contiguous()
    rows, starts = routing.rows.to(torch.int64).contiguous(), routing.starts.to(torch.int64)
    (n, d), (groups, _, h) = x.shape, w.shape
    once = routing.once
    y = x.new_empty(n, h) if once else None
    p = x.new_empty(rows.numel(), h) if keep or not once else None
    threads = torch.get_num_threads()
    grouped_gemm.kernel("forward")(groups, starts.data_ptr(), rows.data_ptr(), vals.data_ptr(), x.data_ptr(),
                                   w.data_ptr(), d, h, y.data_ptr() if once else None,
                                   None if p is None else p.data_ptr(), int(not keep),
                                   grouped_gemm.row_block(rows.numel(), d, threads), threads)
    if not once:
        y = x.new_zeros(n, h).index_add_(0, rows, p * vals[:, None] if keep else p)
    return y, p


def compiled_backward(routing, vals, x, w, p, p_in_y, dy, needs):
    """The gradients ``(vals, x, W)`` (None where ``needs`` says not) of ``compiled_forward``, given its unweighted
    products ``p`` (or with ``p_in_y`` its result, each row one entry's product weighted): ``dW`` and the gate
    values' by the weight gradient's kernel, ``dx`` by the forward's with each expert's matrix transposed (one
    copy of ``W``, by ``relayout``'s tiled transposition)."""
    x, w, vals, dy = x.contiguous(), w.contiguous(), vals.contiguous(), dy.contiguous()
    rows, starts = routing.rows.to(torch.int64).contiguous(), routing.starts.to(torch.int64)
    (_, d), (groups, _, h) = x.shape, w.shape
    gv = gx = gw = None
    if needs[2]:
        gw = torch.empty_like(w)
        gv = x.new_empty(rows.numel()) if needs[0] else None
        mc, db = grouped_gemm.grad_blocks(groups, rows.numel(), d, h, torch.get_num_threads())
        grouped_gemm.kernel("weight_grad")(groups, starts.data_ptr(), rows.data_ptr(), vals.data_ptr(),
                                           x.data_ptr(), dy.data_ptr(), None if gv is None else p.data_ptr(),
                                           int(p_in_y), d, h, gw.data_ptr(), None if gv is None else gv.data_ptr(),
                                           mc, db, torch.get_num_threads())
    elif needs[0]:
        gv = (dy.index_select(0, rows) * (p.index_select(0, rows) if p_in_y else p)).sum(1)
        gv = gv / vals if p_in_y else gv
    if needs[1]:  # dx[r] = sum_e v[e] dY[rows[e]] W[g(e)]^T: the forward's kernel on W transposed
        gx = compiled_forward(routing, vals, dy, relayout.dim_last(w, 1), keep=False)[0]
    return gv, gx, gw


#: the smallest gate weight by which the forward's result is divided to recover an entry's product (top-1): the
#: quotient's error is then at most float32's smallest subnormal step (1.4e-45) / 2^-40 = 1.5e-33 an element
DIVISIBLE = 2.0 ** -40

#: above this many bytes of gathered rows, the forward without gradients runs group by group in the cache (the
#: gathered rows and their product stay there between the calls); below it, as whole-array ops (fewer calls)
IN_CACHE_BYTES = 1 << 20


def _moe_product(grouping, form, inputs, ops, sizes, dtype):
    """The mixture-of-experts form ``y[r, h] = sum S[r, g] x[r, d] W[g, d, h]`` (``moe_operands``): the entries
    sorted by group once (their counts by ``bincount``, no per-group search). With gradients, ``_GroupedProduct``;
    without, the same products with the values applied in place, large ones group by group in the cache: the
    group's rows of ``x`` gathered (weighed unless the values are ones), one matrix product with ``W[g]``, the
    product copied (or added, where rows repeat) into ``y``'s rows while it is still in the cache."""
    from ..formats import storage
    k = grouping.sparse
    xj, wj = form
    s, letters = ops[k], inputs[k]
    (r,), (g,) = grouping.rows, grouping.group
    dims, vals = storage.unpack(s.format, s.shape, s.levels, s.values())
    routing, order = route(dims[letters.index(g)], dims[letters.index(r)], sizes[g], sizes[r])
    vals, x, w = vals[order].to(dtype), ops[xj].to(dtype), ops[wj].to(dtype)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or vals.requires_grad):
        return _GroupedProduct.apply(routing, vals, x, w)
    if compiled(vals, x, w):
        return compiled_forward(routing, vals, x, w, keep=False)[0]
    h = w.shape[2]
    ones = bool((vals == 1).all())
    if vals.numel() * max(x.shape[1], h) * x.element_size() <= IN_CACHE_BYTES:
        xs = x.index_select(0, routing.rows)
        p = _mm_ranges(routing, xs, lambda gi, lo, hi: w[gi], h)
        return _place(routing, p if ones else p.mul_(vals[:, None]), h)
    y = (torch.zeros if routing.inverse is None else torch.empty)(sizes[r], h, dtype=dtype, device=x.device)
    # one buffer each for the gathered rows and their product, reused group after group (no allocation per
    # group: a large one is fresh pages from the system, each page a fault)
    most = max((hi - lo for _, lo, hi in routing.ranges), default=0)
    xbuf = torch.empty(most, x.shape[1], dtype=dtype, device=x.device)
    pbuf = torch.empty(most, h, dtype=dtype, device=x.device)
    for gi, lo, hi in routing.ranges:
        at = routing.rows[lo:hi]
        xg = torch.index_select(x, 0, at, out=xbuf[:hi - lo])
        if not ones:
            xg.mul_(vals[lo:hi, None])
        prod = torch.mm(xg, w[gi], out=pbuf[:hi - lo])
        if routing.inverse is not None:
            y.index_copy_(0, at, prod)
        else:
            y.index_add_(0, at, prod)
    return y


def placed(part, at, shape):
    """The rows of ``part`` added into a zero tensor of ``shape`` at the rows ``at``. Where ``at`` names each row
    exactly once (top-1 gates; every expert's gradient) a gather in row order instead: no zero fill, no adds
    (the identity order, the usual one for groups, is ``part`` itself). Public for tests
    (``tests/compiler/test_grouped.py``)."""
    n = shape[0]
    if not _once_each(at, n):
        return torch.zeros(shape, dtype=part.dtype, device=part.device).index_add(0, at, part)
    if bool((at == torch.arange(n, device=at.device)).all()):
        return part
    return part.index_select(0, torch.empty_like(at).scatter_(0, at, torch.arange(n, device=at.device)))


def _once_each(at, n) -> bool:
    """Whether the row numbers ``at`` name each of ``n`` rows exactly once (the result needs no zero fill)."""
    return at.numel() == n and bool((torch.bincount(at, minlength=n) == 1).all())


def _linear(coords, extents, n, device):
    """The row-major linear index of ``n`` coordinates (one tensor per dimension; none: all 0)."""
    if not coords:
        return torch.zeros(n, dtype=torch.long, device=device)
    return linear_index(torch.stack(coords), extents)


def _gather(t, idx, rows, coords):
    """Dense ``t`` (indices ``idx``) at the entries' row coordinates: its row dimensions become one entry
    dimension, at the first one's place."""
    held = [v for v in idx if v in rows]
    dims = [idx.index(v) for v in held]
    others = [d for d in range(t.dim()) if d not in dims]
    flat = t.permute(dims + others).reshape([math.prod(t.shape[d] for d in dims)] + [t.shape[d] for d in others])
    g = flat.index_select(0, _linear([coords[v] for v in held], [t.shape[d] for d in dims],
                                      coords[held[0]].shape[0], t.device))
    place = [dims[0]] + others  # the dimensions of g, by their place in idx
    return g.permute(sorted(range(len(place)), key=lambda a: place[a]))


def _select(t, idx, group, key):
    """Dense ``t`` at the group coordinates ``key`` along its group dimensions."""
    for v in reversed([v for v in idx if v in group]):
        t = t.select(idx.index(v), key[group.index(v)])
        idx = tuple(w for w in idx if w != v)
    return t
