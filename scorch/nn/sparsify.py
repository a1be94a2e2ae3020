"""Sparsifiers: rules that decide which entries of a tensor to keep.

A sparsifier is a small object with one method to override, ``mask(w) -> BoolTensor`` (same shape as ``w``,
True = keep). It is only the rule: whether it runs once (a static pattern) or after every optimizer step (a
dynamic pattern), on weights or on activations, is decided by the schedule (``scorch.schedule``).

Conventions:

- ``sparsity`` is the fraction of entries REMOVED: ``ScalarFraction(0.9)`` keeps the 10% largest ``|w|``
  (``density = 1 - sparsity`` is the fraction kept). The number kept is exact: ``round((1 - sparsity) *
  count)`` entries (or blocks), rounded half up; ties are broken towards the lower (row-major) index.
- ``__call__(w)`` gives the dense ``w * mask`` (for reference and inspection; differentiable in ``w``).
- ``sparsify(w, format)`` gives a ``scorch.SparseTensor`` in ``format`` that stores exactly the kept entries
  with ``w``'s values (detached). A kept entry whose value is exactly 0 is stored as an explicit zero, so the
  pattern is the mask, except in formats with a padded level (ELL's ``fixed``), where a stored zero cannot be
  told from padding and is dropped. Formats that store whole blocks (``bsr``) also store the zeros of a block
  that holds a kept entry.

A user-defined sparsifier is a subclass overriding ``mask``::

    class Positive(scorch.nn.Sparsifier):
        def mask(self, w):
            return w > 0
"""
from __future__ import annotations

import math
import numbers

import torch

from ..engine import weights
from ..formats import storage as _storage
from ..interop import asformat
from ..sparse_tensor import SparseTensor

__all__ = ["Sparsifier", "KeepAll", "ScalarThreshold", "ScalarFraction", "RandomFraction", "BlockFraction", "NM",
           "masked", "packed_weight"]


def packed_weight(s: SparseTensor) -> SparseTensor:
    """``s`` as a weight is held for ``F.linear``'s kernels (``engine.weights``), on the same values: a CSR or BSR
    weight on the CPU with at most 2**15 (block) columns keeps its column indices in 16 bits
    (``storage.packed_coordinates``), which those kernels read natively, 6 bytes a float32 entry instead of 8. Every
    other kernel reads them widened to the row pointers' width, made once per pattern (``PackedLevel``). Other
    formats (n:m keeps a byte per offset already), devices and sizes: ``s`` itself."""
    kind = weights.kind_of(s) if type(s) is SparseTensor and len(s._shape) == 2 else None
    if kind is None or kind[0] not in ("csr", "bsr") or s._vals.device.type != "cpu":
        return s
    levels = _storage.packed_coordinates(s._format, s._shape, s._levels)
    if all(a is b for a, b in zip(levels, s._levels)):
        return s
    return SparseTensor(s._format, s._shape, levels, s._vals, check=False)


def masked(x: torch.Tensor, mask: torch.Tensor, format) -> SparseTensor:
    """The SparseTensor in ``format`` storing the entries of the dense ``x`` where ``mask`` is True.

    Differentiable in ``x`` (the stored values are gathered from ``x``), so an activation sparsified this way
    passes gradients back. The pattern is ``mask``'s (explicit zeros kept, in a padded format too, but for the one
    case ``storage.padding`` cannot read: a lone kept zero at a segment's coordinate 0), except that a block
    format stores whole blocks (zeros where ``mask`` is False).
    """
    if isinstance(x, SparseTensor) or x.layout != torch.strided:
        raise TypeError("masked: x must be a dense tensor")
    if mask.dtype != torch.bool or mask.shape != x.shape:
        raise ValueError(f"masked: the mask must be a bool tensor of x's shape {tuple(x.shape)}, got"
                         f" {mask.dtype} {tuple(mask.shape)}")
    pattern = asformat(mask.to(x.dtype if x.is_floating_point() or x.is_complex() else torch.float32), format)
    leaf, dims, inside = _storage.coordinates(pattern.format, pattern.shape, pattern.levels)
    real = inside & (pattern.values()[leaf] != 0)  # not padding, not the masked-out cells of a stored block
    leaf, dims = leaf[real], dims[:, real]
    values = torch.zeros(pattern.nnz, dtype=x.dtype, device=x.device)
    values = values.index_put((leaf,), x[tuple(dims)])
    return pattern.with_values(values)


def _check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1] (the fraction of entries removed), got {value!r}")
    return float(value)


def _keep_count(sparsity: float, n: int) -> int:
    """``round((1 - sparsity) * n)``, halves up, within ``[0, n]`` (1e-9 absorbs float error: 0.1 * 100)."""
    return max(0, min(n, math.floor((1.0 - sparsity) * n + 0.5 + 1e-9)))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A bool mask of ``scores``' shape keeping its ``k`` largest entries; ties go to the lower flat index."""
    flat = scores.reshape(-1)
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k:
        keep[torch.argsort(flat, descending=True, stable=True)[:k]] = True
    return keep.reshape(scores.shape)


class Sparsifier:
    """Base class: override ``mask(w)``. ``sparsifier(w)`` is the dense ``w * mask``; ``sparsify(w, format)`` the
    SparseTensor storing the kept entries (see the module docstring for what is stored)."""

    def mask(self, w: torch.Tensor) -> torch.Tensor:
        """A bool tensor of ``w``'s shape: True where the entry is kept."""
        raise NotImplementedError(f"{type(self).__name__} must override mask(w)")

    def checked_mask(self, w: torch.Tensor) -> torch.Tensor:
        """``mask(w)``, checked: a bool tensor of ``w``'s shape (TypeError / ValueError naming the class)."""
        if isinstance(w, SparseTensor):
            w = w.to_dense()
        m = self.mask(w)
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise TypeError(f"{type(self).__name__}.mask must return a bool tensor, got"
                            f" {getattr(m, 'dtype', type(m).__name__)}")
        if m.shape != w.shape:
            raise ValueError(f"{type(self).__name__}.mask returned shape {tuple(m.shape)} for a tensor of shape"
                             f" {tuple(w.shape)}")
        return m.to(w.device)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        """The dense ``w * mask(w)`` (the mask is computed without gradient; the product keeps ``w``'s graph)."""
        with torch.no_grad():
            m = self.checked_mask(w.detach())
        return w * m

    def sparsify(self, w: torch.Tensor, format="csr") -> SparseTensor:
        """``w``'s kept entries as a SparseTensor in ``format`` (values detached and exact), stored for the weight
        kernels (``packed_weight``)."""
        w = w.detach()
        if isinstance(w, SparseTensor):
            w = w.to_dense()
        return packed_weight(masked(w, self.checked_mask(w), format))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class KeepAll(Sparsifier):
    """Keeps every entry: a fully dense pattern stored in a sparse format (zeros stored explicitly)."""

    def mask(self, w):
        return torch.ones(w.shape, dtype=torch.bool, device=w.device)


class ScalarThreshold(Sparsifier):
    """Keeps the entries with ``|w| > threshold``. ``ScalarThreshold(0)`` keeps the nonzeros."""

    def __init__(self, threshold: float):
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or math.isnan(threshold):
            raise ValueError(f"threshold must be a real number, got {threshold!r}")
        self.threshold = float(threshold)

    def mask(self, w):
        return w.abs() > self.threshold


class ScalarFraction(Sparsifier):
    """Magnitude pruning: removes the fraction ``sparsity`` of entries with the smallest ``|w|``, keeping exactly
    ``round((1 - sparsity) * numel)`` entries (``ScalarFraction(0.9)`` keeps the 10% largest)."""

    def __init__(self, sparsity: float):
        self.sparsity = _check_fraction("sparsity", sparsity)

    def mask(self, w):
        return _top(w.abs(), _keep_count(self.sparsity, w.numel()))


class RandomFraction(Sparsifier):
    """A uniformly random pattern keeping exactly ``round((1 - sparsity) * numel)`` entries.

    ``seed`` (or an explicit CPU ``generator``) makes the sequence of patterns reproducible; each ``mask`` call
    draws a new pattern. Without either, torch's global random state is used."""

    def __init__(self, sparsity: float, seed: int | None = None, generator: torch.Generator | None = None):
        self.sparsity = _check_fraction("sparsity", sparsity)
        if seed is not None and generator is not None:
            raise ValueError("RandomFraction takes a seed or a generator, not both")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
                raise ValueError(f"seed must be an integer, got {seed!r}")
            generator = torch.Generator().manual_seed(int(seed))
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.seed = seed
        self._generator = generator

    def mask(self, w):
        n = w.numel()
        keep = torch.zeros(n, dtype=torch.bool)
        keep[torch.randperm(n, generator=self._generator)[:_keep_count(self.sparsity, n)]] = True
        return keep.reshape(w.shape).to(w.device)


class BlockFraction(Sparsifier):
    """Block magnitude pruning of a 2-d tensor: each ``bh x bw`` block is scored by its L2 norm (``norm="l1"``:
    L1) and the fraction ``sparsity`` of blocks with the smallest scores is removed; exactly
    ``round((1 - sparsity) * blocks)`` whole blocks are kept.

    A shape that is not a multiple of the block is allowed: the edge blocks are partial (scored on the entries
    they have), as scorch's block formats store them."""

    def __init__(self, sparsity: float, block=(16, 16), norm: str = "l2"):
        self.sparsity = _check_fraction("sparsity", sparsity)
        try:
            bh, bw = block
        except (TypeError, ValueError):
            raise ValueError(f"block must be a pair (bh, bw), got {block!r}") from None
        for b in (bh, bw):
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
                raise ValueError(f"block sizes must be positive integers, got {block!r}")
        if norm not in ("l1", "l2"):
            raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
        self.block, self.norm = (int(bh), int(bw)), norm

    def mask(self, w):
        if w.dim() != 2:
            raise ValueError(f"BlockFraction needs a 2-d tensor, got shape {tuple(w.shape)}")
        (bh, bw), (r, c) = self.block, w.shape
        nr, nc = -(-r // bh), -(-c // bw)
        padded = w.new_zeros(nr * bh, nc * bw)
        padded[:r, :c] = w
        blocks = padded.reshape(nr, bh, nc, bw).transpose(1, 2).abs()
        score = blocks.sum((2, 3)) if self.norm == "l1" else blocks.square().sum((2, 3))
        keep = _top(score, _keep_count(self.sparsity, nr * nc))
        return keep.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:r, :c]


class NM(Sparsifier):
    """N:M structured sparsity: in every group of ``m`` consecutive entries along ``dim`` (default the last), keep
    the ``n`` largest ``|w|`` (``NM(2, 4)``: 2:4). The size of ``dim`` must be a multiple of ``m``."""

    def __init__(self, n: int, m: int, dim: int = -1):
        for name, v in (("n", n), ("m", m), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"NM: {name} must be an integer, got {v!r}")
        if m <= 0 or not 0 <= n <= m:
            raise ValueError(f"NM needs 0 <= n <= m and m > 0, got n={n}, m={m}")
        self.n, self.m, self.dim = int(n), int(m), int(dim)

    def mask(self, w):
        if w.dim() == 0:
            raise ValueError("NM needs a tensor of at least one dimension")
        dim = self.dim % w.dim() if -w.dim() <= self.dim < w.dim() else None
        if dim is None:
            raise ValueError(f"NM: dim {self.dim} is out of range for a {w.dim()}-d tensor")
        size = w.shape[dim]
        if size % self.m:
            raise ValueError(f"NM({self.n}, {self.m}): dimension {dim} has size {size}, not a multiple of {self.m}")
        moved = w.abs().movedim(dim, -1)
        groups = moved.reshape(-1, self.m)
        order = torch.argsort(groups, dim=1, descending=True, stable=True)[:, :self.n]
        keep = torch.zeros(groups.shape, dtype=torch.bool, device=w.device).scatter_(1, order, True)
        return keep.reshape(moved.shape).movedim(-1, dim)
