"""The synthetic regression task: a random teacher MoE (the same top-k gating as the model, its own gate and
experts) maps Gaussian tokens to targets; the student learns to reproduce them. Generated with plain torch from
the seed, identically for every backend (no files: ``--data`` is not read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Task:
    train_x: list          # training batches, (tokens, dim) each
    train_y: list          # their targets, (tokens, hidden)
    test_x: list           # held-out batches
    test_y: list
    target_var: float      # the targets' mean square (the loss of predicting 0)


def teacher(x, gate, experts, top_k):
    """The teacher's outputs, expert by expert (each expert's tokens in one matmul): the same function as
    ``model.build(torch, ...)`` with these parameters."""
    probs = torch.softmax(x @ gate, dim=-1)
    weights, index = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch.zeros(x.shape[0], experts.shape[2], dtype=x.dtype)
    for n in range(experts.shape[0]):
        hit = index == n                                   # (tokens, k): at most one True per row
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel():
            w = (weights * hit).sum(dim=1)[rows]
            y.index_add_(0, rows, w[:, None] * (x[rows] @ experts[n]))
    return y


def make(tokens: int, dim: int, hidden: int, experts: int, top_k: int, batches: int, test_batches: int,
         seed: int, sharpness: float = 3.0, dtype=torch.float32) -> Task:
    """``batches`` training batches and ``test_batches`` held-out batches of ``tokens`` tokens each. The teacher's
    gate logits have standard deviation about ``sharpness``, so routing is decided but not saturated. Targets are
    scaled to unit mean square."""
    g = torch.Generator().manual_seed(10_000 + seed)
    gate = torch.randn(dim, experts, generator=g, dtype=torch.float64) * (sharpness / dim ** 0.5)
    expert_w = torch.randn(experts, dim, hidden, generator=g, dtype=torch.float64) / dim ** 0.5
    xs = [torch.randn(tokens, dim, generator=g, dtype=torch.float64) for _ in range(batches + test_batches)]
    ys = [teacher(x, gate, expert_w, top_k) for x in xs]
    scale = torch.cat(ys[:batches]).pow(2).mean().sqrt().item()
    ys = [(y / scale).to(dtype) for y in ys]
    xs = [x.to(dtype) for x in xs]
    test_var = torch.cat(ys[batches:]).double().pow(2).mean().item()
    return Task(xs[:batches], ys[:batches], xs[batches:], ys[batches:], test_var)
