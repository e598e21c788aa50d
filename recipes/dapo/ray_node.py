"""Start this node's Ray process for the job (scripts/ray_start_head.sh, ray_start_worker.sh).

The raylet's environment is what every worker on the node inherits, so the device
environment (A2: HCCL timeouts, task queue, socket interface; open-file limit) is set here
as well as in the job's runtime env.
"""

import argparse
import json
import os
import sys

from recipes.dapo import cluster


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ray_start_{head,worker}.sh", description=__doc__.splitlines()[0]
    )
    p.add_argument("role", choices=("head", "worker"))
    p.add_argument("--device", choices=("npu", "cuda"), required=True)
    p.add_argument("--devices", type=int, default=8, help="accelerators on this node")
    p.add_argument("--address", help="worker: HEAD_IP:PORT printed by ray_start_head.sh")
    p.add_argument("--port", type=int, default=6379, help="head: GCS port")
    p.add_argument("--ifname", help="network interface for HCCL/NCCL and gloo")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment only")
    return p


def ray_command(args) -> list[str]:
    cmd = [cluster.ray_executable(), "start"]
    if args.role == "head":
        cmd += ["--head", "--port", str(args.port), "--dashboard-host", "0.0.0.0"]
    else:
        if not args.address:
            raise cluster.LaunchError(
                "a worker needs --address HEAD_IP:PORT (printed by ray_start_head.sh)"
            )
        cmd += ["--address", args.address]
    if args.device == "npu":  # Ray's resource name for Ascend NPUs
        return cmd + ["--resources", json.dumps({"NPU": args.devices})]
    return cmd + ["--num-gpus", str(args.devices)]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        cmd = ray_command(args)
    except cluster.LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = cluster.job_env(args.device, args.ifname)
    print("environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print("command: " + " ".join(cmd))
    if args.dry_run:
        return 0
    if args.device == "npu":
        cluster.raise_open_files()
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    raise SystemExit(main())
