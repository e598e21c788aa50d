#!/usr/bin/env bash
# Main job. With no accelerator it runs the embedded default: the tiny Qwen3-MoE on CPU
# through the megatron-core actor (HF -> mcore, parity check, fwd/bwd steps, export to HF).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
exec .venv/bin/python -m recipes.local.smoke "$@"
