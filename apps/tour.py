"""The main job's tour: what sparsity buys on this machine, measured here.

    python -m apps.tour [--quick] [--out tour-results] [--threads 2] [--data ../shared/data]

1. A BERT-base-sized encoder (768 wide, 3072 hidden; 4 of BERT-base's 12 layers; batch 8 x 128 tokens),
   written as plain PyTorch, pruned with ``scorch.schedule`` (every Linear weight: 90% unstructured in CSR, 90%
   of 16 x 16 blocks in BSR, 2:4), inference against its dense self, in float32 and bfloat16.
2. The mixture-of-experts app (``apps.moe``): a training epoch with sparse gates (scorch) against dense gates.
3. A GCN training epoch (``apps.gnn``) on Cora (from ``--data`` / ``SCORCH_DATA``; a generated graph of Cora's
   sizes where there is none, named as such) with scorch, dense torch and PyTorch Geometric where installed.

Every time is a median of interleaved rounds in this process; the ratios are over the dense peer of the same
dtype. The table is printed and written to ``<out>/tour.md`` with the CPU named; the plot to ``<out>/tour.png``.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import scorch

F = torch.nn.functional
#: the pruned variants of the encoder: (label, format, sparsifier)
VARIANTS = (("csr, 90% unstructured", "csr", lambda: scorch.nn.ScalarFraction(0.9)),
            ("bsr(16, 16), 90% of blocks", "bsr(16, 16)", lambda: scorch.nn.BlockFraction(0.9, (16, 16))),
            ("nm(2, 4)", "nm(2, 4)", lambda: scorch.nn.NM(2, 4)))


class Layer(torch.nn.Module):
    """One encoder layer as BERT writes it: self-attention (four width x width Linears), then a GELU feed-forward
    (width -> hidden -> width), each followed by a residual add and a LayerNorm."""

    def __init__(self, width: int, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (torch.nn.Linear(width, width) for _ in range(4))
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (f(x).view(b, s, self.heads, w // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, w)
        x = self.norm1(x + self.out(a))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


def encoder(layers: int, width: int = 768, hidden: int = 3072, heads: int = 12, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(Layer(width, hidden, heads) for _ in range(layers))).eval()


def pruned(model, fmt: str, sparsifier) -> torch.nn.Module:
    """A copy of ``model`` whose Linear weights ``scorch.schedule`` made sparse in ``fmt``."""
    import copy
    m = copy.deepcopy(model)
    s = scorch.schedule(m)
    s.regex(r".*\.(query|key|value|out|up|down)\.weight").sparsify(sparsifier).set_format(fmt)
    s.apply()
    return m


def masked_dense(model_sparse) -> torch.nn.Module:
    """The dense model holding the sparse model's (masked) weights: what its values must equal."""
    import copy
    m = copy.deepcopy(model_sparse)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear) and isinstance(mod.weight, scorch.SparseTensor):
            mod.weight = torch.nn.Parameter(mod.weight.detach().to_dense())
    return m


def interleaved(calls: dict, rounds: int) -> dict:
    """Median seconds of each call, over ``rounds`` rounds in which every call runs once, in rotated order."""
    names = list(calls)
    for f in calls.values():
        f()
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - t)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}


def weight_bytes(model) -> int:
    """Bytes of the Linear weights: values and index arrays of a sparse one (``scorch.nn.storage_bytes``)."""
    return sum(scorch.nn.storage_bytes(mod.weight) for mod in model.modules() if isinstance(mod, torch.nn.Linear))


def encoder_rows(quick: bool, rounds: int) -> list:
    layers, batch = (1, 2) if quick else (4, 8)
    dense = encoder(layers)
    x = torch.randn(batch, 128, 768)
    rows = []
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        base = dense.to(dtype)
        xi = x.to(dtype)
        models = {f"dense {label}": base}
        for name, fmt, sparsifier in VARIANTS:
            models[f"scorch {name}, {label}"] = pruned(base, fmt, sparsifier())
        with torch.no_grad():
            for name, m in models.items():  # values first: each pruned model equals its masked dense self
                if m is not base:
                    ref = masked_dense(m)(xi).float()
                    err = ((m(xi).float() - ref).abs().max() / ref.abs().max()).item()
                    if err > (1e-4 if dtype == torch.float32 else 3e-2):
                        raise AssertionError(f"tour: {name} differs from its masked dense model by {err:.2e}")
            t = interleaved({n: (lambda m=m: m(xi)) for n, m in models.items()}, rounds)
        ref = t[f"dense {label}"]
        for n, m in models.items():
            rows.append((f"encoder {layers}x768, batch {batch}x128: {n}", t[n], ref / t[n],
                         weight_bytes(m) / weight_bytes(base)))
    return rows


def moe_rows(quick: bool, threads: int) -> list:
    from . import moe
    size = dict(tokens=512, batches=4, dim=64, experts=8) if quick else {}
    out = {b: moe.run(b, epochs=3, threads=threads, **size) for b in ("torch", "scorch")}
    ref = out["torch"]["epoch_s"]
    return [(f"MoE training epoch ({b} gates)", r["epoch_s"], ref / r["epoch_s"], None) for b, r in out.items()]


def gcn_rows(quick: bool, threads: int, data) -> list:
    from . import gnn
    from .gnn.data import dataset
    from . import common
    try:
        g = dataset("cora", common.data_root(data))
    except (FileNotFoundError, ValueError):
        g = dataset("sbm-like-cora", None)
    backends = ["torch", "scorch"]
    try:
        import torch_geometric  # noqa: F401
        backends.append("pyg")
    except ImportError:
        pass
    epochs = 6 if quick else 30
    out = {b: gnn.run(b, "gcn", epochs=epochs, threads=threads, graph=g) for b in backends}
    ref = out["torch"]["epoch_s"]
    return [(f"GCN training epoch on {g.name} ({b})", r["epoch_s"], ref / r["epoch_s"], None) for b, r in out.items()]


def table(rows: list, cpu: str) -> str:
    lines = [f"# scorch tour\n\nMachine: {cpu}; {torch.get_num_threads()} threads; torch {torch.__version__}.\n",
             "| case | median | vs dense | weight bytes vs dense |", "|---|---:|---:|---:|"]
    for name, sec, ratio, nbytes in rows:
        lines.append(f"| {name} | {sec * 1e3:.1f} ms | {ratio:.2f}x | {'' if nbytes is None else f'{nbytes:.2f}x'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, ratios = [r[0] for r in rows], [r[2] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    ax.barh(range(len(rows)), ratios, color=["#888" if abs(r - 1) < 1e-9 else "#2a7" for r in ratios])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speed over the dense peer (higher is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--out", default="tour-results", help="folder for tour.md and tour.png")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--data", default=None, help="folder with Cora (default: $SCORCH_DATA)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from benchmarks.report import cpu_details, cpu_model
    details = cpu_details()
    cpu = f"{cpu_model()} ({details['CPU vendor / family / model']}; {details['CPU ISA']}; " \
          f"{details['CPU caches (per core, L3 shared)']})"
    print(f"scorch tour on {cpu}, {a.threads} threads\n")
    rows = encoder_rows(a.quick, a.rounds)
    rows += moe_rows(a.quick, a.threads)
    rows += gcn_rows(a.quick, a.threads, a.data)
    text = table(rows, cpu)
    print(text)
    out = Path(a.out)
    os.makedirs(out, exist_ok=True)
    (out / "tour.md").write_text(text)
    plot(rows, out / "tour.png")
    print(f"written: {out / 'tour.md'}, {out / 'tour.png'}")
    return rows


if __name__ == "__main__":
    main()
