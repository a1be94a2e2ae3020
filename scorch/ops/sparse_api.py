"""torch's sparse-tensor API on SparseTensors: ``coalesce``, index accessors, ``to_sparse*``, and softmax.

Softmax follows ``torch.sparse.softmax``: the implicit entries count as -inf, so the result has the input's
pattern and each group of stored entries along ``dim`` is normalized on its own (a group with no stored entry
stays empty). ``F.softmax`` / ``F.log_softmax`` / ``torch.softmax`` on a SparseTensor mean the same.
It is vectorized torch on the values (grouped by the coordinates other than ``dim``), so autograd, double
backward included, comes from torch's own ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fusion
from .. import loopir as L
from ..deferred import Deferred
from ..formats import Compressed, Singleton, Var, named, storage
from ..sparse_tensor import SparseTensor, implements, shape_of
from . import segment


def _coo_like(x):
    """A COO format: a compressed first level, singletons below, plain coordinates in dimension order."""
    fmt = x._format
    return isinstance(fmt.level_types[0], Compressed) and all(
        isinstance(lvl, Singleton) for lvl in fmt.level_types[1:]) and [
        e.dim if isinstance(e, Var) else None for e in fmt.exprs] == list(range(fmt.ndim))


def coalesce(x):
    """Duplicates summed and entries sorted: COO with duplicates becomes coalesced COO; other formats hold
    each entry once already and are returned as they are (the ops' own use)."""
    return x.asformat(named.coo_nd(x.dim(), dense_dim=x.dense_dim())) if x._format.keeps_duplicates else x


@implements(torch.Tensor.coalesce)
def coalesce_method(x):
    """torch's ``coalesce``: duplicates summed, entries sorted. A tensor of torch's COO layout that is not
    coalesced COO already (uncoalesced COO, a transposed COO view, a format torch has no layout for) comes back
    as coalesced COO, whose ``indices()`` / ``values()`` torch code reads next; other layouts as they are."""
    if x.layout == torch.sparse_coo and (x._format.keeps_duplicates or not _coo_like(x)):
        return x.asformat(named.coo_nd(x.dim(), dense_dim=x.dense_dim()))
    return x


@implements(torch.Tensor._is_view)
def _is_view(x):
    """False: a SparseTensor is not a view of another tensor (the values it shares with its parameter or with a
    ``detach()`` are its own arrays). Torch's tracers ask (``torch.export``'s fakification): on the dense form it
    was a densify warning, and the wrapper's own answer (True for an ``nn.Parameter`` over it, with no autograd
    view record) crashed ``_get_creation_meta``."""
    return False


@implements(torch.Tensor.is_coalesced)
def is_coalesced(x):
    """False only for COO that may hold duplicates."""
    return not x._format.keeps_duplicates


@implements(torch.Tensor.indices, torch.Tensor._indices)
def indices(x):
    """The ``(sparse_dim, nnz)`` int64 coordinates of a COO SparseTensor (hybrid too: its sparse levels), as
    torch's ``indices()``."""
    hybrid = named.hybrid_coo_dims(x._format)
    if not _coo_like(x) and hybrid is None:
        raise NotImplementedError(f"scorch: indices() of format {x._format.name or x._format}: it is defined for"
                                  " COO; use x.to_sparse_coo().indices()")
    return torch.stack([st.crd.to(torch.int64) for st in x._levels[:x.dim() - (hybrid[0] if hybrid else 0)]])


def _compressed_arrays(x, names):
    n = x._format.name or ""
    if n.startswith(names):
        return x._levels[1]
    raise NotImplementedError(f"scorch: this accessor is defined for {' and '.join(names)} formats, not"
                              f" {n or x._format}")


#: torch's index accessors give int64, as torch's own layouts hold them by default: a narrower stored array is
#: widened (a copy; an int64 one is shared). Code built on them expects int64: torch 2.13's CPU ``gather`` with an
#: expanded int32 index returns wrong rows (the backward of PyG's scatter: GATConv's gradients on a scorch CSR)


def _as_int64(a):
    return a if a.dtype == torch.int64 else a.to(torch.int64)


@implements(torch.Tensor.crow_indices)
def crow_indices(x):
    """CSR/BSR: the row pointer array, int64 (shared where stored as int64)."""
    return _as_int64(_compressed_arrays(x, ("csr", "bsr")).pos)


@implements(torch.Tensor.col_indices)
def col_indices(x):
    """CSR/BSR: the column index array, int64 (shared where stored as int64)."""
    return _as_int64(_compressed_arrays(x, ("csr", "bsr")).crd)


@implements(torch.Tensor.ccol_indices)
def ccol_indices(x):
    """CSC/BSC: the column pointer array, int64 (shared where stored as int64)."""
    return _as_int64(_compressed_arrays(x, ("csc", "bsc")).pos)


@implements(torch.Tensor.row_indices)
def row_indices(x):
    """CSC/BSC: the row index array, int64 (shared where stored as int64)."""
    return _as_int64(_compressed_arrays(x, ("csc", "bsc")).crd)


# --- to_sparse* -----------------------------------------------------------------------------------------------
_LAYOUT_FORMATS = {torch.sparse_coo: "coo", torch.sparse_csr: "csr", torch.sparse_csc: "csc",
                   torch.sparse_bsr: "bsr", torch.sparse_bsc: "bsc"}


def _blocked(x, name, blocksize):
    if name in ("bsr", "bsc"):
        if blocksize is None:
            raise ValueError(f"to_sparse_{name}: a blocksize is required")
        bh, bw = (blocksize, blocksize) if isinstance(blocksize, int) else tuple(blocksize)  # (torch takes both)
        return f"{name}({bh}, {bw})"
    return named.coo_nd(x.dim(), dense_dim=x.dense_dim()) if name == "coo" else name


@implements(torch.Tensor.to_sparse)
def to_sparse(x, *args, layout=None, blocksize=None, dense_dim=None):
    """Converted to the format of ``layout`` (COO by default), a SparseTensor."""
    if args and isinstance(args[0], int) and args[0] != x.dim():
        raise NotImplementedError("scorch: to_sparse(sparse_dim) with hybrid dimensions is not supported")
    if dense_dim:
        raise NotImplementedError("scorch: hybrid (dense_dim) sparse tensors are not supported")
    name = _LAYOUT_FORMATS.get(layout or torch.sparse_coo)
    if name is None:
        raise ValueError(f"to_sparse: unsupported layout {layout}")
    return x.asformat(_blocked(x, name, blocksize))


@implements(torch.Tensor.to_sparse_coo)
def to_sparse_coo(x):
    """Converted to COO (a SparseTensor)."""
    return to_sparse(x)


@implements(torch.Tensor.to_sparse_csr)
def to_sparse_csr(x, dense_dim=None):
    """Converted to CSR."""
    return to_sparse(x, layout=torch.sparse_csr, dense_dim=dense_dim)


@implements(torch.Tensor.to_sparse_csc)
def to_sparse_csc(x, dense_dim=None):
    """Converted to CSC."""
    return to_sparse(x, layout=torch.sparse_csc, dense_dim=dense_dim)


@implements(torch.Tensor.to_sparse_bsr)
def to_sparse_bsr(x, blocksize, dense_dim=None):
    """Converted to BSR with the block size."""
    return to_sparse(x, layout=torch.sparse_bsr, blocksize=blocksize, dense_dim=dense_dim)


@implements(torch.Tensor.to_sparse_bsc)
def to_sparse_bsc(x, blocksize, dense_dim=None):
    """Converted to BSC with the block size."""
    return to_sparse(x, layout=torch.sparse_bsc, blocksize=blocksize, dense_dim=dense_dim)


# --- softmax ---------------------------------------------------------------------------------------------------

def _softmax(x: SparseTensor, dim, dtype, log: bool):
    n = len(shape_of(x))
    if not -n <= dim < n:
        raise IndexError(f"softmax: dimension {dim} is out of range for a {n}-d tensor")
    dim %= n
    if x._format.keeps_duplicates:
        x = coalesce(x)
    if type(x._vals) is Deferred:  # lazy scores inside scorch.compile: the softmax stays lazy too
        lazy = fusion.lazy_softmax(x, dim, dtype, log)
        if lazy is not None:
            return lazy
    v = x._vals if dtype is None else x._vals.to(dtype)
    if not v.dtype.is_floating_point:
        raise TypeError(f"softmax: expected a floating point SparseTensor, got {v.dtype}")
    pos = storage.segments(x._format, x._levels, dim)
    if pos is not None and v.dtype in segment.SUPPORTED and v.device.type == "cpu":
        return x.with_values(segment.softmax(v, pos, log))
    leaf, dims = storage.entries(x._format, x._shape, x._levels, x._vals)
    others = [d for d in range(n) if d != dim]
    key = storage.linear_index(dims[others], [x._shape[d] for d in others])
    groups, inv = torch.unique(key, return_inverse=True)
    # 16-bit values: computed in float32 and rounded once (a 16-bit sum of a group's exponentials drifts)
    ct = torch.float32 if v.dtype in L.HALF_DTYPES else v.dtype
    vals = v[leaf].to(ct)
    peak = torch.full((groups.numel(),), float("-inf"), dtype=ct, device=v.device)
    peak = peak.scatter_reduce(0, inv, vals.detach(), "amax")  # a shift: softmax does not depend on it
    shifted = vals - peak[inv]
    total = torch.zeros(groups.numel(), dtype=ct, device=v.device).index_add(0, inv, shifted.exp())
    out = shifted - total.log()[inv] if log else shifted.exp() / total[inv]
    # padding keeps 0 (so it stays padding); positions are in the values' order
    res = torch.zeros(v.shape, dtype=v.dtype, device=v.device).index_put((leaf,), out.to(v.dtype))
    return x.with_values(res)


def _dtype_arg(args, kwargs):
    dt = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dt = a
    return dt


@implements(torch.sparse.softmax, torch.softmax, torch.Tensor.softmax, F.softmax)
def softmax(x, dim=None, *args, **kwargs):
    """As ``torch.sparse.softmax``: implicit entries are -inf; the result keeps the pattern and format."""
    if dim is None:
        raise ValueError("softmax of a sparse tensor needs dim")
    return _softmax(x, dim, _dtype_arg(args, kwargs), log=False)


@implements(torch.sparse.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax)
def log_softmax(x, dim=None, *args, **kwargs):
    """As ``torch.sparse.log_softmax``: implicit entries are -inf; pattern and format kept."""
    if dim is None:
        raise ValueError("log_softmax of a sparse tensor needs dim")
    return _softmax(x, dim, _dtype_arg(args, kwargs), log=True)


@implements(torch.Tensor.sparse_mask)
def sparse_mask(x, mask):
    """``x.sparse_mask(mask)``: ``x``'s values (dense or sparse) at ``mask``'s stored positions, on ``mask``'s
    pattern (a COO mask coalesced first, as torch's result is); differentiable in ``x``. It went to the dense
    fallback, where torch's op refuses a dense mask."""
    if type(mask) is not SparseTensor:
        raise TypeError(f"sparse_mask: the mask must be a sparse tensor, got a {mask.layout} tensor")
    if tuple(x.shape) != tuple(mask.shape):
        raise ValueError(f"sparse_mask: the tensor's shape {tuple(x.shape)} and the mask's {tuple(mask.shape)}"
                         " differ")
    if not mask.is_coalesced():
        mask = mask.coalesce()
    from .._autograd import values_at
    return mask.detach().with_values(values_at(x, mask))


def _torch_coo(x):
    """The coalesced torch COO tensor of ``x`` (a SparseTensor, else as it is), for torch's COO-only products."""
    if type(x) is not SparseTensor:
        return x
    return x.asformat(named.coo_nd(x.dim(), dense_dim=x.dense_dim())).to_torch()


def _from_torch_product(op):
    """``op`` (torch's ``smm``, ``hspmm`` or ``sspaddmm``: products torch runs only on COO, with a sparse result)
    run by torch's own sparse kernel on the COO form of the SparseTensor operands; the result as a SparseTensor.
    They reached the dense fallback, where torch refuses dense operands."""
    def run(*args, **kwargs):
        from ..interop import from_torch
        r = op(*[_torch_coo(a) for a in args], **{k: _torch_coo(v) for k, v in kwargs.items()})
        return from_torch(r, check=False) if r.layout != torch.strided else r
    run.__name__ = run.__qualname__ = op.__name__
    run.__doc__ = f"``torch.{op.__name__}`` by torch's COO kernel on the SparseTensor operands' COO form."
    return run


for _name in ("smm", "hspmm", "sspaddmm"):
    implements(*[f for f in (getattr(torch, _name), getattr(torch.Tensor, _name, None)) if f is not None])(
        _from_torch_product(getattr(torch, _name)))
