#!/usr/bin/env bash
# Main job. On a machine with Ascend NPUs or NVIDIA GPUs: DAPO on verl with the megatron-core
# actor, launched on the running Ray cluster (scripts/ray_start_head.sh / ray_start_worker.sh).
# Without an accelerator: the embedded local run on CPU. All logic is in recipes/launcher/
# (arguments.py parses, run_spec.py validates once, resolution.py resolves, launch.py runs):
#   bash scripts/train_mcore.sh --help
#   bash scripts/train_mcore.sh --device npu --tp 4 --ep 8 --model DIR --train-file F --val-file F \
#       --ckpt-dir DIR [--ifname eth0] [--dry-run] [-- verl.override=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
# a cluster install (bootstrap.sh --target npu|npu-cann851|npu-cann91|cuda) recorded its Python
# in .stack; else the cpu set in .venv
if [[ -f .stack ]]; then
    read -r _ PY < .stack
else
    bash scripts/bootstrap.sh
    PY=.venv/bin/python
fi
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::UserWarning}
# the launcher runs in this process (exec): its wall time counts from here, and the
# summary names the bootstrap's share of it
export MCORE_DAPO_BOOTSTRAP_S=$SECONDS
exec "$PY" -m recipes.launcher "$@"
