"""The call path of one SpMM, ``scorch.einsum("ij,jk->ik", S, X)`` (issue 18), counted with ``sys.setprofile``.

S is a 64 x 64 CSR ``scorch.SparseTensor`` of density about 0.1 (float32, a zero-copy view of a torch CSR tensor,
so no scorch kernel runs before the counted call), X a dense 64 x 16 matrix.

- Cold: the first call in a new process after ``import scorch``. By default the kernel is already in the disk
  cache (a first child process puts it there, a second one is measured); ``--no-disk-cache`` points
  ``SCORCH_CACHE_DIR`` at a new temporary directory, so the measured call also generates and compiles it.
- Warm: a later call of the same process (after the cold one and a few more), counted the same way, and timed:
  the median of ``--repeat`` single calls (``time.perf_counter``), in microseconds per call.

Counted, each for the cold and the warm call: Python function calls (profile ``call`` events: function entries,
generator resumptions and the bodies of modules imported on the way), C calls (``c_call`` events) apart, the
calls into scorch's own files, the distinct scorch files touched, and file changes: how often a call into a
scorch file lands in another scorch file than the previous call into a scorch file.

``python tools/callpath.py [--top N] [--json] [--no-disk-cache] [--tree DIR]``; ``--tree`` measures the scorch
package under DIR (e.g. an export of an older commit) instead of the installed one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, os, statistics, sys, time
from collections import Counter
import torch
import scorch

threads, repeat, tree = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
pkg = os.path.dirname(os.path.abspath(scorch.__file__))
if tree and not pkg.startswith(os.path.abspath(tree)):
    raise SystemExit(f"scorch was imported from {pkg}, not from {tree}")
root = os.path.dirname(pkg)
g = torch.Generator().manual_seed(0)
d = torch.randn(64, 64, generator=g) * (torch.rand(64, 64, generator=g) < 0.1)
S = scorch.from_torch(d.to_sparse_csr())
X = torch.randn(64, 16, generator=g)


def count(fn):
    calls = c_calls = 0
    files = Counter()
    changes = 0
    last = None
    ours = {}  # filename -> relative path or None (the verdict per file, once)

    def profile(frame, event, arg):
        nonlocal calls, c_calls, changes, last
        if event == "call":
            calls += 1
            name = frame.f_code.co_filename
            rel = ours.get(name, 0)
            if rel == 0:
                path = os.path.abspath(name)
                rel = ours[name] = os.path.relpath(path, root) if path.startswith(pkg + os.sep) else None
            if rel is not None:
                files[rel] += 1
                if last is not None and rel != last:
                    changes += 1
                last = rel
        elif event == "c_call":
            c_calls += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, {"calls": calls, "c_calls": c_calls, "scorch_calls": sum(files.values()), "files": len(files),
                 "file_changes": changes, "per_file": dict(files.most_common())}


call = lambda: scorch.einsum("ij,jk->ik", S, X)
Y, cold = count(call)
ok = bool(torch.allclose(Y, d @ X, atol=1e-5))
for _ in range(10):
    call()
_, warm = count(call)
times = []
for _ in range(repeat):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
warm["us_per_call"] = statistics.median(times) * 1e6
warm["us_min"] = min(times) * 1e6
print(json.dumps({"cold": cold, "warm": warm, "ok": ok, "scorch": pkg, "threads": threads, "repeat": repeat}))
"""


def _child(env: dict, threads: int, repeat: int, tree: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(threads), str(repeat), tree], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    if run.returncode != 0:
        raise SystemExit(f"callpath: the child process failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(disk_cache: bool = True, threads: int = 1, repeat: int = 2000, tree: str | None = None) -> dict:
    """The cold and warm counts (and the warm timing) of one SpMM, from new child processes."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="scorch-callpath-") as fresh:
        if disk_cache:
            _child(env, threads, 1, tree or "")  # puts the kernel into the disk cache
        else:
            env["SCORCH_CACHE_DIR"] = fresh
        result = _child(env, threads, repeat, tree or "")
    result["disk_cache"] = disk_cache
    return result


def report(result: dict, top: int) -> str:
    cache = "kernel in the disk cache" if result["disk_cache"] else "empty disk cache (the call compiles)"
    lines = [f"one SpMM, scorch.einsum('ij,jk->ik', S 64x64 CSR ~0.1 float32, X 64x16); {result['threads']} "
             f"thread(s); scorch from {result['scorch']}; result {'correct' if result['ok'] else 'WRONG'}",
             f"{'':6}{'calls':>8}{'c_calls':>9}{'scorch':>8}{'files':>7}{'file changes':>14}"]
    for name in ("cold", "warm"):
        r = result[name]
        lines.append(f"{name:6}{r['calls']:>8}{r['c_calls']:>9}{r['scorch_calls']:>8}{r['files']:>7}"
                     f"{r['file_changes']:>14}")
    w = result["warm"]
    lines.append(f"cold: the first call of a new process, {cache}")
    lines.append(f"warm: {w['us_per_call']:.1f} us per call (median of {result['repeat']}; min {w['us_min']:.1f})")
    for name in ("cold", "warm") if top else ():
        lines.append(f"{name}: the {top} files with the most calls")
        lines += [f"  {n:>6}  {f}" for f, n in list(result[name]["per_file"].items())[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=0, metavar="N", help="list the N files with the most calls")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--no-disk-cache", action="store_true", help="measure the cold call on an empty disk cache")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--repeat", type=int, default=2000, help="warm calls timed (default 2000)")
    ap.add_argument("--tree", help="measure the scorch package under this directory")
    args = ap.parse_args(argv)
    result = measure(not args.no_disk_cache, args.threads, args.repeat, args.tree)
    if args.json:
        if args.top:
            for name in ("cold", "warm"):
                result[name]["per_file"] = dict(list(result[name]["per_file"].items())[:args.top])
        print(json.dumps(result, indent=1))
    else:
        print(report(result, args.top))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
