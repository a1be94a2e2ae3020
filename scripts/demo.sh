#!/usr/bin/env bash
# The main job: one matrix in many formats (printed), then the tour: a pruned BERT-sized encoder against its
# dense self (fp32, bf16), the MoE app and a GCN epoch, measured on this machine (a table and a plot saved in
# tour-results/). Arguments go to the tour (--quick, --out DIR, --threads N, --data DIR).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m scorch.demo
exec python -m apps.tour "$@"
