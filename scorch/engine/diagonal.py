"""Diagonals of einsum operands: an operand indexed with a repeated letter (``"ii"``, ``"bcb"``) is replaced by
its diagonal before an einsum is planned (``engine.evaluate``), so that no kernel, contraction path or
gradient ever meets a letter repeated within one operand.

A dense operand gives torch's diagonal view. A sparse operand gives the stored entries whose coordinates agree
on the repeated dimensions, as a COO tensor over the operand's distinct letters; its values are gathered from
the operand's values, so a gradient reaches exactly the stored entries on the diagonal (zero elsewhere) and
the gradient of a sparse leaf stays on its own pattern.
"""
from __future__ import annotations

import torch

from ..formats import storage
from ..sparse_tensor import SparseTensor, shape_of
from .convert import coo_from_entries


def distinct(letters) -> tuple:
    """The distinct letters of an operand, in first-seen order: the letters of its diagonal."""
    return tuple(dict.fromkeys(letters))


def check_sizes(letters, x, k, name="einsum"):
    """Raise ``ValueError`` where a letter repeated in operand ``k`` indexes dimensions of different sizes
    (torch refuses these too; a diagonal needs them equal)."""
    shape = shape_of(x)
    for d, v in enumerate(letters):
        first = letters.index(v)
        if shape[d] != shape[first]:
            raise ValueError(f"scorch {name}: index {v!r} is repeated in operand {k} but indexes dimensions of"
                             f" sizes {shape[first]} and {shape[d]} (shape {tuple(shape)})")


def diagonal(x, letters):
    """``x`` (dense or a SparseTensor) indexed by ``letters`` restricted to its diagonal: indexed by
    ``distinct(letters)``. Differentiable in ``x`` (in a SparseTensor's values)."""
    letters = tuple(letters)
    uniq = distinct(letters)
    if len(uniq) == len(letters):
        return x
    if type(x) is SparseTensor and storage.row_major(x.format):  # the values are the dense tensor: its diagonal
        x = x.values().reshape(x.shape)
    if type(x) is not SparseTensor:
        have = list(letters)
        for v in uniq:
            while have.count(v) > 1:  # torch.diagonal puts the diagonal last: follow the letters alike
                d1 = have.index(v)
                d2 = have.index(v, d1 + 1)
                x = x.diagonal(0, d1, d2)
                have = [w for d, w in enumerate(have) if d not in (d1, d2)] + [v]
        return x.permute([have.index(v) for v in uniq])
    leaf, dims = storage.entries(x.format, x.shape, x.levels, x.values())
    first = [letters.index(v) for v in uniq]
    on = torch.ones(leaf.numel(), dtype=torch.bool, device=leaf.device)
    for d, v in enumerate(letters):
        if d != letters.index(v):
            on &= dims[d] == dims[letters.index(v)]
    rows = list(dims[first][:, on].unbind(0))
    shape = torch.Size(x.shape[d] for d in first)
    return coo_from_entries(rows, x.values()[leaf[on]], shape, duplicates=x.format.keeps_duplicates)
