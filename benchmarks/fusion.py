"""Fusion across ops (deferred einsum results, ``scorch.compile``): the issue's targets, measured.

``python -m benchmarks.fusion [--quick] [--write] [--repeats N] [--threads N]``:

1. **MoE**, the issue's program (B=4096, D_in=D_out=512, 16 experts): ``rearrange`` -> ``einsum("bnd,ndh->bnh")``
   -> ``einsum("bnd,bn->bd")``, with the one-hot ``gates`` dense (cast to float: torch's einsum refuses the
   integer one-hot next to float experts) and with ``.to_sparse()`` added (the integer one-hot, as written); the
   sparse version also with deferral off (``scorch.deferral("off")``: op by op, every expert on every token, then
   the sparse combine), and the plain PyTorch peer that routes by hand: a per-expert loop
   ``y[idx_e] = x[idx_e] @ E[e]`` (the token indices of each expert found from the expert ids in the loop).
   Medians of interleaved repeats; peak memory of each version in a fresh subprocess (peak RSS during one run
   minus the RSS before it, after a warm-up). Then a training step of each (the experts an ``nn.Parameter``:
   forward, ``F.mse_loss``, ``backward()``, ``SGD.step()``), interleaved likewise.
2. **Sparse attention** (sequence 4096, window 64, 2 global tokens, 1 random block of 64; head dim 32): one head of
   the sparse transformer app's attention (``apps.sparse_transformer.model.sparse_attention``: SDDMM -> softmax
   -> SpMM) op by op and under ``scorch.compile`` (one fused kernel), forward under ``no_grad`` and forward +
   backward to q, k and v (a fused backward kernel), and the sparse transformer's attention layer (4 heads,
   d_model 128, QKV and output projections included) both ways, forward and forward + backward.
3. **Dense-only code**: dense einsums (matrix products below the automatic threshold and at it, a batched product
   at it followed by an elementwise op) with deferral ``auto`` (the default) against ``off``: what deferral costs
   code that never meets a sparse operand.

``--write`` replaces the "Fusion" section of ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, the repeats interleaved after one warm-up each, the order reversed every
    other round (A B C C B A A B C ...) so that no function always runs after the same one."""
    times = {k: [] for k in fns}
    for k, f in fns.items():
        f()
    for r in range(repeats):
        for k, f in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# --- 1. MoE -----------------------------------------------------------------------------------------------------

def moe_program(B, D, N, seed=0):
    """``(x, E, gates_int, run)``: the issue's inputs and program (``run(gates)``)."""
    import scorch
    import scorch as torch
    from scorch.nn import functional as F
    torch.manual_seed(seed)
    x = torch.randn(B, D)
    E = torch.randn(N, D, D)
    gates = F.one_hot(torch.rand(B, N).argmax(1), N)

    def run(g, E=E):
        x_dispatch = torch.rearrange(x, "bd->bnd", n=N)
        y_experts = torch.einsum("bnd,ndh->bnh", x_dispatch, E)
        y = torch.einsum("bnd,bn->bd", y_experts, g)
        if type(y) is scorch.deferred.Deferred:  # (never, at this size: the combine is below the threshold)
            y.compute()
        return y  # a dense tensor with either gates (docs/format-inference.md, rule 4)

    return x, E, gates, run


def per_expert_loop(x, E, experts):
    """The plain PyTorch way to route top-1: the tokens of each expert gathered, multiplied, written back."""
    import torch as T
    y = T.zeros(x.shape[0], E.shape[2], dtype=x.dtype)
    for e in range(E.shape[0]):
        idx = (experts == e).nonzero().squeeze(1)
        y[idx] = x[idx] @ E[e]
    return y


def moe_variants(B, D, N):
    import scorch
    x, E, gates, run = moe_program(B, D, N)
    dense, sparse, experts = gates.float(), gates.to_sparse(), gates.argmax(1)

    def unfused():
        with scorch.deferral("off"):
            return run(sparse)

    return {"dense gates": lambda: run(dense), "sparse gates": lambda: run(sparse), "sparse, deferral off": unfused,
            "per-expert loop (torch)": lambda: per_expert_loop(x, E, experts)}


def moe_training_variants(B, D, N):
    """One training step of each version: the experts a Parameter, ``F.mse_loss`` to a target, ``backward()``,
    an SGD step (a small rate: the repeats do not drift far)."""
    import torch as T
    x, E0, gates, run = moe_program(B, D, N)
    target = T.randn(B, D, generator=T.Generator().manual_seed(1))
    experts = gates.argmax(1)

    def step_of(forward):
        E = T.nn.Parameter(E0.clone())
        opt = T.optim.SGD([E], lr=1e-4)

        def step():
            opt.zero_grad()
            loss = T.nn.functional.mse_loss(forward(E), target)
            loss.backward()
            opt.step()
            return loss
        return step

    return {"dense gates": step_of(lambda E: run(gates.float(), E)),
            "sparse gates": step_of(lambda E: run(gates.to_sparse(), E)),
            "per-expert loop (torch)": step_of(lambda E: per_expert_loop(x, E, experts))}


def moe_check(B, D, N):
    """The versions agree (forward, and the experts' gradient of a training step), with no warning."""
    import warnings
    import torch as T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = {k: f() for k, f in moe_variants(B, D, N).items()}
        for k, y in outs.items():
            assert type(y) is T.Tensor, (k, type(y))
            T.testing.assert_close(y, outs["dense gates"], rtol=1e-4, atol=1e-3)
        losses = {k: float(f().detach()) for k, f in moe_training_variants(B, D, N).items()}
    assert max(losses.values()) - min(losses.values()) < 1e-3 * max(losses.values()), losses


def _peak_child(B, D, N, variant):
    """In a fresh process: warm up, then run once while a thread samples the resident set every 0.2 ms; print
    the peak minus the resident set before the run, in bytes (``MALLOC_MMAP_THRESHOLD_`` is set low by the parent,
    so that large blocks go back to the system when freed and the resident set follows the live tensors)."""
    import gc
    import threading
    fn = moe_variants(B, D, N)[variant]
    fn()
    gc.collect()
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    print("RESULT " + json.dumps({"peak_delta": max(peak[0], rss()) - before}))


def moe_peak_bytes(B, D, N, variant, threads):
    code = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parents[1])!r});"
            f"import torch; torch.set_num_threads({threads});"
            f"from benchmarks.fusion import _peak_child; _peak_child({B}, {D}, {N}, {variant!r})")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"peak memory of {variant!r} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][7:])["peak_delta"]


def moe(quick, repeats, threads):
    B, D, N = (1024, 256, 16) if quick else (4096, 512, 16)
    moe_check(B, D, N)
    times = _interleaved(moe_variants(B, D, N), repeats)
    peaks = {k: moe_peak_bytes(B, D, N, k, threads) for k in times}
    base = times["dense gates"]
    rows = [(k, times[k] * 1e3, base / times[k], peaks[k] / 2**20) for k in times]
    train = _interleaved(moe_training_variants(B, D, N), repeats)
    train_rows = [(k, train[k] * 1e3, train["dense gates"] / train[k]) for k in train]
    return {"B": B, "D": D, "N": N, "rows": rows, "train": train_rows}


# --- 2. attention -----------------------------------------------------------------------------------------------

def attention(quick, repeats, threads):
    import torch as T
    import scorch as torch
    from apps import sparse_transformer as app
    from apps.sparse_transformer import model, pattern as P
    n = 1024 if quick else 4096
    crow, col = P.build_pattern(n, 64, 2, 1, 64, 0)
    mask = torch.sparse_csr_tensor(crow, col, T.ones(col.numel()), (n, n))
    g = T.Generator().manual_seed(0)
    q, k, v = (T.randn(n, 32, generator=g) for _ in range(3))

    def head(q, k, v, mask):  # the app's attention of one head: sampled_addmm -> sparse softmax -> sparse mm
        return model.sparse_attention(torch, q, k, v, mask)

    fused = torch.compile(head)
    torch.testing.assert_close(fused(q, k, v, mask), head(q, k, v, mask))
    with T.no_grad():  # (a head takes about a millisecond: many interleaved repeats, for a steady median)
        ops = _interleaved({"op by op": lambda: head(q, k, v, mask), "fused": lambda: fused(q, k, v, mask)},
                           repeats * 40)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    grad = T.randn(n, 32, generator=g)

    def train(f):
        for t in leaves:
            t.grad = None
        f(*leaves, mask).backward(grad)

    both = _interleaved({"op by op": lambda: train(head), "fused": lambda: train(fused)}, repeats * 8)
    layer = {}
    for rnd in range(2):  # two rounds, alternating, so that load changes hit both
        for fuse in (False, True):
            r = app.time_attention("scorch", n, d_model=128, heads=4, batch=1, repeats=repeats, threads=threads,
                                   fuse=fuse)
            layer.setdefault(fuse, []).append(r)
    lay = {f: {m: statistics.median(r[m] for r in rs) for m in ("fwd_s", "fwd_bwd_s")} for f, rs in layer.items()}
    return {"n": n, "nnz": int(crow[-1]), "head": ops, "head_bwd": both, "layer": lay}


# --- 3. dense-only overhead -------------------------------------------------------------------------------------

def dense_overhead(quick, repeats):
    import torch as T
    import scorch
    g = T.Generator().manual_seed(0)
    a64, b64 = T.randn(64, 64, generator=g), T.randn(64, 64, generator=g)
    a1k, b1k = T.randn(1024, 1024, generator=g), T.randn(1024, 1024, generator=g)
    a2k, b2k = T.randn(2048, 2048, generator=g), T.randn(2048, 1024, generator=g)
    xb, wb = T.randn(64, 512, 512, generator=g), T.randn(64, 512, 256, generator=g)
    cases = {
        "ij,jk->ik, 64x64 (not deferred: below the threshold)": lambda: scorch.einsum("ij,jk->ik", a64, b64) + 1,
        "ij,jk->ik, 1024^3, then + 1 (not deferred: below the threshold)":
            lambda: scorch.einsum("ij,jk->ik", a1k, b1k) + 1,
        "ij,jk->ik, 2048x2048x1024 (2^32, the smallest deferred), then + 1":
            lambda: scorch.einsum("ij,jk->ik", a2k, b2k) + 1,
        "bij,bjk->bik, 64x512x512x256 (2^32), then relu": lambda: T.relu(scorch.einsum("bij,bjk->bik", xb, wb)),
    }
    out = []
    for name, fn in cases.items():
        def off(fn=fn):
            with scorch.deferral("off"):
                return fn()

        def auto(fn=fn):
            with scorch.deferral("auto"):
                return fn()

        reps = repeats * (40 if "64x64" in name else 2)
        t = _interleaved({"off": off, "auto": auto}, reps)
        out.append((name, t["off"] * 1e6, t["auto"] * 1e6, t["auto"] / t["off"]))
    return out


# --- report -----------------------------------------------------------------------------------------------------

def report(m, a, d, threads, quick) -> str:
    """The Fusion section; a part that was not run (None: ``--only``) is left out."""
    import torch
    lines = ["## Fusion (deferred einsum results, scorch.compile)", "",
             f"`python -m benchmarks.fusion{' --quick' if quick else ''}` ({platform.processor() or platform.machine()},"
             f" {os.cpu_count()} cores, {threads} threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})."]
    if m is not None:
        lines += _moe_report(m)
    if a is not None:
        lines += _attention_report(a)
    if d is not None:
        lines += ["", "### Dense-only code: deferral auto (default) against off", "",
                  "| einsum | off, us | auto, us | auto / off |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {n} | {o:.1f} | {au:.1f} | {r:.3f} |" for n, o, au, r in d]
    return "\n".join(lines) + "\n"


def _moe_report(m):
    lines = ["", f"### MoE, the issue's program: B={m['B']}, D_in=D_out={m['D']}, {m['N']} experts, top-1", "",
             "| gates | ms (median) | speedup vs dense gates | peak MiB above the inputs during one run |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {t:.1f} | {x:.1f}x | {p:.0f} |" for k, t, x, p in m["rows"]]
    lines += ["", "Training step (experts a Parameter; forward, `F.mse_loss`, `backward()`, `SGD.step()`):", "",
              "| gates | ms (median) | speedup vs dense gates |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {t:.1f} | {x:.1f}x |" for k, t, x in m["train"]]
    return lines


def _attention_report(a):
    h, hb, lay = a["head"], a["head_bwd"], a["layer"]
    return ["", f"### Sparse attention, sequence {a['n']}, window 64 ({a['nnz']:,} entries), head dim 32", "",
              "| what | op by op | fused (scorch.compile) | speedup |", "| --- | ---: | ---: | ---: |",
              f"| one head, forward (SDDMM -> softmax -> SpMM) | {h['op by op'] * 1e3:.2f} ms | {h['fused'] * 1e3:.2f} ms"
              f" | {h['op by op'] / h['fused']:.2f}x |",
              f"| one head, forward + backward (to q, k, v) | {hb['op by op'] * 1e3:.2f} ms |"
              f" {hb['fused'] * 1e3:.2f} ms | {hb['op by op'] / hb['fused']:.2f}x |",
              f"| attention layer (4 heads, projections included), forward | {lay[False]['fwd_s'] * 1e3:.1f} ms |"
              f" {lay[True]['fwd_s'] * 1e3:.1f} ms | {lay[False]['fwd_s'] / lay[True]['fwd_s']:.2f}x |",
              f"| attention layer, forward + backward | {lay[False]['fwd_bwd_s'] * 1e3:.1f} ms |"
              f" {lay[True]['fwd_bwd_s'] * 1e3:.1f} ms | {lay[False]['fwd_bwd_s'] / lay[True]['fwd_bwd_s']:.2f}x |"]


def write(section: str):
    text = RESULTS.read_text()
    start = text.find("## Fusion (deferred einsum results, scorch.compile)")
    if start >= 0:
        end = text.find("\n## ", start + 3)
        text = text[:start] + section + (text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fusion", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes")
    p.add_argument("--write", action="store_true", help="replace the Fusion section of benchmarks/RESULTS.md")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("moe", "attention", "dense"), help="run one part (no --write)")
    a = p.parse_args(argv)
    if a.only and a.write:
        p.error("--write replaces the whole section: run every part")
    import torch
    torch.set_num_threads(a.threads)
    from tqdm import tqdm
    parts = {}
    steps = [("moe", lambda: moe(a.quick, a.repeats, a.threads)),
             ("attention", lambda: attention(a.quick, a.repeats, a.threads)),
             ("dense", lambda: dense_overhead(a.quick, a.repeats))]
    steps = [(name, fn) for name, fn in steps if a.only in (None, name)]
    for name, fn in tqdm(steps, desc="fusion benchmarks", disable=None):
        parts[name] = fn()
    text = report(parts.get("moe"), parts.get("attention"), parts.get("dense"), a.threads, a.quick)
    print(text)
    if a.write:
        write(text)
    return parts


if __name__ == "__main__":
    main()
