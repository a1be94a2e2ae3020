"""The attention pattern: Longformer's local window and global tokens plus BigBird's random blocks, as CSR.

``build_pattern`` returns plain index arrays (``crow``, ``col``, int64 torch tensors); each backend turns them into
its own mask: a CSR sparse tensor (``scorch.sparse_csr_tensor`` or ``torch.sparse_csr_tensor``) or a dense bool
matrix for ``F.scaled_dot_product_attention``.

Entry ``(i, j)`` means query ``i`` may attend to key ``j``. The pattern is the union of
  window   ``|i - j| <= window // 2`` (Longformer's convention: a window of ``w`` tokens, ``w / 2`` on each side,
           plus the token itself);
  globals  the first ``n_globals`` tokens attend to every token (their rows) and every token attends to them
           (their columns);
  random   for each block-row of ``block`` queries, ``random_blocks`` key blocks of ``block`` tokens chosen at
           random (without repeats, from the blocks the window does not already reach), deterministic by ``seed``.
The window and the globals are symmetric; the random blocks are not (as in BigBird).
"""
from __future__ import annotations

import torch


def build_pattern(seq_len: int, window: int, n_globals: int = 0, random_blocks: int = 0, block: int = 64,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR arrays ``(crow, col)`` (int64; columns sorted within each row, no duplicates) of the attention pattern
    of a ``seq_len`` x ``seq_len`` score matrix. See the module docstring for the parts."""
    n = int(seq_len)
    if n < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if window < 0 or n_globals < 0 or random_blocks < 0 or block < 1:
        raise ValueError("window, n_globals and random_blocks must be >= 0 and block >= 1")
    half = window // 2
    keys = []
    # window: rows i, columns i - half .. i + half (clipped)
    offsets = torch.arange(-half, half + 1)
    rows = torch.arange(n).repeat_interleave(offsets.numel())
    cols = rows + offsets.repeat(n)
    keep = (cols >= 0) & (cols < n)
    keys.append(rows[keep] * n + cols[keep])
    # global tokens: their rows and their columns
    g = min(n_globals, n)
    if g:
        gi = torch.arange(g)
        every = torch.arange(n)
        keys.append((gi[:, None] * n + every[None, :]).reshape(-1))   # rows of the globals
        keys.append((every[:, None] * n + gi[None, :]).reshape(-1))   # columns of the globals
    # random key blocks per block-row
    if random_blocks:
        n_blocks = (n + block - 1) // block
        reach = (half + block - 1) // block                           # block distance the window covers
        gen = torch.Generator().manual_seed(seed)
        for br in range(n_blocks):
            choices = torch.tensor([bc for bc in range(n_blocks) if abs(bc - br) > reach], dtype=torch.int64)
            if choices.numel() == 0:
                continue
            picked = choices[torch.randperm(choices.numel(), generator=gen)[:random_blocks]]
            r = torch.arange(br * block, min(n, (br + 1) * block))
            c = (picked[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
            c = c[c < n]
            keys.append((r[:, None] * n + c[None, :]).reshape(-1))
    key = torch.unique(torch.cat(keys))                               # sorted: row-major, columns ascending
    row, col = key // n, key % n
    crow = torch.zeros(n + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(torch.bincount(row, minlength=n), 0)
    return crow, col


def rows_of(crow: torch.Tensor) -> torch.Tensor:
    """The row index of every stored entry (COO rows from CSR row pointers)."""
    n = crow.numel() - 1
    return torch.repeat_interleave(torch.arange(n), crow[1:] - crow[:-1])


def dense_mask(crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """The pattern as a dense ``n x n`` bool matrix (True: may attend)."""
    n = crow.numel() - 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows_of(crow), col] = True
    return mask


def density(crow: torch.Tensor) -> float:
    n = crow.numel() - 1
    return int(crow[-1]) / float(n * n)
