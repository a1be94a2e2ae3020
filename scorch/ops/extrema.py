"""``torch.max`` / ``min`` / ``argmax`` / ``argmin`` of SparseTensors, with torch's semantics: reductions over the
stored entries with the implicit zeros accounted for; dense results, as torch's. ``max(x, dim)`` returns the
index of the first maximum along ``dim``, an implicit zero included, as torch does. (``amax`` / ``amin``, a
compiled reduction, are in ``reduce``.)

Everything is vectorized torch on the values and the coordinates, so autograd (through the values) comes from
torch's own ops.
"""
from __future__ import annotations

import torch

from ..sparse_tensor import NoSparseRule, SparseTensor
from .entries import _entries, _groups, _kind, _linear, _no_out, _probe_shape, _register, _shaped

_T = torch.Tensor


def _select(x: SparseTensor, dim, largest: bool):
    """The first extreme of each group along ``dim`` (or of the flattened tensor where ``dim`` is None), implicit
    zeros included: ``(values, indices, reduce_dims)``, values differentiable (the gradient goes to the chosen entry,
    as torch's ``max(x, dim)`` sends it)."""
    edims, v = _entries(x)
    shape = x._shape
    if dim is None:
        rdims = tuple(range(x.dim()))
        coord, n = _linear(edims, shape), x.numel()
    else:
        rdims = (dim % x.dim(),)
        coord, n = edims[rdims[0]], shape[rdims[0]]
    gid, groups, _ = _groups(shape, edims, rdims)
    vd = v.detach()
    count = torch.bincount(gid, minlength=groups)
    implicit = count < n
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    best = torch.zeros(groups, dtype=v.dtype, device=v.device)
    best = best.scatter_reduce(0, gid, vd, "amax" if largest else "amin", include_self=False)
    beyond = (best < zero) if largest else (best > zero)  # an implicit zero beats the stored extreme
    best = torch.where(implicit & beyond, zero, best)  # (a group with nothing stored keeps 0 from the start)
    if v.is_floating_point():
        nan = torch.isnan(vd)
        has_nan = torch.zeros(groups, dtype=torch.bool, device=v.device)
        has_nan = has_nan.index_put((gid[nan],), torch.ones((), dtype=torch.bool, device=v.device))
        best = torch.where(has_nan, torch.nan, best)
        hit = torch.where(has_nan[gid], nan, vd == best[gid])
    else:
        has_nan = torch.zeros(groups, dtype=torch.bool, device=v.device)
        hit = vd == best[gid]
    # the first stored position holding the extreme...
    first = torch.full((groups,), n, dtype=torch.int64, device=v.device)
    first = first.scatter_reduce(0, gid[hit], coord[hit], "amin", include_self=True)
    # ... and the first implicit zero: in a group sorted by coordinate, the k-th stored entry sits at k until the
    # first gap, so the number of entries sitting at their rank is the first missing coordinate
    order = torch.argsort(gid * max(n, 1) + coord)
    g, c = gid[order], coord[order]
    start = torch.cumsum(count, 0) - count
    rank = torch.arange(g.numel(), device=v.device) - start[g]
    gap = torch.zeros(groups, dtype=torch.int64, device=v.device).index_add(0, g, (c == rank).long())
    zero_wins = implicit & (best == 0) & ~has_nan
    index = torch.minimum(first, torch.where(zero_wins, gap, n))
    # the chosen value: from its stored entry (differentiable), or an implicit 0
    entry = torch.full((groups,), v.numel(), dtype=torch.int64, device=v.device)
    at = coord == index[gid]
    entry = entry.scatter_reduce(0, gid[at], torch.arange(v.numel(), device=v.device)[at], "amin", include_self=True)
    values = torch.cat([v, zero.reshape(1)])[entry]
    return values, index, rdims


def _dim_arg(args, kwargs):
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    return dim, keepdim


def _extremum(largest: bool):
    name = "max" if largest else "min"
    torch_fn = torch.max if largest else torch.min
    result_type = torch.return_types.max if largest else torch.return_types.min

    def apply(x, *args, **kwargs):
        """max / min: over everything (a 0-d tensor; the gradient shared by the tied positions), or along ``dim``
        (values and the index of the first extreme, an implicit zero included, as torch's); dense."""
        _no_out(kwargs.pop("out", None), f"torch.{name}", x)
        if args and isinstance(args[0], torch.Tensor) or isinstance(kwargs.get("other"), torch.Tensor) or (
                not isinstance(x, SparseTensor)):
            other = args[0] if args else kwargs.get("other")
            raise NoSparseRule(f"scorch: torch.{name}({_kind(x)}, {_kind(other)}): the elementwise {name} of"
                                      " a sparse tensor is not supported")
        dim, keepdim = _dim_arg(args, kwargs)
        probe = torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device)
        if dim is None:
            torch_fn(probe)  # torch's dtype checks
            if x.numel() == 0:
                return torch_fn(x.to_dense())  # torch's error for an empty tensor
            return _all_extreme(x, largest)
        torch_fn(probe, dim, keepdim)  # torch's checks of dim
        if x.numel() == 0:
            return torch_fn(x.to_dense(), dim, keepdim)
        values, index, rdims = _select(x, dim, largest)
        return result_type((_shaped(values, x._shape, rdims, keepdim), _shaped(index, x._shape, rdims, keepdim)))
    apply.__name__ = apply.__qualname__ = name
    return apply


def _all_extreme(x: SparseTensor, largest: bool):
    """``torch.max(x)``: the extreme over every position; the gradient is shared by all the positions holding it,
    implicit zeros included (as torch shares it)."""
    _, v = _entries(x)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    implicit = x.numel() - v.numel()
    vd = v.detach()
    if v.numel():
        best = vd.max() if largest else vd.min()
        if implicit and ((best < zero) if largest else (best > zero)):
            best = zero
    else:
        best = zero
    if not v.is_floating_point() or not v.requires_grad:
        return best.clone()
    ties = (vd == best).to(v.dtype)
    share = ties / (ties.sum() + (implicit if bool(best == 0) else 0)).clamp(min=1)
    picked = (v * share).sum()
    return best + (picked - picked.detach())  # the exact value, the gradient spread over the ties


def _arg_extremum(largest: bool):
    name = "argmax" if largest else "argmin"
    torch_fn = torch.argmax if largest else torch.argmin

    def apply(x, dim=None, keepdim=False, *, out=None):
        """argmax / argmin: the index of the first extreme (flattened, or along ``dim``), implicit zeros included."""
        _no_out(out, f"torch.{name}", x)
        torch_fn(torch.zeros(_probe_shape(x), dtype=x.dtype, device=x.device), dim, keepdim)
        if x.numel() == 0:
            return torch_fn(x.to_dense(), dim, keepdim)
        _, index, rdims = _select(x, dim, largest)
        if dim is None:
            return index.reshape((1,) * x.dim()) if keepdim else index.reshape(())
        return _shaped(index, x._shape, rdims, keepdim)
    apply.__name__ = apply.__qualname__ = name
    return apply


_register(torch.max, _T.max)(_extremum(True))
_register(torch.min, _T.min)(_extremum(False))
_register(torch.argmax, _T.argmax)(_arg_extremum(True))
_register(torch.argmin, _T.argmin)(_arg_extremum(False))
