"""Recommender: matrix factorization with multi-hot side features on MovieLens-100k.

``python -m apps.recsys --backend scorch|torch``. The model (``model.py``) is one piece of ordinary PyTorch run
with ``torch`` or ``scorch`` as its torch module: under ``scorch`` the loss is computed on the observed ratings
only by an SDDMM (``torch.sparse.sampled_addmm`` on the ratings' pattern) and the user/item features go through
SpMM embedding bags (a sparse multi-hot matrix times the feature table); under ``torch`` the same numbers come
from gathering factor rows at the (user, item) pairs and ``nn.EmbeddingBag(mode="sum")``.
"""
from __future__ import annotations

import math
import time

from .. import common

BACKENDS = ("scorch", "torch")
EPOCHS = 60
QUICK_EPOCHS = 8
DEFAULTS = dict(rank=32, lr=0.01, weight_decay=1e-3, batches=1, test_fraction=0.1, dtype="float32",
                generated=False, users=943, items=1682, ratings=100_000)


def operands(torch, backend: str, dataset, batches: int, seed: int, dtype):
    """The model's inputs for a backend: the observed entries (per training batch, and the test set) and the two
    multi-hot feature matrices. scorch: sparse matrices (CSR); torch: index pairs and EmbeddingBag inputs."""
    import torch as real_torch

    def observed(r):
        if backend == "scorch":
            crow = r.crow(dataset.n_users)
            return torch.sparse_csr_tensor(crow, r.items, r.ratings.to(dtype), (dataset.n_users, dataset.n_items))
        return (r.users, r.items)

    def features(f):
        if backend == "scorch":
            ones = real_torch.ones(f.col.numel(), dtype=dtype)
            return torch.sparse_csr_tensor(f.crow, f.col, ones, f.shape)
        return (f.col, f.crow[:-1])          # nn.EmbeddingBag's (input, offsets)

    train = dataset.train
    if batches > 1:   # fixed random chunks of the training ratings (each kept in row-major order)
        from .data import Ratings
        perm = real_torch.randperm(len(train), generator=real_torch.Generator().manual_seed(seed + 1))
        chunks = [c.sort().values for c in perm.tensor_split(batches)]
        parts = [Ratings(train.users[c], train.items[c], train.ratings[c]) for c in chunks]
    else:
        parts = [train]
    return ([observed(p) for p in parts], [p.ratings.to(dtype) for p in parts],
            observed(train), train.ratings.to(dtype), observed(dataset.test), dataset.test.ratings.to(dtype),
            features(dataset.user_features), features(dataset.item_features))


class Session:
    """One backend's model, optimizer and operands on a dataset: ``train_epoch()`` runs one epoch of Adam steps
    and returns the mean training loss; ``rmse(observed, ratings)`` evaluates (predictions clamped to 1..5)."""

    def __init__(self, backend: str, dataset, seed: int = 0, **options):
        import torch as real_torch
        from . import model as model_mod
        opt = {**DEFAULTS, **options}
        self.backend, self.dataset, self.options = backend, dataset, opt
        self.torch = torch = common.backend_module(backend)
        dtype = getattr(real_torch, opt["dtype"])
        (self.batch_obs, self.batch_y, self.train_obs, self.train_y, self.test_obs, self.test_y,
         self.user_feat, self.item_feat) = operands(torch, backend, dataset, opt["batches"], seed, dtype)
        self.mean = dataset.train.ratings.double().mean().item()
        torch.manual_seed(seed)
        self.model = model_mod.build(torch, dataset.n_users, dataset.n_items, len(dataset.user_features.names),
                                     len(dataset.item_features.names), opt["rank"], self.mean).to(dtype)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"])
        self._order = real_torch.Generator().manual_seed(seed + 2)

    def train_epoch(self) -> float:
        import torch as real_torch
        F, model, optimizer = self.torch.nn.functional, self.model, self.optimizer
        model.train()
        n = len(self.batch_obs)
        order = real_torch.randperm(n, generator=self._order).tolist() if n > 1 else [0]
        total = 0.0
        for b in order:
            optimizer.zero_grad()
            loss = F.mse_loss(model(self.batch_obs[b], self.user_feat, self.item_feat), self.batch_y[b])
            loss.backward()
            optimizer.step()
            total += loss.item() * self.batch_y[b].numel()
        return total / len(self.dataset.train)

    def rmse(self, observed, ratings) -> float:
        self.model.eval()
        with self.torch.no_grad():
            pred = self.model(observed, self.user_feat, self.item_feat).clamp(1, 5)
        return math.sqrt(self.torch.nn.functional.mse_loss(pred, ratings).item())

    def test_rmse(self) -> float:
        return self.rmse(self.test_obs, self.test_y)

    def train_rmse(self) -> float:
        return self.rmse(self.train_obs, self.train_y)


def load_data(data=None, seed: int = 0, **options):
    from . import data as data_mod
    opt = {**DEFAULTS, **options}
    return data_mod.load(data, generated=opt["generated"], users=opt["users"], items=opt["items"],
                         ratings=opt["ratings"], test_fraction=opt["test_fraction"], seed=seed)


def _check(backend, epochs, options):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if options.get("batches", 1) < 1:
        raise ValueError(f"batches must be at least 1, got {options['batches']}")


def run(backend: str = "scorch", epochs: int = EPOCHS, threads: int = 2, seed: int = 0, quiet: bool = True,
        data=None, quick: bool = False, **options) -> dict:
    """Train and evaluate; returns the metrics, timings and sizes. Options: ``rank``, ``lr``, ``weight_decay``,
    ``batches`` (training batches per epoch; 1 = full batch), ``test_fraction``, ``dtype``, and for generated
    data ``generated=True`` with ``users``, ``items``, ``ratings``. ``quick``: at most ``QUICK_EPOCHS`` epochs
    (a smoke-sized benchmark run; the RMSE is then far from converged)."""
    if quick:
        epochs = min(epochs, QUICK_EPOCHS)
    _check(backend, epochs, options)
    common.set_threads(threads)
    dataset = load_data(data, seed, **options)
    session = Session(backend, dataset, seed, **options)
    opt = session.options

    epoch_watch, infer_watch = common.Stopwatch(), common.Stopwatch()
    losses, test_curve = [], []
    bar = common.progress(range(epochs), desc=f"recsys[{backend}]", quiet=quiet)
    start = time.perf_counter()
    for _ in bar:
        with epoch_watch:
            losses.append(session.train_epoch())
        with infer_watch:
            test_curve.append(session.test_rmse())
        if not quiet:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", test_rmse=f"{test_curve[-1]:.4f}")
    total_s = time.perf_counter() - start

    baseline = math.sqrt(((dataset.test.ratings.double() - session.mean) ** 2).mean().item())
    return {
        "backend": backend,
        "data": dataset.source,
        "users": dataset.n_users,
        "items": dataset.n_items,
        "train_ratings": len(dataset.train),
        "test_ratings": len(dataset.test),
        "user_features": len(dataset.user_features.names),
        "item_features": len(dataset.item_features.names),
        "rank": opt["rank"],
        "epochs": epochs,
        "batches": opt["batches"],
        "threads": threads,
        "baseline_rmse": baseline,        # predicting the training mean for every test rating
        "train_rmse": session.train_rmse(),
        "test_rmse": test_curve[-1],
        "best_test_rmse": min(test_curve),
        "epoch_s": epoch_watch.median(skip=1),
        "first_epoch_s": epoch_watch.times[0],
        "batch_s": epoch_watch.median(skip=1) / opt["batches"],
        "infer_s": infer_watch.median(skip=1),
        "total_s": total_s,
        "epoch_times": epoch_watch.times[1:],   # the timed epochs after the first (which compiles kernels)
        "infer_times": infer_watch.times[1:],
        "losses": losses,
        "test_rmse_curve": test_curve,
    }


def main(argv=None) -> dict:
    p = common.parser("recsys", "Matrix factorization with multi-hot side features on MovieLens-100k: the loss "
                       "on observed ratings by SDDMM, feature embedding bags by SpMM (scorch), or gathers and "
                       "nn.EmbeddingBag (torch).", backends=BACKENDS, epochs=EPOCHS)
    p.add_argument("--rank", type=int, default=DEFAULTS["rank"], help=f"factor rank (default {DEFAULTS['rank']})")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help=f"Adam learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"],
                   help=f"Adam weight decay (default {DEFAULTS['weight_decay']})")
    p.add_argument("--batches", type=int, default=DEFAULTS["batches"],
                   help="training batches per epoch (default 1: full batch)")
    p.add_argument("--test-fraction", type=float, default=DEFAULTS["test_fraction"],
                   help=f"held-out fraction of the ratings (default {DEFAULTS['test_fraction']})")
    p.add_argument("--dtype", choices=("float32", "float64"), default=DEFAULTS["dtype"])
    p.add_argument("--generated", action="store_true",
                   help="use a generated ratings matrix instead of ML-100k (sizes: --users, --items, --ratings)")
    p.add_argument("--users", type=int, default=DEFAULTS["users"])
    p.add_argument("--items", type=int, default=DEFAULTS["items"])
    p.add_argument("--ratings", type=int, default=DEFAULTS["ratings"])
    args = p.parse_args(argv)
    return common.run_and_report("recsys", run, args, DEFAULTS)
