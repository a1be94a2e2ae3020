"""Timing table for the MoE block: one training step (forward, backward, Adam) and one inference forward, per
backend, einsum spelling, expert count and top-k, on random tokens and targets (the task's data does not change
the work). ``python -m apps.moe.bench [--tokens 4096 --dim 512 --experts 16 64 --top-k 1 2 ...]``.

Each configuration is built with ``model.build`` exactly as ``apps.moe.run`` builds it, warmed up once (scorch
compiles its kernels then), and timed ``--repeats`` times, the repeats interleaved across the configurations of
one (experts, top-k) pair; the medians are printed, with the speedup of each row over the torch backend's
``fused`` spelling (the dense gate computing every expert for every token) and over the plain PyTorch
per-expert loop (``loop``: ``index_select``, one ``torch.mm`` per expert, ``index_add_``; run by the torch
backend only, it has no gate tensor).
"""
from __future__ import annotations

import argparse

from .. import common


def prepare(backend, einsum, tokens, dim, hidden, experts, top_k, seed=0):
    """``(step, infer)`` closures for one configuration, built as ``apps.moe.run`` builds its model."""
    import torch as real_torch
    from . import model as model_mod
    torch = common.backend_module(backend)
    F = torch.nn.functional
    torch.manual_seed(seed)
    model = model_mod.build(torch, dim, hidden, experts, top_k, sparse_gate=(backend == "scorch"), einsum=einsum)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = real_torch.Generator().manual_seed(seed)
    x, y = real_torch.randn(tokens, dim, generator=g), real_torch.randn(tokens, hidden, generator=g)

    def step():
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    def infer():
        with torch.no_grad():
            model(x)

    return step, infer


def time_configs(configs, tokens, dim, hidden, experts, top_k, repeats):
    """Medians of ``repeats`` timed steps and inference forwards per configuration, after one warm-up of each
    (scorch compiles its kernels then). The repeats are interleaved across the configurations (A B C A B C ...),
    so a change in the machine's load hits them all alike and the ratios stay fair on a shared machine."""
    fns = {c: prepare(*c, tokens, dim, hidden, experts, top_k) for c in configs}
    watches = {c: (common.Stopwatch(), common.Stopwatch()) for c in configs}
    for r in range(repeats + 1):
        for c in (configs if r % 2 == 0 else configs[::-1]):  # (no configuration always runs after the same one)
            step, infer = fns[c]
            for fn, watch in zip((step, infer), watches[c]):
                with watch:
                    fn()
    return {c: {"step_s": w[0].median(skip=1), "infer_s": w[1].median(skip=1), "step_times": w[0].times[1:],
                "infer_times": w[1].times[1:]} for c, w in watches.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m apps.moe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["torch", "scorch"], choices=("torch", "scorch"))
    p.add_argument("--einsum", nargs="+", default=["fused", "slots", "loop"],
                   choices=("slots", "fused", "dispatch", "combine", "loop"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=None, help="default: --dim")
    p.add_argument("--experts", type=int, nargs="+", default=[16, 64])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    hidden = args.hidden or args.dim
    print(f"tokens={args.tokens} dim={args.dim} hidden={hidden} threads={args.threads} repeats={args.repeats}"
          " (medians; speedups over torch/fused, the dense gate, and over torch/loop, the per-expert loop)")
    print(f"{'experts':>7} {'top_k':>5} {'backend':>7} {'einsum':>8} {'step ms':>9} {'infer ms':>9} {'step x':>7}"
          f" {'infer x':>7} {'step x loop':>11} {'infer x loop':>12}")
    rows = []
    for experts in args.experts:
        for top_k in args.top_k:
            configs = [(b, e) for e in args.einsum for b in args.backends if not (e == "loop" and b != "torch")]
            times = time_configs(configs, args.tokens, args.dim, hidden, experts, top_k, args.repeats)
            base, loop = times.get(("torch", "fused")), times.get(("torch", "loop"))
            for (backend, einsum), t in times.items():
                ratios = [f"{b[key] / t[key]:.2f}" if b else "-" for b in (base, loop) for key in ("step_s", "infer_s")]
                print(f"{experts:>7} {top_k:>5} {backend:>7} {einsum:>8} {t['step_s'] * 1e3:>9.1f}"
                      f" {t['infer_s'] * 1e3:>9.1f} {ratios[0]:>7} {ratios[1]:>7} {ratios[2]:>11} {ratios[3]:>12}",
                      flush=True)
                rows.append(dict(experts=experts, top_k=top_k, backend=backend, einsum=einsum,
                                 step_s=t["step_s"], infer_s=t["infer_s"]))
    return rows


if __name__ == "__main__":
    main()
