"""Vectorized (torch) assembly and traversal of level storage, written only against the level interface.

``pack`` builds any format's arrays from a list of coordinates; ``unpack`` lists a storage's entries;
``validate`` checks storage invariants. These serve format conversion until the compiler generates it.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch

from .expr import Mod, Var, dim_name
from .format import Format
from .levels import Compressed, Dense, LevelStorage, Singleton, packed_level
from .levels.base import INDEX_DTYPES, NARROW_INDEX_DTYPES
from .levels.fixed import Fixed, SlotsExceeded

INT32_MAX = 2**31 - 1


def pick_index_dtype(*extents: int) -> torch.dtype:
    """int32 when every coordinate, position and count fits, else int64."""
    return torch.int32 if max((abs(int(e)) for e in extents), default=0) < INT32_MAX else torch.int64


def narrow_index_dtype(fmt: Format, shape):
    """int8 or int16 for a format whose only index arrays are fixed levels storing an offset in a group
    (coordinate ``j % m``: ``nm(n, m)``'s offset of each kept entry in its group of m) when every offset fits,
    else None. Such arrays hold offsets only, never positions, counts or whole coordinates, so their largest
    value is the group's size whatever the shape: an nm(2, 4) weight then stores a byte per kept entry instead
    of four. (Other formats keep int32 or int64 by default, as torch's index arrays are.)"""
    extent = 0
    for e, lvl, (lo, hi) in zip(fmt.exprs, fmt.level_types, fmt.level_bounds(shape)):
        if isinstance(lvl, Fixed) and isinstance(e, Mod):
            extent = max(extent, abs(int(lo)), abs(int(hi)))
        elif not isinstance(lvl, Dense):
            return None
    if extent == 0:
        return None  # (no index array at all)
    return next((d for d in NARROW_INDEX_DTYPES if extent <= torch.iinfo(d).max + 1), None)


def wide_index(index_dtype):
    """The index dtype of a converted copy of a tensor with ``index_dtype`` (a co-iteration's operand in a
    mergeable format): the same, except int64 for int8 and int16, which hold small coordinates only while the
    copy's arrays hold positions (the plan types the copy before its sizes are known)."""
    return torch.int64 if index_dtype in NARROW_INDEX_DTYPES else index_dtype


def _fits(levels, index_dtype) -> bool:
    """Whether every index array's values fit ``index_dtype``."""
    info = torch.iinfo(index_dtype)
    return all(a.numel() == 0 or (info.min <= int(a.min()) and int(a.max()) <= info.max)
               for st in levels for a in st.arrays().values())


def pack(fmt: Format, shape, dims: torch.Tensor, values: torch.Tensor, index_dtype=None):
    """Assemble ``fmt`` storage for the entries at ``dims`` (``(ndim, M)`` int64) with ``values`` (``(M,)``).

    Entries are sorted by level coordinates; duplicates are summed unless the format keeps them.
    Returns ``(levels, values)``: a tuple of ``LevelStorage`` and the 1-d values array (0 where padded).
    """
    bounds = fmt.level_bounds(shape)
    given = dims, values
    coords = [e.evaluate(dims) for e in fmt.exprs]
    m = values.numel()
    split = _dense_tail(fmt)
    if m > 1:
        if not _in_order(coords):  # (entries of a dense tensor in a row-major format already are)
            perm = torch.arange(m, device=values.device)
            for c in reversed(coords):
                perm = perm[torch.argsort(c[perm], stable=True)]
            coords = [c[perm] for c in coords]
            values = values[perm]
        if not fmt.keeps_duplicates or split is not None:  # (a dense tail stores a position once)
            new = torch.zeros(m, dtype=torch.bool, device=values.device)
            new[0] = True
            for c in coords:
                new[1:] |= c[1:] != c[:-1]
            if not bool(new.all()):
                group = torch.cumsum(new.long(), 0) - 1
                summed = torch.zeros(int(group[-1]) + 1, dtype=_acc_dtype(values), device=values.device)
                summed.index_add_(0, group, values.to(summed.dtype))
                values = summed.to(values.dtype) if values.dtype != torch.bool else summed > 0
                coords = [c[new] for c in coords]
    entry_group = None
    if split is not None and values.numel():
        # the levels above the dense tail store each distinct prefix once; the tail gives each a dense block
        first = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
        first[0] = True
        for c in coords[:split]:
            first[1:] |= c[1:] != c[:-1]
        entry_group = torch.cumsum(first.long(), 0) - 1
        coords = [c[first] for c in coords[:split]] + coords[split:]
    parent = torch.zeros(values.numel() if entry_group is None else int(entry_group[-1]) + 1, dtype=torch.int64,
                         device=values.device)
    count, levels, largest = 1, [], [m]
    for k, ((lo, hi), lvl, c) in enumerate(zip(bounds, fmt.level_types, coords)):
        if k == split and entry_group is not None:
            parent = parent[entry_group]
        try:
            st, parent, count = lvl.assemble(parent, count, c, lo, hi)
        except SlotsExceeded as e:
            nonzero = given[1] != 0
            if not bool(nonzero.all()):  # (stored zeros, as a BSR block's or a DIA diagonal's: not kept for room)
                return pack(fmt, shape, given[0][:, nonzero], given[1][nonzero], index_dtype)
            raise ValueError(_slots_message(fmt, k, [x[e.entry] for x in coords[:k]], e)) from None
        levels.append(st)
        largest += [count, lo, hi]
    out = torch.zeros(count, dtype=values.dtype, device=values.device)
    out[parent] = values
    if index_dtype is None:
        index_dtype = narrow_index_dtype(fmt, shape) or pick_index_dtype(*largest)
    elif max(abs(x) for x in largest) >= INT32_MAX and index_dtype == torch.int32:
        raise ValueError("index_dtype=int32 cannot address this tensor: sizes exceed 2**31 - 1")
    elif index_dtype in NARROW_INDEX_DTYPES and not _fits(levels, index_dtype):
        raise ValueError(f"index_dtype={index_dtype} cannot hold this tensor's index arrays (positions or"
                         f" coordinates beyond {torch.iinfo(index_dtype).max}): use torch.int32 or torch.int64")
    levels = [st.map(lambda a: a.to(index_dtype)) for st in levels]
    rows = len(levels) if split is None else split
    if rows > 1 and all(type(lvl) is Singleton for lvl in fmt.level_types[1:rows]):
        # COO: the coordinate arrays are the rows of one (ndim, nnz) matrix, as torch's COO indices are
        crd = torch.stack([st.crd for st in levels[:rows]]).unbind(0)
        levels = ([LevelStorage(pos=levels[0].pos, crd=crd[0])] + [LevelStorage(crd=r) for r in crd[1:]]
                  + levels[rows:])
    return tuple(levels), out


def _dense_tail(fmt: Format):
    """The index of the first of the trailing dense levels (one coordinate each) when a level above them may
    repeat a coordinate (hybrid COO), else None: such levels must store each distinct prefix once."""
    k = len(fmt.levels)
    while k > 0 and type(fmt.level_types[k - 1]) is Dense and type(fmt.exprs[k - 1]) is Var:
        k -= 1
    if k == len(fmt.levels) or k == 0 or all(lvl.unique for lvl in fmt.level_types[:k]):
        return None
    return k


def _in_order(coords) -> bool:
    """Whether the entries are already sorted by their level coordinates (lexicographically, ties allowed)."""
    ok = None
    for c in reversed(coords):
        a, b = c[:-1], c[1:]
        ok = b >= a if ok is None else (b > a) | ((b == a) & ok)
    return bool(ok.all())


def _slots_message(fmt: Format, k, parent_coords, e: SlotsExceeded) -> str:
    """The error for a parent with more entries than level ``k`` (a ``fixed(n)`` level) stores."""
    from .named import nm_size
    nmsize = nm_size(fmt)
    if nmsize is not None:
        n, m = nmsize
        row, group = (int(x) for x in parent_coords)
        return (f"cannot store this tensor as nm({n}, {m}): row {row}, column group {group} (columns"
                f" {group * m}..{group * m + m - 1}) has {e.count} nonzeros, more than the {n} of every {m} that"
                f" n:m sparsity keeps (this is the first such group). Prune first, e.g. with an n:m sparsifier that"
                f" keeps the {n} largest-magnitude entries of every group of {m} columns")
    names = [dim_name(d) for d in range(fmt.ndim)]
    where = ", ".join(e_.render(names) for e_ in fmt.exprs[:k])
    at = ", ".join(str(int(x)) for x in parent_coords)
    return (f"cannot store this tensor in format {fmt.name or fmt}: level {k} ({fmt.level_text(k)}) stores at most"
            f" {e.slots} entries under each ({where}), but ({where}) = ({at}) has {e.count} (the first such);"
            f" drop entries first, or use a format without a fixed number of slots")


def _acc_dtype(values):
    return torch.int64 if values.dtype == torch.bool else values.dtype


def positions(fmt: Format, shape, levels):
    """Walk the levels top-down: returns ``(leaf_pos, level_coords)`` for every stored position, in order."""
    parent = torch.zeros(1, dtype=torch.int64, device=_device(levels))
    count, coords = 1, []
    for (lo, hi), lvl, st in zip(fmt.level_bounds(shape), fmt.level_types, levels):
        src, child, c = lvl.iterate(st, parent, count, lo, hi)
        coords = [x[src] for x in coords] + [c]
        count = lvl.num_positions(st, count, lo, hi)
        parent = child
    return parent, coords


def coordinates(fmt: Format, shape, levels):
    """Every stored position's coordinates: ``(leaf, dims, inside)``, where ``leaf`` is the position in the
    values array, ``dims`` the ``(ndim, P)`` int64 coordinates and ``inside`` whether they fall in the shape
    (block and diagonal formats store positions outside it)."""
    leaf, coords = positions(fmt, shape, levels)
    dims = [None] * fmt.ndim
    for rec in fmt.inverse:
        dims[rec.dim] = rec.evaluate(coords, dims)
    dims = torch.stack(dims) if dims else torch.zeros(0, leaf.numel(), dtype=torch.int64, device=leaf.device)
    inside = torch.ones(leaf.numel(), dtype=torch.bool, device=leaf.device)
    for d, n in enumerate(shape):
        inside &= (dims[d] >= 0) & (dims[d] < n)
    return leaf, dims, inside


def padding(fmt: Format, shape, levels, values, *others):
    """A bool mask over ``values``: the padding of a format with a padded (fixed) level; None for other formats.

    Where the fixed level is the last one (ELL, n:m), padding is read off the coordinates: a segment's real
    coordinates increase, and a shorter segment repeats its last one to its end, so a slot whose coordinate
    equals the one before it is padding, whatever its value (a stored zero of a real slot, such as optimizer
    state or a trained weight at exactly 0, is an entry). Only a segment whose every slot is at coordinate 0
    cannot be read so: empty, or one entry at 0; its first slot is padding where it holds 0 (in ``values`` and
    in each of ``others``, value arrays on the same index arrays). Formats whose fixed level has levels below
    it: every stored zero (as in ``values`` and ``others``) is padding."""
    if not fmt.padded:
        return None
    zero = values == 0
    for o in others:
        zero &= o == 0
    last = fmt.level_types[-1]
    if not isinstance(last, Fixed) or any(isinstance(lvl, Fixed) for lvl in fmt.level_types[:-1]):
        return zero
    crd = levels[-1].crd
    count = 1
    for (lo, hi), lvl, st in zip(fmt.level_bounds(shape)[:-1], fmt.level_types[:-1], levels[:-1]):
        count = lvl.num_positions(st, count, lo, hi)
    w = last.width(levels[-1], count)
    if crd is None or crd.numel() != values.numel() or count * w != crd.numel():
        return zero
    if w == 0:
        return zero
    c = crd.reshape(count, w)
    pad = torch.zeros((count, w), dtype=torch.bool, device=crd.device)
    pad[:, 1:] = c[:, 1:] == c[:, :-1]
    pad[:, 0] = (c == 0).all(1) & zero.reshape(count, w)[:, 0]
    return pad.reshape(-1)


def entries(fmt: Format, shape, levels, values):
    """The stored entries as ``(leaf, dims)``: their positions in the values array and their ``(ndim, M)`` int64
    coordinates, padding dropped.

    Padding means positions whose coordinates fall outside the shape (block and diagonal formats) and the
    padding of a padded (fixed) level (``padding``).
    """
    leaf, dims, keep = coordinates(fmt, shape, levels)
    if fmt.padded:
        keep &= ~padding(fmt, shape, levels, values.detach())[leaf]
    if bool(keep.all()):
        return leaf, dims
    return leaf[keep], dims[:, keep]


def unpack(fmt: Format, shape, levels, values):
    """The stored entries as ``(dims, values)``: ``dims`` is ``(ndim, M)`` int64, padding dropped (``entries``).
    The values are gathered (a copy), so gradients reach the stored values."""
    listed = _coordinate_list(fmt, shape, levels)
    if listed is not None:  # (COO, CSR, CSC: the coordinates are read off the arrays)
        dims, (lo, hi) = listed
        return dims, values[lo:hi].clone()
    leaf, dims = entries(fmt, shape, levels, values)
    return dims, values[leaf]


def _coordinate_list(fmt: Format, shape, levels):
    """``(dims, (lo, hi))`` of a COO-like storage (a root compressed level, the rest singletons) or a CSR-like
    one (a dense root, then a compressed level), each level one whole dimension: the ``(ndim, M)`` int64
    coordinates of the stored positions ``lo:hi`` (all of them), read off the arrays without walking the levels
    (the walk is several passes over every entry); None for other formats."""
    from .levels import Compressed
    types, exprs = fmt.level_types, fmt.exprs
    if len(types) < 2 or not all(type(e) is Var for e in exprs) or \
            sorted(e.dim for e in exprs) != list(range(fmt.ndim)):
        return None
    dims = [None] * fmt.ndim
    if type(types[0]) is Compressed and all(type(t) is Singleton for t in types[1:]):
        lo, hi = (int(p) for p in levels[0].pos[:2])
        for e, st in zip(exprs, levels):
            dims[e.dim] = st.stored_crd[lo:hi].long()
    elif len(types) == 2 and type(types[0]) is Dense and type(types[1]) is Compressed:
        pos = levels[1].pos.long()
        lo, hi = int(pos[0]), int(pos[-1])
        rows = shape[exprs[0].dim]
        dims[exprs[0].dim] = torch.repeat_interleave(torch.arange(rows, device=pos.device), pos[1:] - pos[:-1],
                                                     output_size=hi - lo)
        dims[exprs[1].dim] = levels[1].stored_crd[lo:hi].long()
    else:
        return None
    return torch.stack(dims), (lo, hi)


def linear_index(dims: torch.Tensor, shape) -> torch.Tensor:
    """The row-major linear index of each coordinate column of ``dims`` (``(ndim, P)``), as int64 (a shape has
    fewer than 2**63 elements, so it fits)."""
    key = torch.zeros(dims.shape[1], dtype=torch.int64, device=dims.device)
    for c, n in zip(dims, shape):
        key = key * n + c
    return key


def lookup(fmt: Format, shape, levels, values, dims: torch.Tensor) -> torch.Tensor:
    """The tensor's value at each coordinate column of ``dims``: 0 where nothing is stored, duplicates summed.
    Differentiable in ``values`` (a gather)."""
    edims, evals = unpack(fmt, shape, levels, values)
    zero = torch.zeros((), dtype=_acc_dtype(values), device=values.device)
    if evals.numel() == 0 or dims.shape[1] == 0:
        return zero.expand(dims.shape[1]).to(values.dtype)
    keys = linear_index(edims, shape)
    keys, order = torch.sort(keys)
    evals = evals[order]
    if fmt.keeps_duplicates:
        keys, group = torch.unique_consecutive(keys, return_inverse=True)
        evals = torch.zeros(keys.numel(), dtype=zero.dtype, device=values.device).index_add(
            0, group, evals.to(zero.dtype))
        evals = evals > 0 if values.dtype == torch.bool else evals
    query = linear_index(dims, shape)
    at = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)
    hit = keys[at] == query
    return torch.where(hit, evals[at], torch.zeros((), dtype=evals.dtype, device=values.device))


def row_major(fmt: Format) -> bool:
    """Whether ``fmt`` stores every position in row-major order (``dense_nd``): its values are the dense tensor."""
    return fmt.is_dense and all(type(e) is Var and e.dim == k for k, e in enumerate(fmt.exprs))


def to_dense(fmt: Format, shape, levels, values):
    """The dense tensor of a storage (differentiable in ``values``, also when nothing is stored), its entries
    listed and put. ``SparseTensor.to_dense`` runs a generated kernel instead where one pays
    (``compiler.densify``)."""
    if row_major(fmt):
        return values.reshape(shape)
    dims, vals = unpack(fmt, shape, levels, values)
    out = torch.zeros(tuple(shape), dtype=values.dtype, device=values.device)
    return out.index_put(tuple(dims), vals, accumulate=fmt.keeps_duplicates)


def array_version(t: torch.Tensor):
    """``t._version``, or for an inference tensor (made under ``torch.inference_mode``, without a version
    counter) a new object, equal to nothing: what is keyed or checked on its version is never reused."""
    try:
        return t._version
    except RuntimeError:
        return object()


class _Memo:
    """Entries kept up to ``limit``, the least recently used dropped first (``_make_room``)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._entries: dict = {}

    def __len__(self):
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _make_room(self) -> None:
        while len(self._entries) >= max(self.limit, 1):
            del self._entries[next(iter(self._entries))]


class PatternMemo(_Memo):
    """Results that depend only on a pattern's index arrays, looked up by the arrays' identity and version: a
    model that builds sparse tensors on the same arrays every step (attention scores on a graph's edges, a
    gradient on a weight's pattern) pays for the work once. An entry is served only while every array is alive,
    is the same object and is unmodified (``_version``); it is dropped when one of its arrays dies. A memo holding
    ``limit`` entries drops its least recently used one: a model cycling through more patterns than that (the 72
    weights of BERT-base through a memo of 64) would otherwise miss on every call."""

    @staticmethod
    def _key(extra, levels):
        """The key, or None for arrays made under ``torch.inference_mode`` (no version counter: not kept)."""
        arrays = [a for st in levels for a in st.arrays().values()]
        if any(a.is_inference() for a in arrays):
            return None, arrays
        return (extra, tuple((id(a), a._version) for a in arrays)), arrays

    def get(self, extra, levels):
        key, arrays = self._key(extra, levels)
        entry = None if key is None else self._entries.get(key)
        if entry is None or not all(r() is a for r, a in zip(entry[0], arrays)):
            return None
        self._entries[key] = self._entries.pop(key)  # most recently used last
        return entry[1]

    def put(self, extra, levels, value) -> None:
        key, arrays = self._key(extra, levels)
        if key is None:
            return
        self._entries.pop(key, None)
        self._make_room()
        entries = self._entries

        def drop(_ref, key=key):  # an array died: its id may be reused, the entry is of no use
            entries.pop(key, None)

        self._entries[key] = ([weakref.ref(a, drop) for a in arrays], value)

    def lookup(self, extra, levels, make):
        """``make()``'s result for this pattern, made once and kept (None included) while the arrays are alive and
        unmodified."""
        got = self.get(extra, levels)
        if got is None:
            got = (make(),)
            self.put(extra, levels, got)
        return got[0]



class ValuesMemo(_Memo):
    """Results derived from a values tensor (a weight's values packed in a kernel's layout), one entry per tensor
    and key: served while the tensor is alive and unmodified (``_version``), remade when it changes (a weight
    trained in place: the stale copy is replaced, not kept beside), dropped when the tensor dies. At most
    ``limit`` entries, the least recently used dropped first."""

    def lookup(self, extra, values: torch.Tensor, make, depends=()):
        """``make()`` for ``values`` as they are now, made once per version and per objects ``depends`` (e.g. the
        pattern's layout the result follows: another object, even at the same address, makes it anew)."""
        key = (id(values), extra)
        entry = self._entries.pop(key, None)
        inference = values.is_inference()  # (no version counter: never kept)
        if entry is not None and entry[0]() is values and not inference and entry[1] == values._version and \
                len(entry[3]) == len(depends) and all(r() is d for r, d in zip(entry[3], depends)):
            self._entries[key] = entry
            return entry[2]
        result = make()
        if inference:
            return result
        self._make_room()
        entries = self._entries

        def drop(_ref, key=key):
            entries.pop(key, None)
        self._entries[key] = (weakref.ref(values, drop), values._version, result, [weakref.ref(d) for d in depends])
        return result


# index arrays already validated, per format, shape and number of values
VALIDATED = PatternMemo(256)
#: the slots outside the shape, per pattern (``outside``)
OUTSIDE = PatternMemo(64)


def outside(fmt: Format, shape, levels, n: int):
    """A bool mask over the ``n`` stored values: the slots whose coordinates fall outside the shape (a DIA
    diagonal's ends, a BSR block past the edge), or None where there are none (formats whose levels index the
    dimensions themselves have none; a padded format's are its padding, ``padding``). Read once per pattern."""
    if fmt.padded or all(isinstance(e, Var) for e in fmt.exprs):
        return None
    def make():
        leaf, _, keep = coordinates(fmt, shape, levels)
        mask = torch.ones(n, dtype=torch.bool, device=leaf.device)
        mask[leaf[keep]] = False
        return mask if bool(mask.any()) else None
    return OUTSIDE.lookup((fmt, tuple(shape), n), levels, make)


def validate(fmt: Format, shape, levels, values) -> None:
    """Check storage invariants; raise ``ValueError`` naming the level and position of the first violation."""
    extra = (fmt, tuple(shape), values.numel())
    if values.dim() == 1 and VALIDATED.get(extra, levels):
        return
    validate_uncached(fmt, shape, levels, values)
    VALIDATED.put(extra, levels, True)


def validate_loaded(fmt: Format, shape, levels, values) -> None:
    """``validate`` for a SparseTensor ``torch.load`` rebuilds: now, or, while a legacy-format file
    (``_use_new_zipfile_serialization=False``) is read, at the end of that load (such a load reads the arrays'
    data only after every object is rebuilt: what they hold now is not the file's). Arrays on the meta device
    (``map_location="meta"``) hold no data to check."""
    if values.device.type == "meta":
        return
    if not _in_legacy_load():
        return validate(fmt, shape, levels, values)
    import torch._utils as tu
    original = tu._validate_loaded_sparse_tensors
    if not getattr(original, "scorch", False):  # (once: torch calls this hook at the end of every load)
        def validate_pending(*args, **kwargs):  # (torch 2.14 passes weights_only=)
            try:
                while _LOADED:
                    validate(*_LOADED.pop())
            finally:
                _LOADED.clear()
                original(*args, **kwargs)
        validate_pending.scorch = True
        tu._validate_loaded_sparse_tensors = validate_pending
    _LOADED.append((fmt, shape, levels, values))


#: storage rebuilt by a legacy-format ``torch.load``, validated at its end (``validate_loaded``)
_LOADED: list = []


def _in_legacy_load() -> bool:
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "_legacy_load" and f.f_code.co_filename.endswith("serialization.py"):
            return True
        f = f.f_back
    return False


def index_dtypes(levels) -> set:
    """The dtypes of the index arrays of ``levels`` as kernels read them (a packed level's coordinates as its
    positions' dtype: ``PackedLevel``)."""
    return {d for st in levels for d in st.dtypes()}


def index_dtype_of(levels) -> torch.dtype:
    """The index dtype of a tensor over ``levels`` (one, ``uniform_index_dtype``): that of its first index array as
    kernels read it (a packed level's positions come first), int64 where there is none."""
    return next((a.dtype for st in levels for a in (st.pos, st.stored_crd) if a is not None), torch.int64)


def packed_coordinates(fmt: Format, shape, levels, dtype=torch.int16) -> tuple:
    """``levels`` with each compressed level's coordinates stored as ``dtype`` (``PackedLevel``) where every
    coordinate of the level's range fits it and its positions are wider; other levels as they are. Kernels still
    read one index dtype (the positions'); what is held shrinks: a pruned weight's columns take 2 bytes instead
    of 4 where the weight has at most 2**15 columns."""
    info, out = torch.iinfo(dtype), []
    for (lo, hi), lvl, st in zip(fmt.level_bounds(shape), fmt.level_types, levels):
        if type(lvl) is Compressed and type(st) is LevelStorage and st.pos is not None and st.crd is not None and \
                info.min <= lo and hi - 1 <= info.max and st.crd.dtype != dtype:
            st = packed_level(st.pos, st.crd.to(dtype))
        out.append(st)
    return tuple(out)


def uniform_index_dtype(levels) -> tuple:
    """``levels`` with one index dtype for all arrays: the widest of their index dtypes (a widening, so every
    value fits), else the arrays as they are. Kernels are specialized on one index type per tensor and read
    every array of it with that width: an int32 ``crd`` read as int64 runs past its end, an int64 ``pos`` read
    as int32 gives wrong positions. Non-integer arrays are left for ``validate`` to reject."""
    levels = tuple(levels)
    present = index_dtypes(levels)
    found = [d for d in INDEX_DTYPES if d in present]
    if len(found) > 1:
        widest = found[-1]
        levels = tuple(st.map(lambda a: a.to(widest) if a.dtype in found else a) for st in levels)
    return levels


def validate_bounds(fmt: Format, shape, levels, values) -> None:
    """The checks of ``validate`` that keep a kernel's reads inside the arrays: each level's own (array lengths,
    ``pos`` from 0 and never decreasing to its ``crd``'s length, coordinates in range) and the number of values;
    not the order and uniqueness of coordinates (a sort-like pass, ~20 ns an entry). ``from_torch`` runs these
    on a torch tensor (torch's constructors check nothing by default: an out-of-range column crashed a kernel)."""
    if len(levels) != len(fmt.levels):
        raise ValueError(f"format {fmt} has {len(fmt.levels)} levels, storage has {len(levels)}")
    count = 1
    for k, ((lo, hi), lvl, st) in enumerate(zip(fmt.level_bounds(shape), fmt.level_types, levels)):
        lvl.validate(st, count, lo, hi, f"level {k} ({fmt.level_text(k)})")
        count = lvl.num_positions(st, count, lo, hi)
    if values.dim() != 1 or values.numel() != count:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({count},): one per stored position")


def validate_uncached(fmt: Format, shape, levels, values) -> None:
    """The checks of :func:`validate`, run every time: ``validate`` runs them once per unchanged index arrays
    (format, shape and number of values). Public for tests: ``tests/test_reuse.py`` counts its calls."""
    bounds = fmt.level_bounds(shape)
    if len(levels) != len(fmt.levels):
        raise ValueError(f"format {fmt} has {len(fmt.levels)} levels, storage has {len(levels)}")
    if len(index_dtypes(levels) & set(INDEX_DTYPES)) > 1:
        found = ", ".join(f"level {k} {name}: {a.dtype}" for k, st in enumerate(levels)
                          for name, a in st.arrays().items())
        raise ValueError(f"format {fmt.name or fmt}: the index arrays mix integer widths ({found}); all index"
                         " arrays of a tensor must have one dtype: convert them, e.g. with .long(), or build the"
                         " tensor with scorch's constructors, which widen them to the widest")
    parent = torch.zeros(1, dtype=torch.int64, device=values.device)
    count, group = 1, torch.zeros(1, dtype=torch.int64, device=values.device)
    for k, ((lo, hi), lvl, st) in enumerate(zip(bounds, fmt.level_types, levels)):
        where = f"level {k} ({fmt.level_text(k)})"
        lvl.validate(st, count, lo, hi, where)
        src, child, c = lvl.iterate(st, parent, count, lo, hi)
        g = group[src]
        if lvl.ordered and c.numel() > 1:
            same = g[1:] == g[:-1]
            bad = same & ((c[1:] <= c[:-1]) if lvl.unique else (c[1:] < c[:-1]))
            if bool(bad.any()):
                p = int(bad.nonzero()[0, 0]) + 1
                what = "not strictly increasing" if lvl.unique else "decreasing"
                raise ValueError(f"{where}: coordinates {what} at stored entry {int(child[p])}"
                                 f" ({int(c[p])} after {int(c[p - 1])})")
        new = torch.ones(c.numel(), dtype=torch.bool, device=c.device)
        if c.numel() > 1:
            new[1:] = (g[1:] != g[:-1]) | (c[1:] != c[:-1])
        group = torch.cumsum(new.long(), 0) - 1
        count = lvl.num_positions(st, count, lo, hi)
        parent = child
    if values.dim() != 1 or values.numel() != count:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({count},): one per stored position")


def _device(levels):
    for st in levels:
        for a in st.arrays().values():
            return a.device
    return torch.device("cpu")


def segments(fmt: Format, levels, dim: int):
    """The last level's ``pos`` when each of its segments is one group along ``dim`` (a softmax's, a reduction's):
    the last level is compressed and stores ``dim``, the levels above store the other dimensions one each,
    uniquely (CSR with dim 1, CSC with dim 0, CSF along its last dimension). Else None."""
    return levels[-1].pos if _groups_by_last_level(fmt, dim) else None


@functools.lru_cache(maxsize=256)
def _groups_by_last_level(fmt, dim) -> bool:
    expr, last = fmt.levels[-1]
    if fmt.padded or type(last) is not Compressed or not last.unique or not isinstance(expr, Var) \
            or expr.dim != dim:
        return False
    return all(isinstance(e, Var) and type(lvl) in (Dense, Compressed) and lvl.unique for e, lvl in fmt.levels[:-1])
