# Sourced by the other scripts: create or reuse the project's virtual environment (.venv) and install
# scorch with its extras. The CPU build of torch is installed first (TORCH_SPEC overrides it), so that the
# `torch>=2.4` requirement is already met and pip never pulls a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SCORCH_VENV:-$ROOT/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${SCORCH_EXTRAS:-dev}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "scorch: creating virtual environment in $VENV" >&2
    "$PY" -m venv "$VENV"
fi
# Reinstall only when the requirements changed: the stamp records what was installed.
stamp="$VENV/.scorch-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "scorch: installing $TORCH_SPEC and scorch[$EXTRAS] into $VENV" >&2
    log="$VENV/install.log"
    { "$VENV/bin/python" -m pip install "$TORCH_SPEC" &&
      "$VENV/bin/python" -m pip install -e "$ROOT[$EXTRAS]" &&
      # MovieLens-100k for apps/recsys: only the data files of the recbole wheel are read (its own
      # dependencies, ray among them, are not needed and not installed).
      "$VENV/bin/python" -m pip install --no-deps "recbole==1.2.1"; } > "$log" 2>&1 ||
        { tail -n 40 "$log" >&2; echo "scorch: installation failed; full log in $log" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
