#!/usr/bin/env bash
# The main job. For now: a short demo that builds sparse tensors in several formats and prints them.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m scorch.demo "$@"
