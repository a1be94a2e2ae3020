"""Routing attention: a dynamic sparsifier, the attention pattern computed from the activations on every forward
(the Routing Transformer: Roy, Saffar, Vaswani, Grangier, "Efficient Content-Based Sparse Attention with Routing
Transformers", TACL 2021).

Each head of each layer keeps ``clusters`` centroids on the unit sphere (a buffer). On every forward, each query
and each key (normalized to unit length) is assigned to its nearest centroid (the largest dot product: spherical
k-means), and query ``i`` attends to key ``j`` where both fall in the same cluster, plus
  itself      ``j == i`` (so that no row is empty, whatever the clusters),
  globals     the first ``n_globals`` tokens attend to every token and every token attends to them (as in the
              fixed pattern: the task's query token is token 0).
In training mode the centroids then move towards their members (the paper's online mini-batch k-means, an
exponential moving average): ``mu <- normalize(decay * mu + (1 - decay) * mean of the unit queries and keys
assigned to mu)``, per head over the batch; a centroid with no member stays. The assignment is an argmax (the
paper's), not a balanced top-k: the clusters, and so the pattern's size, vary with the data.

The pattern is built as CSR arrays of the block-diagonal ``(N n) x (N n)`` matrix of the ``N`` = batch x heads
problems (``model.block_diagonal``'s layout, which the attention kernels take in one call), from a sort of each
problem's keys by cluster: no ``n x n`` matrix is formed. Only the pattern comes from the assignment; the
gradients reach ``q``, ``k`` and ``v`` through the attention at the kept pairs, as with a fixed mask.
"""
from __future__ import annotations

import torch

DECAY = 0.9  # centroid EMA (the paper's 0.999 is for 100k-step trainings; the app trains a few hundred steps)


def init_centroids(heads: int, clusters: int, dim: int, generator=None) -> torch.Tensor:
    """``(heads, clusters, dim)`` random unit vectors."""
    c = torch.randn(heads, clusters, dim, generator=generator)
    return c / c.norm(dim=-1, keepdim=True)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The nearest centroid of each ``(B, H, n, dh)`` vector (unit-normalized; ``centroids`` ``(H, C, dh)``):
    ``(B, H, n)`` int64."""
    return torch.einsum("bhnd,hcd->bhnc", _unit(x), centroids).argmax(-1)


def update(centroids: torch.Tensor, members, clusters_of, decay: float = DECAY) -> None:
    """One EMA step of the centroids (in place) towards the mean of the unit vectors ``members`` (each ``(B, H, n,
    dh)``) assigned to them (``clusters_of``, each ``(B, H, n)``)."""
    H, C, dh = centroids.shape
    slots = torch.arange(H * C)[:, None]
    heads = torch.arange(H)[None, :, None]
    sums = torch.zeros(H * C, dh, dtype=centroids.dtype)
    counts = torch.zeros(H * C, dtype=centroids.dtype)
    for x, c in zip(members, clusters_of):
        # (a one-hot product: index_add_ into a few dozen rows serializes on their conflicts, 50x slower here)
        member = ((heads * C + c).reshape(1, -1) == slots).to(centroids.dtype)   # (H C, members)
        sums += member @ _unit(x).reshape(-1, dh).to(centroids.dtype)
        counts += member.sum(1)
    has = counts > 0
    moved = centroids.reshape(H * C, dh).clone()
    moved[has] = decay * moved[has] + (1 - decay) * sums[has] / counts[has, None]
    centroids.copy_(_unit(moved).reshape(H, C, dh))


def pattern(cq: torch.Tensor, ck: torch.Tensor, n_globals: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR ``(crow, col)`` (int64, columns sorted, no duplicates) of the ``(N n)^2`` block-diagonal pattern of
    the ``N`` problems whose queries and keys are in clusters ``cq``, ``ck`` (each ``(N, n)``): query ``i`` of
    problem ``p`` (row ``p n + i``) attends to key ``j`` (column ``p n + j``) where ``cq[p, i] == ck[p, j]``,
    where ``j == i``, and where ``i`` or ``j`` is below ``n_globals``.

    Each problem's keys are sorted by (cluster, position) once, so a query's same-cluster keys are one run of that
    order, already sorted; a global query's run is all keys, in a second copy in position order. The few pairs
    the clusters miss (the diagonal, the global columns) are merged into those sorted runs (their places found by
    binary search in the sorted keys): no ``n x n`` matrix, no sort of the entries."""
    N, n = cq.shape
    M = N * n
    g = min(int(n_globals), n)
    clusters = int(max(cq.max(), ck.max())) + 1 if cq.numel() else 1
    pos = torch.arange(n)
    base = (torch.arange(N) * n)[:, None]
    # each problem's keys by (cluster, position): ``by_cluster`` their sort keys, offset by problem so that the
    # whole is sorted; ``order`` (N, 2n) their positions as columns of the big matrix, then all keys in order
    by_cluster, order = torch.sort(ck * n + pos + base * clusters, dim=1)
    order = torch.cat([order, pos.expand(N, n)], 1) + base
    counts = torch.zeros(N, clusters, dtype=torch.int64).scatter_add_(1, ck, torch.ones_like(ck))
    length, first = counts.gather(1, cq), counts.cumsum(1).gather(1, cq) - counts.gather(1, cq)
    src_start = (first + 2 * base).reshape(-1)
    length[:, :g] = n                                              # a global query: every key (the second half)
    src_start.view(N, n)[:, :g] += n - first[:, :g]
    length = length.reshape(-1)
    seg = length.cumsum(0) - length                                # where each row's run starts
    rows = torch.repeat_interleave(length)
    src = (src_start - seg)[rows].add_(torch.arange(rows.numel()))
    col = order.reshape(-1)[src]
    # the global columns and the diagonal where the clusters do not already give them (global rows have them all),
    # in order: (query, key) row-major, the globals' positions (< g) before the query's own (>= g)
    cand_i = pos[None, :, None].expand(N, n, g + 1)
    cand_j = torch.cat([pos[:g].expand(n, g), pos[:, None]], 1)[None].expand(N, n, g + 1)
    cand_p = torch.arange(N)[:, None, None].expand(N, n, g + 1)
    extra = (cand_i >= g) & (cq[cand_p, cand_i] != ck[cand_p, cand_j])
    p, i, j = cand_p[extra], cand_i[extra], cand_j[extra]
    # merged: an added key goes after the kept keys of its row at smaller positions (those of its query's cluster:
    # a binary search in ``by_cluster``) and the added entries before it
    c = cq[p, i]
    before = torch.searchsorted(by_cluster.reshape(-1), (p * clusters + c) * n + j) - p * n - first[p, i]
    at = seg[p * n + i] + before + torch.arange(i.numel())
    out = torch.empty(col.numel() + i.numel(), dtype=torch.int64)
    out[at] = p * n + j
    kept = torch.ones(out.numel(), dtype=torch.bool)
    kept[at] = False
    out.masked_scatter_(kept, col)
    crow = torch.zeros(M + 1, dtype=torch.int64)
    crow[1:] = (length + torch.bincount(p * n + i, minlength=M)).cumsum(0)
    return crow, out


def dense_blocks(crow: torch.Tensor, col: torch.Tensor, problems: int) -> torch.Tensor:
    """The diagonal blocks of a block-diagonal CSR pattern as a dense ``(problems, n, n)`` bool mask."""
    total = crow.numel() - 1
    n = total // problems
    row = torch.repeat_interleave(torch.arange(total), crow[1:] - crow[:-1])
    mask = torch.zeros(problems, n, n, dtype=torch.bool)
    mask[row // n, row % n, col % n] = True
    return mask
