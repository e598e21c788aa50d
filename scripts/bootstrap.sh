#!/usr/bin/env bash
# Create .venv and install the pinned stack; safe to run any number of times.
# A stamp records the hash of the files that define the stack, so a second run
# with nothing changed returns in a second, and an edit to pyproject.toml reinstalls.
#
# Also installs megatron-core 0.12.1 (the release MindSpeed pins) without deps
# into .venv/overlays/megatron-core-0.12.1; put it first on PYTHONPATH to run
# against that API (scripts/test.sh does for the compat tests).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
OVERLAY=$VENV/overlays/megatron-core-0.12.1
STAMP=$VENV/.bootstrap-stamp
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)

if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    exit 0
fi

"$PYTHON" - <<'PY' || { echo "bootstrap: Python >= 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

echo "bootstrap: installing the pinned stack into $VENV (first run takes a few minutes)"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q)
# torch first and pinned: anything unpinned would pull a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[dev]"
"${PIP[@]}" --no-deps --upgrade --target "$OVERLAY" megatron-core==0.12.1
echo "$want" > "$STAMP"
echo "bootstrap: done ($("$VENV/bin/python" -W ignore -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")'))"
