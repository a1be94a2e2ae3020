"""The ``compile`` group: scorch under ``torch.compile`` against eager scorch and the best torch / PyG version, itself
compiled where torch.compile takes it, per training epoch (issue 20).

Two apps, each backend trained in this process one after another with the same seed and data (as ``apps.py``'s
tables): the GNN app (``python -m apps.gnn --compile``) and the sparse transformer app (``python -m
apps.sparse_transformer --compile``). A compiled run's first epochs compile the graph (and recompile once for
inference under ``no_grad``); the apps leave them out of the medians, as they leave out eager's kernel compiles.
A backend that torch.compile cannot take is a row saying why, not a failure of the suite.
"""
from __future__ import annotations

from .apps import app_table

GNN = {"scorch, torch.compile": ("scorch", True), "scorch, eager": ("scorch", False),
       "PyG, torch.compile": ("pyg", True), "PyG, eager": ("pyg", False), "torch.sparse, eager": ("torch", False)}

TRANSFORMER = {"scorch, torch.compile": ("scorch", dict(compile=True)), "scorch, eager": ("scorch", {}),
               "scorch, scorch.compile (fused)": ("scorch", dict(fuse=True)),
               "torch dense (SDPA, mask), torch.compile": ("dense", dict(compile=True)),
               "torch dense (SDPA, mask), eager": ("dense", {}),
               "torch.sparse, eager": ("sparse", {})}


def _best_torch(t, names):
    """The fastest torch / PyG row that ran (the ratio's peer), else the first name."""
    ran = [r for r in t.rows if r.name in names and r.timing is not None]
    return min(ran, key=lambda r: r.timing.median).name if ran else names[0]


def gnn(threads: int, quick: bool, model: str = "gcn", data=None):
    from apps import common
    from apps import gnn as app
    from apps.gnn.data import dataset as load

    dataset, epochs = ("cora", 20) if quick else ("cora", 200)
    g = load(dataset, common.data_root(data))
    runs = {label: (lambda b=b, c=c: app.run(b, model, epochs=epochs, threads=threads, graph=g, compile=c))
            for label, (b, c) in GNN.items()}
    t = app_table("compile", f"{model.upper()} training under torch.compile, {g.name}",
                  f"{g.describe()}; full-batch training, {epochs} epochs (Adam), the app's defaults "
                  f"(`python -m apps.gnn --model {model} --dataset {dataset} --epochs {epochs} [--compile]`)",
                  runs, "scorch, torch.compile", "PyG, eager", lambda r: f"test accuracy {r['test_acc']:.3f}")
    t.torch = _best_torch(t, [n for n in GNN if not n.startswith("scorch")])
    t.notes.append("Ratios are over the compiled scorch row; the peer column is the fastest torch / PyG row. "
                   "Compiled runs draw other dropout masks than eager ones, so accuracies differ a little. "
                   "torch.compile does not take torch's own sparse tensors (Dynamo leaves a function with one to "
                   "eager), so torch.sparse has no compiled row.")
    return t


def transformer(threads: int, quick: bool):
    from apps import sparse_transformer as app

    options = dict(epochs=2, seq_len=256, train_size=16) if quick else dict(epochs=4)
    runs = {label: (lambda b=b, extra=extra: app.run(b, threads=threads, **options, **extra))
            for label, (b, extra) in TRANSFORMER.items()}
    t = app_table("compile", f"Sparse transformer training under torch.compile (sequence {options.get('seq_len', 512)})",
                  f"`apps.sparse_transformer` with {', '.join(f'{k}={v}' for k, v in options.items())} "
                  "[--compile | --fuse]", runs, "scorch, torch.compile", "torch dense (SDPA, mask), eager",
                  lambda r: f"accuracy {r['accuracy']:.3f}")
    t.torch = _best_torch(t, [n for n in TRANSFORMER if not n.startswith("scorch")])
    t.notes.append("Under torch.compile scorch's attention (sampled_addmm -> softmax -> mm) is one custom op running "
                   "the fused row kernel of `scorch.compile`; the projections, norms and feed-forward blocks are "
                   "Inductor's. torch.compile does not take torch's own sparse tensors, so torch.sparse has no "
                   "compiled row.")
    return t
