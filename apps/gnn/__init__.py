"""Node classification with GCN, GraphSAGE and GAT: ``python -m apps.gnn --backend scorch|torch|pyg``.

Backends: ``scorch`` (the model code of ``model.py`` with ``import scorch as torch``), ``torch`` (the same code
with the real torch: torch.sparse kernels) and ``pyg`` (PyTorch Geometric's GCNConv / SAGEConv / GATConv).
Full-batch training with Adam; the reported test accuracy is at the epoch of best validation accuracy.
"""
from __future__ import annotations

import contextlib
import warnings

from .. import common

BACKENDS = ("scorch", "torch", "pyg")
DEFAULTS = {  # the usual recipes (Kipf & Welling; Hamilton et al.; Velickovic et al.)
    "gcn": dict(hidden=16, heads=1, lr=0.01, weight_decay=5e-4, dropout=0.5),
    "sage": dict(hidden=16, heads=1, lr=0.01, weight_decay=5e-4, dropout=0.5),
    "gat": dict(hidden=8, heads=8, lr=0.005, weight_decay=5e-4, dropout=0.6),
}


def prepare(backend: str, model: str, graph, hidden=None, heads=None, dropout=None):
    """(module, inputs, graph tensors): the model built for ``backend`` and what its forward takes."""
    d = DEFAULTS[model]
    hidden = hidden or d["hidden"]
    heads = heads or d["heads"]
    dropout = d["dropout"] if dropout is None else dropout
    if backend == "pyg":
        from . import pyg
        from .model import graph_tensors
        import torch
        gt = graph_tensors(torch, graph, dense_features=True)
        net = pyg.build(model, graph.num_features, hidden, graph.num_classes, heads=heads, dropout=dropout)
        return net, (gt.x, pyg.edge_index(graph)), gt
    from .model import build, graph_tensors
    torch = common.backend_module(backend)
    # torch's CSR tensors have no softmax: GAT's attention matrices are COO under torch (CSR under scorch)
    gt = graph_tensors(torch, graph, attention_layout="csr" if backend == "scorch" else "coo")
    net = build(torch, model, graph.num_features, hidden, graph.num_classes, heads=heads, dropout=dropout)
    return net, (gt.x, gt), gt


def run(backend: str = "scorch", model: str = "gcn", dataset: str = "cora", epochs: int = 200, threads: int = 2,
        seed: int = 0, quiet: bool = True, data=None, hidden=None, heads=None, lr=None, weight_decay=None,
        dropout=None, graph=None, device="cpu", compile=False) -> dict:
    """Train ``model`` on ``dataset`` with ``backend``; returns accuracies and the median times of a training
    epoch (forward, backward, optimizer step) and of an inference forward. ``graph`` (an ``apps.gnn.data.Graph``)
    skips loading. ``device``: where the model and the graph's tensors live ("cuda": sparse ops on the GPU).
    ``compile``: the model under ``torch.compile``."""
    return common.finish(training(**locals()))


def training(backend: str = "scorch", model: str = "gcn", dataset: str = "cora", epochs: int = 200, threads: int = 2,
             seed: int = 0, quiet: bool = True, data=None, hidden=None, heads=None, lr=None, weight_decay=None,
             dropout=None, graph=None, device="cpu", compile=False):
    """``run`` an epoch at a time: a generator that yields after each epoch (training step and inference) and
    returns ``run``'s dict, so that a benchmark can interleave the epochs of several backends (``common.finish``
    runs one to its end)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose {', '.join(BACKENDS)}")
    import torch
    from .data import dataset as load

    common.set_threads(threads)
    g = graph if graph is not None else load(dataset, common.data_root(data), seed=seed)
    d = DEFAULTS[model]
    torch.manual_seed(seed)
    with _quiet_sparse():
        net, inputs, gt = prepare(backend, model, g, hidden, heads, dropout)
    if device != "cpu":
        net, gt = net.to(device), common.to_device(gt, device)
        inputs = (gt.x, gt) if backend != "pyg" else (gt.x, inputs[1].to(device))
    opt = torch.optim.Adam(net.parameters(), lr=lr or d["lr"],
                           weight_decay=d["weight_decay"] if weight_decay is None else weight_decay)
    labels, train_idx = gt.labels, gt.train_idx
    forward = common.compiled(net, compile)
    train_watch, infer_watch = common.Stopwatch(), common.Stopwatch()
    best_val, test_at_best, losses = -1.0, 0.0, []
    bar = common.progress(range(epochs), f"{model} {backend} {g.name}", quiet)
    for _ in bar:
        with _quiet_sparse():  # (entered and left within an epoch: interleaved generators nest no state)
            with train_watch:
                net.train()
                opt.zero_grad()
                out = forward(*inputs)
                loss_t = torch.nn.functional.cross_entropy(out[train_idx], labels[train_idx])
                loss_t.backward()
                opt.step()
            with infer_watch, torch.no_grad():
                net.eval()
                pred = forward(*inputs).argmax(1)
        val = (pred[gt.val_idx] == labels[gt.val_idx]).float().mean().item()
        if val > best_val:
            best_val = val
            test_at_best = (pred[gt.test_idx] == labels[gt.test_idx]).float().mean().item()
        losses.append(loss_t.item())
        if not quiet:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{val:.3f}")
        yield
    warm = min(3, max(epochs - 1, 0))  # the first epochs compile kernels and warm caches: not timed
    return {"backend": backend, "model": model, "data": g.name, "nodes": g.num_nodes, "edges": g.num_edges,
            "epochs": epochs, "train_loss": losses[-1] if losses else float("nan"), "losses": losses,
            "val_acc": best_val, "test_acc": test_at_best,
            "epoch_s": train_watch.median(skip=warm), "infer_s": infer_watch.median(skip=warm),
            "epoch_times": train_watch.times[warm:], "infer_times": infer_watch.times[warm:], "threads": threads,
            "device": str(device), "compiled": bool(compile)}


@contextlib.contextmanager
def _quiet_sparse():
    """torch.sparse's beta / invariant-check warnings left out of the app's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*(beta|invariant)")
        yield


def main(argv=None) -> dict:
    p = common.parser("gnn", __doc__.splitlines()[0], BACKENDS, epochs=200)
    p.add_argument("--model", choices=tuple(DEFAULTS), default="gcn")
    p.add_argument("--dataset", default="cora", help="cora, citeseer (Planetoid's, from --data or SCORCH_DATA: an "
                   "error when not found), or a generated graph: sbm-like-cora, sbm-like-citeseer (the same sizes), "
                   "sbm (Cora-sized) or sbm-<nodes>, e.g. sbm-100000")
    p.add_argument("--hidden", type=int, default=None, help="hidden units (per head for GAT)")
    p.add_argument("--heads", type=int, default=None, help="GAT heads (default 8)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--dropout", type=float, default=None)
    common.add_device(p)
    p.add_argument("--distributed", action="store_true", help="under torchrun: the graph's rows split across the "
                   "processes, halo rows exchanged (apps/gnn/distributed.py; gcn and sage)")
    p.add_argument("--partition", choices=("spectral", "contiguous"), default="spectral",
                   help="with --distributed: how the nodes are split (distributed.partition)")
    common.add_compile(p)
    a = p.parse_args(argv)
    if a.distributed:
        from . import distributed
        return distributed.main(a)
    common.set_threads(a.threads)
    from .data import dataset as load
    try:
        graph = load(a.dataset, common.data_root(a.data), seed=a.seed)
    except FileNotFoundError as e:  # (a usage error: how to point at the data, not a traceback)
        p.error(str(e))
    result = run(a.backend, a.model, a.dataset, a.epochs, a.threads, a.seed, a.quiet, a.data, a.hidden, a.heads,
                 a.lr, a.weight_decay, a.dropout, graph=graph, device=a.device, compile=a.compile)
    common.report(f"apps.gnn: {a.model} on {result['data']} with {a.backend}", result)
    return result
