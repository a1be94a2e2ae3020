#!/usr/bin/env bash
# Run the test suite (what CI runs). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k formats`.
# Without arguments the suite runs twice: as it stands, then with every dense einsum result deferred
# (SCORCH_DEFER=all, scorch/deferred.py), which shows that deferral is invisible to every dense-reference test.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
python -m pytest -q
echo "scorch: the suite again with every dense einsum result deferred (SCORCH_DEFER=all)" >&2
SCORCH_DEFER=all exec python -m pytest -q -p no:cacheprovider
