"""``F.scaled_dot_product_attention`` with a sparse ``attn_mask``: the scores, their softmax and the product with
``value`` computed only at the mask's entries.

The mask says which (query, key) pairs attend, in any scorch format (CSR, COO, blocked, N-d COO...) and of any
shape that broadcasts to ``(*batch, L, S)`` as torch's dense mask does:

- a **bool** mask: its stored entries whose value is True attend (a stored False is masked out, as in the dense
  mask), every other position is masked out;
- a **float** (additive) mask: its stored entries attend, with their values added to the scores; a position not
  stored is masked out: the mask means the dense additive mask whose unstored positions are ``-inf`` (not 0, the
  implicit value of a sparse tensor elsewhere: a sparse mask lists what is allowed). Its values may require
  gradients (a learned bias): they get ``d(loss)/d(score)`` at their entries, as the dense mask's would.

``is_causal=True`` with a sparse mask keeps the mask's entries with ``key <= query`` (torch's top-left causal
mask): the intersection (torch refuses a mask with ``is_causal``; the sparse rule does not need to). A row with no
allowed key gives zeros, and zero gradients, as torch 2.13's SDPA does for a fully masked row.

How it runs: the batch's ``N`` (batch x heads) problems become one: ``query`` as ``(N L, E)``, ``key`` as
``(N S, E)``, ``value`` as ``(N S, Ev)`` and the mask's pattern repeated (or, for a mask with batch dimensions,
laid) along the diagonal of an ``(N L) x (N S)`` CSR pattern, made once per mask and kept (``_PATTERNS``); rows
never mix problems, and the softmax is per row. Without dropout the fused attention kernels run (``scorch.fusion``:
SDDMM, row softmax and SpMM in one pass per row, forward and backward; an additive mask's values added to the
scores as the kernel stores them, ``fuse.add_stores``). Dropout, and an additive mask holding ``-inf``, run the
same three sparse ops one by one (``sampled_addmm``, with an additive mask's values as its input,
``torch.sparse.softmax``, dropout of the probabilities' stored values, ``@``). A dense or absent mask, or a sparse
``query`` / ``key`` / ``value``, is torch's own SDPA (on the dense form, visibly, for a sparse one).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import engine, fusion
from .. import loopir
from ..compiler.caches import register
from ..engine.convert import asformat
from ..formats import LevelStorage, named, storage
from ..formats.storage import PatternMemo
from ..sparse_tensor import SparseTensor, dense_fallback, implements

_SDPA = F.scaled_dot_product_attention
#: the value types the fused kernels take (16-bit ones computed in float32)
_FLOATS = (torch.float32, torch.float64) + loopir.HALF_DTYPES

#: the block-diagonal patterns made from masks, by the mask's arrays (values included: a bool mask's values are
#: part of its pattern) and the problem's shape
_PATTERNS = PatternMemo(32)
register("attention-masks", "block-diagonal attention patterns made from sparse SDPA masks", _PATTERNS.__len__,
         _PATTERNS.clear)


class _Arrays:
    """One more array for ``PatternMemo``'s key (it reads ``levels`` as objects with ``arrays()``)."""

    def __init__(self, **arrays):
        self._arrays = arrays

    def arrays(self):
        return self._arrays


def _check(q, k, v, mask, enable_gqa):
    """torch's argument checks, with torch's messages where torch has one (every one is a RuntimeError there)."""
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise RuntimeError("Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{q.dim()} key.dim: {k.dim()} and value.dim: {v.dim()} instead.")
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: {q.dtype} "
                           f"key.dtype: {k.dtype} and value.dtype: {v.dtype} instead.")
    if not q.dtype.is_floating_point:
        raise RuntimeError(f"scorch: scaled_dot_product_attention takes floating-point query, key and value, got "
                           f"{q.dtype}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {mask.dtype} and  query.dtype: {q.dtype} instead.")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise RuntimeError(f"scaled_dot_product_attention: query {tuple(q.shape)}, key {tuple(k.shape)} and value "
                           f"{tuple(v.shape)} do not fit: query and key need the same last size (E), key and value "
                           "the same number of keys (S)")
    if enable_gqa and q.dim() >= 3 and k.dim() >= 3 and (
            k.shape[-3] != v.shape[-3] or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]):
        raise RuntimeError(f"Number of heads in key and value must divide the number of heads in query: query "
                           f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}")


def _is_coo(mask) -> bool:
    return mask._format in (named.coo_nd(mask.dim()), named.coo_nd(mask.dim(), coalesced=False))


def _mask_entries(mask, L, S, ndim, causal):
    """The mask's allowed entries, coalesced, sorted by (mask batch index, query, key): ``(mb, l, s, at, keep_from,
    batch sizes)``: the flat index over the mask's batch dimensions (of sizes ``batch sizes``, padded to ``ndim -
    2`` on the left), the query and key coordinates (a query or key dimension of size 1 broadcast to ``L`` /
    ``S``), and where each entry's value is: ``at``, a position in the mask's values, or with ``keep_from`` (an
    uncoalesced additive mask: ``(stored positions, inverse, count)``) a position among its summed duplicates."""
    nvals = mask._vals.numel()
    # each stored value's coordinates: a COO mask's own (its duplicates kept), any other format's by converting
    # the positions 1..n (never zero, so none is dropped; no duplicates, so none is summed) to COO
    if mask._format == named.csr:  # (the usual mask: its coordinates read off directly)
        pos = mask._levels[1].pos.to(torch.int64)
        at = torch.arange(nvals, device=mask.device)
        found = [torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff()),
                 mask._levels[1].crd.to(torch.int64)]
    else:
        positions = torch.arange(1, nvals + 1, device=mask.device).reshape(mask._vals.shape)
        coo = mask.with_values(positions) if _is_coo(mask) else asformat(mask.with_values(positions), "coo")
        at = coo._vals.to(torch.int64) - 1
        found = [lvl.crd.to(torch.int64) for lvl in coo._levels]
    pad = ndim - mask.dim()
    coords = [torch.zeros_like(at)] * pad + found
    sizes = (1,) * pad + tuple(mask.shape)
    for d, n in ((ndim - 2, L), (ndim - 1, S)):  # a query or key dimension of size 1, broadcast
        if sizes[d] == 1 and n != 1:
            m = at.numel()
            at, coords = at.repeat(n), [c.repeat(n) for c in coords]
            coords[d] = torch.arange(n, device=at.device).repeat_interleave(m)
    mb = torch.zeros_like(at)
    for c, n in zip(coords[:-2], sizes[:-2]):
        mb = mb * n + c
    l, s = coords[-2], coords[-1]
    key = (mb * L + l) * S + s
    keep_from = None
    if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
        order = torch.argsort(key, stable=True)
        key, at, mb, l, s = key[order], at[order], mb[order], l[order], s[order]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
        if not bool(first.all()):  # duplicates (an uncoalesced COO mask): one entry each, values summed
            inverse = torch.cumsum(first, 0) - 1
            keep_from = (at, inverse, int(inverse[-1]) + 1)
            at = torch.arange(keep_from[2], device=at.device)
            mb, l, s = mb[first], l[first], s[first]
    if mask.dtype == torch.bool:  # a stored False is masked out: only the True entries are the pattern
        allowed = mask._vals.detach().reshape(-1)
        if keep_from is not None:  # duplicates: allowed where any is True (their sum, in the dense form)
            stored, inverse, count = keep_from
            allowed = torch.zeros(count, dtype=torch.int64, device=at.device).index_add_(
                0, inverse, allowed[stored].to(torch.int64)) > 0
            keep_from = None
        keep = allowed[at]
        if causal:
            keep &= s <= l
        mb, l, s, at = mb[keep], l[keep], s[keep], at[keep]
    elif causal:
        keep = s <= l
        mb, l, s, at = mb[keep], l[keep], s[keep], at[keep]
    return mb, l, s, at, keep_from, sizes[:-2]


def _csr(crow, col, values, shape):
    index = storage.pick_index_dtype(col.numel(), *shape)
    return SparseTensor("csr", shape, (LevelStorage(), LevelStorage(pos=crow.to(index), crd=col.to(index))), values,
                        check=False)


def _pattern(mask, batch, L, S, causal, dtype):
    """``(pattern, (transposed, perm), src, keep_from)``: the ``(N L) x (N S)`` block-diagonal CSR pattern (values:
    ones of ``dtype``) of the mask's allowed entries broadcast to ``(*batch, L, S)`` (block ``b``: the mask's batch
    element that ``b`` broadcasts from), its transpose (for the backward's ``dk`` and ``dv``: its entry ``e`` is the
    pattern's entry ``perm[e]``), and each entry's value in the mask (``src``, ``keep_from``: ``_mask_entries``);
    made once per mask arrays and problem shape. The work on entries is done on the mask's own (a mask shared by
    the batch: one block's), then laid out N times, so it stays in order and needs no sort of the big pattern."""
    def make():
        mb, l, s, at, keep_from, msizes = _mask_entries(mask, L, S, len(batch) + 2, causal)
        dev, nmb, n = at.device, math.prod(msizes), math.prod(batch)
        start = torch.zeros(nmb + 1, dtype=torch.int64, device=dev)  # each mask batch element's entries
        start[1:] = torch.cumsum(torch.bincount(mb, minlength=nmb), 0)
        of = torch.arange(nmb, device=dev).reshape(msizes).expand(batch).reshape(-1)  # block -> mask element
        count = start[1:][of] - start[:-1][of]
        first = torch.zeros(n, dtype=torch.int64, device=dev)  # each block's first entry in the pattern
        first[1:] = torch.cumsum(count, 0)[:-1]
        block = torch.repeat_interleave(torch.arange(n, device=dev), count)
        idx = torch.arange(block.numel(), device=dev) + (start[:-1][of] - first)[block]  # -> the mask's entry
        perm_t = torch.argsort((mb * S + s) * L + l)  # the mask's entries in transposed order
        rel = perm_t - start[:-1][mb[perm_t]]

        def crow(rows, size):
            per = torch.bincount(mb * size + rows, minlength=nmb * size).reshape(nmb, size)[of].reshape(-1)
            return torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(per, 0)])

        ones = torch.ones(idx.numel(), dtype=dtype, device=dev)
        pattern = _csr(crow(l, L), s[idx] + block * S, ones, (n * L, n * S))
        transposed = _csr(crow(s, S), l[perm_t][idx] + block * L, ones, (n * S, n * L))
        small = storage.pick_index_dtype(idx.numel(), at.numel())  # (kept with the pattern: int32 where it fits)
        return pattern, (transposed, (rel[idx] + first[block]).to(small)), at[idx].to(small), keep_from

    values = (_Arrays(values=mask._vals),) if mask.dtype == torch.bool else ()
    return _PATTERNS.lookup((tuple(batch), L, S, bool(causal), dtype, tuple(mask.shape), mask._format),
                            (*mask._levels, *values), make)


def _scores(pattern, q, k, scale, bias=None):
    """``scale * q @ k^T`` (plus ``bias``, values on the pattern's entries) at the pattern's entries, by
    ``sampled_addmm``; a stored ``-inf`` in ``bias`` leaves the pattern (``_without_minus_inf``)."""
    if bias is None:
        return torch.sparse.sampled_addmm(pattern, q, k.t(), beta=0.0, alpha=scale)
    scores = torch.sparse.sampled_addmm(pattern.with_values(bias), q, k.t(), beta=1.0, alpha=scale)
    return _without_minus_inf(scores) if bool(torch.isneginf(bias.detach()).any()) else scores


def _attend(pattern, q, k, v, scale, bias=None):
    """The attention on a CSR pattern as three sparse ops (SDDMM, row softmax, SpMM): differentiable by autograd
    through their own rules; the fused kernels' fallback and their recorded (double) backward."""
    return torch.sparse.softmax(_scores(pattern, q, k, scale, bias), 1) @ v


class _FusedAttention(torch.autograd.Function):
    """``softmax(scale * SDDMM(pattern, q, k) + bias) @ v`` by ``fusion.attention`` (one pass per row), backward by
    ``fusion.attention_backward`` (the scores' gradient and ``dq`` in one pass; the bias's gradient is the scores'
    without the scale) and two transposed products (``dk``, ``dv``). Called directly rather than through
    ``scorch.compile``'s lazy values: those fingerprint ``q`` and ``k`` on every call (design notes, issue 44)."""

    @staticmethod
    def forward(ctx, boxed, q, k, v, bias, scale):
        pattern, ctx_t = boxed
        keep = ctx is not None and any(ctx.needs_input_grad[1:5])
        out, p = fusion.attention(fusion.SddmmExpr(pattern, q, k, scale, bias), v, keep_probs=keep)
        if ctx is not None:
            ctx.pattern, ctx.transposed, ctx.scale = pattern, ctx_t, scale
            ctx.save_for_backward(p, q, k, v, bias)
        return out

    @staticmethod
    def backward(ctx, g):
        p, q, k, v, bias = ctx.saved_tensors
        pattern, scale, need = ctx.pattern, ctx.scale, ctx.needs_input_grad[1:5]
        done = None if torch.is_grad_enabled() else fusion.attention_backward(pattern, p, g, v, k, scale)
        if done is None:  # a backward recording a graph, or kernels that are not one row loop: op by op
            return (None, *_unfused_grads(pattern, (q, k, v, bias), scale, g, need), None)
        ds, dq = done
        transposed, perm = ctx.transposed
        dk = engine.einsum("ij,jk->ik", transposed.with_values(ds[perm]), q) if need[1] else None
        dv = engine.einsum("ij,jk->ik", transposed.with_values(p[perm]), g) if need[2] else None
        return None, dq if need[0] else None, dk, dv, ds / scale if need[3] else None, None


def _unfused_grads(pattern, inputs, scale, g, need):
    """The gradients of ``inputs`` (q, k, v, bias; where ``need``ed) through the three ops, differentiated by
    autograd: as a graph of the saved inputs when the backward records one (the fused backward's probabilities are
    saved values, so second-order terms through them would be lost), else on detached copies."""
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        xs = [x if x is None or (graph and n) else x.detach().requires_grad_(n) for x, n in zip(inputs, need)]
        out = _attend(pattern, *xs[:3], scale, xs[3])
        got = iter(torch.autograd.grad(out, [x for x, n in zip(xs, need) if n], g, create_graph=graph,
                                       allow_unused=True))
    return tuple(next(got) if n else None for n in need)


def _bias(mask, src, keep_from, dtype, problem):
    """``(bias, minus_inf)``: an additive mask's values on the pattern's entries (``_pattern``'s ``src``,
    ``keep_from``) as ``dtype``, and whether any is ``-inf``; kept per mask values unless they need a gradient."""
    def make():
        bias = mask._vals.reshape(-1).to(dtype)
        if keep_from is not None:  # an uncoalesced mask's duplicates: their sum, as its dense form has
            at, inverse, count = keep_from
            bias = torch.zeros(count, dtype=bias.dtype, device=bias.device).index_add(0, inverse, bias[at])
        return bias[src], bool(torch.isneginf(mask._vals.detach()).any())

    if mask._vals.requires_grad and torch.is_grad_enabled():
        return make()
    batch, L, S, causal = problem
    return _PATTERNS.lookup(("bias", tuple(batch), L, S, bool(causal), dtype, tuple(mask.shape), mask._format),
                            (*mask._levels, _Arrays(values=mask._vals)), make)


def _fused(pattern, transposed, q, k, v, scale, bias, minus_inf):
    """The attention by the fused kernels (CPU, float types; with a bias: no ``-inf`` in it, a nonzero scale,
    which its gradient is divided by), else by the three ops."""
    if q.device.type != "cpu" or q.dtype not in _FLOATS or (bias is not None and (scale == 0 or minus_inf)):
        return _attend(pattern, q, k, v, scale, bias)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, bias)):
        return _FusedAttention.apply((pattern, transposed), q, k, v, bias, scale)
    return _FusedAttention.forward(None, (pattern, transposed), q, k, v, bias, scale)


@implements(_SDPA)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention with a sparse ``attn_mask`` (any format: CSR, COO, blocked,
    N-d COO, torch's sparse layouts; a shape broadcasting to ``(*batch, L, S)``) computes the attention only at the
    mask's allowed entries: a bool mask's stored True entries (a stored False is masked out), or an additive float
    mask's stored entries (a blocked format's stored padding too), their values added to the scores (an unstored
    position means -inf: masked out). Every batch x head problem runs in one block-diagonal pattern, made once per
    mask, by the fused SDDMM (+ the additive mask) -> row softmax -> SpMM kernels, forward and backward; with
    ``dropout_p > 0``, or an additive mask holding -inf, by the three sparse ops in turn. ``is_causal=True`` keeps
    the mask's entries with key <= query (torch refuses a mask with it); ``scale``, ``dropout_p`` and ``enable_gqa`` as torch; a row with no allowed key gives zeros, as
    torch. Values and gradients (q, k, v, and an additive mask's values) are dense SDPA's given the dense mask. A
    dense or absent mask is torch's own SDPA; a sparse query, key or value, or a hybrid mask, the dense fallback.

    (The module's documentation says how; ``_pattern`` how the mask becomes the pattern.)"""
    mask = attn_mask
    if type(mask) is not SparseTensor or any(type(t) is SparseTensor for t in (query, key, value)) or \
            mask.dense_dim() or (mask._format.keeps_duplicates and not _is_coo(mask)):
        # (a hybrid mask, or duplicates in a format other than COO: on the dense form, visibly)
        return dense_fallback(_SDPA, (query, key, value), dict(
            attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))
    _check(query, key, value, mask, enable_gqa)
    q, k, v = query, key, value
    if enable_gqa and q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # torch's grouped query
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if torch.broadcast_shapes(tuple(mask.shape), (*batch, L, S)) != (*batch, L, S):
        raise RuntimeError(f"scaled_dot_product_attention: attn_mask of shape {tuple(mask.shape)} does not broadcast "
                           f"to the attention's shape {(*batch, L, S)}")
    n = math.prod(batch)
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    out_shape = (*batch, L, Ev)
    if n * L * Ev == 0 or n * S == 0:  # an empty problem: torch's answer, on an empty (so free) dense mask
        return _SDPA(query, key, value, attn_mask=mask.to_dense(), dropout_p=dropout_p, scale=scale,
                     enable_gqa=enable_gqa)
    pattern, transposed, src, keep_from = _pattern(mask, batch, L, S, is_causal, q.dtype)
    q2 = q.expand(*batch, L, E).reshape(n * L, E)
    k2 = k.expand(*batch, S, E).reshape(n * S, E)
    v2 = v.expand(*batch, S, Ev).reshape(n * S, Ev)
    bias, minus_inf = (None, False) if mask.dtype == torch.bool else _bias(mask, src, keep_from, q.dtype,
                                                                                      (batch, L, S, is_causal))
    if dropout_p > 0.0:  # (dropout of the probabilities: not in the fused kernel)
        out = F.dropout(torch.sparse.softmax(_scores(pattern, q2, k2, scale, bias), 1), dropout_p, True) @ v2
    else:
        out = _fused(pattern, transposed, q2, k2, v2, scale, bias, minus_inf)
    return out.reshape(out_shape)


def _without_minus_inf(scores):
    """The scores with their ``-inf`` entries (a stored ``-inf`` of an additive mask) left out of the pattern: they
    are masked out either way, and a row of only ``-inf`` gives torch's zeros instead of the softmax's NaN."""
    vals = scores._vals
    out = torch.isneginf(vals.detach())
    pos = scores._levels[1].pos.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(pos.numel() - 1, device=pos.device), pos.diff())
    keep = ~out
    crow = torch.zeros_like(pos)
    crow[1:] = torch.cumsum(torch.bincount(rows[keep], minlength=pos.numel() - 1), 0)
    return _csr(crow, scores._levels[1].crd[keep], vals[keep], tuple(scores.shape))
