"""``F.embedding`` and ``F.embedding_bag`` with a sparse weight: only the rows the input looks up are read.

The rows are gathered sparse (``index_select`` along dimension 0, differentiable: the weight's gradient lies on
its pattern) and made dense, a ``len(input) x D`` matrix; torch's own ``embedding`` / ``embedding_bag`` then runs
on those rows, with the input renumbered to them, so every option (``padding_idx``, the bag modes, offsets,
``per_sample_weights``, ``include_last_offset``) keeps torch's meaning. The table itself is never densified. A
``max_norm`` renorms the looked-up rows' stored values in place first, as torch renorms its weight;
``scale_grad_by_freq`` scales each lookup's gradient by the inverse of its row's count in the input (as documented;
torch 2.13's CPU ``embedding_bag`` divides some rows by another row's count, pytorch#190063); ``sparse``
(torch's sparse gradient for a dense weight) changes nothing: a sparse weight's gradient is on its pattern.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sparse_tensor import SparseTensor, dense_fallback, implements


def _renorm_rows(weight: SparseTensor, rows, max_norm, norm_type) -> None:
    """``torch.embedding_renorm_`` on a sparse weight's stored values, in place: each of ``rows`` (unique) whose
    ``norm_type``-norm exceeds ``max_norm`` scaled to ``max_norm`` (torch's ``max_norm / (norm + 1e-7)``)."""
    from ..formats import storage
    with torch.no_grad():
        norms = torch.linalg.vector_norm(weight.detach().index_select(0, rows).to_dense(), ord=norm_type, dim=1)
        scale = torch.ones(weight.shape[0], dtype=weight.dtype, device=norms.device)
        scale[rows] = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
        leaf, dims, _ = storage.coordinates(weight._format, weight._shape, weight._levels)
        weight._vals[leaf] = weight._vals[leaf] * scale[dims[0]]


def _rows(weight: SparseTensor, flat, max_norm, norm_type, scale_grad_by_freq):
    """The dense rows ``weight[flat]`` (after ``max_norm``'s renorm), with ``scale_grad_by_freq``'s gradient."""
    if weight.dim() != 2:
        raise RuntimeError(f"embedding: weight must be 2-d, got {weight.dim()}-d")
    n = weight.shape[0]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"embedding: index out of range in self (indices from 0 to {n - 1}: the weight has {n} rows)")
    unique, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    if max_norm is not None:
        _renorm_rows(weight, unique, max_norm, 2.0 if norm_type is None else norm_type)
    rows = weight.index_select(0, flat).to_dense()
    if scale_grad_by_freq and rows.requires_grad:
        scale = (1.0 / counts.to(rows.dtype))[inverse].unsqueeze(1)
        rows = rows.detach() + (rows - rows.detach()) * scale  # the values exactly; the gradient scaled
    return rows


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """``F.embedding`` with a sparse weight: the looked-up rows gathered sparse, then dense (``input.shape + (D,)``);
    torch's options, the gradient on the weight's pattern, the table never densified."""
    if type(weight) is not SparseTensor or type(input) is SparseTensor:
        return dense_fallback(F.embedding, (input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                                            sparse), {})
    if input.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"embedding: indices must be int32 or int64, got {input.dtype}")
    n = weight.shape[0] if weight.dim() == 2 else 0
    if padding_idx is not None and not -n <= padding_idx < n:
        raise AssertionError("Padding_idx must be within num_embeddings")
    flat = input.reshape(-1).to(torch.int64)
    rows = _rows(weight, flat, max_norm, norm_type, scale_grad_by_freq)
    if padding_idx is not None and rows.requires_grad:  # the padding row's lookups take no gradient
        pad = (flat == (padding_idx % n)).unsqueeze(1)
        rows = torch.where(pad, rows.detach(), rows)
    return rows.reshape(*input.shape, rows.shape[1])


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False, mode="mean",
                  sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """``F.embedding_bag`` with a sparse weight: torch's bag (every mode and option) on the looked-up rows,
    gathered sparse; indices past ``include_last_offset``'s last offset are in no bag, as documented."""
    if type(weight) is not SparseTensor or any(type(t) is SparseTensor for t in (input, offsets,
                                                                                  per_sample_weights)):
        return dense_fallback(F.embedding_bag, (input, weight, offsets, max_norm, norm_type, scale_grad_by_freq,
                                                mode, sparse, per_sample_weights, include_last_offset,
                                                padding_idx), {})
    if input.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"embedding_bag: indices must be int32 or int64, got {input.dtype}")
    n = weight.shape[0] if weight.dim() == 2 else 0
    if input.dim() == 1 and include_last_offset and offsets is not None and offsets.numel() and \
            int(offsets[-1]) < input.numel():
        # indices past the last offset are in no bag: left out (torch 2.13's backward reads an uninitialized bag
        # for them, and gives their rows a gradient of whatever it finds there)
        input = input[:int(offsets[-1])]
        per_sample_weights = None if per_sample_weights is None else per_sample_weights[:input.numel()]
    flat = input.reshape(-1).to(torch.int64)
    rows = _rows(weight, flat, max_norm, norm_type, scale_grad_by_freq)
    # torch's bag on the gathered rows, the input renumbered to them; a padding index maps to a row of zeros
    # appended, which torch's padding_idx then leaves out of its bag (and of a mean's count)
    local = torch.arange(flat.numel(), device=flat.device).reshape(input.shape)
    if padding_idx is not None:
        if not -n <= padding_idx < n:
            raise AssertionError("padding_idx must be within num_embeddings")
        local = torch.where(input == padding_idx % n, flat.numel(), local)
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        padding_idx = flat.numel()
    return F.embedding_bag(local, rows, offsets, None, norm_type, False, mode, False, per_sample_weights,
                           include_last_offset, padding_idx)


implements(F.embedding)(embedding)
implements(F.embedding_bag)(embedding_bag)
