"""``F.scaled_dot_product_attention`` with a sparse ``attn_mask`` against torch's SDPA with the same mask dense.

``python -m benchmarks.sdpa_mask [--quick] [--repeats N] [--additive]``: for L = S in 512, 1024, 2048 (quick: 512),
batch 2 x 4 heads of 64 dimensions, a random mask of 5% and of 10% (plus the diagonal, so that no row is empty),
the forward (under ``no_grad``) and the forward + backward to q, k and v, of

- scorch: ``F.scaled_dot_product_attention(q, k, v, attn_mask=S)``, ``S`` the mask as a scorch CSR bool tensor
  (the fused kernels), and with ``--additive`` also as a float CSR additive mask (the fused kernels adding its
  values to the scores);
- torch: the same call on the dense mask (bool; for the additive one, float with ``-inf`` where not stored).

Medians of interleaved repeats (``benchmarks.fusion._interleaved``), in milliseconds, and the ratio torch / scorch
(above 1: scorch faster).
"""
from __future__ import annotations

import argparse


def cases(L, density, additive, seed=0):
    """``{name: (forward, forward + backward)}`` of the scorch and torch calls on one problem."""
    import torch
    import scorch
    from scorch.nn import functional as F
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(L, L, generator=g) < density) | torch.eye(L, dtype=torch.bool)
    q, k, v = (torch.randn(2, 4, L, 64, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(2, 4, L, 64, generator=g)
    masks = {"scorch bool (fused)": scorch.asformat(keep, "csr"), "torch bool": keep}
    if additive:
        bias = torch.randn(L, L, generator=g) * 0.1
        masks["scorch additive"] = scorch.asformat(torch.where(keep, bias, 0), "csr")
        masks["torch additive"] = torch.where(keep, bias, float("-inf"))

    def forward(m):
        def run():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return run

    def backward(m):
        def run():
            F.scaled_dot_product_attention(q, k, v, attn_mask=m).backward(grad)
        return run

    return {name: (forward(m), backward(m)) for name, m in masks.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sdpa_mask", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--additive", action="store_true")
    args = p.parse_args(argv)
    import torch
    from .fusion import _interleaved
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch 2 x 4 heads, head dim 64; ms "
          "(medians of interleaved repeats); ratio = torch / scorch")
    print("| L = S | mask density | pass | " + " | ".join(["scorch bool (fused)", "torch bool", "ratio"] + (
        ["scorch additive", "torch additive", "ratio"] if args.additive else [])) + " |")
    for L in ((512,) if args.quick else (512, 1024, 2048)):
        for density in (0.05, 0.10):
            fns = cases(L, density, args.additive)
            for i, name in enumerate(("forward", "forward + backward")):
                t = _interleaved({n: f[i] for n, f in fns.items()}, args.repeats)
                cells = [t["scorch bool (fused)"], t["torch bool"]]
                row = [f"{cells[0] * 1e3:.1f}", f"{cells[1] * 1e3:.1f}", f"{cells[1] / cells[0]:.2f}x"]
                if args.additive:
                    a, b = t["scorch additive"], t["torch additive"]
                    row += [f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a:.2f}x"]
                print(f"| {L} | {density:.0%} | {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
