"""The app suite: each app of ``apps/`` trained with each of its backends in this process, one after another
(same seed, same data), giving the median time of a training epoch and of an inference batch, and the quality
each reached. Epochs are timed by the app itself (``apps._common.Stopwatch``); the first epochs, which compile
kernels, are left out. Unlike the kernel cases, backends are not interleaved round by round: a burst of load
from another process lands on one backend only, which the min column and the load average show.
"""
from __future__ import annotations

import importlib
import statistics
from dataclasses import dataclass

from .timing import Row, Table, Target, Timing


@dataclass(frozen=True)
class AppConfig:
    gnn_datasets: tuple      # (data set, epochs) for the accuracy-and-time runs
    gnn_big: tuple           # (generated data set, epochs): timing on a large graph
    moe: dict
    recsys: dict
    transformer: dict
    seq_lens: tuple          # attention time against sequence length
    spmm_nnz: tuple          # SpMM time against nnz: densities of a uniform n x n matrix
    spmm_nnz_n: int


FULL = AppConfig(gnn_datasets=(("cora", 200), ("citeseer", 200)), gnn_big=("sbm-100000", 8),
                 moe=dict(), recsys=dict(), transformer=dict(), seq_lens=(512, 1024, 2048, 4096, 8192),
                 spmm_nnz=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2), spmm_nnz_n=20000)
QUICK = AppConfig(gnn_datasets=(("cora", 30),), gnn_big=("sbm-5000", 5), moe=dict(quick=True),
                  recsys=dict(quick=True), transformer=dict(quick=True), seq_lens=(256, 512, 1024),
                  spmm_nnz=(1e-3, 1e-2), spmm_nnz_n=2000)


def timing_of(result: dict, key: str) -> Timing | None:
    """A ``Timing`` from an app's result: ``<key>_times`` (the timed steps) when given, else ``<key>_s``."""
    times = result.get(f"{key}_times")
    if times:
        return Timing(statistics.median(times), min(times), len(times))
    sec = result.get(f"{key}_s")
    return None if sec is None else Timing(sec, sec, 1)


def app_table(group: str, title: str, setup: str, runs: dict, scorch_name: str, torch_name: str,
              metric) -> Table:
    """A table from ``runs``: backend label -> thunk returning the app's result dict (or raising).
    ``metric(result)`` gives the quality text of a row."""
    t = Table(group, title, setup, kind="app")
    t.scorch, t.torch = scorch_name, torch_name
    for name, thunk in runs.items():
        try:
            r = thunk()
        except Exception as e:  # noqa: BLE001  (a backend that fails is a row saying so)
            t.rows.append(Row(name, status=f"error: {type(e).__name__}: {' '.join(str(e).split())[:160]}"))
            continue
        t.rows.append(Row(name, timing_of(r, "epoch"), infer=timing_of(r, "infer"), metric=metric(r)))
    return t


def _target(t: Table, text: str, goal: float, peer: str) -> Target:
    tg = Target(text, goal, t.ratio(peer))
    if tg.value is None:
        row = t.row(peer) or t.row(t.scorch)
        tg.why_missing = row.status if row else "absent"
    return tg


# --- GNN ------------------------------------------------------------------------------------------------------

GNN_NAMES = {"scorch": "scorch", "torch": "torch.sparse", "pyg": "PyG"}


def gnn(model: str, dataset: str, epochs: int, threads: int, data=None) -> Table:
    from apps import _common
    from apps import gnn as app
    from apps.gnn.data import dataset as load

    g = load(dataset, _common.data_root(data))
    runs = {GNN_NAMES[b]: (lambda b=b: app.run(b, model, epochs=epochs, threads=threads, graph=g))
            for b in app.BACKENDS}
    t = app_table("gnn", f"{model.upper()} training, {g.name}",
                  f"{g.describe()}; full-batch training, {epochs} epochs (Adam), the app's defaults "
                  f"(`python -m apps.gnn --model {model} --dataset {dataset} --epochs {epochs}`)",
                  runs, "scorch", "torch.sparse", lambda r: f"test accuracy {r['test_acc']:.3f}")
    for peer in ("PyG", "torch.sparse"):
        t.targets.append(_target(t, f"scorch training epoch faster than {peer} (aim 1.5x)", 1.0, peer))
    t.notes.append("scorch and torch.sparse run the same model code (`apps/gnn/model.py`, the torch module passed "
                   "in); PyG runs its own GCNConv / SAGEConv / GATConv on dense features. Test accuracy is at the "
                   "epoch of best validation accuracy.")
    return t


# --- the other apps: their run() with each backend ----------------------------------------------------------------

def generic(group: str, module: str, title: str, backends: dict, scorch_name: str, torch_name: str, options: dict,
            threads: int, metric, targets=()) -> Table:
    """An app whose ``run(backend, threads=..., **options)`` returns ``epoch_s``/``infer_s`` (or their
    ``_times``) and a quality figure."""
    app = importlib.import_module(module)
    runs = {label: (lambda b=b: app.run(backend=b, threads=threads, **options)) for label, b in backends.items()}
    t = app_table(group, title, f"`{module}` with {', '.join(f'{k}={v}' for k, v in options.items()) or 'defaults'}",
                  runs, scorch_name, torch_name, metric)
    for text, goal, peer in targets:
        t.targets.append(_target(t, text, goal, peer))
    return t
