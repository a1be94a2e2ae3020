"""Sparsifying an existing model: a plain ``torch.nn`` model trained dense, then pruned to 50%, 75% and 90%
sparsity with ``scorch.schedule``, fine-tuned, and compared with the dense model.

``python -m apps.sparsify [--model mlp|transformer] [--format csr|bsr16|bsr32|nm24] [--sparsities 0.5,0.75,0.9]``.

``--model mlp`` (default): an ``nn.Sequential`` of ``nn.Linear`` / ``nn.ReLU`` / ``nn.Dropout`` classifying the
nodes of Cora (or CiteSeer) from their bag-of-words features (``planetoid/`` under ``--data``, ``SCORCH_DATA`` or
``../shared/data``: an error naming them when absent; ``--dataset sbm-like-cora`` generates data of the same shape),
on a random 60/20/20 split of the nodes; the two wide hidden weights are sparsified.
``--model transformer``: token and position ``nn.Embedding``s, an ``nn.TransformerEncoder`` and an ``nn.Linear``
head on a generated per-token task (each token's class is a fixed random function of the token and the
sequence's first token, so it needs both the attention and the feed-forward layers' capacity); the feed-forward
weights (``linear1``, ``linear2``) of every layer are sparsified (``nn.MultiheadAttention``'s cannot be: scorch
refuses them at ``apply``).

The schedule selects the weights by a regex; the model's code is not touched. For each sparsity the app reports
test accuracy right after pruning and after fine-tuning, the weights' bytes, the inference time of a batch and the
time of a training epoch, each beside the dense model's.
"""
from __future__ import annotations

import copy
import re
import statistics
import time

from .. import common

FORMATS = {
    # name: (how the weights are pruned, how they are stored)
    "csr": "magnitude of single entries (ScalarFraction), CSR",
    "bsr16": "L2 norm of 16 x 16 blocks (BlockFraction), bsr(16, 16)",
    "bsr32": "L2 norm of 32 x 32 blocks (BlockFraction), bsr(32, 32)",
    "nm24": "2 largest of every 4 in a row (NM(2, 4)), nm(2, 4); 50% only",
}
SPARSE_WEIGHTS = r"[03]\.weight"  # the MLP's two wide hidden layers; the small classifier layer stays dense
TRANSFORMER_WEIGHTS = r"encoder\.layers\.\d+\.linear[12]\.weight"  # every layer's feed-forward weights
WEIGHTS = {"mlp": SPARSE_WEIGHTS, "transformer": TRANSFORMER_WEIGHTS}
DEFAULTS = dict(model="mlp", dataset="cora", hidden=2048, epochs=60, finetune_epochs=10, lr=1e-2, batch=256,
                repeats=20, sparsities=(0.5, 0.75, 0.9), format="bsr16")
# --model transformer: the sizes and training that differ from the MLP's (hidden is the feed-forward width)
TRANSFORMER = dict(hidden=2048, epochs=6, finetune_epochs=2, lr=1e-3, batch=64, d_model=256, heads=4, layers=2,
                   seq_len=16, vocab=64, classes=4, sequences=5000)
IGNORE = -100  # a label cross_entropy and accuracy leave out (the transformer task's first position)


def features(dataset: str, data, seed: int):
    """Row-normalized dense features, labels, and a random 60/20/20 split of the labelled nodes. The feature
    columns are padded with zeros to a multiple of 4 (Cora's 1433 -> 1436, CiteSeer's 3703 -> 3704), so that the
    2:4 groups of ``--format nm24`` tile the first layer's rows; the zero columns change no output."""
    import numpy as np
    import torch

    from ..gnn.data import dataset as load
    g = load(dataset, common.data_root(data), seed=seed)
    n = g.num_nodes
    x = torch.zeros(n, -(-g.num_features // 4) * 4)
    rows = np.repeat(np.arange(n), np.diff(g.feat_indptr))
    x[torch.from_numpy(rows), torch.from_numpy(g.feat_indices)] = torch.from_numpy(g.feat_data)
    x = x / x.sum(1, keepdim=True).clamp_min(1e-12)
    y = torch.from_numpy(g.labels)
    labelled = torch.nonzero(y >= 0).squeeze(1)
    perm = labelled[torch.randperm(labelled.numel(), generator=torch.Generator().manual_seed(seed))]
    a, b = int(0.6 * perm.numel()), int(0.8 * perm.numel())
    return g, x, y, perm[:a], perm[a:b], perm[b:]


def lookup_task(sequences: int, seq_len: int, vocab: int, classes: int, seed: int):
    """The transformer's task: ``(tokens, labels)``, both ``(sequences, seq_len)`` int64. Tokens are uniform;
    token ``i > 0`` has class ``table[x_i, x_0]`` for a fixed random ``vocab x vocab`` table (the same for every
    seed), so a model must read the first token (attention) and learn the table (feed-forward layers); chance
    accuracy is ``1 / classes``. Position 0 has no label (``IGNORE``)."""
    import torch
    table = torch.randint(classes, (vocab, vocab), generator=torch.Generator().manual_seed(1234))
    x = torch.randint(vocab, (sequences, seq_len), generator=torch.Generator().manual_seed(seed))
    y = table[x, x[:, :1]]
    y[:, 0] = IGNORE
    return x, y


def mlp(torch, n_in: int, hidden: int, n_out: int):
    """The MLP: plain torch.nn modules."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(hidden, n_out))


def transformer(torch, vocab: int, seq_len: int, d_model: int, heads: int, hidden: int, layers: int, classes: int):
    """The transformer: token and position embeddings, ``nn.TransformerEncoder`` (``hidden`` is the feed-forward
    width), a linear head giving every token's class scores."""
    nn = torch.nn

    class TokenClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq_len, d_model)
            layer = nn.TransformerEncoderLayer(d_model, heads, hidden, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, classes)

        def forward(self, x):
            return self.head(self.encoder(self.tok(x) + self.pos.weight[: x.shape[1]]))

    return TokenClassifier()


def loss_fn(out, y):
    """Cross entropy over the last dimension, for one label per row (MLP) or per token (transformer)."""
    import torch
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=IGNORE)


def accuracy(model, x, y, idx) -> float:
    import torch
    model.eval()
    with torch.no_grad():
        pred = model(x[idx]).argmax(-1)
    keep = y[idx] != IGNORE
    return float((pred[keep] == y[idx][keep]).float().mean())


def train(model, x, y, idx, epochs: int, lr: float, batch: int, seed: int, desc: str, quiet: bool):
    """Adam on minibatches of ``batch`` training examples; the wall time of every epoch."""
    import torch
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in common.progress(range(epochs), desc, quiet):
        model.train()
        t0 = time.perf_counter()
        for part in idx[torch.randperm(idx.numel(), generator=gen)].split(batch):
            loss = loss_fn(model(x[part]), y[part])
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


def sparsify(model, fmt: str, sparsity: float, weights: str = SPARSE_WEIGHTS):
    """Prune the weights of ``model`` whose names match ``weights`` in place with a schedule; the schedule is
    returned."""
    import scorch
    s = scorch.schedule(model)
    sel = s.regex(weights)
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


def finetune(model, fmt: str, x, y, idx, epochs: int, lr: float, batch: int, seed: int, desc: str, quiet: bool):
    """``train`` on the pruned model, whose sparse weights keep their pattern. An ``nm(2, 4)`` weight cannot be
    updated in place yet (scorch refuses in-place arithmetic on padded formats, so ``torch.optim`` fails on it):
    for ``nm24`` the same kept entries are stored as CSR while fine-tuning and as ``nm(2, 4)`` again after it,
    so that format's epoch time is CSR's."""
    import scorch
    if fmt != "nm24":
        return train(model, x, y, idx, epochs, lr, batch, seed, desc, quiet)

    def sparse(fmt):
        return lambda name, w: fmt if isinstance(w, scorch.SparseTensor) else None
    scorch.nn.reformat_model(model, sparse("csr"))
    times = train(model, x, y, idx, epochs, lr, batch, seed, desc, quiet)
    scorch.nn.reformat_model(model, sparse("nm(2, 4)"))
    return times


def build(model: str, dataset: str, data, seed: int, hidden: int, sequences: int | None = None):
    """The dense model and its data: ``(net, x, y, train, test, data name)``."""
    import torch
    if model == "mlp":
        g, x, y, tr, va, te = features(dataset, data, seed)
        return mlp(torch, x.shape[1], hidden, int(y.max()) + 1), x, y, tr, te, g.name
    t = TRANSFORMER
    n = sequences or t["sequences"]
    x, y = lookup_task(n, t["seq_len"], t["vocab"], t["classes"], seed)
    split = int(0.8 * n)
    net = transformer(torch, t["vocab"], t["seq_len"], t["d_model"], t["heads"], hidden, t["layers"], t["classes"])
    return net, x, y, torch.arange(split), torch.arange(split, n), f"generated lookup task ({n} sequences of {t['seq_len']} tokens)"


def run(backend: str = "scorch", *, model: str = DEFAULTS["model"], epochs: int | None = None, threads: int = 2,
        seed: int = 0, quiet: bool = False, data=None, dataset: str = DEFAULTS["dataset"], hidden: int | None = None,
        finetune_epochs: int | None = None, lr: float | None = None, batch: int | None = None,
        repeats: int = DEFAULTS["repeats"], sparsities=DEFAULTS["sparsities"], format: str = DEFAULTS["format"],
        sequences: int | None = None) -> dict:
    """Train dense, then prune to each sparsity and fine-tune. ``result["rows"]``: one dict per model (the
    dense one first) with its accuracies, bytes and times; the top-level keys summarize the sparsest. Sizes left
    None take the model's defaults (``DEFAULTS`` for the MLP, ``TRANSFORMER`` for the transformer)."""
    import torch

    import scorch
    from scorch.formats.named import short_name
    if format not in FORMATS:
        raise ValueError(f"unknown --format {format!r}; choose from {', '.join(FORMATS)}")
    if model not in WEIGHTS:
        raise ValueError(f"unknown --model {model!r}; choose from {', '.join(WEIGHTS)}")
    size = dict(DEFAULTS, **(TRANSFORMER if model == "transformer" else {}))
    hidden = size["hidden"] if hidden is None else hidden
    epochs = size["epochs"] if epochs is None else epochs
    finetune_epochs = size["finetune_epochs"] if finetune_epochs is None else finetune_epochs
    lr = size["lr"] if lr is None else lr
    batch = size["batch"] if batch is None else batch
    weights = WEIGHTS[model]
    torch.manual_seed(seed)
    dense, x, y, tr, te, name = build(model, dataset, data, seed, hidden, sequences)
    times = train(dense, x, y, tr, epochs, lr, batch, seed, f"dense {model} training", quiet)
    dense_infer = infer_times(dense, x, batch, repeats)
    rows = [dict(model="dense", format="dense", sparsity=0.0, acc_pruned=None, acc=accuracy(dense, x, y, te),
                 bytes=weight_bytes(dense), infer_times=dense_infer, epoch_times=times[1:] or times)]
    for sp in sparsities:
        net = copy.deepcopy(dense)
        sparsify(net, format, sp, weights)
        kinds = {type(p).__name__ for n, p in net.named_parameters() if re.fullmatch(weights, n)}
        assert kinds == {"SparseTensor"}, kinds
        pruned = accuracy(net, x, y, te)
        tuned = finetune(net, format, x, y, tr, finetune_epochs, lr, batch, seed + 1, f"fine-tune {sp:.0%}", quiet)
        stored = next(p for n, p in net.named_parameters() if re.fullmatch(weights, n))
        rows.append(dict(model=f"{format} {sp:.0%}", format=short_name(stored.format), sparsity=sp, acc_pruned=pruned,
                         acc=accuracy(net, x, y, te), bytes=weight_bytes(net),
                         infer_times=infer_times(net, x, batch, repeats), epoch_times=tuned[1:] or tuned))
    sparsest = rows[-1]
    return dict(model=model, data=name, dense_test_acc=rows[0]["acc"], test_acc=sparsest["acc"],
                bytes_ratio=rows[0]["bytes"] / sparsest["bytes"],
                infer_speedup=statistics.median(dense_infer) / statistics.median(sparsest["infer_times"]),
                hidden=hidden, epochs=epochs, finetune_epochs=finetune_epochs, batch=batch,
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
    p = common.parser("sparsify", "Prune a torch.nn model with scorch.schedule to 50/75/90% sparsity, fine-tune, "
                       "and compare accuracy, weight bytes and time with the dense model", ("scorch",),
                       DEFAULTS["epochs"])
    t = TRANSFORMER
    p.add_argument("--model", default=DEFAULTS["model"], choices=tuple(WEIGHTS),
                   help="mlp: nn.Sequential MLP on Cora's features; transformer: nn.TransformerEncoder on a "
                        "generated per-token task (default mlp)")
    p.set_defaults(epochs=None)
    p.add_argument("--dataset", default=DEFAULTS["dataset"], help="mlp: cora or citeseer (default cora; from "
                   "--data), or sbm-like-cora / sbm-like-citeseer (generated, the same shapes)")
    p.add_argument("--format", default=DEFAULTS["format"], choices=tuple(FORMATS),
                   help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()).replace("%", "%%")
                   + f" (default {DEFAULTS['format']})")
    p.add_argument("--sparsities", default=",".join(str(s) for s in DEFAULTS["sparsities"]),
                   help="comma-separated fractions of weights removed (default 0.5,0.75,0.9)")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden width: the MLP's (default {DEFAULTS['hidden']}),"
                   f" the transformer's feed-forward width (default {t['hidden']})")
    p.add_argument("--finetune-epochs", type=int, default=None, dest="finetune_epochs",
                   help=f"default {DEFAULTS['finetune_epochs']} (mlp), {t['finetune_epochs']} (transformer)")
    p.add_argument("--batch", type=int, default=None, help=f"training and inference batch: {DEFAULTS['batch']} nodes "
                   f"(mlp), {t['batch']} sequences of {t['seq_len']} tokens (transformer)")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], help="timed inference batches (20)")
    p.add_argument("--sequences", type=int, default=None,
                   help=f"transformer: generated sequences, 80%% for training (default {t['sequences']})")
    for action in p._actions:
        if action.dest == "epochs":
            action.help = f"dense training epochs (default {DEFAULTS['epochs']} for mlp, {t['epochs']} for transformer)"
    args = p.parse_args(argv)
    args.sparsities = tuple(float(s) for s in args.sparsities.split(",") if s.strip())
    result = common.run_and_report("sparsify", run, args, ("model", "dataset", "format", "sparsities", "hidden",
                                                            "finetune_epochs", "batch", "repeats", "sequences"))
    print(table(result))
    return result
