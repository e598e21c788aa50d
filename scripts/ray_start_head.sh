#!/usr/bin/env bash
# Start the Ray head on the node that will launch the job, with the device environment.
#   bash scripts/ray_start_head.sh --device npu|cuda [--devices 8] [--port 6379] [--ifname eth0]
# Then on every other node: bash scripts/ray_start_worker.sh --device ... --address HEAD_IP:6379
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m recipes.dapo.cluster.ray_node head "$@"
