"""GPU kernels against torch.sparse (cuSPARSE): SpMM and SDDMM on the benchmark matrices, on a CUDA device.

``python -m benchmarks.gpu [--write]`` times, per case, scorch's generated CUDA kernel (the library choice off,
so the kernel itself is measured), torch.sparse on the same CSR arrays (cuSPARSE), and scorch's dispatcher with
its measured choice; each the median of CUDA-event times over repeated calls after warm-up, interleaved. It
also reports the fraction of the memory-bandwidth floor the kernel reaches: the bytes that must move (the
sparse arrays once, the dense operand once, the output once) divided by the device's bandwidth (measured here
by a device-to-device copy), over the kernel's time. ``--write`` appends the table to ``benchmarks/RESULTS.md``
with the device's name. Without a GPU it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys

import torch

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")


def _time(fn, runs: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    from scorch.compiler.library import seconds
    return statistics.median(seconds(fn) for _ in range(runs)) * 1e3


def bandwidth_gbs() -> float:
    """Device memory bandwidth (GB/s) from a 1 GiB device-to-device copy (read + write)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    ms = _time(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 4 / (ms / 1e3) / 1e9


def cases(quick: bool):
    from benchmarks import data
    n = 50_000 if quick else 200_000
    yield data.uniform(n, 16 / n, seed=1)
    yield data.power_law(n, 16, 4000, seed=2)
    for name in ("cora", "citeseer"):
        m = data.planetoid(name)
        if m is not None:
            yield m


def run(quick: bool, runs: int):
    import scorch
    from scorch.compiler import library
    bw = bandwidth_gbs()
    rows = []
    for m in cases(quick):
        a = m.scorch.cuda()
        t = a.to_torch()
        nrows, ncols = a.shape
        nnz = a.nnz
        sparse_bytes = nnz * (4 + 4) + (nrows + 1) * 4
        for op, k in (("SpMM", 32), ("SpMM", 128), ("SDDMM", 64)):
            if op == "SpMM":
                x = torch.randn(ncols, k, device="cuda")
                eq, ops = "ij,jk->ik", (a, x)
                peer = lambda: torch.sparse.mm(t, x)  # noqa: E731
                floor = sparse_bytes + ncols * k * 4 + nrows * k * 4
            else:
                u, v = torch.randn(nrows, k, device="cuda"), torch.randn(ncols, k, device="cuda")
                eq, ops = "ij,ik,jk->ij", (a, u, v)
                # sampled_addmm samples on A's pattern; scorch also multiplies by A's values
                peer = lambda: torch.sparse.sampled_addmm(t, u, v.t(), beta=0.0)  # noqa: E731
                floor = sparse_bytes + nnz * 4 + (nrows + ncols) * k * 4
            ref = torch.einsum(eq, *[o.to_dense() if isinstance(o, scorch.SparseTensor) else o for o in ops]) \
                if nrows * ncols <= 1 << 26 else None
            library.ENABLED = False
            try:
                got = scorch.einsum(eq, *ops)
                kernel = lambda: scorch.einsum(eq, *ops)  # noqa: E731
                for _ in range(3):
                    kernel(), peer()
                tk, tp = [], []
                for r in range(runs):  # interleaved, so drift in clocks lands on both alike
                    tk.append(_time(kernel, 1))
                    tp.append(_time(peer, 1))
                tk, tp = statistics.median(tk), statistics.median(tp)
            finally:
                library.ENABLED = True
            scorch.einsum(eq, *ops)  # the dispatcher's choice, measured once
            td = _time(lambda: scorch.einsum(eq, *ops), runs)
            if ref is not None:
                g = got.to_dense() if isinstance(got, scorch.SparseTensor) else got
                torch.testing.assert_close(g, ref, rtol=1e-3, atol=1e-3)
            floor_ms = floor / (bw * 1e9) * 1e3
            rows.append((m.label.split(" (")[0], nrows, nnz, op, k, tk, tp, td, floor_ms / tk))
            print(f"{rows[-1][0]:>10} {op:6} K={k:<4} scorch {tk:8.3f} ms  cuSPARSE {tp:8.3f} ms  "
                  f"x{tp / tk:5.2f}  floor {100 * floor_ms / tk:5.1f}%", flush=True)
    return bw, rows


def table(bw, rows) -> str:
    dev = torch.cuda.get_device_name()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"## GPU: {dev}", "",
           f"`python -m benchmarks.gpu` on {when}; torch {torch.__version__}, CUDA {torch.version.cuda}; measured "
           f"device bandwidth {bw:.0f} GB/s (device-to-device copy). Times: median of CUDA-event times. 'kernel' is "
           "scorch's generated CUDA kernel alone; 'dispatch' is scorch with its measured library choice; speedup is "
           "cuSPARSE / kernel; floor is (bytes that must move / bandwidth) / kernel time.", "",
           "| matrix | rows | nnz | op | K | kernel ms | cuSPARSE ms | dispatch ms | speedup | floor |",
           "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, n, nnz, op, k, tk, tp, td, frac in rows:
        out.append(f"| {name} | {n:,} | {nnz:,} | {op} | {k} | {tk:.3f} | {tp:.3f} | {td:.3f} | {tp / tk:.2f}x |"
                   f" {100 * frac:.0f}% |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller matrices")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    bw, rows = run(args.quick, args.runs)
    text = table(bw, rows)
    print(text)
    if args.write:
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
