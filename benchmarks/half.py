"""bfloat16 and float16 SpMM against float32 on the same pattern (issue 19: "bf16 SpMM at least 1.3x faster than
float32 SpMM at K=128, half the bytes"), interleaved in one process, medians.

Part of the full run as the group ``half`` (``python -m benchmarks --only half``); on its own it prints one line
per case:

    python -m benchmarks.half [--threads 2] [--repeat 20] [--quick]

The matrices are the suite's (``data.uniform``, ``data.power_law``); each dtype gets its own copy of the values
and of the dense operand (``.to(dtype)``), the index arrays are shared. Each result is checked against the
float32 product of the same (rounded) operands.
"""
from __future__ import annotations

import argparse
import os

#: a 16-bit result is rounded once from float32 sums: its error is about half a unit in the last of its 8 (bf16)
#: or 11 (fp16) bits of the largest value, well inside this
TOLERANCE_16 = 1e-2
DTYPES = ("float32", "bfloat16", "float16")


def _name(dtype: str) -> str:
    return f"scorch  S @ X, {dtype}"


def table(inputs, which: str, k: int):
    """One case of the group: SpMM on the suite's ``which`` matrix in the three dtypes, and torch's CSR product
    in bfloat16 (a row saying why where torch refuses it)."""
    import torch

    from . import data
    from .cases import _ratio_target, relative_error
    from .timing import Row, Table, measure
    cfg = inputs.cfg
    a = inputs.matrix(which)
    x = data.dense((a.torch.shape[1], k), seed=90 + k)
    t = Table("half", f"16-bit SpMM, {which}, K={k}", f"{a.describe()}; X: {x.shape[0]:,} x {k}; Y = A @ X with "
              "the values of A and X in float32, bfloat16 and float16 (float32 sums, one rounding of each result)")
    t.scorch = _name("bfloat16")
    calls, status = {}, {}
    for dtype in DTYPES:
        d = getattr(torch, dtype)
        s, xd = a.scorch.to(d), x.to(d)
        ref = (s.to(torch.float32) @ xd.float()) if dtype != "float32" else a.torch @ x
        calls[_name(dtype)] = lambda s=s, xd=xd: s @ xd
        err = relative_error(calls[_name(dtype)]().float(), ref)
        if err > (TOLERANCE_16 if dtype != "float32" else 1e-4):
            raise AssertionError(f"scorch {dtype} SpMM is wrong on {t.title}: relative error {err:.1e}")
        t.notes.append(f"scorch {dtype} checked against float32 on the same operands: max |diff| / max |ref| "
                       f"{err:.1e}.")
    ab, xb = a.torch.to(torch.bfloat16), x.to(torch.bfloat16)
    try:
        ab @ xb
        calls["torch CSR  A @ X, bfloat16"] = lambda: ab @ xb
    except Exception as e:  # noqa: BLE001  (torch's CPU CSR product takes no bfloat16 in some versions)
        status["torch CSR  A @ X, bfloat16"] = "torch refuses it: " + " ".join(str(e).split())[:120]
    timings = measure(calls, cfg.repeat, warmup=1, budget_s=cfg.budget_s, min_s=cfg.min_s, max_rounds=cfg.max_rounds)
    for name in list(calls) + list(status):
        t.rows.append(Row(name, timings.get(name), status.get(name, "")))
    if k >= 128:
        t.targets.append(_ratio_target(t, "bfloat16 SpMM >= 1.3x faster than float32 SpMM", 1.3, _name("float32"),
                                       _name("bfloat16")))
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small matrices (a smoke run)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import dataclasses

    import torch

    from . import cases
    torch.set_num_threads(args.threads)
    inputs = cases.Inputs(dataclasses.replace(cases.QUICK if args.quick else cases.FULL, repeat=args.repeat))
    for which in ("uniform", "power-law"):
        for k in (32, 128):
            t = table(inputs, which, k)
            f32 = t.row(_name("float32")).timing.median
            print(f"{t.title}: " + ", ".join(f"{r.name.rsplit(', ', 1)[1]} {r.timing.median * 1e3:.2f} ms"
                                             for r in t.rows if r.timing) +
                  "; float32 / bfloat16 "
                  f"{f32 / t.row(_name('bfloat16')).timing.median:.2f}x, float32 / float16 "
                  f"{f32 / t.row(_name('float16')).timing.median:.2f}x")


if __name__ == "__main__":
    main()
