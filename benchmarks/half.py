"""bfloat16 and float16 SpMM against float32 on the same pattern (issue 19: "bf16 SpMM at least 1.3x faster than
float32 SpMM at K=128, half the bytes"), interleaved in one process, medians.

    python -m benchmarks.half [--threads 2] [--repeat 20] [--quick]

The matrices are the suite's (``data.uniform``, ``data.power_law``); each dtype gets its own copy of the values
and of the dense operand (``.to(dtype)``), the index arrays are shared. Prints one line per case: the three
medians in ms and the ratio float32 / 16-bit (above 1: the 16-bit kernel is faster).
"""
from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small matrices (a smoke run)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from . import data
    from .timing import measure
    torch.set_num_threads(args.threads)
    matrices = ([data.uniform(2000, 1e-2)] if args.quick else
                [data.uniform(20000, 1e-3), data.power_law(100000, 20, 2000)])
    for m in matrices:
        n = m.torch.shape[1]
        for k in (32, 128):
            x = data.dense((n, k), seed=1)
            peers = {}
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                s, xd = m.scorch.to(dtype), x.to(dtype)
                peers[str(dtype).replace("torch.", "")] = (lambda s=s, xd=xd: s @ xd)
            t = measure(peers, args.repeat)
            f32 = t["float32"].median
            print(f"{m.label}, K={k}: " + ", ".join(f"{name} {v.median * 1e3:.2f} ms" for name, v in t.items())
                  + f"; float32 / bfloat16 {f32 / t['bfloat16'].median:.2f}x,"
                  f" float32 / float16 {f32 / t['float16'].median:.2f}x")


if __name__ == "__main__":
    main()
