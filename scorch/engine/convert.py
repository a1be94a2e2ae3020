"""Every format conversion: between any two formats, and zero-copy interop with torch's layouts.

``asformat`` takes any tensor into any format. A 2-d source into a CSR-like target (a dense level over a
compressed one) converts by generated kernels (``convert``: a counting sort, count pass, prefix sum and fill
pass, kernels from ``compiler.pipeline.conversion_plan``); a known pattern converts by one gather of its values
(the permutation kept per pattern); a dense tensor into a rows-compressed format keeps its nonzero rows whole;
other targets list the entries and pack them (``formats.storage``). A sparse source keeps its last conversions.

torch layout            scorch format                                       shared arrays
sparse_coo (N-d)        coo_nd(n) (uncoalesced variant if not coalesced)    indices rows, values
sparse_coo (hybrid)     coo_nd(n, dense_dim=k): dense trailing levels       indices rows, values (flat)
sparse_csr              csr                                                 crow/col indices, values
sparse_csc              csc                                                 ccol/row indices, values
sparse_bsr (bh, bw)     bsr(bh, bw)                                         crow/col indices, values (flat)
sparse_bsc (bh, bw)     bsc(bh, bw)                                         ccol/row indices, values (flat)
strided                 dense_nd(n) (only through ``to_torch``)             values
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref

import torch

from ..compiler.caches import register
from ..compiler.pipeline import conversion_plan
from ..compiler.schedule import compressed_target
from ..formats import LevelStorage, named, resolve
from ..formats import storage as _storage
from ..formats.storage import array_version
from ..formats.levels.base import INDEX_DTYPES, NARROW_INDEX_DTYPES
from ..rules import RULES
from ..sparse_tensor import SparseTensor, checking_invariants, needs_grad, refuse_complex
from .args import SUPPORTED, argument, level_info, tensor_type
from .scipy_interop import from_scipy, is_scipy_sparse


def convert(x: SparseTensor, fmt, index_dtype=None, drop_zeros=False):
    """``x`` in the CSR-like format ``fmt`` by generated kernels (counting sort: count, prefix sum, fill), or
    None when this path does not apply (another target, or a source with duplicates to sum).
    ``drop_zeros``: leave stored zeros out (a dense source's zeros are not entries)."""
    from ..formats import storage
    rc = compressed_target(fmt)
    if rc is None or x.format.keeps_duplicates or x.dim() != 2 or x.dtype not in SUPPORTED or \
            x.device.type != "cpu":  # (conversions on a GPU go through torch's sort)
        return None
    plans = conversion_plan(tensor_type(x), fmt, drop_zeros, rc)
    info, _ = level_info(x)
    sizes = {"i": x.shape[0], "j": x.shape[1]}
    rows = x.shape[rc[0]]
    counts = torch.zeros(rows, dtype=torch.int64)
    low, k, _ = plans["count"]
    k(*[_ptr(counts if a.kind == "counts" else argument(a, [x], info, sizes, {}, None)) for a in low.args])
    row_ptr = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    nnz = int(row_ptr[-1])
    nxt = row_ptr[:-1].clone()
    crd = torch.empty(nnz, dtype=torch.int64)
    vals = torch.empty(nnz, dtype=x.dtype)
    extra = {"next": nxt, "out_crd": crd, "out": vals}
    low, k, _ = plans["fill"]
    k(*[_ptr(extra[a.kind] if a.kind in extra else argument(a, [x], info, sizes, {}, None)) for a in low.args])
    # entries reach each row in the source's loop order: sorted when the source's outermost level stores the
    # target's column coordinate (ordered, unique: CSR -> CSC and back); else checked, and None when not sorted
    from ..formats import Var
    e0, l0 = x.format.levels[0]
    if nnz > 1 and not (isinstance(e0, Var) and e0.dim == rc[1] and l0.ordered and l0.unique):
        starts = torch.zeros(nnz, dtype=torch.bool)
        starts[row_ptr[:-1][counts > 0]] = True
        if bool(((crd[1:] <= crd[:-1]) & ~starts[1:]).any()):
            return None
    idx = index_dtype or storage.pick_index_dtype(nnz, *x.shape)
    return SparseTensor(fmt, x.shape, [None, {"pos": row_ptr.to(idx), "crd": crd.to(idx)}], vals, check=False)


def _ptr(v):
    return v.data_ptr() if isinstance(v, torch.Tensor) else v


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def asformat(x, format, *, index_dtype=None, check=False) -> SparseTensor:
    """``x`` (a dense tensor, a torch sparse tensor, a SparseTensor or a SciPy sparse array, viewed first by
    ``scorch.from_scipy``) stored in ``format``.

    ``format`` is a ``scorch.Format``, format text, or a name (``"csr"``, ``"bsr(2, 2)"``...).
    ``index_dtype`` forces the index arrays' dtype (default: int32 when the sizes allow; int8 or int16 for
    formats whose only index arrays are small coordinates, such as ``nm(n, m)``'s offsets). int8 and int16
    are refused (``ValueError``) where a position or coordinate does not fit.
    ``check=True`` validates the source storage (when sparse) and the result.
    Returns ``x`` itself when it already has that format and index type.
    """
    if not isinstance(x, torch.Tensor):
        x = from_scipy(x) if is_scipy_sparse(x) else torch.as_tensor(x)
    if x.is_complex():
        refuse_complex("scorch.asformat's input", x.dtype)
    if x.device.type == "meta" and x.layout == torch.strided:
        raise NotImplementedError("scorch.asformat: a dense tensor on the meta device has no values, so which of"
                                  " its entries are nonzero (the pattern, and nnz) is unknown. A meta SparseTensor"
                                  " needs meta index arrays: scorch.sparse_csr_tensor(crow, col, values, size)"
                                  " with meta tensors, or S.to('meta') of a real SparseTensor")
    if x.dim() == 0:
        raise ValueError("scorch formats store tensors of at least one dimension, got a 0-d tensor")
    fmt = resolve(format, x.dim())
    if index_dtype is not None and index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype must be torch.int8, torch.int16, torch.int32 or torch.int64, got {index_dtype}")
    narrow = index_dtype in NARROW_INDEX_DTYPES  # (assembled by storage.pack, which checks that every value fits)
    check = check or checking_invariants()
    if x.layout in _SPARSE_LAYOUTS:
        x = from_torch(x, check=check or None)
    if type(x) is SparseTensor and len(_storage.index_dtypes(x._levels)) > 1:  # (built with check=False)
        x = SparseTensor(x._format, x._shape, _storage.uniform_index_dtype(x._levels), x._vals, check=check)
    if needs_grad([x]) and not (isinstance(x, SparseTensor) and x.format == fmt and index_dtype in (
            None, x.index_dtype)):
        return RULES.differentiable_convert(x, lambda src: asformat(src, fmt, index_dtype=index_dtype, check=check))
    if isinstance(x, SparseTensor):
        if check:
            x.check_invariants()
        if x.format == fmt and index_dtype in (None, x.index_dtype):
            return x
        fast = None if narrow else _compiled_conversion(x, fmt, index_dtype, drop_zeros=False)
        if fast is not None:
            return fast
        dims, vals = _storage.unpack(x.format, x.shape, x.levels, x.values())
    else:
        if x.layout != torch.strided:
            raise ValueError(f"cannot convert a tensor of layout {x.layout} to a scorch format")
        rows = None if narrow else compressed_rows(x, fmt, index_dtype, check)
        if rows is not None:
            return rows
        if x.dim() == 2 and not narrow:
            view = SparseTensor(named.dense, x.shape, [LevelStorage(), LevelStorage()], x.detach().reshape(-1),
                                check=False)
            fast = _compiled_conversion(view, fmt, index_dtype, drop_zeros=True)
            if fast is not None:
                return fast
        dims = x.nonzero().T
        vals = x[tuple(dims)]
    levels, values = _storage.pack(fmt, x.shape, dims, vals.detach(), index_dtype)
    return SparseTensor(fmt, x.shape, levels, values, check=check)


def compressed_rows(x, fmt, index_dtype, check, copy=True):
    """A dense tensor into ``(i : compressed, j : dense, ...)`` (rows with a nonzero kept whole, as a product
    with a sparse row index infers): one pass to find the rows, one gather; None for other formats."""
    from ..formats import Compressed, Dense, Var
    types, exprs = fmt.level_types, fmt.exprs
    if x.dim() < 2 or not (type(types[0]) is Compressed and types[0].unique and types[0].ordered) or \
            any(type(t) is not Dense for t in types[1:]) or \
            [e.dim if isinstance(e, Var) else None for e in exprs] != list(range(x.dim())):
        return None
    flat = x.detach().reshape(x.shape[0], x[0].numel() if x.shape[0] else math.prod(x.shape[1:]))
    if flat.dtype == torch.bool or flat.dtype.is_complex or flat.shape[1] == 0:
        nonzero = flat.ne(0).any(1)
    else:  # (two reductions, no temporary of x's size: abs() would allocate one, each page a fault)
        nonzero = (flat.amax(1) != 0) | (flat.amin(1) != 0)
    kept = nonzero.nonzero().reshape(-1)  # (a NaN row is kept: NaN != 0)
    if index_dtype is None:
        index_dtype = _storage.pick_index_dtype(*x.shape, flat.numel())
    pos = torch.tensor([0, kept.numel()], dtype=index_dtype, device=x.device)
    levels = [LevelStorage(pos=pos, crd=kept.to(index_dtype))] + [LevelStorage() for _ in types[1:]]
    if copy or kept.numel() < flat.shape[0] or not flat.is_contiguous():
        values = flat.index_select(0, kept).reshape(-1)  # (a copy: the result never shares the caller's memory)
    else:  # (the caller's tensor is its own to give away)
        values = flat.reshape(-1)
    return SparseTensor(fmt, x.shape, levels, values, check=check)


def _compiled_conversion(x, fmt, index_dtype, drop_zeros):
    """CSR and CSC targets are assembled by generated kernels (counting sort); None where that path does
    not apply, and the vectorized conversion below serves instead."""
    if x.device.type != "cpu" or x.numel() == 0:
        return None
    # a sparse source keeps its last conversions: a constant operand read transposed every step (the features
    # in the backward pass of ``X @ W``) is converted once. An entry is used only while neither the source nor
    # the converted tensor has been modified in place since (``_stamp``).
    memo = x.__dict__.setdefault("_conversions", {}) if type(x) is SparseTensor and not x.format.is_dense else None
    key = (fmt, index_dtype, drop_zeros)
    result = _kept(x, memo, key)
    if result is not None:
        return result
    moved = _by_known_permutation(x, fmt, index_dtype) if memo is not None and not drop_zeros else None
    result, prints = moved if moved is not None else (convert(x, fmt, index_dtype, drop_zeros), None)
    if memo is not None and result is not None:
        memo[key] = (_stamp(x, result, prints), result)
    return result


def kept_conversion(x: SparseTensor, fmt) -> SparseTensor:
    """``asformat(x, fmt)`` for a SparseTensor ``x`` and a ``Format``: the conversion ``x`` keeps, checked as
    ``asformat`` checks it (``_stamp``), without ``asformat``'s checks of its arguments first (a compiled
    backward's kept gradient call asks for the same transposition of the same operand every step)."""
    kept = None if checking_invariants() or needs_grad([x]) else \
        _kept(x, x.__dict__.get("_conversions"), (fmt, None, False))
    return asformat(x, fmt) if kept is None else kept


def _kept(x: SparseTensor, memo, key):
    """The conversion of ``x`` that ``memo`` (its ``_conversions``, or None) keeps under ``key``, where neither
    tensor changed since (``_stamp``), else None."""
    entry = None if memo is None else memo.get(key)
    return entry[1] if entry is not None and entry[0] == _stamp(x, entry[1]) else None


def _stamp(x: SparseTensor, result: SparseTensor, prints=None) -> tuple:
    """What a kept conversion of ``x`` to ``result`` is checked against: the versions of both tensors' arrays and
    values, and the fingerprints of both tensors' values (``relayout.fingerprint``: writes through ``.data`` or a
    NumPy view leave the version counter as it was; a values array is read once for it, a fraction of a
    conversion), or ``prints``, those fingerprints taken just now. Index arrays are trusted by their versions."""
    if prints is None:
        prints = _fingerprint(x._vals), _fingerprint(result._vals)
    return (_versions(x), _versions(result)) + prints


def _fingerprint(v: torch.Tensor) -> int:
    from ..compiler import relayout
    return relayout.fingerprint(v if v.is_contiguous() else v.contiguous())


# Conversions of a pattern, by the pattern's index arrays (identity and version): the target's index arrays and
# the permutation taking the source's values to the target's order. Another tensor on the same arrays (attention
# scores on a graph, a gradient on a weight's pattern) then converts by one gather of its values.
_PERMUTATIONS = _storage.PatternMemo(64)
register("permutations", "conversions of a pattern (target index arrays and the values' permutation), by the"
         " source's index arrays", _PERMUTATIONS.__len__, _PERMUTATIONS.clear)
register("validated", "index arrays already validated, per format, shape and number of values",
         _storage.VALIDATED.__len__, _storage.VALIDATED.clear)


def _by_known_permutation(x: SparseTensor, fmt, index_dtype):
    """``(x converted to fmt, the fingerprints of x's and its values)`` by the pattern's kept permutation (made
    here on its first conversion), or None where that path does not apply."""
    from ..compiler import relayout
    extra = (x._format, fmt, index_dtype, tuple(x._shape))
    entry = _PERMUTATIONS.get(extra, x._levels)
    if entry is None:
        blocks = _block_matrices(x, fmt)
        if blocks is not None:  # BSR <-> BSC: the blocks move whole; their pattern converts as a matrix
            src, target, inner = blocks
        elif x.nnz >= 2 ** 53 or x._format.padded or compressed_target(fmt) is None:
            return None
        else:
            src, target, inner = x, fmt, None
        positions = src.with_values(torch.arange(src._vals.numel(), dtype=torch.float64, device=src.device))
        moved = convert(positions, target, index_dtype)
        if moved is None:
            return None
        perm = moved._vals.to(torch.int32 if x.nnz < 2 ** 31 else torch.int64)  # index_select takes either
        levels = moved._levels if inner is None else (LevelStorage(), moved._levels[1]) + tuple(inner)
        entry = (levels, perm)
        _PERMUTATIONS.put(extra, x._levels, entry)
    levels, perm = entry[:2]
    src = x._vals.detach()
    last = entry[2] if len(entry) > 2 else None  # the last values moved: the same values ask again (a weight
    prints = None                                  # read transposed by several calls), unchanged (``_stamp``)
    # (``array_version``: an inference tensor, without a version counter, matches nothing: moved every time)
    if last is not None and last[0]() is x._vals and (last[1], last[3]) == (array_version(x._vals),
                                                                            array_version(last[2])):
        prints = _fingerprint(x._vals), _fingerprint(last[2])
    if prints is not None and prints == last[4]:
        vals = last[2]
    else:
        if len(levels) != 2 and perm.numel():  # whole blocks
            vals = torch.index_select(src.view(perm.numel(), -1), 0, perm).reshape(-1)
        else:
            vals = relayout.gather(src, perm)
        prints = _fingerprint(x._vals) if prints is None else prints[0], _fingerprint(vals)
        _PERMUTATIONS.put(extra, x._levels, (levels, perm, (weakref.ref(x._vals), array_version(x._vals), vals,
                                                            array_version(vals), prints)))
    return SparseTensor(fmt, x._shape, levels, vals, check=False), prints


def _block_matrices(x: SparseTensor, fmt):
    """For blocked formats that differ only in the order of their two block levels (BSR and BSC): the source's
    block pattern as a CSR-like matrix of block numbers, the target's block-level format, and the target's
    (unchanged) in-block level storage; else None."""
    from ..formats import Compressed, Dense, Div, Format, Var
    a, b = x._format, fmt
    if len(a.levels) != 4 or len(b.levels) != 4 or a.levels[2:] != b.levels[2:] or a.exprs[:2] != b.exprs[1::-1]:
        return None
    if not all(isinstance(e, Div) for e in a.exprs[:2]) or {e.dim for e in a.exprs[:2]} != {0, 1} or not all(
            isinstance(t, Dense) for t in a.level_types[2:]):
        return None
    for f in (a, b):
        if not (isinstance(f.level_types[0], Dense) and isinstance(f.level_types[1], Compressed)
                and f.level_types[1].unique and f.level_types[1].ordered):
            return None
    sizes = [-(-int(x._shape[d]) // e.block) for d, e in sorted((e.dim, e) for e in a.exprs[:2])]
    as_matrix = (lambda f: Format.from_levels(2, [(Var(f.exprs[0].dim), Dense()),
                                                  (Var(f.exprs[1].dim), Compressed())]))
    src = SparseTensor(as_matrix(a), sizes, [LevelStorage(), x._levels[1]],
                       torch.zeros(x._levels[1].crd.numel(), dtype=torch.float64, device=x.device), check=False)
    return src, as_matrix(b), x._levels[2:]


# Patterns weighed for a transposition (``recurring_pattern``), by their index arrays.
_WEIGHED = _storage.PatternMemo(64)
register("weighed-patterns", "patterns weighed for a transposition before, by their index arrays", _WEIGHED.__len__,
         _WEIGHED.clear)


def recurring_pattern(x: SparseTensor, fmt) -> bool:
    """Whether converting ``x`` to ``fmt`` costs one gather of its values: its pattern's permutation is kept
    (``_PERMUTATIONS``: another tensor on the same index arrays was converted), or the same arrays were weighed
    for this conversion before (a graph's pattern holding new values every step, as GAT's attention: the
    conversion that follows keeps the permutation, its sort paid once). Each call counts as one weighing."""
    if type(x) is not SparseTensor or x._format.padded or compressed_target(fmt) is None or x.device.type != "cpu":
        return False
    extra = (x._format, fmt, None, tuple(x._shape))
    if _PERMUTATIONS.get(extra, x._levels) is not None:
        return True
    seen = _WEIGHED.get(extra, x._levels) is not None
    if not seen:
        _WEIGHED.put(extra, x._levels, True)
    return seen


def converted_already(x, fmt) -> bool:
    """Whether ``asformat(x, fmt)`` would return a kept conversion (no work)."""
    memo = x.__dict__.get("_conversions") if type(x) is SparseTensor else None
    entry = memo.get((resolve(fmt, x.dim()), None, False)) if memo else None
    # (versions only: a planning guess, and ``asformat`` checks the values' fingerprints before it returns one)
    return entry is not None and entry[0][:2] == (_versions(x), _versions(entry[1]))


def _versions(s: SparseTensor):
    """The versions of ``s``'s values and arrays (``array_version``: an inference tensor's matches nothing, so a
    conversion of or into one is never served again)."""
    return (array_version(s._vals),) + tuple(array_version(a) for st in s._levels for a in st.arrays().values())


def from_torch(t: torch.Tensor, *, check=None) -> SparseTensor:
    """View a torch sparse tensor (COO, CSR, CSC, BSR, BSC) as a SparseTensor, sharing its arrays. ``check``:
    None (default) checks what keeps the kernels' reads in bounds (``storage.validate_bounds``: array lengths,
    positions, coordinate ranges; torch's constructors check nothing by default); True validates everything
    (order and uniqueness too); False nothing (arrays scorch made itself)."""
    if isinstance(t, SparseTensor):
        return t
    layout = t.layout
    if layout not in _SPARSE_LAYOUTS:
        raise ValueError(f"from_torch takes a torch sparse tensor, got layout {layout}; use scorch.asformat"
                         " to convert a dense tensor")
    if layout == torch.sparse_coo:
        sparse_dim, dense_dim = t.sparse_dim(), t.dense_dim()
        if sparse_dim == 0:
            raise NotImplementedError(f"scorch: a COO tensor with no sparse dimension (sparse_dim=0, shape"
                                      f" {tuple(t.shape)}) has no scorch format; use its dense form")
        if t.requires_grad and not t.is_coalesced():  # (torch gives the values of a tensor that may hold
            t = t.coalesce()  # duplicates only through ``_values()``, outside the graph: coalesced, they keep it)
        idx, vals = t._indices(), t._values()
        if t.requires_grad:  # ``values()`` carries the graph (``_values()`` does not)
            vals = t.values()
        vals = vals.reshape(-1)  # hybrid: each entry's dense block, row-major, as the dense levels store it
        coalesced = t.is_coalesced()
        pos = torch.tensor([0, idx.shape[1]], dtype=idx.dtype, device=idx.device)
        levels = ([LevelStorage(pos=pos, crd=idx[0])] + [LevelStorage(crd=idx[d]) for d in range(1, sparse_dim)]
                  + [LevelStorage()] * dense_dim)
        fmt = named.coo_nd(t.dim(), coalesced=coalesced, dense_dim=dense_dim)
    else:
        if t.dim() != 2 or t.dense_dim():
            raise NotImplementedError(f"scorch: batched or hybrid {layout} tensors are not supported"
                                      f" (shape {tuple(t.shape)}, dense_dim={t.dense_dim()})")
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            pos, crd = t.crow_indices(), t.col_indices()
        else:
            pos, crd = t.ccol_indices(), t.row_indices()
        vals = t.values()
        if layout == torch.sparse_csr:
            fmt = named.csr
        elif layout == torch.sparse_csc:
            fmt = named.csc
        else:
            bh, bw = vals.shape[1:3]
            fmt = (named.bsr if layout == torch.sparse_bsr else named.bsc)(bh, bw)
            vals = vals.reshape(-1)
        levels = [LevelStorage()] + [LevelStorage(pos=pos, crd=crd)] + [LevelStorage()] * (len(fmt.levels) - 2)
    # torch keeps int32 crow indices beside int64 column indices when invariants are not checked
    levels = _storage.uniform_index_dtype(levels)
    if check is None and not checking_invariants():
        _storage.validate_bounds(fmt, t.shape, levels, vals)
        if layout != torch.sparse_coo and not _increasing_in_rows(levels[1].pos, levels[1].crd):
            if t.requires_grad and not t.is_leaf:
                raise ValueError(f"scorch: from_torch: this {layout} tensor has unsorted or repeated indices within a"
                                 " row and is the result of a recorded operation: sorting it would cut the graph;"
                                 " build it with sorted, unique indices")
            r = from_torch(_canonical(t), check=False)  # (made by torch's own conversions: sorted, in bounds)
            return r.requires_grad_() if t.requires_grad else r
    return SparseTensor(fmt, t.shape, levels, vals, requires_grad=t.requires_grad and t.is_leaf, check=bool(check))


def _increasing_in_rows(pos, crd) -> bool:
    """Whether the coordinates of each compressed row (column) strictly increase: what scorch's kernels assume
    (a merge of two rows, sparse + sparse, read an unsorted one wrongly; ``to_dense`` kept one of two duplicates)."""
    n = crd.numel()
    if n < 2:
        return True
    starts = torch.zeros(n, dtype=torch.bool, device=crd.device)
    inner = pos[1:-1]
    starts[inner[inner < n].long()] = True
    return bool(((crd[1:] > crd[:-1]) | starts[1:]).all())


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """A compressed torch tensor whose rows have unsorted or repeated coordinates, rebuilt with them sorted and the
    repeats summed (as torch's ``to_dense`` and products count them), in new arrays (warned: no longer shared)."""
    warnings.warn(f"scorch: from_torch: this {t.layout} tensor has unsorted or repeated indices within a row"
                  " (torch's constructors do not check them): sorted, and repeats summed, into new arrays that the"
                  " torch tensor no longer shares", UserWarning, stacklevel=3)
    coo = t.to_sparse_coo()  # (marked coalesced by torch, which assumes sorted rows: rebuilt to be summed)
    coo = torch.sparse_coo_tensor(coo._indices(), coo._values(), coo.shape).coalesce()
    if t.layout in (torch.sparse_csr, torch.sparse_csc):
        return coo.to_sparse_csr() if t.layout == torch.sparse_csr else coo.to_sparse_csc()
    block = tuple(t.values().shape[1:3])
    return coo.to_sparse_bsr(block) if t.layout == torch.sparse_bsr else coo.to_sparse_bsc(block)


def to_torch(s: SparseTensor) -> torch.Tensor:
    """The torch tensor with the same storage: COO, CSR, CSC, BSR, BSC, or strided for dense formats.

    The arrays are shared, except COO index arrays that are int32 or not rows of one tensor (torch's COO
    needs one int64 ``(ndim, nnz)`` tensor; scorch's own COO is built that way only for int64).
    """
    fmt, lv, vals = s.format, s.levels, s.values()
    if _storage.row_major(fmt):
        return vals.reshape(s.shape)
    if fmt.is_dense:  # another order of the positions (a transposed dense format)
        return s.to_dense()
    coo = named.hybrid_coo_dims(fmt)
    if coo is not None:
        dense_dim, coalesced = coo
        sparse_dim = fmt.ndim - dense_dim
        idx = _rows_as_matrix([st.crd for st in lv[:sparse_dim]])
        return torch.sparse_coo_tensor(idx, vals.reshape(idx.shape[1], *s.shape[sparse_dim:]), s.shape,
                                       is_coalesced=coalesced, check_invariants=False)
    kw = dict(size=s.shape, check_invariants=False)
    if fmt in (named.csr, named.csc):
        with quiet_beta():
            make = torch.sparse_csr_tensor if fmt == named.csr else torch.sparse_csc_tensor
            return make(lv[1].pos, lv[1].crd, vals, **kw)
    block = named.block_size(fmt)
    if block is not None:
        bh, bw = block
        if s.shape[0] % bh or s.shape[1] % bw:
            raise ValueError(f"torch's BSR/BSC need the shape {tuple(s.shape)} to be a multiple of the block"
                             f" size {block}")
        blocks = vals.reshape(-1, bh, bw)
        make = torch.sparse_bsr_tensor if named.name_of(fmt).startswith("bsr") else torch.sparse_bsc_tensor
        with quiet_beta():
            return make(lv[1].pos, lv[1].crd, blocks, **kw)
    raise ValueError(f"format {fmt.name or fmt} has no torch layout; convert it first, e.g."
                     " scorch.asformat(S, 'csr'), or use S.to_dense()")


def _rows_as_matrix(rows):
    """``rows`` as one ``(n, nnz)`` int64 tensor: a view when they are equally spaced rows of one storage."""
    first = rows[0]
    if all(r.dtype == torch.int64 and r.stride() == (1,)
           and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for r in rows):
        step = (rows[1].data_ptr() - first.data_ptr()) // 8 if len(rows) > 1 else first.numel()
        if step >= first.numel() and all(r.data_ptr() == first.data_ptr() + 8 * k * step
                                         for k, r in enumerate(rows)):
            return first.as_strided((len(rows), first.numel()), (step, 1))
    return torch.stack([r.long() for r in rows])


@contextlib.contextmanager
def quiet_beta():
    """torch warns that its compressed layouts are beta each time one is made; scorch makes them on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*support is in beta state")
        yield


def coo_from_entries(rows, vals, shape, duplicates: bool) -> SparseTensor:
    """The coalesced COO SparseTensor of the entries at ``rows`` (one int64 coordinate array per dimension)
    with ``vals``: sorted row-major, duplicates summed (only an input that keeps duplicates has any), index
    arrays as ``scorch.asformat(..., "coo")`` makes them (int32 when the sizes allow, the rows of one matrix).
    ``vals`` is only gathered and summed, so gradients flow back through it."""
    device = vals.device
    # the row-major linear index: it fits int64 as the shape has fewer than 2**63 elements
    key = _storage.linear_index(torch.stack(rows), shape) if rows else torch.zeros(vals.numel(), dtype=torch.int64,
                                                                                   device=device)
    if key.numel() > 1:
        key, order = torch.sort(key, stable=True)
        vals = vals[order]
        rows = [c[order] for c in rows]
        if duplicates:
            first = torch.ones(key.numel(), dtype=torch.bool, device=device)
            first[1:] = key[1:] != key[:-1]
            if not bool(first.all()):
                group = torch.cumsum(first.long(), 0) - 1
                acc = torch.int64 if vals.dtype == torch.bool else vals.dtype
                summed = torch.zeros(int(group[-1]) + 1, dtype=acc, device=device).index_add(0, group, vals.to(acc))
                vals = summed > 0 if vals.dtype == torch.bool else summed
                rows = [c[first] for c in rows]
    m = vals.numel()
    index_dtype = _storage.pick_index_dtype(m, *shape)
    crd = torch.stack(rows).to(index_dtype).unbind(0)
    pos = torch.tensor([0, m], dtype=index_dtype, device=device)
    levels = [LevelStorage(pos=pos, crd=crd[0])] + [LevelStorage(crd=c) for c in crd[1:]]
    return SparseTensor(named.coo_nd(len(shape)), shape, levels, vals, check=False)
