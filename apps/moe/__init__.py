"""Mixture of experts: a top-1 / top-2 gated MoE block in the einsum style, trained to imitate a random teacher MoE.

``python -m apps.moe --backend scorch|torch``. The model (``model.py``) is one piece of ordinary PyTorch run with
``torch`` or ``scorch`` as its torch module; the backends differ only in the gate tensors: under ``scorch`` they
are sparse CSR tensors (``torch.sparse_csr_tensor``) built from the top-k, so the einsums compute only the selected
experts of each token; under ``torch`` they are dense with zeros outside the top-k, so the einsums compute every
expert for every token (``--einsum fused``, the default) or multiply by one-hot dispatch / combine matrices
(``slots``). ``--einsum loop`` is the plain PyTorch per-expert loop (no gate tensor). ``model.py`` describes the
spellings; ``bench.py`` times them (``python -m apps.moe.bench``).

The task is synthetic (``data.py``): Gaussian tokens, targets from a random teacher MoE with the same gating;
``--data`` is accepted for uniformity with the other apps and not read.
"""
from __future__ import annotations

import math
import time

from .. import common

BACKENDS = ("scorch", "torch")
EPOCHS = 8
DEFAULTS = dict(tokens=2048, dim=128, hidden=None, experts=16, top_k=1, batches=16, test_batches=2, lr=0.03,
                einsum="fused", dtype="float32")


def run(backend: str = "scorch", epochs: int = EPOCHS, threads: int = 2, seed: int = 0, quiet: bool = True,
        data=None, **options) -> dict:
    """Train and evaluate; returns the metrics, timings and sizes. Options: ``tokens`` (per batch), ``dim``,
    ``hidden`` (each expert's output width; default ``dim``), ``experts``, ``top_k``, ``batches`` (training
    batches per epoch), ``test_batches``, ``lr`` (Adam), ``einsum`` (the spelling, ``model.SPELLINGS``),
    ``dtype``. ``data`` is accepted and unused (the task is generated)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    opt = {**DEFAULTS, **options}
    if opt["hidden"] is None:
        opt["hidden"] = opt["dim"]
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if not 1 <= opt["top_k"] <= opt["experts"]:
        raise ValueError(f"top_k must be between 1 and the number of experts ({opt['experts']}), got {opt['top_k']}")
    from .model import SPELLINGS
    if opt["einsum"] not in SPELLINGS:
        raise ValueError(f"einsum spelling {opt['einsum']!r}: choose from {', '.join(SPELLINGS)}")
    common.set_threads(threads)
    import torch as real_torch
    from . import data as data_mod, model as model_mod  # noqa: E401

    torch = common.backend_module(backend)
    dtype = getattr(real_torch, opt["dtype"])
    task = data_mod.make(opt["tokens"], opt["dim"], opt["hidden"], opt["experts"], opt["top_k"], opt["batches"],
                         opt["test_batches"], seed, dtype=dtype)

    torch.manual_seed(seed)
    model = model_mod.build(torch, opt["dim"], opt["hidden"], opt["experts"], opt["top_k"],
                            sparse_gate=(backend == "scorch"), einsum=opt["einsum"]).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=opt["lr"])
    F = torch.nn.functional

    epoch_watch, step_watch, infer_watch = common.Stopwatch(), common.Stopwatch(), common.Stopwatch()
    order_gen = real_torch.Generator().manual_seed(seed + 1)
    losses, epoch_losses, test_curve = [], [], []
    bar = common.progress(range(epochs), desc=f"moe[{backend}]", quiet=quiet)
    start = time.perf_counter()
    for epoch in bar:
        model.train()
        with epoch_watch:
            for b in real_torch.randperm(len(task.train_x), generator=order_gen).tolist():
                with step_watch:
                    optimizer.zero_grad()
                    loss = F.mse_loss(model(task.train_x[b]), task.train_y[b])
                    loss.backward()
                    optimizer.step()
                losses.append(loss.item())
        epoch_losses.append(sum(losses[-len(task.train_x):]) / len(task.train_x))
        model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in zip(task.test_x, task.test_y):
                with infer_watch:
                    pred = model(x)
                total += F.mse_loss(pred, y).item()
        test_curve.append(total / len(task.test_x))
        if not quiet:
            bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}", test_loss=f"{test_curve[-1]:.4f}")
    total_s = time.perf_counter() - start

    steps = len(task.train_x)
    return {
        "backend": backend,
        "gate": "sparse (csr)" if backend == "scorch" else "dense",
        "einsum": opt["einsum"],
        "tokens": opt["tokens"],
        "dim": opt["dim"],
        "hidden": opt["hidden"],
        "experts": opt["experts"],
        "top_k": opt["top_k"],
        "batches": steps,
        "epochs": epochs,
        "threads": threads,
        "dtype": opt["dtype"],
        "target_var": task.target_var,     # the loss of predicting 0 on the held-out batches
        "first_loss": losses[0],
        "train_loss": epoch_losses[-1],
        "loss": test_curve[-1],            # held-out mean squared error
        "r2": 1.0 - test_curve[-1] / task.target_var if task.target_var > 0 else math.nan,
        "epoch_s": epoch_watch.median(skip=1),
        "first_epoch_s": epoch_watch.times[0],
        "step_s": step_watch.median(skip=steps),
        "infer_s": infer_watch.median(skip=len(task.test_x)),
        "total_s": total_s,
        "losses": losses,
        "test_loss_curve": test_curve,
    }


def model_spellings() -> tuple:
    from .model import SPELLINGS
    return SPELLINGS


def main(argv=None) -> dict:
    p = common.parser("moe", "Mixture of experts (top-1 / top-2 gating, experts as one (experts, dim, hidden) "
                       "tensor, einsum style) trained to imitate a random teacher MoE. scorch: the gate tensors are "
                       "sparse CSR and only the selected experts are computed; torch: dense gates, so the einsums "
                       "work on every (token, expert) pair. The task is generated: --data is not read.",
                       backends=BACKENDS, epochs=EPOCHS)
    p.add_argument("--tokens", type=int, default=DEFAULTS["tokens"],
                   help=f"tokens per batch (default {DEFAULTS['tokens']})")
    p.add_argument("--dim", type=int, default=DEFAULTS["dim"], help=f"input width (default {DEFAULTS['dim']})")
    p.add_argument("--hidden", type=int, default=None, help="each expert's output width (default: --dim)")
    p.add_argument("--experts", type=int, default=DEFAULTS["experts"],
                   help=f"number of experts (default {DEFAULTS['experts']})")
    p.add_argument("--top-k", type=int, default=DEFAULTS["top_k"], choices=(1, 2),
                   help=f"experts per token (default {DEFAULTS['top_k']})")
    p.add_argument("--batches", type=int, default=DEFAULTS["batches"],
                   help=f"training batches per epoch (default {DEFAULTS['batches']})")
    p.add_argument("--test-batches", type=int, default=DEFAULTS["test_batches"],
                   help=f"held-out batches (default {DEFAULTS['test_batches']})")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help=f"Adam learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--einsum", choices=model_spellings(), default=DEFAULTS["einsum"],
                   help="spelling of the MoE product (model.py): fused 'bn,bd,ndh->bh' (default); slots, GShard-style "
                        "dispatch 'sb,bd->sd', experts 'ncd,ndh->nch', combine 'bs,sh->bh'; dispatch 'bn,bd->bnd' "
                        "then 'bnd,ndh->bh'; combine 'bd,ndh->bnh' then 'bn,bnh->bh'; loop, the plain PyTorch "
                        "per-expert loop (index_select, torch.mm, index_add_; no gate tensor)")
    p.add_argument("--dtype", choices=("float32", "float64"), default=DEFAULTS["dtype"])
    p.add_argument("--distributed", action="store_true", help="under torchrun: experts placed on the processes, "
                   "tokens sent to them with all_to_all (apps/moe/distributed.py)")
    args = p.parse_args(argv)
    if args.distributed:
        from . import distributed
        return distributed.main(args, DEFAULTS)
    return common.run_and_report("moe", run, args, DEFAULTS)
