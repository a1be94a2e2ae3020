"""How long ``import scorch`` takes against ``import torch`` (issue 44): whole processes, interleaved.

``python tools/import_time.py [-n RUNS] [--top K]`` starts ``python -c "import torch"`` and ``python -c "import
scorch"`` in turn, RUNS times each, and prints the medians and the median of the pairwise ratios (pairing keeps
the ratio meaningful on a machine whose speed drifts); then, from one ``python -X importtime -c "import scorch"``,
the K modules with the largest own times, and whether torch.compile's machinery (``torch._dynamo``, sympy) was
imported. Byte code is written and used as an installed package would (``PYTHONDONTWRITEBYTECODE`` is dropped:
without ``.pyc`` files the 90 modules of scorch are compiled from source on every import, about 0.25 s).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _wall(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=str(ROOT))
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--runs", type=int, default=9)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    _wall("import scorch")  # (writes the byte code; warms the file cache)
    torch_s, scorch_s = [], []
    for _ in range(args.runs):
        torch_s.append(_wall("import torch"))
        scorch_s.append(_wall("import scorch"))
    ratio = statistics.median(b / a for a, b in zip(torch_s, scorch_s))
    print(f"import torch {statistics.median(torch_s):.3f} s, import scorch {statistics.median(scorch_s):.3f} s"
          f" (medians of {args.runs}); scorch / torch {ratio:.2f} (median of the pairs)")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        "import sys, scorch; print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"],
                       capture_output=True, text=True, env=_env(), cwd=str(ROOT), check=True)
    rows = [m.groups() for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", r.stderr)]
    own = sorted(((int(s), name) for s, _, _, name in rows if name.startswith("scorch")), reverse=True)
    total = next(int(c) for _, c, _, name in reversed(rows) if name == "scorch")
    torch_total = next(int(c) for _, c, ind, name in rows if name == "torch" and len(ind) <= 3)
    print(f"-X importtime: scorch {total / 1e3:.0f} ms in all, torch's part {torch_total / 1e3:.0f} ms;"
          f" compile machinery imported: {r.stdout.strip()}")
    for us, name in own[:args.top]:
        print(f"  {us / 1e3:7.1f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
