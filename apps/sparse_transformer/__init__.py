"""Sparse transformer: attention on a Longformer/BigBird pattern (local window, global tokens, random blocks) as
SDDMM -> sparse softmax -> SpMM, in a small encoder trained on a synthetic long-sequence task; or (``--pattern
routing``) on a pattern computed from the data every forward: the Routing Transformer's same-cluster pairs.

Backends (one model file, ``model.py``, ordinary PyTorch against the ``torch`` module passed in):
  scorch  ``import scorch as torch``; the mask is a scorch CSR SparseTensor, so sampled_addmm, softmax and mm run
          as scorch's compiled kernels;
  sparse  the real torch with a ``torch.sparse_csr`` mask: torch's CSR sampled_addmm, COO softmax (torch has no
          CSR softmax on the CPU), COO @ dense;
  dense   the real torch: ``F.scaled_dot_product_attention`` with the pattern as a dense bool mask.

In-process entry points: ``run`` (train and evaluate), ``time_attention`` (one attention layer, forward and
forward+backward), ``measure_memory`` (the same in a fresh subprocess, peak RSS above the RSS before the step) and
``attention_setup`` (that layer with its input, output gradient and mask, as they build it).
``python -m apps.sparse_transformer --help`` lists the options.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from .. import common
from . import model as _model

BACKENDS = ("scorch", "dense", "sparse")

DEFAULTS = dict(seq_len=512, window=64, n_globals=2, random_blocks=1, block=64, d_model=64, heads=2, layers=2,
                batch=4, train_size=64, test_size=16, vocab=8, lr=3e-3, fuse=False, compile=False, pattern="bigbird",
                clusters=4)
PATTERNS = ("bigbird", "routing")


def _torch_for(backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return common.backend_module(backend)


def pattern_and_mask(backend, seq_len, window, n_globals, random_blocks, block, seed=0):
    """The CSR pattern ``(crow, col)`` and the backend's mask made from it."""
    from .pattern import build_pattern
    torch = _torch_for(backend)
    crow, col = build_pattern(seq_len, window, n_globals, random_blocks, block, seed)
    return crow, col, _model.make_mask(torch, crow, col, seq_len, sparse=backend != "dense")


def routing_config(backend, pattern, clusters, n_globals, compile=False):
    """The attention layers' ``routing`` argument (``model.py``, ``routing.py``) for ``pattern``: None for the fixed
    ``"bigbird"`` pattern; for ``"routing"``, ``clusters`` per head, the ``n_globals`` global tokens, a sparse mask
    unless the backend is dense."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")
    if pattern == "bigbird":
        return None
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
        raise ValueError(f"clusters must be a positive integer, got {clusters!r}")
    if compile:
        raise ValueError("pattern 'routing' builds its mask from the data in Python: not under compile=True")
    return dict(clusters=clusters, n_globals=n_globals, sparse=backend != "dense")


def routed_size(net, seq_len):
    """``(nnz, density)`` of the routed patterns of ``net``'s last forward: per ``n x n`` problem (one sequence, one
    head), averaged over the attention layers."""
    sizes = [m.last_nnz for m in net.modules() if getattr(m, "routing", None) is not None]
    nnz = sum(sizes) / max(len(sizes), 1)
    return int(round(nnz)), nnz / seq_len ** 2


def _config(options):
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {', '.join(sorted(unknown))}")
    return {**DEFAULTS, **options}


def run(backend="scorch", epochs=4, threads=2, seed=0, quiet=True, data=None, device="cpu", **options) -> dict:
    """Train the encoder on the synthetic task (``task.py``) for ``epochs`` and evaluate it.

    ``data`` is accepted for the common app interface and unused (the task is generated from ``seed``).
    ``options``: the keys of ``DEFAULTS``. Returns the backend, sizes, the pattern's nnz and density, test
    ``accuracy`` and ``loss``, ``epoch_s`` (median epoch time, leaving out the first, which compiles kernels),
    ``step_s`` (median training step, leaving out the first epoch's), ``infer_s`` (median forward of one batch).
    ``device``: where the model, mask and batches live ("cuda": the attention's sparse ops on the GPU).
    ``compile``: the encoder under ``torch.compile``.
    """
    return common.finish(training(backend, epochs, threads, seed, quiet, data, device, **options))


def training(backend="scorch", epochs=4, threads=2, seed=0, quiet=True, data=None, device="cpu", **options):
    """``run`` a step at a time: a generator that yields after each training step and each inference batch and
    returns ``run``'s dict, so that a benchmark can interleave the steps of several backends
    (``apps.common.interleave``). An epoch's time is the sum of its steps' (what a run alone measures, less the
    loop's few microseconds between steps)."""
    from .pattern import density
    from .task import CLASSES, IGNORE, make_task
    cfg = _config(options)
    if threads:
        common.set_threads(threads)
    torch = _torch_for(backend)
    import torch as real_torch  # data and bookkeeping: plain tensors under every backend

    n = cfg["seq_len"]
    routing = routing_config(backend, cfg["pattern"], cfg["clusters"], cfg["n_globals"], cfg["compile"])
    if routing is None:
        crow, col, mask = pattern_and_mask(backend, n, cfg["window"], cfg["n_globals"], cfg["random_blocks"],
                                           cfg["block"], seed)
    else:  # (the layers build their masks from the data)
        if device != "cpu":
            raise ValueError("pattern 'routing' runs on the CPU only")
        crow = mask = None
    x_train, y_train = make_task(cfg["train_size"], n, cfg["vocab"], seed + 1)
    x_test, y_test = make_task(cfg["test_size"], n, cfg["vocab"], seed + 2)
    net = _model.build_encoder(torch, cfg["vocab"], cfg["d_model"], cfg["heads"], cfg["layers"], CLASSES, seed,
                               fuse=cfg["fuse"], routing=routing)
    if device != "cpu":
        net, mask = net.to(device), common.to_device(mask, device)
        x_train, y_train, x_test, y_test = common.to_device((x_train, y_train, x_test, y_test), device)
    opt = torch.optim.Adam(net.parameters(), lr=cfg["lr"])
    forward = common.compiled(net, cfg["compile"])
    batched = {}

    def mask_for(count):
        """The mask of a batch of ``count`` sequences: a sparse mask as the batch's ``(B H n)^2`` block-diagonal
        one (``model.block_diagonal``, made once per batch size), so that every head of the batch attends in one
        call, compiled or not; a dense one as it is."""
        if mask is None or not _model.is_sparse_mask(torch, mask):
            return mask
        return _model.block_diagonal(torch, mask, count * cfg["heads"], batched)

    F = torch.nn.functional
    bs = cfg["batch"]
    order_gen = real_torch.Generator().manual_seed(seed + 3)

    step_watch, epoch_times = common.Stopwatch(), []
    losses = []
    steps_per_epoch = (cfg["train_size"] + bs - 1) // bs
    for epoch in range(epochs):
        net.train()
        perm = real_torch.randperm(cfg["train_size"], generator=order_gen).to(x_train.device)
        batches = [perm[i:i + bs] for i in range(0, cfg["train_size"], bs)]
        first = len(step_watch.times)
        for idx in common.progress(batches, f"{backend} epoch {epoch + 1}/{epochs}", quiet):
            with step_watch:
                logits = forward(x_train[idx], mask_for(len(idx)))
                loss = F.cross_entropy(logits.reshape(-1, CLASSES), y_train[idx].reshape(-1),
                                       ignore_index=IGNORE)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()))
            yield
        epoch_times.append(sum(step_watch.times[first:]))

    net.eval()
    infer_watch = common.Stopwatch()
    correct = total = 0
    test_loss = 0.0
    for i in range(0, cfg["test_size"], bs):
        with torch.no_grad():  # (left before the yield: grad mode is the thread's, not this generator's)
            with infer_watch:
                logits = forward(x_test[i:i + bs], mask_for(min(bs, cfg["test_size"] - i)))
            y = y_test[i:i + bs]
            keep = y != IGNORE
            test_loss += float(F.cross_entropy(logits[keep], y[keep], reduction="sum"))
            correct += int((logits.argmax(-1)[keep] == y[keep]).sum())
            total += int(keep.sum())
        yield
    nnz, dens = (int(crow[-1]), density(crow)) if routing is None else routed_size(net, n)
    return {
        "backend": backend, "seq_len": n, "window": cfg["window"], "globals": cfg["n_globals"],
        "random_blocks": cfg["random_blocks"], "block": cfg["block"], "pattern": cfg["pattern"],
        "clusters": cfg["clusters"], "nnz": nnz, "density": dens, "d_model": cfg["d_model"], "heads": cfg["heads"],
        "layers": cfg["layers"], "batch": bs, "params": sum(p.numel() for p in net.parameters()), "epochs": epochs,
        "threads": threads, "accuracy": correct / max(total, 1), "loss": test_loss / max(total, 1),
        "train_loss": losses[-1] if losses else float("nan"), "losses": losses,
        "epoch_s": statistics.median(epoch_times[1:] or epoch_times) if epoch_times else float("nan"),
        "epoch_times": epoch_times[1:] or epoch_times, "step_s": step_watch.median(skip=steps_per_epoch),
        "infer_s": infer_watch.median(skip=1), "device": str(device), "fuse": cfg["fuse"],
        "compiled": cfg["compile"],
    }


# --- one attention layer: time and memory --------------------------------------------------------------------

def attention_setup(backend, seq_len, window, n_globals, random_blocks, block, d_model, heads, batch, seed,
                    fuse=False, pattern="bigbird", clusters=4):
    """``(torch, crow, layer, x, grad, mask)``: one attention layer of ``backend`` (``torch`` the module it runs
    against, ``crow`` the pattern's row pointers, ``mask`` the backend's mask; both None for ``pattern="routing"``,
    whose layer builds its mask per forward), an input ``x`` that requires grad and an output gradient ``grad``,
    all seeded by ``seed``. What ``time_attention`` and ``measure_memory`` time; public for tests, which run the
    layer of each backend and compare."""
    torch = _torch_for(backend)
    routing = routing_config(backend, pattern, clusters, n_globals)
    crow = mask = None
    if routing is None:
        crow, col, mask = pattern_and_mask(backend, seq_len, window, n_globals, random_blocks, block, seed)
    layer = _model.build_attention(torch, d_model, heads, seed, fuse, routing)
    torch.manual_seed(seed + 1)
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)
    grad = torch.randn(batch, seq_len, d_model)
    return torch, crow, layer, x, grad, mask


def time_attention(backend, seq_len, window=64, n_globals=2, random_blocks=1, block=64, d_model=128, heads=4,
                   batch=1, repeats=5, threads=None, seed=0, fuse=False, pattern="bigbird", clusters=4) -> dict:
    """Median seconds of one attention layer (QKV and output projections included): ``fwd_s`` a forward under
    ``no_grad``, ``fwd_bwd_s`` a forward and backward (to the input and the weights); ``fwd_min_s`` and
    ``fwd_bwd_min_s`` the fastest repeats (steadier than medians on a machine shared with other jobs). One
    forward+backward first, untimed, compiles scorch's kernels."""
    from .pattern import density
    if threads:
        common.set_threads(threads)
    torch, crow, layer, x, grad, mask = attention_setup(backend, seq_len, window, n_globals, random_blocks,
                                                        block, d_model, heads, batch, seed, fuse, pattern, clusters)

    def fwd_bwd():
        layer.zero_grad()
        x.grad = None
        layer(x, mask).backward(grad)

    fwd_bwd()
    fwd, both = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            layer(x, mask)
        t1 = time.perf_counter()
        fwd_bwd()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        both.append(t2 - t1)
    return {"backend": backend, "seq_len": seq_len, "window": window, "globals": n_globals,
            "random_blocks": random_blocks, "block": block, "d_model": d_model, "heads": heads, "batch": batch,
            "pattern": pattern, "clusters": clusters,
            **(dict(zip(("nnz", "density"), routed_size(layer, seq_len))) if crow is None else
               {"nnz": int(crow[-1]), "density": density(crow)}),
            "fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(both), "fwd_min_s": min(fwd),
            "fwd_bwd_min_s": min(both), "fuse": fuse}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to /proc/self/clear_refs); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_child(backend, mode, seq_len, window, n_globals, random_blocks, block, d_model, heads, batch, seed,
                  threads) -> dict:
    """In a fresh process: one warm-up step on separate objects of the full size (kernels compiled or loaded, so
    no compilation happens in the measured step), then a new layer, input and mask, and one measured step: peak
    RSS (``getrusage``) minus the RSS just before it. The parent sets ``MALLOC_MMAP_THRESHOLD_``, so the
    warm-up's large blocks went back to the system and cannot be reused unseen by the measured step."""
    import gc
    common.set_threads(threads)
    torch, _, layer, x, grad, mask = attention_setup(backend, seq_len, window, n_globals, random_blocks, block,
                                                     d_model, heads, batch, seed)
    if mode == "fwd":
        with torch.no_grad():
            layer(x, mask)
    else:
        layer(x, mask).backward(grad)
    del layer, x, grad, mask
    gc.collect()
    torch, crow, layer, x, grad, mask = attention_setup(backend, seq_len, window, n_globals, random_blocks, block,
                                                        d_model, heads, batch, seed)
    gc.collect()
    reset = _reset_peak()
    before = _rss_bytes()
    peak_before = common.peak_rss_bytes()
    if mode == "fwd":
        with torch.no_grad():
            out = layer(x, mask)
    else:
        layer(x, mask).backward(grad)
        out = x.grad
    peak = common.peak_rss_bytes()
    return {"backend": backend, "mode": mode, "seq_len": seq_len, "nnz": int(crow[-1]), "rss_before": before,
            "peak": peak, "peak_before": peak_before, "peak_reset": reset,
            "peak_delta": max(0, peak - before), "finite": bool(out.isfinite().all())}


def measure_memory(backend, seq_len, mode="fwd_bwd", window=64, n_globals=2, random_blocks=1, block=64,
                   d_model=128, heads=4, batch=1, seed=0, threads=2) -> dict:
    """Peak memory of one attention layer's forward (``mode="fwd"``, under no_grad) or forward+backward
    (``"fwd_bwd"``), measured in a fresh subprocess (see ``_memory_child``). ``peak_delta`` is the number to
    compare: bytes of peak RSS above the RSS just before the step (the inputs, weights and mask already there).
    The child runs with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so large freed blocks go back to the system
    at once (the RSS before the step holds no memory the allocator kept for reuse)."""
    args = dict(backend=backend, mode=mode, seq_len=seq_len, window=window, n_globals=n_globals,
                random_blocks=random_blocks, block=block, d_model=d_model, heads=heads, batch=batch, seed=seed,
                threads=threads)
    code = ("import json, sys; from apps.sparse_transformer import _memory_child; "
            f"print('RESULT ' + json.dumps(_memory_child(**{args!r})))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(common.ROOT), env=env, capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"memory measurement failed ({backend}, {mode}, {seq_len}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# --- command line ----------------------------------------------------------------------------------------------

def main(argv=None):
    p = common.parser("sparse_transformer", __doc__.splitlines()[0], backends=BACKENDS, epochs=4)
    common.add_device(p)
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="sequence length (default %(default)s)")
    p.add_argument("--window", type=int, default=DEFAULTS["window"],
                   help="local window in tokens, half on each side (default %(default)s)")
    p.add_argument("--globals", type=int, default=DEFAULTS["n_globals"], dest="n_globals",
                   help="global tokens: the first ones attend to all and are attended by all (default %(default)s)")
    p.add_argument("--random-blocks", type=int, default=DEFAULTS["random_blocks"],
                   help="random key blocks per block-row (default %(default)s)")
    p.add_argument("--block", type=int, default=DEFAULTS["block"], help="block size of the random blocks "
                   "(default %(default)s)")
    p.add_argument("--d-model", type=int, default=DEFAULTS["d_model"], help="model width (default %(default)s)")
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="attention heads (default %(default)s)")
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="encoder layers (default %(default)s)")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per batch (default %(default)s)")
    p.add_argument("--train-size", type=int, default=DEFAULTS["train_size"],
                   help="training sequences (default %(default)s)")
    p.add_argument("--test-size", type=int, default=DEFAULTS["test_size"], help="test sequences (default %(default)s)")
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help="vocabulary size (default %(default)s)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="Adam learning rate (default %(default)s)")
    p.add_argument("--time-attention", action="store_true",
                   help="instead of training: time one attention layer (forward; forward+backward) at --seq-len "
                   "with --d-model, --heads, --batch")
    p.add_argument("--measure-memory", action="store_true",
                   help="instead of training: peak memory of one attention layer's forward and forward+backward, "
                   "each in a fresh subprocess")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats for --time-attention (default 5)")
    p.add_argument("--pattern", choices=PATTERNS, default=DEFAULTS["pattern"],
                   help="the attention pattern: bigbird (window, globals, random blocks: fixed) or routing (the pairs"
                   " whose query and key fall in the same cluster, computed from the data every forward, plus the"
                   " globals and the diagonal) (default %(default)s)")
    p.add_argument("--clusters", type=int, default=DEFAULTS["clusters"],
                   help="--pattern routing: clusters per head (default %(default)s)")
    p.add_argument("--fuse", action="store_true", help="scorch backend: run each head's SDDMM -> softmax -> SpMM as"
                   " one fused kernel (scorch.compile)")
    common.add_compile(p)
    a = p.parse_args(argv)
    common.set_threads(a.threads)
    common.data_root(a.data)  # checked for existence only: the task is synthetic, generated from --seed
    shape = dict(window=a.window, n_globals=a.n_globals, random_blocks=a.random_blocks, block=a.block,
                 d_model=a.d_model, heads=a.heads, batch=a.batch, seed=a.seed)
    if a.time_attention:
        r = time_attention(a.backend, a.seq_len, repeats=a.repeats, threads=a.threads, fuse=a.fuse,
                           pattern=a.pattern, clusters=a.clusters, **shape)
        common.report(f"sparse_transformer attention layer ({a.backend})", r)
        return r
    if a.measure_memory:
        if a.pattern != "bigbird":
            p.error("--measure-memory measures the fixed pattern (--pattern bigbird)")
        r = {"backend": a.backend, "seq_len": a.seq_len}
        for mode in ("fwd", "fwd_bwd"):
            m = measure_memory(a.backend, a.seq_len, mode=mode, threads=a.threads, **shape)
            r["nnz"] = m["nnz"]
            r[f"{mode}_peak_MiB"] = m["peak_delta"] / 2**20
        common.report(f"sparse_transformer attention layer memory ({a.backend})", r)
        return r
    r = run(a.backend, epochs=a.epochs, threads=a.threads, seed=a.seed, quiet=a.quiet, data=a.data,
            seq_len=a.seq_len, window=a.window, n_globals=a.n_globals, random_blocks=a.random_blocks, block=a.block,
            d_model=a.d_model, heads=a.heads, layers=a.layers, batch=a.batch, train_size=a.train_size,
            test_size=a.test_size, vocab=a.vocab, lr=a.lr, device=a.device, fuse=a.fuse, compile=a.compile,
            pattern=a.pattern, clusters=a.clusters)
    shown = {k: v for k, v in r.items() if k != "losses"}
    common.report(f"sparse_transformer ({a.backend})", shown)
    return r
