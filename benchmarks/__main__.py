"""``python -m benchmarks``: parse the options and set the thread count before torch is imported."""
import argparse
import os
import sys

from . import ALIASES, GROUPS


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (under a minute)")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and the kernels (default 2)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds per case (default 20; quick: 5)")
    p.add_argument("--only", default="", help=f"comma-separated groups out of {','.join(GROUPS)}, or "
                   f"{' / '.join(ALIASES)} for all of those")
    p.add_argument("--print-table", action="store_true", help="print RESULTS.md's summary table at the end")
    p.add_argument("--out", default=None, help="folder for RESULTS.md and speedups.png (default: benchmarks/ for a "
                   "full run of every group, else a folder under the temporary directory)")
    args = p.parse_args(argv)
    only = []
    for g in (g.strip() for g in args.only.split(",") if g.strip()):
        only += [x for x in ALIASES.get(g, (g,)) if x not in only]
    unknown = [g for g in only if g not in GROUPS]
    if unknown:
        p.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if args.threads < 1 or (args.repeat is not None and args.repeat < 1):
        p.error("--threads and --repeat must be at least 1")
    args.only = tuple(only) or GROUPS
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch (and its OpenMP runtime) loads
    from .peers import configure_environment
    configure_environment(args.threads)  # MKL's threads and threading layer, before MKL loads
    from .suite import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
