"""Format conversion by generated kernels: CSR-like targets (a dense level over a compressed one) by a counting
sort (count pass, prefix sum, fill pass); the kernels come from ``compiler.pipeline.conversion_plan``."""
from __future__ import annotations

import torch

from ..compiler.pipeline import conversion_plan
from ..compiler.schedule import compressed_target
from ..sparse_tensor import SparseTensor
from .bind import SUPPORTED, argument, level_info, tensor_type


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
