#!/usr/bin/env bash
# Install what the tests need (idempotent), then run the suite on megatron-core 0.16.1
# and the compatibility tests again on 0.12.1 (MindSpeed's release).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
echo "== megatron-core 0.16.1: full suite"
.venv/bin/python -m pytest "$@"
echo "== megatron-core 0.12.1: compatibility tests"
PYTHONPATH=.venv/overlays/megatron-core-0.12.1 .venv/bin/python -m pytest -m mcore_compat "$@"
