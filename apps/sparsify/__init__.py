"""Sparsifying an existing model: a plain ``torch.nn`` MLP trained dense, then pruned to 50%, 75% and 90%
sparsity with ``scorch.schedule``, fine-tuned, and compared with the dense model.

``python -m apps.sparsify [--format csr|bsr16|bsr32|nm24] [--sparsities 0.5,0.75,0.9]``. The model is an
``nn.Sequential`` of ``nn.Linear`` / ``nn.ReLU`` / ``nn.Dropout`` classifying the nodes of Cora (or CiteSeer)
from their bag-of-words features (``../shared/data/planetoid``; generated data of the same shape when absent),
on a random 60/20/20 split of the nodes. The schedule selects the two wide hidden weights by a regex; the
model's code is not touched. For each sparsity the app reports test accuracy right after pruning and after
fine-tuning, the weights' bytes, the inference time of a batch and the time of a training epoch, each beside
the dense model's.
"""
from __future__ import annotations

import copy
import re
import statistics
import time

from .. import _common

FORMATS = {
    # name: (how the weights are pruned, how they are stored)
    "csr": "magnitude of single entries (ScalarFraction), CSR",
    "bsr16": "L2 norm of 16 x 16 blocks (BlockFraction), bsr(16, 16)",
    "bsr32": "L2 norm of 32 x 32 blocks (BlockFraction), bsr(32, 32)",
    "nm24": "2 largest of every 4 in a row (NM(2, 4)), nm(2, 4); 50% only",
}
SPARSE_WEIGHTS = r"[03]\.weight"  # the two wide hidden layers; the small classifier layer stays dense
DEFAULTS = dict(dataset="cora", hidden=2048, epochs=60, finetune_epochs=10, lr=1e-2, batch=256, repeats=20,
                sparsities=(0.5, 0.75, 0.9), format="bsr16")


def features(dataset: str, data, seed: int):
    """Row-normalized dense features, labels, and a random 60/20/20 split of the labelled nodes."""
    import numpy as np
    import torch

    from ..gnn.data import dataset as load
    g = load(dataset, _common.data_root(data), seed=seed)
    n = g.num_nodes
    x = torch.zeros(n, g.num_features)
    rows = np.repeat(np.arange(n), np.diff(g.feat_indptr))
    x[torch.from_numpy(rows), torch.from_numpy(g.feat_indices)] = torch.from_numpy(g.feat_data)
    x = x / x.sum(1, keepdim=True).clamp_min(1e-12)
    y = torch.from_numpy(g.labels)
    labelled = torch.nonzero(y >= 0).squeeze(1)
    perm = labelled[torch.randperm(labelled.numel(), generator=torch.Generator().manual_seed(seed))]
    a, b = int(0.6 * perm.numel()), int(0.8 * perm.numel())
    return g, x, y, perm[:a], perm[a:b], perm[b:]


def mlp(torch, n_in: int, hidden: int, n_out: int):
    """The model: plain torch.nn modules."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(hidden, n_out))


def accuracy(model, x, y, idx) -> float:
    import torch
    model.eval()
    with torch.no_grad():
        pred = model(x[idx]).argmax(1)
    return float((pred == y[idx]).float().mean())


def train(model, x, y, idx, epochs: int, lr: float, batch: int, seed: int, desc: str, quiet: bool):
    """Adam on minibatches of ``batch`` training nodes; the wall time of every epoch."""
    import torch
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in _common.progress(range(epochs), desc, quiet):
        model.train()
        t0 = time.perf_counter()
        for part in idx[torch.randperm(idx.numel(), generator=gen)].split(batch):
            loss = torch.nn.functional.cross_entropy(model(x[part]), y[part])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return times


def infer_times(model, x, batch: int, repeats: int):
    import torch
    model.eval()
    xb = x[:batch]
    times = []
    with torch.no_grad():
        model(xb)  # the first call compiles
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(xb)
            times.append(time.perf_counter() - t0)
    return times


def weight_bytes(model) -> int:
    """Bytes of every parameter: values and, for sparse ones, their index arrays."""
    import scorch
    return sum(scorch.nn.storage_bytes(p) for p in model.parameters())


def sparsify(model, fmt: str, sparsity: float):
    """Prune the wide hidden weights of ``model`` in place with a schedule; the schedule is returned."""
    import scorch
    s = scorch.schedule(model)
    sel = s.regex(SPARSE_WEIGHTS)
    if fmt == "csr":
        sel.sparsify(scorch.nn.ScalarFraction(sparsity)).set_format("csr")
    elif fmt in ("bsr16", "bsr32"):
        b = int(fmt[3:])
        sel.block(b, b).sparsify(scorch.nn.BlockFraction(sparsity, (b, b)))
    elif fmt == "nm24":
        if abs(sparsity - 0.5) > 1e-9:
            raise ValueError("--format nm24 is 2:4 sparsity: 50% exactly (use --sparsities 0.5)")
        sel.sparsify(scorch.nn.NM(2, 4)).set_format("nm(2, 4)")
    else:
        raise ValueError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    s.apply()
    return s


def run(backend: str = "scorch", *, epochs: int = DEFAULTS["epochs"], threads: int = 2, seed: int = 0,
        quiet: bool = False, data=None, dataset: str = DEFAULTS["dataset"], hidden: int = DEFAULTS["hidden"],
        finetune_epochs: int = DEFAULTS["finetune_epochs"], lr: float = DEFAULTS["lr"],
        batch: int = DEFAULTS["batch"], repeats: int = DEFAULTS["repeats"], sparsities=DEFAULTS["sparsities"],
        format: str = DEFAULTS["format"]) -> dict:
    """Train dense, then prune to each sparsity and fine-tune. ``result["rows"]``: one dict per model (the
    dense one first) with its accuracies, bytes and times; the top-level keys summarize the sparsest."""
    import torch

    import scorch
    from scorch.formats.named import short_name
    if format not in FORMATS:
        raise ValueError(f"unknown --format {format!r}; choose from {', '.join(FORMATS)}")
    torch.manual_seed(seed)
    g, x, y, tr, va, te = features(dataset, data, seed)
    dense = mlp(torch, x.shape[1], hidden, int(y.max()) + 1)
    times = train(dense, x, y, tr, epochs, lr, batch, seed, "dense training", quiet)
    dense_infer = infer_times(dense, x, batch, repeats)
    rows = [dict(model="dense", format="dense", sparsity=0.0, acc_pruned=None, acc=accuracy(dense, x, y, te),
                 bytes=weight_bytes(dense), infer_times=dense_infer, epoch_times=times[1:] or times)]
    for sp in sparsities:
        model = copy.deepcopy(dense)
        sparsify(model, format, sp)
        kinds = {type(p).__name__ for n, p in model.named_parameters() if re.fullmatch(SPARSE_WEIGHTS, n)}
        assert kinds == {"SparseTensor"}, kinds
        pruned = accuracy(model, x, y, te)
        tuned = train(model, x, y, tr, finetune_epochs, lr, batch, seed + 1, f"fine-tune {sp:.0%}", quiet)
        stored = next(p for n, p in model.named_parameters() if re.fullmatch(SPARSE_WEIGHTS, n))
        rows.append(dict(model=f"{format} {sp:.0%}", format=short_name(stored.format), sparsity=sp, acc_pruned=pruned,
                         acc=accuracy(model, x, y, te), bytes=weight_bytes(model),
                         infer_times=infer_times(model, x, batch, repeats), epoch_times=tuned[1:] or tuned))
    sparsest = rows[-1]
    return dict(data=g.name, dense_test_acc=rows[0]["acc"], test_acc=sparsest["acc"],
                bytes_ratio=rows[0]["bytes"] / sparsest["bytes"],
                infer_speedup=statistics.median(dense_infer) / statistics.median(sparsest["infer_times"]),
                rows=rows, backend=backend, scorch_version=scorch.__version__)


def table(result: dict) -> str:
    """The comparison as a text table (one line per model)."""
    rows = result["rows"]
    dense_infer = statistics.median(rows[0]["infer_times"])
    dense_epoch = statistics.median(rows[0]["epoch_times"])
    lines = [f"{'model':<14} {'acc pruned':>10} {'acc tuned':>9} {'weights MB':>10} {'vs dense':>8} "
             f"{'infer ms':>8} {'speedup':>7} {'epoch ms':>8} {'speedup':>7}"]
    for r in rows:
        inf, ep = statistics.median(r["infer_times"]), statistics.median(r["epoch_times"])
        pruned = "" if r["acc_pruned"] is None else f"{r['acc_pruned']:.3f}"
        lines.append(f"{r['model']:<14} {pruned:>10} {r['acc']:>9.3f} {r['bytes'] / 1e6:>10.2f} "
                     f"{rows[0]['bytes'] / r['bytes']:>7.1f}x {inf * 1e3:>8.2f} {dense_infer / inf:>6.2f}x "
                     f"{ep * 1e3:>8.1f} {dense_epoch / ep:>6.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = _common.parser("sparsify", "Prune a torch.nn MLP with scorch.schedule to 50/75/90% sparsity, fine-tune, "
                       "and compare accuracy, weight bytes and time with the dense model", ("scorch",),
                       DEFAULTS["epochs"])
    p.add_argument("--dataset", default=DEFAULTS["dataset"], help="cora or citeseer (default cora)")
    p.add_argument("--format", default=DEFAULTS["format"], choices=tuple(FORMATS),
                   help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()) + f" (default {DEFAULTS['format']})")
    p.add_argument("--sparsities", default=",".join(str(s) for s in DEFAULTS["sparsities"]),
                   help="comma-separated fractions of weights removed (default 0.5,0.75,0.9)")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="hidden width (default 2048)")
    p.add_argument("--finetune-epochs", type=int, default=DEFAULTS["finetune_epochs"], dest="finetune_epochs")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="training and inference batch (256)")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], help="timed inference batches (20)")
    args = p.parse_args(argv)
    args.sparsities = tuple(float(s) for s in args.sparsities.split(",") if s.strip())
    result = _common.run_and_report("sparsify", run, args, ("dataset", "format", "sparsities", "hidden",
                                                            "finetune_epochs", "batch", "repeats"))
    print(table(result))
    return result
