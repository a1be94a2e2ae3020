#!/usr/bin/env bash
# Run an app from a fresh machine: `bash scripts/app.sh gnn --backend pyg --model gat` (apps: gnn, moe, recsys, sparsify,
# sparse_transformer). Creates or reuses .venv like the other scripts; the remaining arguments go to the app.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
app="${1:?usage: bash scripts/app.sh <gnn|moe|recsys|sparse_transformer|sparsify> [options]}"
shift
exec python -m "apps.$app" "$@"
