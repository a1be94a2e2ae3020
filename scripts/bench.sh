#!/usr/bin/env bash
# The benchmark suite: `bash scripts/bench.sh` runs the quick suite (small sizes, a few minutes) and prints the
# results table; `bash scripts/bench.sh --full` runs the full suite, which rewrites benchmarks/RESULTS.md and
# benchmarks/plots/. Other arguments go to `python -m benchmarks` (e.g. --only gnn,spmm --threads 2).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "${1:-}" = "--full" ]; then
    shift
    exec python -m benchmarks --print-table "$@"
fi
exec python -m benchmarks --quick --print-table "$@"
