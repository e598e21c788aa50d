"""Start or stop this node's Ray process for the job (scripts/ray_start_head.sh, ray_start_worker.sh).

The raylet's environment is what every worker on the node inherits, so the device
environment (A2: HCCL timeouts, task queue, socket interface; open-file limit; the CPU
platform) is set here as well as in the job's runtime env.

`ray start --block` runs in the background in a session of its own: its pid and the
cluster's address are kept in <temp-dir>/mcore_ray_<role>.json, and `--stop` ends that
session's processes only, then removes what they leaked in /dev/shm (multiprocessing's
segments and semaphores made since the node started that no process maps). (Ray's own `ray stop` ends every Ray process of the machine: right
on a cluster node, wrong on a machine that other Ray runs share.) Several nodes on one machine,
as `--device cpu` rehearses the cluster path on one box, each need their own --temp-dir
(Ray's sockets, logs and address file live there); their other ports are chosen free.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend.shared.cli_contract import OneLineParser, parse_or_exit_code, run_cli
from recipes.dapo.cluster import ray_job
from recipes.dapo.cluster.reaper import remove_unowned
from recipes.dapo.errors import LaunchError

START_TIMEOUT_S = 240
# Ray gives a new node a fixed 30 s to register with the GCS (ray/_private/node.py), which a
# loaded machine can miss; then this script starts it again, START_TRIES times in all
REGISTER_TIMEOUT, START_TRIES = "The current node timed out during startup", 3
# the raylet dies when its agents (Python processes) have not registered within Ray's
# default wait (~15 s seen), which a loaded machine misses; a longer one only delays the
# failure of a broken Ray
RAY_START = {"RAY_agent_register_timeout_ms": "120000"}
STOP_GRACE_S = 45  # Ray drains a node for up to 30 s on SIGTERM
# --device cpu: what the CPU platform declares per node (recipes/local/cpu/platform.py): one "GPU"
# per rank, never used, and CPUs for TransferQueue's storage units, agent-loop and reward
# workers, which each ask for one; the small object store leaves room for the other runs
CPU_NODE = ["--num-cpus", "16", "--object-store-memory", str(512 << 20)]


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ray_start_{head,worker}.sh", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("head", "worker"))
    p.add_argument("--device", choices=("npu", "cuda", "cpu"), help="required unless --stop")
    p.add_argument("--devices", type=int, help="accelerators on this node (default 8; cpu: 1)")
    p.add_argument("--address", help="worker: HEAD_IP:PORT printed by ray_start_head.sh")
    p.add_argument("--port", type=int, default=6379, help="head: GCS port")
    p.add_argument(
        "--temp-dir", help="this node's Ray temp dir (default Ray's, /tmp/ray); one per node"
    )
    p.add_argument("--ifname", help="network interface for HCCL/NCCL and gloo")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment only")
    p.add_argument("--stop", action="store_true", help="stop the node this script started here")
    return p


def temp_dir(args) -> Path:
    if args.temp_dir:
        return Path(args.temp_dir).expanduser().absolute()
    from ray._common.utils import get_default_ray_temp_dir

    return Path(get_default_ray_temp_dir())


def state_file(args) -> Path:
    return temp_dir(args) / f"mcore_ray_{args.role}.json"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_command(args) -> list[str]:
    if args.device is None:
        raise LaunchError("pass --device npu, cuda or cpu (or --stop)")
    cmd = [ray_job.ray_executable(), "start", "--block", "--disable-usage-stats"]
    one_box = args.device == "cpu"
    if args.role == "head":
        cmd += ["--head", "--port", str(args.port)]
        if one_box:
            cmd += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port())]
            cmd += ["--ray-client-server-port", str(free_port())]
        else:
            cmd += ["--dashboard-host", "0.0.0.0"]
    else:
        if not args.address:
            raise LaunchError(
                "a worker needs --address HEAD_IP:PORT (printed by ray_start_head.sh)"
            )
        cmd += ["--address", args.address]
    if args.temp_dir:
        cmd += ["--temp-dir", str(temp_dir(args))]
    if one_box:  # random worker ports, a free agent port: no clash with the other raylets here
        cmd += ["--min-worker-port", "0", "--max-worker-port", "0"]
        cmd += ["--dashboard-agent-listen-port", str(free_port()), *CPU_NODE]
    if args.device == "npu":  # Ray's resource name for Ascend NPUs
        return cmd + ["--resources", json.dumps({"NPU": declared(args)})]
    return cmd + ["--num-gpus", str(declared(args))]


def declared(args) -> int:
    """The devices this node offers Ray (the CPU platform's: one per rank, never used)."""
    return args.devices or (1 if args.device == "cpu" else 8)


def node_env(args) -> dict[str, str]:
    """The job's environment, Ray's node-death detection pinned (ray_job.RAY_HEALTH), and
    the agents' start-up wait (RAY_START)."""
    return {**ray_job.job_env(args.device, args.ifname), **ray_job.RAY_HEALTH, **RAY_START}


def read_state(path: Path) -> dict | None:
    """The node this script started with that temp dir, if its process is still there."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if ours(state) == "running" else None


def ours(state: dict) -> str:
    """What state's pid is now: "running" (the `ray start` this script started), "gone" (no
    process: what is left of its session is ours) or "other" (another process has the pid)."""
    import psutil

    try:
        created = psutil.Process(state["pid"]).create_time()
    except psutil.NoSuchProcess:
        return "gone"
    return "running" if created == state.get("created") else "other"


def start(args) -> int:
    cmd, env, root = ray_command(args), node_env(args), temp_dir(args)
    print("environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print("command: " + " ".join(cmd))
    if args.dry_run:
        return 0
    running = read_state(state_file(args))
    if running:
        raise LaunchError(
            f"a Ray {args.role} started here with temp dir {root} is running (pid "
            f"{running['pid']}): stop it with --stop, or give this node another --temp-dir"
        )
    if args.device == "npu":
        ray_job.raise_open_files()
    if args.role == "head":
        ray_job.ensure_auth_token(env)
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, START_TRIES + 1):
        state = launch_node(args, cmd, env, root)
        if state["address"] or attempt == START_TRIES:
            break
        print(f"Ray's node did not register in its 30 s (attempt {attempt}): starting it again")
    if not state["address"]:
        raise LaunchError(state["problem"])
    print(next_steps(args, state, root))
    return 0


def launch_node(args, cmd: list[str], env: dict[str, str], root: Path) -> dict:
    """`ray start --block` in a session of its own, until the node is up (state["address"])
    or has failed (state["problem"]; its session stopped)."""
    address_file = root / "ray_current_cluster"  # written by `ray start` once the node is up
    address_file.unlink(missing_ok=True)
    log = root / f"ray_start_{args.role}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    state = {"pid": proc.pid, "created": _created(proc.pid), "role": args.role,
             "device": args.device, "address": None, "log": str(log)}  # fmt: skip
    state_file(args).write_text(json.dumps(state))  # from now on --stop finds it
    deadline = time.monotonic() + START_TIMEOUT_S
    while not address_file.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if address_file.is_file():
        state["address"] = address_file.read_text().strip()
        state_file(args).write_text(json.dumps(state))
        return state
    stop_session(proc.pid)
    text = log.read_text()
    tail = " ".join([line for line in text.splitlines() if line.strip()][-1:])[-300:]
    state["problem"] = (
        f"`ray start` exited with status {proc.returncode} ({tail}): see {log}"
        if proc.returncode is not None
        else f"Ray did not come up in {START_TIMEOUT_S} s: see {log}"
    )
    if REGISTER_TIMEOUT not in text:  # only Ray's own 30 s limit is worth another try
        raise LaunchError(state["problem"])
    return state


def _created(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # `ray start` failed at once
        return None


def next_steps(args, state: dict, root: Path) -> str:
    devices, kind = declared(args), ray_job.RAY_KIND[args.device]
    script = f"bash scripts/ray_start_{args.role}.sh"
    lines = [
        f"Ray {args.role} up: cluster {state['address']}, {devices} {kind} declared, temp dir "
        f"{root}, pid {state['pid']} (log {state['log']})",
        f"check: {_auth_prefix()}{ray_job.ray_executable()} status --address {state['address']}",
    ]
    if args.role == "head":
        box = " --temp-dir <another dir>" if args.device == "cpu" else ""
        lines.append(
            f"next, on every other node: bash scripts/ray_start_worker.sh --device {args.device} "
            f"--address {state['address']}{box}"
        )
        lines.append(
            f"then: bash scripts/train_mcore.sh --device {args.device} --ray-address "
            f"{state['address']} --nodes N --devices-per-node M ..."
        )
    lines.append(f"stop: {script} --stop" + (f" --temp-dir {root}" if args.temp_dir else ""))
    return "\n".join(lines)


def _auth_prefix() -> str:
    """What a shell needs to talk to this node's Ray (ray_job.ray_auth_mode)."""
    mode = ray_job.ray_auth_mode()
    return "" if os.environ.get("RAY_AUTH_MODE") == mode else f"RAY_AUTH_MODE={mode} "


def stop(args) -> int:
    path = state_file(args)
    state = read_state(path)
    if state is None:
        path.unlink(missing_ok=True)
        print(
            f"no Ray {args.role} started by this script is running with temp dir {temp_dir(args)}"
        )
        return 0
    stop_session(state["pid"])
    path.unlink(missing_ok=True)
    # what the node's processes leaked in /dev/shm (a killed vLLM engine's message queues):
    # made since the node started, mapped by no process now (recipes.dapo.cluster.reaper)
    count, size = remove_unowned(state.get("created") or time.time())
    of = state["address"] or "a cluster it had not joined yet"
    leaked = (
        f"; removed {count} leaked shared-memory files ({size / 2**20:.0f} MiB)" if count else ""
    )
    print(f"stopped the Ray {args.role} of {of} (pid {state['pid']} and its processes){leaked}")
    return 0


def session_processes(pid: int) -> list:
    """`ray start`'s process, the processes of its session (it leads one) and its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        found = {root, *root.children(recursive=True)}
    except psutil.NoSuchProcess:
        found = set()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == pid:
                found.add(proc)
        except (OSError, psutil.Error):
            continue
    return list(found)


def stop_session(pid: int, sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to `ray start --block` (it drains the node and stops what it started), then
    SIGKILL to whatever of its session is left after the grace."""
    import psutil

    procs = session_processes(pid)
    for proc in procs if sig == signal.SIGKILL else [p for p in procs if p.pid == pid]:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive + session_processes(pid):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit_code(build_parser(), list(sys.argv[1:] if argv is None else argv))
    if isinstance(args, int):
        return args
    return run_cli(
        lambda: stop(args) if args.stop else start(args),
        debug=False,
        user_errors=(LaunchError,),
        interrupted="the node may be half started: run the script again with --stop",
    )


if __name__ == "__main__":
    raise SystemExit(main())
