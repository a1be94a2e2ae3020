"""The synthetic long-sequence task: "match the query", per token.

Token 0 of each sequence is the query ``q`` (a global token of the pattern). Every other token is ``q`` with
probability 1/2, else another token of the vocabulary drawn uniformly. Token ``i``'s label says whether it
matches the query:

    y_i = [x_i == q]            (classes 0 and 1, each with probability 1/2: chance accuracy is 0.5)

A token farther than ``window / 2`` from the start can read the query only through the global column of the
pattern (token 0 is global), so the task needs the long-range part of the pattern: with ``--globals 0`` the
model cannot do better than chance beyond the window. Position 0 has no label (``-100``, ignored).
"""
from __future__ import annotations

import torch

IGNORE = -100
CLASSES = 2


def make_task(n_seqs: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)``, both ``(n_seqs, seq_len)`` int64, deterministic by ``seed``."""
    if vocab < 2:
        raise ValueError("vocab must be at least 2")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(vocab, (n_seqs, 1), generator=gen)
    other = (q + torch.randint(1, vocab, (n_seqs, seq_len), generator=gen)) % vocab     # any token but q
    match = torch.rand(n_seqs, seq_len, generator=gen) < 0.5
    tokens = torch.where(match, q.expand(-1, seq_len), other)
    tokens[:, 0] = q[:, 0]
    labels = (tokens == q).long()
    labels[:, 0] = IGNORE
    return tokens, labels
