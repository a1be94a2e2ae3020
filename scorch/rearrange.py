"""``rearrange``: einops-style ``rearrange`` and ``repeat`` in one function, for dense tensors and SparseTensors.

A pattern ``"lhs -> rhs"`` names the input's dimensions on the left and the result's on the right::

    rearrange(x, "bd->bnd", n=3)              # repeat along a new axis n (scorch style: one letter per axis)
    rearrange(x, "b (h d) -> b h d", h=4)      # split a dimension (einops style: names separated by spaces)
    rearrange(x, "b h d -> b (h d)")           # merge dimensions
    rearrange(x, "b n d -> n b d")             # permute
    rearrange(x, "b ... d -> d ... b")         # an ellipsis stands for any number of dimensions

Reading a pattern: when neither side has whitespace inside it, every character is one axis (``"bd->bnd"`` is
b, d -> b, n, d and ``"b(hd)->bhd"`` splits the second dimension into h, d; ``...`` is still an ellipsis).
Otherwise axes are names separated by spaces and parentheses, as in einops. Whitespace around ``->`` does
not count.

- ``(a b)`` groups axes: on the left it splits a dimension (sizes as keyword arguments; one unknown size per
  group is inferred), on the right it merges axes into one dimension (row-major: ``b`` varies fastest).
- An axis only on the right is new: the result repeats the input along it (einops' ``repeat``); its size
  must be given as a keyword (``n=4``), or written as a number (``"b -> b 3"``, one digit in the
  one-letter-per-axis style).
- ``1`` or ``()`` is an axis of size 1: on the left it consumes a dimension of size 1, on the right it adds one.
- Every named axis of the left must appear on the right (dropping an axis would need a reduction), and no
  axis may appear twice on a side.

Problems raise ``ValueError`` naming them: an unknown axis, a missing size, a size mismatch, a wrong number
of dimensions, an axis that appears twice, an axis dropped.
"""
from __future__ import annotations

import operator
import re

import torch

from .interop import coo_from_entries as _canonical_coo
from .sparse_tensor import SparseTensor

__all__ = ["rearrange"]

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_WORD_TOKENS = re.compile(r"\.\.\.|[()]|[^\s()]+")


class _Anon:
    """An anonymous axis (``1``, ``()``'s nothing, or a number on the right): a key no name can equal."""
    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __repr__(self):
        return str(self.size)


_ELLIPSIS = "..."


def rearrange(x, pattern: str, **sizes):
    """Rearrange ``x`` by an einops pattern: permute, split, merge and repeat dimensions.

    ``x`` is a dense ``torch.Tensor`` (or a list/tuple of them, stacked along a new first dimension, as
    einops does), a ``scorch.SparseTensor`` in any format, or a torch sparse COO/CSR/CSC/BSR/BSC tensor
    (viewed with ``scorch.from_torch``). ``pattern`` is ``"lhs -> rhs"`` (see this module's docstring for the
    syntax); ``sizes`` give axis sizes by name (``h=4``, ``n=3``).

    Returns:
    - for a dense ``x``, a dense tensor built from ``reshape``/``permute``/``unsqueeze``/``expand``: a view of
      ``x`` whenever torch's ``reshape`` can make one (a copy otherwise, e.g. merging permuted axes). A new
      (repeated) axis is an ``expand``: a broadcast view with stride 0 along it (einops' ``repeat`` copies
      instead), unless it is merged with another axis, which copies. Call ``.contiguous()`` before writing
      into the result in place. Differentiable like any torch op.
    - for a sparse ``x``, a SparseTensor in canonical (coalesced) COO format holding ``x``'s stored entries
      moved to their new coordinates (repeated along new axes; the stored values of new positions are
      copies of the input's; explicit zeros stay stored). Padding of block, diagonal and padded (ELL)
      formats is not carried over (``storage.padding``);
      duplicates of an uncoalesced input are summed. Gradients flow from the result's values back to
      ``x.values()``.

    Raises ``ValueError`` for a malformed pattern, an unknown axis, a missing size, a size mismatch, a wrong
    number of dimensions, an axis that appears twice or an axis dropped.
    """
    if isinstance(x, (list, tuple)):
        if not x or not all(isinstance(t, torch.Tensor) and _is_dense(t) for t in x):
            raise TypeError("rearrange of a list or tuple takes a non-empty sequence of dense tensors"
                            " (they are stacked along a new first dimension)")
        x = torch.stack(list(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rearrange takes a torch.Tensor or a scorch.SparseTensor, got {type(x).__name__}")
    if not isinstance(pattern, str):
        raise TypeError(f"the pattern must be a str such as 'b n d -> n b d', got {type(pattern).__name__}")
    sparse = type(x) is SparseTensor or x.layout in _SPARSE_LAYOUTS
    if sparse and type(x) is not SparseTensor:
        from .interop import from_torch
        x = from_torch(x)
    shape = tuple(x._shape) if type(x) is SparseTensor else tuple(x.shape)
    plan = _Plan(pattern, shape, sizes)
    return _sparse(x, plan) if sparse else _dense(x, plan)


def _is_dense(t) -> bool:
    return type(t) is not SparseTensor and t.layout == torch.strided


# --- parsing ------------------------------------------------------------------------------------------------

def _tokens(side: str, words: bool, pattern: str, where: str) -> list:
    if words:
        toks = _WORD_TOKENS.findall(side)
    else:
        toks, k = [], 0
        while k < len(side):
            if side.startswith(_ELLIPSIS, k):
                toks.append(_ELLIPSIS)
                k += 3
            else:
                if not side[k].isspace():
                    toks.append(side[k])
                k += 1
    out = []
    for t in toks:
        if t in ("(", ")", _ELLIPSIS) or t.isidentifier():
            out.append(t)
        elif t.isdecimal():
            out.append(_Anon(int(t)))
        else:
            what = "character" if not words else "axis name"
            raise ValueError(f"rearrange: invalid {what} {t!r} on the {where} of {pattern!r}: axes are names"
                             " (letters, digits, '_'), numbers, '()' groups or '...'")
    return out


def _parse_side(side: str, words: bool, pattern: str, where: str) -> list:
    """The side's dimensions: a list of groups, each a list of axes (names, ``_Anon``, ``...``) and a flag
    saying whether it was written in parentheses."""
    groups, current = [], None
    for t in _tokens(side, words, pattern, where):
        if t == "(":
            if current is not None:
                raise ValueError(f"rearrange: nested parentheses on the {where} of {pattern!r}")
            current = []
        elif t == ")":
            if current is None:
                raise ValueError(f"rearrange: unbalanced ')' on the {where} of {pattern!r}")
            groups.append((current, True))
            current = None
        elif current is not None:
            current.append(t)
        else:
            groups.append(([t], False))
    if current is not None:
        raise ValueError(f"rearrange: unbalanced '(' on the {where} of {pattern!r}")
    return groups


def _as_size(name, n) -> int:
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(f"rearrange: the size of axis {name!r} must be an int, got {n!r}") from None
    if n < 0:
        raise ValueError(f"rearrange: the size of axis {name!r} must be >= 0, got {n}")
    return n


def _prod(xs) -> int:
    p = 1
    for v in xs:
        p *= v
    return p


class _Plan:
    """A pattern resolved against the input's shape.

    ``in_axes``/``in_sizes``: the input's elementary axes (named ones, in order; anonymous size-1 axes left
    out); ``in_groups``: per input dimension, the sizes of its elementary axes. ``out_axes``: the result's
    elementary axes, each ``("in", k)`` (input elementary axis k) or ``("new", size)``; ``out_groups``: per
    result dimension, how many elementary axes it merges; ``out_shape``: the result's shape.
    """

    def __init__(self, pattern: str, shape: tuple, sizes: dict):
        if pattern.count("->") != 1:
            raise ValueError(f"rearrange: the pattern {pattern!r} must have the form 'lhs -> rhs' (one '->')")
        left, right = (s.strip() for s in pattern.split("->"))
        words = any(re.search(r"\s", s) for s in (left, right))
        lhs = _parse_side(left, words, pattern, "left")
        rhs = _parse_side(right, words, pattern, "right")
        given = {name: _as_size(name, n) for name, n in sizes.items()}

        # --- axes: each name at most once per side, every left name on the right, sizes known
        def names(groups):
            return [a for g, _ in groups for a in g if isinstance(a, str) and a != _ELLIPSIS]
        l_names, r_names = names(lhs), names(rhs)
        for side, ns in (("left", l_names), ("right", r_names)):
            seen = set()
            for a in ns:
                if a in seen:
                    raise ValueError(f"rearrange: axis {a!r} appears twice on the {side} of {pattern!r}")
                seen.add(a)
        dropped = [a for a in l_names if a not in r_names]
        if dropped:
            raise ValueError(f"rearrange: axis {dropped[0]!r} of the left is dropped on the right of {pattern!r}:"
                             " removing an axis needs a reduction (e.g. sum over it), not rearrange")
        for g, _ in lhs:
            for a in g:
                if isinstance(a, _Anon) and a.size != 1:
                    raise ValueError(f"rearrange: anonymous axis {a.size} on the left of {pattern!r} cannot be"
                                     " matched on the right; only 1 is allowed there (name the axis instead)")
        unknown = [n for n in given if n not in l_names and n not in r_names]
        if unknown:
            raise ValueError(f"rearrange: size given for axis {unknown[0]!r}, which is not in the pattern"
                             f" {pattern!r}")
        for a in r_names:
            if a not in l_names and a not in given:
                raise ValueError(f"rearrange: missing size for the new axis {a!r} on the right of {pattern!r}:"
                                 f" give it as a keyword argument, e.g. {a}=4")

        # --- the ellipsis: expanded into as many named axes as the input has spare dimensions
        l_ell = [k for k, (g, _) in enumerate(lhs) if _ELLIPSIS in g]
        r_ell = sum(g.count(_ELLIPSIS) for g, _ in rhs)
        if len(l_ell) > 1 or r_ell > 1:
            raise ValueError(f"rearrange: '...' appears more than once on a side of {pattern!r}")
        if len(l_ell) != r_ell:
            side = "left" if r_ell else "right"
            raise ValueError(f"rearrange: '...' must appear on both sides of {pattern!r} (missing on the {side})")
        if l_ell and lhs[l_ell[0]][1]:
            raise ValueError(f"rearrange: '...' cannot be inside parentheses on the left of {pattern!r}")
        n_fixed = len(lhs) - len(l_ell)
        if (len(shape) != len(lhs)) if not l_ell else (len(shape) < n_fixed):
            hint = ("" if words or l_ell else "; a pattern without spaces inside its sides is read one letter"
                    " per axis (separate longer names with spaces)")
            need = f"{len(lhs)}" if not l_ell else f"at least {n_fixed}"
            raise ValueError(f"rearrange: the pattern {pattern!r} has {need} dimension(s) on the left, but the"
                             f" input has {len(shape)} (shape {tuple(shape)}){hint}")
        if l_ell:
            extra = [f"...{k}" for k in range(len(shape) - n_fixed)]
            k = l_ell[0]
            lhs = lhs[:k] + [([e], False) for e in extra] + lhs[k + 1:]

            new_rhs = []
            for g, grouped in rhs:
                if grouped:  # '...' inside parentheses: its axes merged
                    new_rhs.append(([b for a in g for b in (extra if a == _ELLIPSIS else [a])], True))
                elif g == [_ELLIPSIS]:  # a bare '...': one dimension per axis
                    new_rhs.extend(([e], False) for e in extra)
                else:
                    new_rhs.append((g, grouped))
            rhs = new_rhs

        # --- the left: each dimension's size split among its axes
        size_of = {}
        self.in_axes, self.in_groups = [], []
        for d, ((g, grouped), n) in enumerate(zip(lhs, shape)):
            text = _group_text(g, grouped)
            known = {a: (a.size if isinstance(a, _Anon) else given[a]) for a in g
                     if isinstance(a, _Anon) or a in given}
            missing = [a for a in g if a not in known]
            p = _prod(known.values())
            if len(missing) > 1:
                raise ValueError(f"rearrange: cannot infer the sizes of axes {', '.join(map(repr, missing))} in"
                                 f" {text} (dimension {d} of size {n}): give all but one as keyword arguments")
            if missing:
                a = missing[0]
                if p == 0 and n == 0:
                    raise ValueError(f"rearrange: cannot infer the size of axis {a!r} in {text} (dimension {d} of"
                                     f" size 0, the other axes' sizes multiply to 0): give it as a keyword argument")
                if p == 0 or n % p:
                    have = ", ".join(f"{b}={v}" for b, v in known.items() if isinstance(b, str)) or "size 1"
                    raise ValueError(f"rearrange: size mismatch: dimension {d} of size {n} cannot be split into"
                                     f" {text} with {have}")
                known[a] = n // p
            elif p != n:
                if grouped:
                    have = ", ".join(f"{b}={v}" for b, v in known.items() if isinstance(b, str))
                    what = f"{text} with {have}" if have else f"{text} (size {p})"
                else:
                    what = f"{text} of size {p}"
                raise ValueError(f"rearrange: size mismatch: dimension {d} has size {n}, but the pattern gives"
                                 f" {what}")
            axes = [a for a in g if isinstance(a, str)]
            for a in axes:
                size_of[a] = known[a]
                self.in_axes.append(a)
            self.in_groups.append([known[a] for a in axes])
        self.in_sizes = [size_of[a] for a in self.in_axes]

        # --- the right: left axes by position, new axes with their sizes
        index = {a: k for k, a in enumerate(self.in_axes)}
        self.out_axes, self.out_groups, self.out_shape = [], [], []
        for g, grouped in rhs:
            total = 1
            for a in g:
                if isinstance(a, _Anon):
                    self.out_axes.append(("new", a.size))
                    total *= a.size
                elif a in index:
                    self.out_axes.append(("in", index[a]))
                    total *= size_of[a]
                else:
                    self.out_axes.append(("new", given[a]))
                    total *= given[a]
            self.out_groups.append(len(g))
            self.out_shape.append(total)
        self.perm = [k for kind, k in self.out_axes if kind == "in"]


def _group_text(g, grouped) -> str:
    return "(" + " ".join(str(a) for a in g) + ")" if grouped else f"axis {str(g[0])!r}"


# --- dense ----------------------------------------------------------------------------------------------------

def _dense(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    y = x
    if list(y.shape) != plan.in_sizes:
        y = y.reshape(plan.in_sizes)
    if plan.perm != sorted(plan.perm):
        y = y.permute(plan.perm)
    if any(kind == "new" for kind, _ in plan.out_axes):
        for d, (kind, _) in enumerate(plan.out_axes):
            if kind == "new":
                y = y.unsqueeze(d)
        y = y.expand([n if kind == "new" else -1 for kind, n in plan.out_axes])
    if list(y.shape) != plan.out_shape:
        y = y.reshape(plan.out_shape)
    return y


# --- sparse ---------------------------------------------------------------------------------------------------

def _sparse(x: SparseTensor, plan: _Plan) -> SparseTensor:
    from .formats import storage
    if not plan.out_shape:  # (0-d: the one element, a dense scalar, as squeeze and select give)
        return x.to_dense().reshape(())
    if _prod(plan.out_shape) >= 2**63:  # torch cannot shape such a tensor; it also keeps the key below in int64
        raise ValueError(f"rearrange: the result's shape {tuple(plan.out_shape)} has 2**63 elements or more")
    fmt = x.format
    dims, vals = storage.unpack(fmt, x.shape, x.levels, x.values())  # padding dropped
    device = dims.device
    if 0 in plan.out_shape:  # nothing to store (an input axis or a new axis of size 0)
        empty = torch.zeros(len(plan.out_shape), 0, dtype=torch.int64, device=device)
        return _canonical_coo(list(empty), vals[:0], plan.out_shape, False)

    # the input's elementary coordinates: each dimension split row-major among its axes
    coords = []
    for d, group in enumerate(plan.in_groups):
        c = dims[d]
        stride = _prod(group)
        for n in group:
            stride //= n
            coords.append(c // stride % n if stride else torch.zeros_like(c))

    # new axes: every entry repeated once per combination of their coordinates
    new = [n for kind, n in plan.out_axes if kind == "new"]
    reps = _prod(new)
    m = vals.numel()
    if reps != 1:
        vals = vals.unsqueeze(1).expand(m, reps).reshape(-1)
        coords = [c.repeat_interleave(reps) for c in coords]
        combo = torch.arange(reps, device=device).repeat(m)
        stride, new_coords = reps, []
        for n in new:
            stride //= n
            new_coords.append(combo // stride % n)
    else:
        new_coords = [torch.zeros(m, dtype=torch.int64, device=device)] * len(new)

    # the result's coordinates: elementary axes merged row-major within each output dimension
    elems, it_new = [], iter(new_coords)
    for kind, k in plan.out_axes:
        elems.append(coords[k] if kind == "in" else next(it_new))
    sizes = [plan.in_sizes[k] if kind == "in" else k for kind, k in plan.out_axes]
    rows, at = [], 0
    for count in plan.out_groups:
        c = torch.zeros(vals.numel(), dtype=torch.int64, device=device)
        for e in range(at, at + count):
            n = sizes[e]
            c = c * n + elems[e]
        rows.append(c)
        at += count
    return _canonical_coo(rows, vals, plan.out_shape, fmt.keeps_duplicates)

