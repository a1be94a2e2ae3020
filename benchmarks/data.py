"""Deterministic inputs: uniform random CSR matrices, power-law graphs, random 3-d tensors.

Every matrix is built once as int32 CSR arrays and shared by all peers without copying: torch's CSR tensor,
scipy's ``csr_matrix`` and scorch's ``from_torch`` view all read the same ``crow``/``col``/``values``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

import scorch


@dataclass
class Matrix:
    label: str
    torch: torch.Tensor   # torch.sparse_csr, int32 indices
    scipy: sp.csr_matrix  # the same arrays
    scorch: object        # scorch.SparseTensor viewing the same arrays

    @property
    def nnz(self) -> int:
        return int(self.torch.values().numel())

    def describe(self) -> str:
        per_row = np.diff(self.scipy.indptr)
        m, n = self.torch.shape
        return (f"{self.label}: {m:,} x {n:,}, nnz {self.nnz:,} ({per_row.mean():.1f} per row on average, "
                f"max row {per_row.max():,})")


def _unique_sorted(keys: np.ndarray) -> np.ndarray:
    keys = np.sort(keys)
    return keys[np.r_[True, keys[1:] != keys[:-1]]]


def _from_keys(label: str, keys: np.ndarray, m: int, n: int, rng: np.random.Generator) -> Matrix:
    """CSR from sorted unique ``row * n + col`` keys, with standard-normal float32 values."""
    rows, cols = keys // n, keys % n
    crow = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=m), out=crow[1:])
    vals = rng.standard_normal(keys.size, dtype=np.float32)
    crow_t = torch.from_numpy(crow.astype(np.int32))
    col_t = torch.from_numpy(cols.astype(np.int32))
    vals_t = torch.from_numpy(vals)
    a = torch.sparse_csr_tensor(crow_t, col_t, vals_t, (m, n))
    s = sp.csr_matrix((vals_t.numpy(), col_t.numpy(), crow_t.numpy()), shape=(m, n), copy=False)
    return Matrix(label, a, s, scorch.from_torch(a))


def uniform(n: int, density: float, seed: int = 0) -> Matrix:
    """An n x n matrix whose nonzeros are placed uniformly at random (about ``density * n * n`` of them)."""
    rng = np.random.default_rng(seed)
    target = int(round(density * n * n))
    keys = _unique_sorted(rng.integers(0, n * n, size=target, dtype=np.int64))
    return _from_keys(f"uniform (density {density:g})", keys, n, n, rng)


def power_law(n: int, mean_degree: float, max_degree: int, seed: int = 0) -> Matrix:
    """A graph adjacency matrix with Zipf-like row degrees: the r-th largest row has about
    ``max_degree * r ** -a`` nonzeros (at least 1), ``a`` chosen so rows average ``mean_degree``; rows are
    shuffled. Columns are drawn with Zipf-like popularity (in-degree skew, as in real graphs), then rows
    short of their degree after removing duplicates are topped up with uniform columns."""
    rng = np.random.default_rng(seed)
    rank = np.arange(1, n + 1, dtype=np.float64)
    lo, hi = 0.05, 4.0
    for _ in range(60):  # bisect the exponent: the degree sum falls as it grows
        a = (lo + hi) / 2
        if np.maximum(1, np.floor(max_degree * rank ** -a)).sum() > mean_degree * n:
            lo = a
        else:
            hi = a
    degree = np.maximum(1, np.floor(max_degree * rank ** -a)).astype(np.int64)[rng.permutation(n)]
    popularity = np.cumsum((rank + 10.0) ** -0.7)
    popularity /= popularity[-1]
    node = rng.permutation(n)
    rows = np.repeat(np.arange(n), degree)
    cols = node[np.minimum(np.searchsorted(popularity, rng.random(rows.size)), n - 1)]
    keys = _unique_sorted(rows * n + cols)
    for _ in range(50):
        short = degree - np.bincount(keys // n, minlength=n)
        if not short.any():
            break
        rows = np.repeat(np.arange(n), short)
        keys = _unique_sorted(np.concatenate([keys, rows * n + rng.integers(0, n, rows.size)]))
    return _from_keys(f"power-law graph (Zipf-like degrees, exponent {a:.2f})", keys, n, n, rng)


def dense(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def random_3d(shape, density: float, seed: int = 0) -> torch.Tensor:
    """A dense torch tensor with about ``density`` of its entries nonzero (standard normal), the rest 0."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=g) < density
    return torch.randn(*shape, generator=g) * mask


def planetoid(name: str) -> Matrix | None:
    """The GCN-normalized adjacency D^-1/2 (A + I) D^-1/2 of Cora or CiteSeer (``../shared/data`` or
    ``$SCORCH_DATA``), or None when the files are not there."""
    from apps import common
    from apps.gnn.data import load_planetoid
    root = common.data_root(None)
    try:
        g = load_planetoid(name, root) if root is not None else None
    except FileNotFoundError:
        g = None
    if g is None:
        return None
    n = g.num_nodes
    rows = np.repeat(np.arange(n), np.diff(g.indptr))
    keys = np.sort(np.concatenate([rows * n + g.indices, np.arange(n) * (n + 1)]))
    r, c = keys // n, keys % n
    deg = np.bincount(r, minlength=n).astype(np.float64)
    crow = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=n), out=crow[1:])
    vals = (1 / np.sqrt(deg[r] * deg[c])).astype(np.float32)
    crow_t, col_t, vals_t = (torch.from_numpy(crow.astype(np.int32)), torch.from_numpy(c.astype(np.int32)),
                             torch.from_numpy(vals))
    a = torch.sparse_csr_tensor(crow_t, col_t, vals_t, (n, n))
    s = sp.csr_matrix((vals_t.numpy(), col_t.numpy(), crow_t.numpy()), shape=(n, n), copy=False)
    return Matrix(f"{name} (GCN-normalized adjacency, real graph)", a, s, scorch.from_torch(a))
