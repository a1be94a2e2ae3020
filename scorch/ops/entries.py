"""What the ops on the stored entries share (``activation``, ``compare``, ``norms``, ``extrema``, ``indexing``):
registration that leaves earlier registrations alone, the entries listed once, the descriptions in error
messages, and the output groups of a reduction over some dimensions.
"""
from __future__ import annotations

import numbers

import torch

from ..formats import storage
from ..sparse_tensor import IMPLEMENTATIONS, NoSparseRule, SparseTensor, _describe, padding_of
from .sparse_api import coalesce


def _register(*funcs):
    """``implements`` that leaves alone functions another module registered already (``F.relu``...)."""
    def register(fn):
        for f in funcs:
            if f is not None and f not in IMPLEMENTATIONS:
                IMPLEMENTATIONS[f] = fn
        return fn
    return register


# duplicates summed: a nonlinear map needs each entry once (f(a) + f(b) != f(a + b))
_coalesced = coalesce


def _desc(*operands) -> str:
    return _describe(operands, {})


def _no_out(out, name, *operands):
    if out is not None:
        raise NoSparseRule(f"scorch: {name} with out= on a sparse operand ({_desc(*operands)})")


def _entries(x: SparseTensor):
    """``(dims, values)`` of the entries, each once: duplicates summed; padding and positions outside the shape
    dropped (``storage.padding``)."""
    x = _coalesced(x)
    return storage.unpack(x._format, x._shape, x._levels, x._vals)


_linear = storage.linear_index


def _kind(v) -> str:
    """An operand as error messages name it: ``sparse ...``, ``dense (shape)``, ``scalar v`` or its type."""
    if isinstance(v, SparseTensor):
        return f"sparse {_desc(v)}"
    if isinstance(v, torch.Tensor):
        return f"dense {tuple(v.shape)}"
    return type(v).__name__ if not isinstance(v, numbers.Number) else f"scalar {v!r}"


def _probe_shape(x):
    """The shape of a one-element tensor of ``x``'s rank: torch's own argument checks run on a zero one."""
    return (1,) * x.dim()


# --- reductions over some dimensions ---------------------------------------------------------------------------

def _reduce_dims(dim, n, empty_all=True):
    """``dim`` (None, an int or a sequence; None means all, and so does () unless ``empty_all`` is false, as for
    torch's ``any`` / ``all``) as a sorted tuple of non-negative dims."""
    if dim is None:
        return tuple(range(n))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    lo, hi = (-n, n - 1) if n else (-1, 0)  # (torch: a 0-d tensor takes dim 0 and -1)
    for d in dims:
        if not lo <= d <= hi:
            raise IndexError(f"Dimension out of range (expected to be in range of [{lo}, {hi}], but got {d})")
    found = [d % max(n, 1) for d in dims]
    if len(set(found)) < len(found):
        raise RuntimeError(f"dim {next(d for d in found if found.count(d) > 1)} appears multiple times in the list"
                           " of dims")
    return tuple(sorted(set(found))) if dims or not empty_all else tuple(range(n))


def _groups(shape, edims, reduce_dims):
    """Each entry's output position (``gid``), the number of outputs and the group size of a reduction."""
    gid = torch.zeros(edims.shape[1], dtype=torch.int64, device=edims.device)
    groups, size = 1, 1
    for d, n in enumerate(shape):
        if d in reduce_dims:
            size *= n
        else:
            gid = gid * n + edims[d]
            groups *= n
    return gid, groups, size


def _shaped(r, shape, reduce_dims, keepdim):
    return r.reshape([1 if d in reduce_dims else n for d, n in enumerate(shape)] if keepdim else
                     [n for d, n in enumerate(shape) if d not in reduce_dims])


def paired_values(a, b, fn):
    """``fn`` of the values of two SparseTensors on one pattern (``a + b``, ``a * b``). In a padded format the
    padding stays 0 and takes no gradient (``(W + 2 * W).values().sum()`` gave it one: an optimizer step then
    turned padding into an entry)."""
    v = fn(a._vals, b._vals)
    return torch.where(padding_of(a, b), 0, v) if a._format.padded else v


def mapped_values(x, fn):
    """``fn`` (a map with f(0) = 0, or a scaling: ``v * inf``, ``v / 0``) of the SparseTensor ``x``'s values. In
    a padded format the padding (0, at a real entry's coordinates: ``padding_of``) stays 0 (``0 * inf`` would
    be nan, and added onto the real entry) and takes no gradient (``fn``'s derivative at 0 may be infinite:
    sqrt, pow(0.5); differentiated where ``fn`` is smooth, at 0.5, and masked out)."""
    v = x._vals
    pad = padding_of(x) if x._format.padded else storage.outside(x._format, x._shape, x._levels, v.numel())
    if pad is None:  # (slots outside the shape, a DIA diagonal's ends: as padding, 0 and no gradient: sqrt's
        return fn(v)  # infinite derivative at 0 made them nan, and an optimizer step then wrote nan there)
    # (masked_fill keeps fn's dtype: torch.where with 0 made isnan's bools int64)
    if not (v.requires_grad and v.dtype.is_floating_point and torch.is_grad_enabled()):
        return fn(v).masked_fill(pad, 0)
    return fn(v.masked_fill(pad, 0.5)).masked_fill(pad, 0)
