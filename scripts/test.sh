#!/usr/bin/env bash
# Run the test suite (what CI runs). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k formats`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest -q "$@"
