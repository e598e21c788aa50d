#!/usr/bin/env bash
# Join this node to the Ray cluster of scripts/ray_start_head.sh, with the device environment.
#   bash scripts/ray_start_worker.sh --device npu|cuda --address HEAD_IP:6379 [--devices 8] [--ifname eth0]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m recipes.dapo.cluster.ray_node worker "$@"
