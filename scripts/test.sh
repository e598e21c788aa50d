#!/usr/bin/env bash
# Install what the tests need (idempotent), then run the whole suite twice: on the cpu set
# (megatron-core 0.16.1) and on the npu set's megatron-core 0.12.1 (MindSpeed's release, an
# overlay without deps; the npu set's verl, transformers and numpy are the cpu set's, checked by
# tests/recipes/test_stack.py); then the mcore_compat tests (parity among them) on megatron-core 0.19.2,
# the newest release (an overlay too: scripts/bootstrap.sh says how). Tests that only hold on
# one release say so in a skip reason.
# Lint first (ruff, the dev extra's, pinned in scripts/stacks/cpu.in): a failure stops here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test-overlays
echo "== lint: ruff check, ruff format --check"
if ! { .venv/bin/ruff check . && .venv/bin/ruff format --check .; }; then
    echo "test.sh: lint failed: run .venv/bin/ruff check --fix . && .venv/bin/ruff format ." >&2
    exit 1
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
echo "== megatron-core 0.16.1 (cpu set): full suite"
.venv/bin/python -m pytest "$@"
echo "== megatron-core 0.12.1 (npu set): full suite but the benchmark scripts, verl trainer launches, vLLM alone (release-independent: the engine they run is tested on both) and the tests that never import megatron-core"
PYTHONPATH=.venv/overlays/megatron-core-0.12.1 .venv/bin/python -m pytest -m "not bench and not trainer_flow and not vllm and not no_mcore" "$@"
echo "== megatron-core 0.19.2 (newest release): the mcore_compat tests (the parity tests among them)"
PYTHONPATH=.venv/overlays/megatron-core-0.19.2 .venv/bin/python -m pytest -m mcore_compat "$@"
