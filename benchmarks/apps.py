"""The app suite: each app of ``apps/`` trained with each of its backends in this process, one after another
(same seed, same data), giving the median time of a training epoch and of an inference batch, and the quality
each reached. Epochs are timed by the app itself (``apps.common.Stopwatch``); the first epochs, which compile
kernels, are left out. The GNN and sparse transformer apps' backends train side by side, a few epochs (steps) of each
in turn (``interleaved``: the app's ``training`` generator); the other apps run one backend after another, so a
burst of load from another process lands on one backend only, which the min column and the load average show.
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


FULL = AppConfig(gnn_datasets=(("cora", 200), ("citeseer", 100)), gnn_big=("sbm-100000", 5),
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


#: epochs of one backend in a row when the backends are interleaved (``interleaved``)
BLOCK = 5


def interleaved(trainings: dict) -> dict:
    """``app_table``'s runs from training generators (label -> thunk making an app's ``training``) stepped in turn
    by ``apps.common.interleave``: ``BLOCK`` epochs (the GNN app) or training steps (the sparse transformer's) of
    each backend a round, so that their medians come from the same minutes, and most of a backend's epochs follow
    one of its own (its data in the caches, as in a training loop run alone: one epoch a turn measured the compiled
    Cora GCN 25% slower, eager 14%)."""
    from apps import common
    results = common.interleave(trainings, BLOCK)
    return {label: (lambda r=r: _result(r)) for label, r in results.items()}


def _result(r):
    if isinstance(r, BaseException):
        raise r
    return r


def _target(t: Table, text: str, goal: float, peer: str) -> Target:
    tg = Target(text, goal, t.ratio(peer))
    if tg.value is None:
        row = t.row(peer) or t.row(t.scorch)
        tg.why_missing = row.status if row else "absent"
    return tg


# --- GNN ------------------------------------------------------------------------------------------------------

GNN_NAMES = {"scorch": "scorch", "torch": "torch.sparse", "pyg": "PyG"}


def gnn(model: str, dataset: str, epochs: int, threads: int, data=None) -> Table:
    from apps import common
    from apps import gnn as app
    from apps.gnn.data import dataset as load

    g = load(dataset, common.data_root(data))
    runs = interleaved({GNN_NAMES[b]: (lambda b=b: app.training(b, model, epochs=epochs, threads=threads, graph=g))
                        for b in app.BACKENDS})
    t = app_table("gnn", f"{model.upper()} training, {g.name}",
                  f"{g.describe()}; full-batch training, {epochs} epochs (Adam), the app's defaults "
                  f"(`python -m apps.gnn --model {model} --dataset {dataset} --epochs {epochs}`)",
                  runs, "scorch", "torch.sparse", lambda r: f"test accuracy {r['test_acc']:.3f}")
    for peer in ("PyG", "torch.sparse"):
        t.targets.append(_target(t, f"scorch training epoch >= 1.5x faster than {peer}", 1.5, peer))
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
    if hasattr(app, "training"):  # (its steps interleaved across the backends)
        runs = interleaved({label: (lambda b=b: app.training(backend=b, threads=threads, **options))
                            for label, b in backends.items()})
    else:
        runs = {label: (lambda b=b: app.run(backend=b, threads=threads, **options)) for label, b in backends.items()}
    t = app_table(group, title, f"`{module}` with {', '.join(f'{k}={v}' for k, v in options.items()) or 'defaults'}",
                  runs, scorch_name, torch_name, metric)
    for text, goal, peer in targets:
        t.targets.append(_target(t, text, goal, peer))
    return t


# --- MoE --------------------------------------------------------------------------------------------------------

MOE_LOOP = "torch, per-expert loop (index_select, mm, index_add_)"


def moe(threads: int, quick: bool) -> list:
    """The issue's case: 16 experts, top-1, B=4096, D=512. The app trained with each backend, one after another:
    scorch's sparse gate (the default spelling, ``fused``: one einsum ``bn,bd,ndh->bh``, a grouped product) against
    the plain PyTorch per-expert loop, the dense gate in the ``slots`` spelling, and the dense-gate einsum that
    computes every expert for every token; then the training step and the inference forward of scorch against
    the per-expert loop, interleaved in one process (``moe_steps``)."""
    from apps import moe as app
    size = dict(tokens=512, dim=64, experts=16, top_k=1, batches=2, test_batches=1) if quick else \
        dict(tokens=4096, dim=512, experts=16, top_k=1, batches=2, test_batches=1)
    epochs = 2 if quick else 3
    runs = {"scorch, sparse gate (fused)": lambda: app.run("scorch", epochs, threads, einsum="fused", **size),
            "scorch, sparse gate (slots)": lambda: app.run("scorch", epochs, threads, einsum="slots", **size),
            MOE_LOOP: lambda: app.run("torch", epochs, threads, einsum="loop", **size),
            "torch, dense gate (slots)": lambda: app.run("torch", epochs, threads, einsum="slots", **size),
            "torch, dense gate, every expert (fused)": lambda: app.run("torch", epochs, threads, einsum="fused",
                                                                        **size)}
    t = app_table("moe", f"MoE, {size['experts']} experts, top-{size['top_k']}, B={size['tokens']}, D={size['dim']}",
                  f"`apps.moe` with {', '.join(f'{k}={v}' for k, v in size.items())}, {epochs} epochs; a training "
                  "epoch is `batches` steps (forward, backward, Adam)", runs, "scorch, sparse gate (fused)",
                  "torch, dense gate, every expert (fused)", lambda r: f"held-out MSE {r['loss']:.4f}")
    t.targets.append(_target(t, "sparse gate >= 4x faster than the dense-gate einsum (every expert for every token)",
                             4.0, "torch, dense gate, every expert (fused)"))
    t.notes.append("`fused` spells the block as one einsum `bn,bd,ndh->bh`: with a sparse gate, scorch sorts the "
                   "gate's entries by expert once and runs one matrix product per expert over its tokens, forward "
                   "and backward, in float32 as compiled kernels that read the tokens in place "
                   "(`scorch/engine/grouped.py`, `scorch/compiler/grouped_gemm.py`). `slots` spells it as dispatch "
                   "(`sb,bd->sd`), "
                   "expert matmuls per slot (`ncd,ndh->nch`, padded to the fullest expert) and combine "
                   "(`bs,sh->bh`). The per-expert loop is plain PyTorch, no gate tensor (`apps/moe/model.py`, "
                   "`loop`). The app runs one backend after another: the interleaved tables below compare step by "
                   "step.")
    sizes = [dict(tokens=512, dim=64)] if quick else [dict(tokens=2048, dim=128), dict(tokens=4096, dim=512)]
    # (one call a sample: the 2 ms calls at D=128 take more samples for a steady median, at little cost)
    return [t] + [table for s in sizes for table in
                  moe_steps(threads, repeats=5 if quick else 41 if s["dim"] <= 128 else 21, **s)]


def moe_steps(threads: int, tokens: int, dim: int, experts: int = 16, top_k: int = 1, repeats: int = 15) -> list:
    """Two tables (training step; inference forward) of scorch's sparse gate in its two spellings and the
    per-expert loop, built as the app builds them and timed interleaved in this process (``apps.moe.bench``)."""
    from apps import common
    from apps.moe import bench
    from .timing import Row
    common.set_threads(threads)
    names = {("scorch", "fused"): "scorch, sparse gate (fused)", ("scorch", "slots"): "scorch, sparse gate (slots)",
             ("torch", "loop"): MOE_LOOP}
    times = bench.time_configs(list(names), tokens, dim, dim, experts, top_k, repeats)
    tables = []
    for key, what in (("step", "training step (forward, backward, Adam)"), ("infer", "inference forward")):
        t = Table("moe", f"MoE {what.split(' (')[0]}, {experts} experts, top-{top_k}, B={tokens}, D={dim}",
                  f"`python -m apps.moe.bench --tokens {tokens} --dim {dim} --experts {experts} --top-k {top_k} "
                  f"--einsum fused slots loop --repeats {repeats}`: one {what} each, the repeats interleaved "
                  f"across the three; {threads} threads")
        t.scorch, t.torch = names[("scorch", "fused")], MOE_LOOP
        for c, name in names.items():
            ts = times[c][f"{key}_times"]
            t.rows.append(Row(name, Timing(statistics.median(ts), min(ts), len(ts))))
        t.targets.append(_target(t, f"scorch's {what.split(' (')[0]} >= 1.2x the per-expert loop", 1.2, MOE_LOOP))
        tables.append(t)
    return tables


# --- recommender ------------------------------------------------------------------------------------------------

def recsys(threads: int, quick: bool) -> Table:
    from apps import recsys as app
    epochs = 8 if quick else 30
    runs = {label: (lambda b=b: app.run(b, epochs=epochs, threads=threads, quick=quick))
            for label, b in (("scorch", "scorch"), ("torch (gather, EmbeddingBag)", "torch"))}
    t = app_table("recsys", "Recommender, MovieLens-100k", f"`apps.recsys`, {epochs} full-batch epochs, rank 32 "
                  "(MovieLens-100k from the recbole package when installed, else generated of the same shape)",
                  runs, "scorch", "torch (gather, EmbeddingBag)",
                  lambda r: f"test RMSE {r['test_rmse']:.4f} ({r.get('data', '')})")
    t.targets.append(_target(t, "scorch epoch faster than the torch gather version", 1.0,
                             "torch (gather, EmbeddingBag)"))
    return t


# --- sparsified model -------------------------------------------------------------------------------------------

def sparsify(threads: int, quick: bool) -> list:
    """``apps.sparsify``: a dense model and its pruned, fine-tuned versions, one table per (model, format): the
    MLP in CSR and BSR 16 x 16, the transformer in BSR 16 x 16; a row per model with its training epoch, its
    inference batch and its accuracy and weight bytes. Ratios are to the 90%-sparse model."""
    from apps import sparsify as app
    sizes = {"mlp": dict(epochs=5, finetune_epochs=2, hidden=512, repeats=5) if quick else
             dict(epochs=60, finetune_epochs=10, hidden=2048, repeats=20),
             "transformer": dict(epochs=2, finetune_epochs=1, hidden=256, sequences=400, repeats=5) if quick else
             dict(epochs=app.TRANSFORMER["epochs"], finetune_epochs=app.TRANSFORMER["finetune_epochs"],
                  hidden=app.TRANSFORMER["hidden"], sequences=app.TRANSFORMER["sequences"], repeats=20)}
    names = dict(csr="CSR", bsr16="BSR 16 x 16")
    tables = []
    for model, fmt in (("mlp", "csr"), ("mlp", "bsr16"), ("transformer", "bsr16")):
        size = sizes[model]
        r = app.run("scorch", model=model, threads=threads, quiet=True, format=fmt, **size)
        rows = r["rows"]
        if model == "mlp":
            title = f"Sparsified MLP, {r['data']}, {names[fmt]}"
            what = (f"MLP {size['hidden']} wide, dense training {size['epochs']} epochs, then each sparsity pruned "
                    f"({app.FORMATS[fmt]}) and fine-tuned {size['finetune_epochs']} epochs; batch {r['batch']}; "
                    "accuracy on a random 20% test split")
            weights = "the two wide hidden layers, the classifier layer stays dense"
        else:
            t_ = app.TRANSFORMER
            title = f"Sparsified transformer encoder, {names[fmt]}"
            what = (f"{t_['layers']}-layer nn.TransformerEncoder, d_model {t_['d_model']}, feed-forward "
                    f"{size['hidden']}, on the {r['data']}; dense training {size['epochs']} "
                    f"epochs, then each sparsity pruned ({app.FORMATS[fmt]}) and fine-tuned "
                    f"{size['finetune_epochs']} epochs; batch {r['batch']} sequences; accuracy on 20% held out")
            weights = "every layer's feed-forward linear1 and linear2, attention and embeddings stay dense"
        t = Table("sparsify", title, f"`python -m apps.sparsify --model {model} --format {fmt}`: {what}", kind="app")
        for row in rows:
            pruned = "" if row["acc_pruned"] is None else f"pruned {row['acc_pruned']:.3f}, "
            t.rows.append(Row(row["model"], Timing(statistics.median(row["epoch_times"]), min(row["epoch_times"]),
                                                   len(row["epoch_times"])),
                              infer=Timing(statistics.median(row["infer_times"]), min(row["infer_times"]),
                                           len(row["infer_times"])),
                              metric=f"test accuracy {pruned}tuned {row['acc']:.3f}; weights "
                                     f"{row['bytes'] / 1e6:.2f} MB ({rows[0]['bytes'] / row['bytes']:.1f}x less)"))
        t.scorch, t.torch = rows[-1]["model"], "dense"
        t.notes.append(f"Ratios are each model's time over the {rows[-1]['model']} model's (the sparsest); the "
                       f"sparse weights are {weights}.")
        tables.append(t)
    return tables


# --- sparse transformer -----------------------------------------------------------------------------------------

ST_NAMES = {"scorch": "scorch", "dense": "torch dense (SDPA, mask)", "sparse": "torch.sparse"}


def transformer(threads: int, quick: bool, seq_lens) -> list:
    """One attention layer at sequence length 4096, window 64 (forward+backward as the training figure, forward
    as inference, and peak memory of each), the same against sequence length, and the training app at its
    defaults."""
    from apps import sparse_transformer as app
    n = 1024 if quick else 4096
    size = dict(window=64, d_model=128, heads=4, batch=1)
    res = {}

    def timed(b):
        r = app.time_attention(b, n, repeats=3 if quick else 5, threads=threads, **size)
        res[b] = r
        return {"epoch_s": r["fwd_bwd_s"], "infer_s": r["fwd_s"]}

    t = app_table("transformer", f"Sparse attention layer, sequence {n}, window 64",
                  "one attention layer (QKV and output projections, d_model 128, 4 heads, batch 1), Longformer/"
                  "BigBird pattern (window 64, 2 global tokens, 1 random block of 64 per block row); training "
                  "column: forward+backward, inference column: forward", {ST_NAMES[b]: (lambda b=b: timed(b))
                                                                          for b in app.BACKENDS},
                  "scorch", "torch dense (SDPA, mask)", lambda r: "")
    mem = {}
    for b in app.BACKENDS:
        for mode in ("fwd", "fwd_bwd"):
            try:
                mem[b, mode] = app.measure_memory(b, n, mode=mode, threads=threads, **size)["peak_delta"]
            except Exception as e:  # noqa: BLE001
                t.notes.append(f"memory of {b} {mode}: {type(e).__name__}: {e}")
    for r in t.rows:
        b = next(k for k, v in ST_NAMES.items() if v == r.name)
        if (b, "fwd") in mem and (b, "fwd_bwd") in mem:
            r.metric = f"peak memory {mem[b, 'fwd'] / 2**20:.1f} MiB fwd, {mem[b, 'fwd_bwd'] / 2**20:.1f} MiB fwd+bwd"
    t.targets.append(_target(t, "scorch >= 3x faster than dense attention (forward+backward)", 3.0,
                             ST_NAMES["dense"]))
    t.targets.append(_target(t, "scorch faster than torch.sparse (forward+backward)", 1.0, ST_NAMES["sparse"]))
    for mode, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
        if ("scorch", mode) in mem and ("dense", mode) in mem:
            t.targets.append(Target(f"scorch >= 5x less peak memory than dense attention ({label})", 5.0,
                                    mem["dense", mode] / max(mem["scorch", mode], 1), "x"))
    t.notes.append("Peak memory: each backend in a fresh process, peak RSS above the RSS just before the step "
                   "(`apps.sparse_transformer.measure_memory`).")

    series = Table("transformer", "Sparse attention, forward+backward time against sequence length", "the layer "
                   "above, window 64", kind="series", x_label="sequence length")
    series.series = {ST_NAMES[b]: [] for b in app.BACKENDS}
    for L in seq_lens:
        for b in app.BACKENDS:
            try:
                r = app.time_attention(b, L, repeats=3, threads=threads, **size)
                series.series[ST_NAMES[b]].append((L, r["fwd_bwd_s"]))
            except Exception as e:  # noqa: BLE001
                series.notes.append(f"{b} at {L}: {type(e).__name__}: {e}")
    train = generic("transformer", "apps.sparse_transformer", "Sparse transformer training (sequence 512)",
                    {ST_NAMES[b]: b for b in app.BACKENDS}, "scorch", ST_NAMES["dense"],
                    dict(epochs=2 if quick else 4), threads, lambda r: f"accuracy {r['accuracy']:.3f}")
    return [t, series, train]
