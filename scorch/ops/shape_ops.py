"""Shape and indexing ops on SparseTensors: ``reshape``/``view``/``flatten``/``unflatten``/``squeeze``/
``unsqueeze``, ``cat``/``stack`` and ``index_select`` (torch semantics, row-major linearization as torch).

Every op moves the input's stored entries to their new coordinates with vectorized torch (no Python loop over
entries) and builds the result's values from the input's values by indexing and ``cat``, so gradients flow
from the result's values back to the inputs' values.

Result formats:

- ``reshape``, ``view``, ``reshape_as``, ``view_as``, ``flatten``, ``ravel``, ``unflatten``, ``unsqueeze``,
  ``squeeze``, ``stack``: canonical (coalesced, row-major sorted) COO, except that an op that leaves the shape
  unchanged (``reshape`` to the same shape, ``squeeze`` of no size-1 dimension, ``flatten`` of a 1-d tensor or
  of a single dimension) returns the input itself, as torch returns a view. ``view`` behaves like ``reshape``
  (torch refuses ``view`` on sparse tensors; here there are no strides to keep, so it cannot fail on them).
- ``cat``: CSR when every input is CSR and ``dim`` is 0, CSC when every input is CSC and ``dim`` is 1 (index
  arrays concatenated, no sort); canonical COO otherwise.
- ``index_select``: CSR for a CSR input along ``dim`` 0, CSC for a CSC input along ``dim`` 1 (rows or columns
  gathered); canonical COO otherwise.
- ``contiguous`` returns the input itself.

Padding is not carried over: positions outside the shape (block and diagonal formats) and the padding of a
padded level (ELL, n:m: ``storage.padding``) are dropped. Stored zeros (explicit zeros, the zero fill inside a
block or diagonal, a real slot of a padded level that holds 0) stay stored. Duplicates of an uncoalesced COO input
are summed in a COO result.

A sparse result needs at least one dimension (scorch formats store tensors of at least one dimension):
reshaping or squeezing to a 0-d tensor raises ``ValueError`` (use ``x.to_dense()`` first). Results with
2**63 elements or more are refused (``ValueError``): coordinates are linearized in int64. Problems raise
``ValueError`` (shapes that do not match, sizes that do not fit), ``IndexError`` (a dimension or index out of
range), ``TypeError`` (an argument of the wrong kind) and ``NotImplementedError`` (``cat``/``stack`` of
sparse with dense tensors, ``view(dtype)``).
"""
from __future__ import annotations

import operator

import torch

from ..formats import LevelStorage, named, storage
from ..interop import coo_from_entries as _canonical_coo
from ..sparse_tensor import NoSparseRule, SparseTensor, implements

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_BIG = 2**63


# --- helpers ----------------------------------------------------------------------------------------------------

def _prod(xs) -> int:
    p = 1
    for v in xs:
        p *= int(v)
    return p


def _entries(x: SparseTensor):
    """``(dims, vals)``: the ``(ndim, M)`` int64 coordinates and the values (gathered from ``x.values()``, so
    differentiable) of ``x``'s stored entries, padding dropped."""
    return storage.unpack(x._format, x._shape, x._levels, x._vals)


def _coo(rows, vals, shape, duplicates: bool, op: str) -> SparseTensor:
    """The canonical COO SparseTensor of ``vals`` at ``rows`` (one int64 array per dimension); for an empty
    ``shape``, the 0-d dense tensor of their sum."""
    shape = tuple(int(n) for n in shape)
    if not shape:  # (0-d: a dense scalar, as select of a 1-d tensor gives: its entries summed, or 0)
        total = vals.sum()
        return total if total.dtype == vals.dtype else total.to(vals.dtype)
    if _prod(shape) >= _BIG:
        raise ValueError(f"{op}: the result's shape {shape} has 2**63 elements or more")
    if 0 in shape:
        rows = [torch.zeros(0, dtype=torch.int64, device=vals.device) for _ in shape]
        vals = vals[:0]
    return _canonical_coo(list(rows), vals, shape, duplicates)


def _dim(d, n: int, op: str) -> int:
    """``d`` as a dimension in ``[0, n)`` (negative counts from the end), or IndexError."""
    try:
        d = operator.index(d)
    except TypeError:
        raise TypeError(f"{op}: a dimension must be an int, got {type(d).__name__}") from None
    if not -n <= d < n:
        lo, hi = (-n, n - 1) if n else (-1, 0)
        raise IndexError(f"{op}: dimension out of range (expected to be in range of [{lo}, {hi}], but got {d})")
    return d % n


def _sizes(args, op: str) -> tuple:
    """Sizes given as varargs (``2, 3``) or one sequence (``(2, 3)``, a ``torch.Size``)."""
    if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
        args = tuple(args[0])
    out = []
    for a in args:
        try:
            out.append(operator.index(a))
        except TypeError:
            raise TypeError(f"{op}: sizes must be ints, got {type(a).__name__} ({a!r})") from None
    return tuple(out)


def _infer(shape, numel: int, op: str) -> tuple:
    """``shape`` with its ``-1`` (at most one) inferred so that it holds ``numel`` elements."""
    unknown = [k for k, n in enumerate(shape) if n == -1]
    if len(unknown) > 1:
        raise ValueError(f"{op}: only one dimension can be inferred (-1), got shape {list(shape)}")
    bad = [n for n in shape if n < -1]
    if bad:
        raise ValueError(f"{op}: invalid shape dimension {bad[0]} in {list(shape)}")
    known = _prod(n for n in shape if n != -1)
    if unknown:
        if known == 0:
            raise ValueError(f"{op}: cannot reshape a tensor of {numel} elements into shape {list(shape)}: the"
                             " unspecified dimension size -1 can be any value and is ambiguous")
        if numel % known:
            raise ValueError(f"{op}: shape {list(shape)} is invalid for input of size {numel}")
        shape = tuple(numel // known if n == -1 else n for n in shape)
    elif known != numel:
        raise ValueError(f"{op}: shape {list(shape)} is invalid for input of size {numel}")
    return tuple(shape)


_linearize = storage.linear_index


def _delinearize(key, shape):
    rows = []
    for n in reversed(shape):
        rows.append(key % n)
        key = key // n
    return rows[::-1]


# --- reshape family -----------------------------------------------------------------------------------------------

def _reshape_to(x: SparseTensor, shape: tuple, op: str) -> SparseTensor:
    old = tuple(x._shape)
    numel = _prod(old)
    shape = _infer(shape, numel, op)
    if shape == old:
        return x
    if numel >= _BIG:
        raise ValueError(f"{op}: the tensor's shape {old} has 2**63 elements or more")
    dims, vals = _entries(x)
    if numel == 0:
        return _coo([], vals, shape, False, op)
    rows = _delinearize(_linearize(dims, old), shape) if shape else []
    return _coo(rows, vals, shape, x._format.keeps_duplicates, op)


@implements(torch.reshape, torch.Tensor.reshape, torch.Tensor.view)
def reshape(x: SparseTensor, *shape, **kwargs):
    """``x`` with another shape (one size may be ``-1``): canonical COO, or ``x`` itself for the same shape.
    ``view`` is the same as ``reshape`` (a SparseTensor has no strides that a view could fail to keep)."""
    if kwargs:
        if shape or set(kwargs) - {"shape", "size"} or len(kwargs) > 1:
            raise TypeError(f"reshape: unexpected arguments {sorted(kwargs)}")
        shape = (next(iter(kwargs.values())),)
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise NoSparseRule(f"scorch: view({shape[0]}) (reinterpreting the bytes of a sparse tensor's"
                                  " values as another dtype) is not implemented; use x.to(dtype)")
    return _reshape_to(x, _sizes(shape, "reshape"), "reshape")


@implements(torch.Tensor.reshape_as, torch.Tensor.view_as)
def reshape_as(x: SparseTensor, other):
    """``reshape`` to ``other``'s shape. A dense ``x`` shaped like a sparse ``other`` stays dense, reshaped (a view
    where torch can make one): LBFGS shapes its flat update ``update[a:b].view_as(p)`` for a sparse parameter."""
    if not isinstance(x, SparseTensor):
        return x.reshape(tuple(other.shape))
    return _reshape_to(x, tuple(other.shape), "reshape_as")


@implements(torch.flatten, torch.Tensor.flatten)
def flatten(x: SparseTensor, start_dim=0, end_dim=-1):
    """Dimensions ``start_dim..end_dim`` merged into one (row-major): canonical COO, ``x`` itself when no
    dimensions are merged."""
    n = x.dim()
    s, e = _dim(start_dim, n, "flatten"), _dim(end_dim, n, "flatten")
    if s > e:
        raise ValueError(f"flatten: start_dim ({start_dim}) cannot come after end_dim ({end_dim})")
    old = tuple(x._shape)
    return _reshape_to(x, old[:s] + (_prod(old[s:e + 1]),) + old[e + 1:], "flatten")


@implements(torch.ravel, torch.Tensor.ravel)
def ravel(x: SparseTensor):
    """``flatten`` to one dimension."""
    return flatten(x)


@implements(torch.unflatten, torch.Tensor.unflatten)
def unflatten(x: SparseTensor, dim, sizes):
    """Dimension ``dim`` split into ``sizes`` (one may be ``-1``): canonical COO."""
    d = _dim(dim, x.dim(), "unflatten")
    sizes = _sizes((sizes,), "unflatten")
    if not sizes:
        raise ValueError("unflatten: sizes must be non-empty")
    old = tuple(x._shape)
    try:
        sizes = _infer(sizes, old[d], "unflatten")
    except ValueError:
        raise ValueError(f"unflatten: sizes {list(sizes)} do not multiply to the size {old[d]} of dimension"
                         f" {d}") from None
    return _reshape_to(x, old[:d] + sizes + old[d + 1:], "unflatten")


@implements(torch.unsqueeze, torch.Tensor.unsqueeze)
def unsqueeze(x: SparseTensor, dim):
    """A dimension of size 1 inserted at ``dim`` (in ``[-ndim - 1, ndim]``): canonical COO."""
    n = x.dim()
    d = _dim(dim, n + 1, "unsqueeze")
    dims, vals = _entries(x)
    rows = list(dims)
    rows.insert(d, torch.zeros(vals.numel(), dtype=torch.int64, device=vals.device))
    shape = list(x._shape)
    shape.insert(d, 1)
    return _coo(rows, vals, shape, x._format.keeps_duplicates, "unsqueeze")


@implements(torch.squeeze, torch.Tensor.squeeze)
def squeeze(x: SparseTensor, dim=None):
    """Dimensions of size 1 removed: all of them, or those among ``dim`` (an int or a tuple; a named dimension
    whose size is not 1 is kept, as torch does). Canonical COO, ``x`` itself when nothing is removed."""
    n = x.dim()
    shape = tuple(x._shape)
    if dim is None:
        drop = {d for d in range(n) if shape[d] == 1}
    else:
        ds = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
        drop = {d for d in (_dim(d, n, "squeeze") for d in ds) if shape[d] == 1}
    if not drop:
        return x
    keep = [d for d in range(n) if d not in drop]
    dims, vals = _entries(x)
    return _coo([dims[d] for d in keep], vals, [shape[d] for d in keep], x._format.keeps_duplicates, "squeeze")


@implements(torch.Tensor.contiguous)
def contiguous(x: SparseTensor, memory_format=torch.contiguous_format):
    """``x`` itself: a SparseTensor's arrays are contiguous already."""
    return x


# --- cat / stack ---------------------------------------------------------------------------------------------------

def _operands(tensors, op: str) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{op}: expected a non-empty list of tensors")
    out = []
    for t in tensors:
        if type(t) is SparseTensor:
            out.append(t)
        elif isinstance(t, torch.Tensor) and t.layout in _SPARSE_LAYOUTS:
            from ..interop import from_torch
            out.append(from_torch(t))
        elif isinstance(t, torch.Tensor):
            raise NoSparseRule(f"scorch: torch.{op} of sparse and dense tensors is not implemented;"
                                      " convert the dense ones with scorch.asformat(t, 'coo'), or the sparse"
                                      " ones with .to_dense()")
        else:
            raise TypeError(f"{op}: expected tensors, got {type(t).__name__}")
    devices = {t.device for t in out}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on the same device, got {sorted(map(str, devices))}")
    return out


def _result_dtype(xs) -> torch.dtype:
    dtype = xs[0].dtype
    for t in xs[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


@implements(torch.cat, torch.concat, torch.concatenate)
def cat(tensors, dim=0, *, axis=None):
    """The inputs joined along ``dim``; their shapes must match on the other dimensions, dtypes are promoted.
    CSR for CSR inputs along dimension 0, CSC for CSC inputs along dimension 1, canonical COO otherwise."""
    if axis is not None:
        dim = axis
    xs = _operands(tensors, "cat")
    n = xs[0].dim()
    d = _dim(dim, n, "cat")
    first = tuple(xs[0]._shape)
    for k, t in enumerate(xs[1:], 1):
        s = tuple(t._shape)
        if len(s) != n:
            raise ValueError(f"cat: tensors must have the same number of dimensions: tensor 0 has shape {first},"
                             f" tensor {k} has shape {s}")
        for j in range(n):
            if j != d and s[j] != first[j]:
                raise ValueError(f"cat: sizes of tensors must match except in dimension {d}: tensor 0 has shape"
                                 f" {first}, tensor {k} has shape {s} (dimension {j} differs)")
    dtype = _result_dtype(xs)
    shape = list(first)
    shape[d] = sum(int(t._shape[d]) for t in xs)
    fmt = xs[0]._format
    if n == 2 and all(t._format == fmt for t in xs) and (fmt, d) in ((named.csr, 0), (named.csc, 1)):
        return _cat_compressed(xs, fmt, shape, dtype)
    rows, vals, offset = [], [], 0
    for t in xs:
        dims, v = _entries(t)
        if offset:
            dims = dims.clone()
            dims[d] += offset
        offset += int(t._shape[d])
        rows.append(dims)
        vals.append(v.to(dtype))
    dims = torch.cat(rows, 1)
    return _coo(list(dims), torch.cat(vals), shape, any(t._format.keeps_duplicates for t in xs), "cat")


def _cat_compressed(xs, fmt, shape, dtype) -> SparseTensor:
    """CSR along rows (CSC along columns): the compressed level's arrays concatenated, positions shifted."""
    total = sum(t.nnz for t in xs)
    index_dtype = storage.pick_index_dtype(total, *shape)
    pos, crd, nnz = [xs[0]._levels[1].pos[:1].to(index_dtype)], [], 0
    for t in xs:
        st = t._levels[1]
        pos.append(st.pos[1:].to(index_dtype) + nnz)
        crd.append(st.crd.to(index_dtype))
        nnz += t.nnz
    vals = torch.cat([t._vals.to(dtype) for t in xs])
    levels = [LevelStorage(), LevelStorage(pos=torch.cat(pos), crd=torch.cat(crd))]
    return SparseTensor(fmt, shape, levels, vals, check=False)


@implements(torch.stack)
def stack(tensors, dim=0):
    """The inputs (all of the same shape) stacked along a new dimension ``dim``: canonical COO."""
    xs = _operands(tensors, "stack")
    n = xs[0].dim()
    d = _dim(dim, n + 1, "stack")
    first = tuple(xs[0]._shape)
    for k, t in enumerate(xs[1:], 1):
        if tuple(t._shape) != first:
            raise ValueError(f"stack: expects each tensor to be equal size, but got {first} at entry 0 and"
                             f" {tuple(t._shape)} at entry {k}")
    dtype = _result_dtype(xs)
    rows, vals = [], []
    for k, t in enumerate(xs):
        dims, v = _entries(t)
        rows.append(torch.cat([dims[:d], torch.full((1, v.numel()), k, dtype=torch.int64, device=dims.device),
                               dims[d:]]))
        vals.append(v.to(dtype))
    shape = list(first)
    shape.insert(d, len(xs))
    return _coo(list(torch.cat(rows, 1)), torch.cat(vals), shape,
                any(t._format.keeps_duplicates for t in xs), "stack")


# --- index_select --------------------------------------------------------------------------------------------------

class IndexOutOfRange(IndexError):
    """An index value outside its dimension (``_index``): getitem raises it only where the result is not empty, as
    torch checks an index's bounds only while it fills the result."""


def _index(index, size: int, device) -> torch.Tensor:
    """``index`` as a 1-d int64 tensor on ``device``, every value checked to be in ``[0, size)``."""
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index_select: index must be a tensor of int32 or int64, got {type(index).__name__}")
    if type(index) is SparseTensor or index.layout != torch.strided:
        raise TypeError("index_select: index must be a dense tensor")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_select: index must be int32 or int64, got {index.dtype}")
    if index.dim() > 1:
        raise IndexError(f"index_select: index must be a vector (0-d or 1-d), got shape {tuple(index.shape)}")
    idx = index.reshape(-1).to(device=device, dtype=torch.int64)
    if idx.numel():
        bad = (idx < 0) | (idx >= size)
        if bool(bad.any()):
            v = int(idx[bad.nonzero()[0, 0]])
            raise IndexOutOfRange(f"index_select: index {v} is out of range for dimension of size {size}")
    return idx


@implements(torch.index_select, torch.Tensor.index_select)
def index_select(x: SparseTensor, dim, index):
    """The slices of ``x`` at positions ``index`` along ``dim``, in ``index``'s order (repeats allowed): an
    entry at coordinate ``c`` appears once per occurrence of ``c`` in ``index``. CSR for a CSR input along
    dimension 0, CSC for a CSC input along dimension 1, canonical COO otherwise."""
    n = x.dim()
    d = _dim(dim, n, "index_select")
    shape = list(x._shape)
    idx = _index(index, shape[d], x.device)
    shape[d] = idx.numel()
    if (x._format, d) in ((named.csr, 0), (named.csc, 1)):
        return _select_compressed(x, idx, shape)
    dims, vals = _gather_along(*_entries(x), d, idx)
    return _coo(list(dims), vals, shape, x._format.keeps_duplicates, "index_select")


def _gather_along(dims, vals, d: int, idx):
    """The entries ``(dims, vals)`` at positions ``idx`` (int64, in range, repeats allowed) along ``d``, renumbered
    by their place in ``idx``: an entry at coordinate ``c`` appears once per occurrence of ``c`` in ``idx``."""
    m = vals.numel()
    device = vals.device
    # each entry's occurrences in index: the run [lo, hi) of its coordinate in the sorted index
    sidx, order = torch.sort(idx)
    c = dims[d]
    lo = torch.searchsorted(sidx, c)
    count = torch.searchsorted(sidx, c, right=True) - lo
    total = int(count.sum()) if m else 0
    entry = torch.repeat_interleave(torch.arange(m, device=device), count, output_size=total)
    start = torch.cumsum(count, 0) - count
    at = lo[entry] + (torch.arange(total, device=device) - start[entry])
    out = dims[:, entry]
    out[d] = order[at]
    return out, vals[entry]


def _select_compressed(x: SparseTensor, idx, shape) -> SparseTensor:
    """CSR rows (CSC columns) gathered: each selected segment of the compressed level copied in order."""
    st = x._levels[1]
    pos = st.pos.to(torch.int64)
    device = pos.device
    first = pos[:-1][idx]
    count = pos[1:][idx] - first
    new_pos = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(count, 0)])
    total = int(new_pos[-1])
    seg = torch.repeat_interleave(torch.arange(idx.numel(), device=device), count, output_size=total)
    src = first[seg] + (torch.arange(total, device=device) - new_pos[:-1][seg])
    index_dtype = storage.pick_index_dtype(total, *shape)
    levels = [LevelStorage(), LevelStorage(pos=new_pos.to(index_dtype), crd=st.crd[src].to(index_dtype))]
    return SparseTensor(x._format, shape, levels, x._vals[src], check=False)


# --- pad ---------------------------------------------------------------------------------------------------------
@implements(torch.nn.functional.pad)
def pad(input, pad, mode="constant", value=None):
    """``F.pad`` with zeros (``mode="constant"``, ``value`` 0 or None): the entries moved by the padding before them
    in each padded dimension (last first, as torch reads ``pad``), those a negative pad crops dropped; canonical COO.
    Another value or mode gives a dense result: the dense form serves."""
    if type(input) is not SparseTensor or mode != "constant" or (value is not None and value != 0):
        raise NoSparseRule("scorch: F.pad of a sparse tensor with a nonzero value or a mode other than constant")
    pad = [int(p) for p in pad]
    n = input.dim()
    if len(pad) % 2:
        raise RuntimeError("Padding length must be divisible by 2")
    if len(pad) > 2 * n:
        raise RuntimeError("Padding length should be less than or equal to two times the input dimension but got"
                           f" padding length {len(pad)} and input of dimension {n}")
    shape = list(input._shape)
    dims, vals = _entries(input)
    keep = torch.ones(vals.numel(), dtype=torch.bool, device=vals.device)
    if pad:
        dims = dims.clone()
    for k in range(len(pad) // 2):
        d, lo, hi = n - 1 - k, pad[2 * k], pad[2 * k + 1]
        size = shape[d] + lo + hi
        if size < 0:
            raise RuntimeError(f"F.pad: the padding {(lo, hi)} of dimension {d} (size {shape[d]}) leaves a negative"
                               f" size {size}")
        shape[d] = size
        dims[d] += lo
        keep &= (dims[d] >= 0) & (dims[d] < size)
    return _coo(list(dims[:, keep]), vals[keep], shape, input._format.keeps_duplicates, "pad")
