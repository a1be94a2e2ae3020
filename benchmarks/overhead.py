"""Compile and call overhead.

- First compile: a new process with an empty ``SCORCH_CACHE_DIR`` times its first ``S @ X`` (planning, code
  generation, the compiler run, loading the library); the compiler's share is what the kernels that
  ``runtime.load`` returned report as ``compile_seconds``.
- Disk cache: another new process on the same cache directory times its first ``S @ X`` (the kernel is found
  on disk and loaded; nothing is compiled). Interpreter and ``import scorch`` time are outside both figures.
- Per-call overhead: in this process, ``S @ X`` on a tiny matrix against the bare kernel (``plan.kernel.fn``
  called with prepared pointer arguments), each averaged over batches of calls.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile

import torch

import scorch

from .timing import Row, Table, Target, Timing, per_call

K_PROBE = 24  # a dense width no other case uses, so the probe's kernel is new to this process

_CHILD = r"""
import json, sys, time
import torch, scorch
from scorch.compiler import runtime
loads = []  # (origin, compiler seconds) of every kernel the call loads
_load = runtime.load
def load(*args, **kwargs):
    kernel = _load(*args, **kwargs)
    if kernel is not None:  # (None: a look on disk only, ``build=False``)
        loads.append((kernel.origin, kernel.compile_seconds))
    return kernel
runtime.load = load
torch.set_num_threads(int(sys.argv[1]))
g = torch.Generator().manual_seed(0)
d = torch.randn(64, 64, generator=g) * (torch.rand(64, 64, generator=g) < 0.1)
S = scorch.from_torch(d.to_sparse_csr())  # a zero-copy view: no scorch kernel runs before the timed call
X = torch.randn(64, int(sys.argv[2]), generator=g)
loads.clear()
t0 = time.perf_counter()
Y = S @ X
first = time.perf_counter() - t0
first_loads = list(loads)
t0 = time.perf_counter()
S @ X
second = time.perf_counter() - t0
origins = sorted({o for o, _ in first_loads})
print(json.dumps({"first": first, "second": second, "compiler": sum(s for _, s in first_loads),
                  "ok": bool(torch.allclose(Y, d @ X, atol=1e-5)), "origin": ",".join(origins) or "none"}))
"""


def _child(cache_dir: str, threads: int) -> dict:
    env = dict(os.environ, SCORCH_CACHE_DIR=cache_dir)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(threads), str(K_PROBE)], env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"overhead probe failed (exit {run.returncode}): {run.stderr.strip()[-800:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compile_and_load(threads: int, runs: int) -> Table:
    t = Table("overhead", "Compile and disk-cache overhead",
              f"a new process's first S @ X (64 x 64 CSR, X: 64 x {K_PROBE}); median of {runs} process(es) each",
              kind="measurements")
    with tempfile.TemporaryDirectory(prefix="scorch-bench-cache-") as root:
        fresh = [_child(os.path.join(root, f"fresh{r}"), threads) for r in range(runs)]
        disk = [_child(os.path.join(root, "fresh0"), threads) for _ in range(runs)]
    for name, group, origin in (("fresh", fresh, "compiled"), ("disk", disk, "disk")):
        bad = [g for g in group if g["origin"] != origin or not g["ok"]]
        if bad:
            t.notes.append(f"Unexpected {name} probe result: {bad[0]} (expected origin {origin!r}, correct result).")
    first = _timing([g["first"] for g in fresh])
    compiler = [g["compiler"] for g in fresh if g["origin"] == "compiled"]
    t.rows.append(Row("first call, new kernel (empty cache)", first))
    if compiler:
        t.rows.append(Row("  of which the C++ compiler", _timing(compiler)))
    t.rows.append(Row("first call, new process, kernel on disk", _timing([g["first"] for g in disk])))
    t.rows.append(Row("second call (memory cache)", _timing([g["second"] for g in disk])))
    t.targets.append(Target("first compile of a new kernel <= 0.5 s (whole first call)", 0.5, first.median, "s",
                            higher=False))
    t.notes.append("With an empty cache the C helper of kept products (`scorch/engine/direct.py`, ~0.4 s of g++ once "
                   "a cache) builds on a thread in the background: the first call compiles its own kernel only, and "
                   "products take the Python path until the helper is there (the process waits for the build at "
                   "exit). A process that finds it on disk loads it at its first product (the disk row).")
    return t


def call_overhead(threads: int, quick: bool) -> Table:
    """``S @ X`` on a tiny matrix against its bare kernel, at ``threads`` threads and at one thread: the
    difference at one thread is scorch's Python-side cost alone; at more threads the bare kernel, called in a
    tight loop, also finds the OpenMP workers still spinning, which a call after Python work may not."""
    from scorch import engine  # the execution layer: argument binding
    from scorch.compiler import pipeline  # the plan cache

    t = Table("overhead", "Per-call overhead (tiny S @ X, cached kernel)",
              f"16 x 16 CSR (about 40 nonzeros) @ 16 x {K_PROBE}; per call, median of interleaved batches",
              kind="measurements")
    g = torch.Generator().manual_seed(1)
    d = torch.randn(16, 16, generator=g) * (torch.rand(16, 16, generator=g) < 0.15)
    s = scorch.asformat(d, "csr")
    a = d.to_sparse_csr()
    x = torch.randn(16, K_PROBE, generator=g)
    before = {k for k, _ in pipeline.compiled_plans()}
    y = s @ x
    assert torch.allclose(y, d @ x, atol=1e-5)
    batch_s, rounds = (0.01, 5) if quick else (0.05, 15)
    try:
        bare_call = _bare_call(engine, [p for k, p in pipeline.compiled_plans() if k not in before], s, x)
        problem = ""
    except Exception as e:  # noqa: BLE001  (the compiler's internals moved: report, do not crash)
        bare_call, problem = None, f"could not call the bare kernel: {type(e).__name__}: {e}"
    overhead = {}
    for n in dict.fromkeys((threads, 1)):
        torch.set_num_threads(n)
        try:
            fns = {"scorch": lambda: s @ x, "torch": lambda: a @ x}
            if bare_call:
                fns["bare"] = bare_call()
            got = per_call(fns, batch_s, rounds)
        finally:
            torch.set_num_threads(threads)
        tag = f", {n} thread{'s' if n > 1 else ''}"
        t.rows.append(Row(f"scorch  S @ X{tag}", got["scorch"]))
        t.rows.append(Row(f"bare kernel  plan.kernel.fn(*pointers){tag}", got.get("bare"), problem))
        t.rows.append(Row(f"torch CSR  A @ X (for scale){tag}", got["torch"]))
        if "bare" in got:
            overhead[n] = (got["scorch"].median - got["bare"].median) * 1e6
    # The target is taken at one thread: there the difference is scorch's own work per call. With more threads
    # both sides also wait for OpenMP workers to wake, which depends on what else runs on the machine.
    t.targets.append(Target("cached-call overhead over the bare kernel <= 20 us (one thread: scorch's dispatch "
                            "cost alone)", 20.0, overhead.get(1), "us", higher=False, why_missing=problem))
    if threads in overhead and threads != 1:
        t.notes.append(f"At {threads} threads the difference is {overhead[threads]:.1f} us. A call at more than one "
                       "thread also wakes the OpenMP workers; the bare kernel called in a tight loop finds them "
                       "still spinning, a call after Python work may not, and on a loaded machine the wake-up "
                       "waits for a free core (compare the median and min columns).")
    if 1 in overhead:
        t.notes.append("Where a cached call spends its time at one thread (cProfile, own time of the top functions "
                       "as a share of the profiled call; the profiler inflates the total): " + _profile(s, x, threads) + ".")
    return t


def _profile(s, x, threads: int, calls: int = 300) -> str:
    """The top functions by own time over ``calls`` one-thread calls of ``s @ x``, as shares of the total."""
    torch.set_num_threads(1)
    try:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            s @ x
        prof.disable()
    finally:
        torch.set_num_threads(threads)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:6]
    return "; ".join(f"{name} ({os.path.basename(file)}:{line}) {100 * v[2] / total:.0f}%"
                     for (file, line, name), v in top)


def _bare_call(engine, plans, s, x):
    """A factory of zero-argument callables running the plan's kernel on prepared pointers (the thread count is
    read when the factory is called)."""
    if len(plans) != 1:
        raise RuntimeError(f"expected one new plan, found {len(plans)}")
    plan = plans[0]
    ops = engine.prepare([s, x])
    info, _ = engine.level_info(ops[0])
    sizes = {v: n for acc in plan.asg.rhs.accesses() for v, n in zip(acc.indices, ops[acc.operand].shape)}
    out = torch.zeros(16, K_PROBE)
    fn = plan.kernel.fn

    def make():
        args = [engine.argument(arg, ops, info, sizes, {}, out) for arg in plan.lowered.args]
        ptrs = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args]
        return lambda: fn(*ptrs)
    make()  # fail here, not inside the timing, if the internals moved
    return make


def _timing(seconds: list) -> Timing:
    return Timing(statistics.median(seconds), min(seconds), len(seconds))
