"""Indexing, broadcasting and logical reductions of SparseTensors with torch's semantics, on the stored entries.

- ``x[key]`` (``Tensor.__getitem__``; ``x[key] = 0`` zeroes the selected stored values in place), ``select``,
  ``narrow``, ``unbind`` (and iterating over ``x``): integers,
  slices (positive steps), ``None``, ``...``, and at most one index tensor or list (int, or a 1-d bool mask)
  along any dimension, as torch reads them. The entries are filtered and moved to their new coordinates with
  vectorized torch; the result is canonical (coalesced, row-major) COO, or a 0-d dense tensor where every
  dimension was indexed by an integer. Other keys (several index tensors, multi-dimensional masks) run on the
  dense form (``SparseTensor.__torch_function__``'s fallback, warned and counted).
- ``torch.broadcast_to``, ``Tensor.expand`` / ``expand_as``: the entries repeated along the broadcast dimensions
  (canonical COO): what ``add``, ``mul`` and the comparisons of operands of different shapes use.
- ``torch.any`` / ``torch.all`` (over everything, or along dimensions): ``any`` is true where a stored entry is
  nonzero; ``all`` is false unless every position of the group is stored and nonzero. Dense bool results
  (uint8 for uint8 inputs), as torch's. ``count_nonzero`` counts the nonzero stored entries (dense int64).
- ``torch.nonzero`` / ``argwhere`` (and ``as_tuple=True``): the coordinates of the nonzero stored entries,
  row-major sorted, as torch's.
- ``swapdims``, ``movedim`` / ``moveaxis``: ``transpose`` and ``permute`` (views sharing the values).

Values are gathered from ``x.values()``, so gradients reach the stored values.
"""
from __future__ import annotations

import numbers
import operator

import torch

from ..formats import storage
from ..sparse_tensor import NoSparseRule, SparseTensor, implements
from .entries import _groups, _reduce_dims, _shaped
from .shape_ops import IndexOutOfRange, _coo, _delinearize, _dim, _entries, _gather_along, _index, _prod
from .sparse_api import coalesce

_T = torch.Tensor


def _result(dims, vals, shape, duplicates: bool, op: str):
    """The entries as canonical COO, or (no dimension left) the 0-d dense tensor holding their sum."""
    if not shape:
        return vals.sum().to(vals.dtype) if vals.dtype != torch.bool else vals.any()
    return _coo(list(dims), vals, shape, duplicates, op)


# --- indexing -------------------------------------------------------------------------------------------------------

def _take(dims, vals, keep):
    return dims[:, keep], vals[keep]


def _at(dims, vals, d: int, i: int):
    """The entries with coordinate ``i`` along ``d``, that dimension dropped."""
    dims, vals = _take(dims, vals, dims[d] == i)
    return torch.cat([dims[:d], dims[d + 1:]]), vals


def _slice(dims, vals, d: int, size: int, sl: slice):
    """The entries inside ``sl`` along ``d``, renumbered; and the new size."""
    start, stop, step = sl.start, sl.stop, sl.step
    step = 1 if step is None else operator.index(step)
    if step <= 0:
        raise ValueError("step must be greater than zero")  # torch's error for a negative step
    start, stop, _ = slice(None if start is None else operator.index(start),
                           None if stop is None else operator.index(stop)).indices(size)
    n = max(0, -(-(stop - start) // step))
    c = dims[d]
    keep = (c >= start) & (c < start + n * step) & ((c - start) % step == 0)
    dims, vals = _take(dims, vals, keep)
    dims = dims.clone()
    dims[d] = (dims[d] - start) // step
    return dims, vals, n


def _integer(k, size: int, d: int) -> int:
    i = operator.index(k)
    if not -size <= i < size:
        raise IndexError(f"index {i} is out of bounds for dimension {d} with size {size}")
    return i % size


def _is_index_tensor(k) -> bool:
    return isinstance(k, (list, tuple)) or (isinstance(k, torch.Tensor) and type(k) is not SparseTensor
                                            and k.layout == torch.strided and k.dim() > 0)


def _as_index(k, size: int, device) -> torch.Tensor:
    """A list or a 1-d tensor of indices (or a 1-d bool mask) along a dimension of ``size``: int64 indices."""
    if not isinstance(k, torch.Tensor):
        k = torch.as_tensor(k) if len(k) else torch.zeros(0, dtype=torch.int64)  # [] indexes nothing, as torch
    t = k.to(device)
    if t.dtype == torch.bool:
        if t.dim() != 1:
            raise NoSparseRule("a multi-dimensional bool mask")
        if t.numel() != size:
            raise IndexError(f"The shape of the mask [{t.numel()}] does not match the shape of the indexed tensor"
                             f" [{size}]")
        return t.nonzero().reshape(-1)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex:
        raise NoSparseRule("an index tensor that is not a 1-d integer or bool tensor")
    t = torch.where(t < 0, t + size, t)  # negative indices count from the end, as torch's
    return _index(t.to(torch.int64), size, device)


def _expand_key(key, ndim: int):
    """``key`` as a tuple with its ``...`` replaced by full slices."""
    key = key if isinstance(key, tuple) else (key,)
    used = sum(1 for k in key if k is not None and k is not Ellipsis and not (
        isinstance(k, torch.Tensor) and k.dtype == torch.bool and k.dim() == 0))
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if used > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    out = []
    for k in key:
        if k is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
        else:
            out.append(k)
    return tuple(out)


@implements(_T.__getitem__)
def getitem(x, key):
    """``x[key]`` with integers, slices, ``None``, ``...`` and one index tensor or list (int or 1-d bool) along
    any dimension: canonical COO (a 0-d dense tensor where every dimension is indexed by an integer)."""
    if type(x) is not SparseTensor:
        raise NoSparseRule("a sparse index")
    rows, vals, out_shape = _indexed_entries(x, key, *_entries(x))
    return _result(rows, vals, out_shape, x._format.keeps_duplicates, "__getitem__")


def _indexed_entries(x: SparseTensor, key, dims, vals):
    """The entries ``(dims, vals)`` of ``x`` that ``x[key]`` keeps, at their coordinates in the result:
    ``(rows, vals, result shape)``. ``vals`` may be any per-entry array (the values, or positions)."""
    if isinstance(key, SparseTensor) or (isinstance(key, tuple) and any(isinstance(k, SparseTensor) for k in key)):
        raise NoSparseRule("a sparse index")
    key = _expand_key(key, x.dim())
    if sum(_is_index_tensor(k) for k in key) > 1:
        raise NoSparseRule("several index tensors")
    shape, out_shape, d = list(x._shape), [], 0  # d: the dimension of x the next key item indexes
    out_of_range = None
    out_dims = []  # per output dimension: a coordinate row, or None for a new size-1 dimension
    for k in key:
        if k is None:
            out_shape.append(1)
            out_dims.append(None)
        elif isinstance(k, bool) or (isinstance(k, torch.Tensor) and k.dtype == torch.bool and k.dim() == 0):
            raise NoSparseRule("a bool scalar index")
        elif isinstance(k, slice):
            dims, vals, n = _slice(dims, vals, d, shape[d], k)
            out_shape.append(n)
            out_dims.append(d)
            d += 1
        elif _is_index_tensor(k):
            try:
                idx = _as_index(k, shape[d], vals.device)
                dims, vals = _gather_along(dims, vals, d, idx)
                count = idx.numel()
            except IndexOutOfRange as e:  # torch checks an index's bounds only while it fills a non-empty result
                out_of_range, count = e, torch.as_tensor(k).numel()
                dims, vals = _take(dims, vals, torch.zeros(vals.numel(), dtype=torch.bool, device=vals.device))
            out_shape.append(count)
            out_dims.append(d)
            d += 1
        elif isinstance(k, (numbers.Integral, torch.Tensor)) or hasattr(k, "__index__"):
            i = _integer(k, shape[d], d)
            keep = dims[d] == i
            dims, vals = _take(dims, vals, keep)
            d += 1
        else:
            raise IndexError(f"only integers, slices (`:`), ellipsis (`...`), None and long or byte Variables are"
                             f" valid indices (got {type(k).__name__})")
    for rest in range(d, x.dim()):
        out_shape.append(shape[rest])
        out_dims.append(rest)
    if out_of_range is not None and _prod(out_shape) != 0:  # (``x[..., :0, [5]]`` is empty in torch, no error)
        raise out_of_range
    zeros = torch.zeros(vals.numel(), dtype=torch.int64, device=vals.device)
    rows = [zeros if r is None else dims[r] for r in out_dims]
    return (torch.stack(rows) if rows else dims[:0]), vals, tuple(out_shape)


def _zero_value(v) -> bool:
    if isinstance(v, numbers.Number):
        return v == 0
    return isinstance(v, torch.Tensor) and type(v) is not SparseTensor and v.numel() == 1 and bool(v == 0)


@implements(_T.__setitem__)
def setitem(x, key, value):
    """``x[key] = 0`` (with any key ``x[key]`` reads by its sparse rule): the selected stored values set to 0, in
    place, pattern kept. Other values would fill implicit zeros: they raise (a sparse tensor cannot become dense in
    place), as a dense ``x`` with a sparse value runs on the dense form."""
    if type(x) is SparseTensor and not _zero_value(value) and _masks_stored_entries(x, key, value):
        return _set_masked(x, key, value)
    if type(x) is not SparseTensor or not _zero_value(value):
        raise NoSparseRule("assignment of a value other than 0")
    leaf, dims, inside = storage.coordinates(x._format, x._shape, x._levels)
    dims, leaf = dims[:, inside], leaf[inside]
    if isinstance(key, torch.Tensor) and key.dtype == torch.bool and key.dim() > 1:
        # a mask over the leading dimensions (x[x < t] = 0): the stored entries where it is True
        k = key.dim()
        if tuple(key.shape) != tuple(x._shape[:k]):
            raise IndexError(f"The shape of the mask {list(key.shape)} does not match the shape of the indexed tensor"
                             f" {list(x._shape)}")
        chosen = leaf[_mask_at(key, dims[:k])]
    else:
        _, chosen, _ = _indexed_entries(x, key, dims, leaf)
    x._vals[chosen] = 0  # every stored entry at a chosen position (duplicates too): the position reads 0


def _mask_at(key, dims):
    """The boolean mask ``key`` (dense or sparse) read at the coordinates ``dims`` (one row per dimension)."""
    if type(key) is SparseTensor:
        return storage.lookup(key._format, key._shape, key._levels, key._vals, dims).bool()
    return key.to(dims.device)[tuple(dims)]


def _masks_stored_entries(x, key, value) -> bool:
    """Whether ``x[key] = value`` is a scalar set through a boolean mask of ``x``'s whole shape (``s[s.gt(0)] = 5``,
    torch's Rprop on its state): ``_set_masked``."""
    return isinstance(key, torch.Tensor) and key.dtype == torch.bool and tuple(key.shape) == tuple(x._shape) and \
        (isinstance(value, numbers.Number) or (isinstance(value, torch.Tensor) and type(value) is not SparseTensor
                                               and value.numel() == 1)) and not x._format.keeps_duplicates


def _set_masked(x, key, value):
    """The stored values of ``x`` where the mask ``key`` is True set to ``value``, in place, pattern kept (padding
    and slots outside the shape left 0). A mask True at an implicit zero of ``x`` would make the tensor dense:
    it raises, except inside an optimizer step or ``scorch.stored_only()``, where the stored entries are what the
    step means (Rprop's ``sign[sign.eq(0)] = 1``)."""
    from ..sparse_tensor import padding_of
    from .pattern import _STORED_ONLY, _in_optimizer_step
    leaf, dims, inside = storage.coordinates(x._format, x._shape, x._levels)
    keep = inside & ~padding_of(x)[leaf] if x._format.padded else inside
    dims, leaf = dims[:, keep], leaf[keep]
    hit = _mask_at(key, dims)
    wanted = int(key.coalesce()._vals.bool().sum()) if type(key) is SparseTensor else int(key.sum())
    if int(hit.sum()) < wanted and not (_STORED_ONLY.depth or _in_optimizer_step()):
        raise NotImplementedError(
            "scorch: x[mask] = value with a nonzero value and a mask that is True where x holds no entry would make"
            " x dense in place; mask only stored entries (x[x.gt(0)] = v), assign to x.values(), or run it inside"
            " `with scorch.stored_only():` to set the stored entries only")
    x._vals[leaf[hit]] = value


@implements(torch.select, _T.select)
def select(x, dim, index):
    """The slice at ``index`` along ``dim``, that dimension removed: canonical COO (0-d dense from a 1-d ``x``)."""
    d = _dim(dim, x.dim(), "select")
    dims, vals = _at(*_entries(x), d, _integer(index, x._shape[d], d))
    shape = tuple(n for k, n in enumerate(x._shape) if k != d)
    return _result(dims, vals, shape, x._format.keeps_duplicates, "select")


@implements(torch.narrow, _T.narrow)
def narrow(x, dim, start, length):
    """``length`` positions from ``start`` along ``dim``: canonical COO."""
    d = _dim(dim, x.dim(), "narrow")
    size = x._shape[d]
    start = operator.index(start)
    start = start + size if start < 0 else start
    length = operator.index(length)
    if not (0 <= start <= size and 0 <= length and start + length <= size):
        raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size ({size}).")
    dims, vals, n = _slice(*_entries(x), d, size, slice(start, start + length))
    shape = list(x._shape)
    shape[d] = n
    return _result(dims, vals, tuple(shape), x._format.keeps_duplicates, "narrow")


def _pieces(x, dim, bounds, name):
    """The pieces of ``x`` along ``dim`` between consecutive ``bounds``, by ``narrow`` (each canonical COO: the
    sparse ``split`` / ``chunk`` / ``tensor_split``, which ran on the dense form and gave dense copies)."""
    d = _dim(dim, x.dim(), name)
    return tuple(narrow(x, d, lo, max(hi - lo, 0)) for lo, hi in zip(bounds[:-1], bounds[1:]))  # (as torch:
    # split points out of order give an empty piece, and the next one starts at its own point)


def _split(x, split_size_or_sections, dim=0):
    """``split``: pieces of a size (the last one shorter), or of the listed sizes (which add up to the dim)."""
    n = x._shape[_dim(dim, x.dim(), "split")]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0 and n:
            raise RuntimeError(f"split: split_size must be positive, got {step}")
        points = list(range(0, n, step)) + [n] if n else [0, 0]
    else:
        sizes = [int(k) for k in split_size_or_sections]
        if sum(sizes) != n:
            raise RuntimeError(f"split: sizes {sizes} do not add up to the dimension's size {n}")
        points = [0]
        for k in sizes:
            points.append(points[-1] + k)
    return _pieces(x, dim, points, "split")


def _chunk(x, chunks, dim=0):
    """``chunk``: pieces of ``ceil(n / chunks)`` (so maybe fewer than ``chunks``, as torch gives)."""
    n = x._shape[_dim(dim, x.dim(), "chunk")]
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    return _split(x, -(-n // chunks), dim) if n else _pieces(x, dim, [0] * (chunks + 1), "chunk")


def _tensor_split(x, indices_or_sections=None, dim=0, *, sections=None, indices=None):
    """``tensor_split``: ``sections`` pieces of near-equal sizes, or pieces between split ``indices``."""
    n = x._shape[_dim(dim, x.dim(), "tensor_split")]
    arg = indices_or_sections if indices_or_sections is not None else sections if sections is not None else indices
    if isinstance(arg, torch.Tensor):
        arg = arg.tolist()
    if isinstance(arg, int) and indices is None:
        q, r = divmod(n, arg)
        points = [0]
        for k in range(arg):
            points.append(points[-1] + q + (1 if k < r else 0))
    else:
        points = [0] + [min(max(int(p) + (n if int(p) < 0 else 0), 0), n) for p in arg] + [n]
    return _pieces(x, dim, points, "tensor_split")


implements(torch.split, _T.split)(_split)
implements(torch.chunk, _T.chunk)(_chunk)
implements(torch.tensor_split, _T.tensor_split)(_tensor_split)


@implements(torch.unbind, _T.unbind)
def unbind(x, dim=0):
    """The slices along ``dim`` (each canonical COO; 0-d dense tensors from a 1-d ``x``), as a tuple."""
    d = _dim(dim, x.dim(), "unbind")
    dims, vals = _entries(x)
    n = x._shape[d]
    order = torch.argsort(dims[d], stable=True)
    counts = torch.bincount(dims[d], minlength=n).tolist() if vals.numel() else [0] * n
    rest = torch.cat([dims[:d], dims[d + 1:]])[:, order]
    shape = tuple(s for k, s in enumerate(x._shape) if k != d)
    return tuple(_result(r, v, shape, x._format.keeps_duplicates, "unbind")
                 for r, v in zip(rest.split(counts, 1), vals[order].split(counts)))


@implements(_T.__iter__)
def iterate(x):
    """Iterating over ``x``: its slices along dimension 0 (``unbind``)."""
    if x.dim() == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(unbind(x, 0))


@implements(_T.__len__)
def length(x):
    """``len(x)``: the size of dimension 0."""
    if x.dim() == 0:
        raise TypeError("len() of a 0-d tensor")
    return x._shape[0]


# --- broadcasting ----------------------------------------------------------------------------------------------------

def broadcast_to(x: SparseTensor, shape) -> SparseTensor:
    """``x`` broadcast to ``shape`` (torch's rules: new leading dimensions, size-1 dimensions repeated): its
    entries repeated, canonical COO; ``x`` itself where the shape is unchanged."""
    shape = tuple(int(n) for n in shape)
    if tuple(x._shape) == shape:
        return x
    if tuple(torch.broadcast_shapes(x._shape, shape)) != shape:
        raise RuntimeError(f"The expanded size of the tensor ({list(shape)}) must match the existing size"
                           f" ({list(x._shape)}) at each non-singleton dimension")
    lead = len(shape) - x.dim()
    old = (1,) * lead + tuple(x._shape)
    edims, vals = _entries(x)
    dims = torch.cat([torch.zeros(lead, edims.shape[1], dtype=torch.int64, device=edims.device), edims])
    grown = [k for k in range(len(shape)) if old[k] == 1 and shape[k] != 1]
    reps = _prod(shape[k] for k in grown)
    m = vals.numel()
    entry = torch.arange(m, device=vals.device).repeat_interleave(reps)
    copy = torch.arange(reps, device=vals.device).repeat(m)
    dims = dims[:, entry]
    for k, c in zip(grown, _delinearize(copy, [shape[k] for k in grown])):
        dims[k] = c
    return _coo(list(dims), vals[entry], shape, x._format.keeps_duplicates, "broadcast_to")


@implements(torch.broadcast_to, _T.broadcast_to)
def broadcast_to_op(x, *size, **kwargs):
    """``torch.broadcast_to``: the entries repeated along the broadcast dimensions (canonical COO). The size as
    one sequence, as separate numbers (``x.broadcast_to(2, 3)``, as torch's method takes it) or ``size=``."""
    if "size" in kwargs:
        size = kwargs.pop("size")
    elif len(size) == 1 and not isinstance(size[0], int):
        size = size[0]
    if type(x) is not SparseTensor or kwargs:
        raise NoSparseRule("a sparse shape argument" if type(x) is not SparseTensor else f"arguments {set(kwargs)}")
    return broadcast_to(x, size)


@implements(_T.expand)
def expand(x, *sizes):
    """``x.expand(*sizes)`` (``-1`` keeps a dimension): as ``broadcast_to``."""
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    lead = len(sizes) - x.dim()
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes provided ({len(sizes)}) must be greater or equal to the"
                           f" number of dimensions in the tensor ({x.dim()})")
    shape = [x._shape[k - lead] if n == -1 and k >= lead else n for k, n in enumerate(sizes)]
    return broadcast_to(x, shape)


@implements(_T.expand_as)
def expand_as(x, other):
    """``x.expand(other.shape)`` (a dense ``x`` expanded as a sparse ``other``: torch's own expand, a view)."""
    if type(x) is not SparseTensor:
        return x.expand(other.shape)
    return broadcast_to(x, other.shape)


# --- any, all ----------------------------------------------------------------------------------------------------------

def _nonzero_counts(x, dim, keepdim, empty_all=True):
    """The number of nonzero entries per group (all dimensions, or along ``dim``), as int64, and the group size
    (``dim=()``: along none of them where ``empty_all`` is false)."""
    n = x.dim()
    rdims = _reduce_dims(dim, n, empty_all)
    x = coalesce(x)  # each position once: a position's duplicates may cancel
    edims, vals = storage.unpack(x._format, x._shape, x._levels, x._vals)
    nz = (vals != 0).detach()
    gid, groups, size = _groups(x._shape, edims, rdims)
    count = torch.zeros(groups, dtype=torch.int64, device=vals.device).index_add(0, gid, nz.long())
    if dim is None and not keepdim:
        return count.reshape(()), size
    return _shaped(count, x._shape, rdims, keepdim), size


def _logical(x, dim, keepdim, every: bool):
    if type(x) is not SparseTensor:
        raise NoSparseRule("a sparse argument other than the input")
    out_dtype = torch.uint8 if x.dtype == torch.uint8 else torch.bool
    count, size = _nonzero_counts(x, dim, keepdim, empty_all=False)  # (torch's any / all over dim=(): none)
    return (count == size if every else count > 0).to(out_dtype)


def _dim_keepdim(args, kwargs):
    dim = args[0] if args else kwargs.get("dim")
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if kwargs.get("out") is not None:
        raise NoSparseRule("out=")
    return dim, keepdim


@implements(torch.any, _T.any)
def any_(x, *args, **kwargs):
    """``any``: true where a stored entry is nonzero (over everything, or along ``dim``); dense bool."""
    return _logical(x, *_dim_keepdim(args, kwargs), every=False)


@implements(torch.all, _T.all)
def all_(x, *args, **kwargs):
    """``all``: false unless every position (over everything, or along ``dim``) is stored and nonzero; dense."""
    return _logical(x, *_dim_keepdim(args, kwargs), every=True)


@implements(torch.count_nonzero, _T.count_nonzero)
def count_nonzero(x, dim=None):
    """The number of nonzero stored entries (over everything, or along ``dim``): dense int64."""
    if type(x) is not SparseTensor:
        raise NoSparseRule("a sparse argument other than the input")
    return _nonzero_counts(x, dim, False)[0]


def _nonzero_coordinates(x: SparseTensor) -> torch.Tensor:
    """``(K, ndim)`` int64: the coordinates of the nonzero entries, row-major sorted (duplicates summed first)."""
    x = coalesce(x)
    dims, vals = storage.unpack(x._format, x._shape, x._levels, x._vals)
    dims = dims[:, (vals != 0).detach()]
    order = torch.argsort(storage.linear_index(dims, x._shape))
    return dims[:, order].T.contiguous()


@implements(torch.nonzero, _T.nonzero)
def nonzero(x, *, out=None, as_tuple=False):
    """The coordinates of the nonzero entries, row-major: ``(K, ndim)`` int64, or one array per dimension with
    ``as_tuple=True``; dense, as torch's."""
    if type(x) is not SparseTensor or out is not None:
        raise NoSparseRule("out= or a sparse argument other than the input")
    coords = _nonzero_coordinates(x)
    return tuple(coords.T) if as_tuple else coords


@implements(torch.argwhere, _T.argwhere)
def argwhere(x):
    """``torch.nonzero(x)``: ``(K, ndim)`` int64 coordinates of the nonzero entries."""
    return nonzero(x)


@implements(torch.swapdims, _T.swapdims)
def swapdims(x, dim0, dim1):
    """``transpose``: a view sharing the values."""
    return torch.transpose(x, dim0, dim1)


@implements(torch.movedim, _T.movedim, torch.moveaxis, _T.moveaxis)
def movedim(x, source, destination):
    """The dimensions ``source`` moved to ``destination`` (a ``permute``, sharing the values)."""
    n = x.dim()
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    if len(src) != len(dst):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({src} dims) should contain the same"
                           f" number of dims as destination ({dst} dims)")
    src = [_dim(d, n, "movedim") for d in src]
    dst = [_dim(d, n, "movedim") for d in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise RuntimeError("movedim: repeated dim in `source` or `destination`")
    order = [None] * n
    for s_, d_ in zip(src, dst):
        order[d_] = s_
    rest = iter(d for d in range(n) if d not in src)
    order = [next(rest) if o is None else o for o in order]
    return torch.permute(x, order)


# --- metadata questions answered without densifying -------------------------------------------------------------------

implements(_T.is_signed)(lambda x: x.dtype.is_signed)
implements(torch.is_same_size, _T.is_same_size)(lambda x, other: tuple(x.shape) == tuple(other.shape))
implements(torch.is_conj, _T.is_conj, torch.is_neg, _T.is_neg)(lambda x: False)
implements(torch.is_inference, _T.is_inference)(lambda x: x.values().is_inference())
