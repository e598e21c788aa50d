"""What the launcher does to the machine: job environment, Ray cluster check, starting processes."""

import os
import re
import resource
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from backend.instruments.memory_probe import MEMORY_PROBE_ENV
from recipes.dapo.errors import LaunchError

REPO = Path(__file__).resolve().parents[3]
# Ascend A2: generous HCCL timeouts (rollouts keep ranks away from collectives for minutes;
# a lost node is not left to them: recipes/dapo/cluster/lost_node.py), the task-queue optimisation,
# vLLM's V1 engine (vllm-ascend)
A2_ENV = {
    "HCCL_CONNECT_TIMEOUT": "1800",
    "HCCL_EXEC_TIMEOUT": "3600",
    "TASK_QUEUE_ENABLE": "1",
    "VLLM_USE_V1": "1",
}
OPEN_FILES = 65536
READER_GRACE_S = 30  # for the child's last lines once it has exited
TQ_DEFAULT_THREADS = 8  # transferqueue 0.1.11's TQ_NUM_THREADS default (client.py)
_DEVICES = re.compile(r"([\d.]+)/([\d.]+)\s+(GPU|NPU)\b")
# the Ray resource each device's ranks ask for; the CPU platform declares "GPU"
# (recipes/local/cpu/platform.py)
RAY_KIND = {"cuda": "GPU", "npu": "NPU", "cpu": "GPU"}
# how soon Ray's GCS calls a node dead (its raylet misses health checks): Ray's defaults, pinned
# on every node by ray_node.py. A node whose processes died misses them at once: dead after
# ~5 x 3 s; a host that vanished times each check out: under a minute (docs/cluster.md,
# "A lost node")
RAY_HEALTH = {
    "RAY_health_check_initial_delay_ms": "5000",
    "RAY_health_check_period_ms": "3000",
    "RAY_health_check_timeout_ms": "10000",
    "RAY_health_check_failure_threshold": "5",
}


PLATFORM_MODULES = "recipes.local.cpu.platform"  # verl imports it in every process
# the CPU platform's part of the job environment (job_env): the driver's
# and every Ray worker's, on the embedded run and on a cluster alike
CPU_ENV = {
    "VERL_PLATFORM": "cpu",
    "VERL_USE_EXTERNAL_MODULES": PLATFORM_MODULES,
    "OMP_NUM_THREADS": "1",  # 2 cores shared by trainer ranks, rollout server, reward
    # vLLM's CPU workers pin their threads to cores of their own NUMA node each by default:
    # a TP 2 engine on one node is refused, and pinning fights the trainer for the cores
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
    # glibc's default of 8 heaps a core per process: each rank's heap grew ~20 MB a step at
    # world 8 (varying batch shapes), 1.6 GB over 10 steps
    "MALLOC_ARENA_MAX": "2",
    # oneDNN keeps a JIT-compiled kernel per shape (1024 by default): vLLM's bf16 linears meet
    # a new batch size at almost every step, and each TP worker grew ~18 MB a step at world 8.
    # 8 kernels held: flat, and generation as fast (tests/recipes/test_cpu_env.py, the note)
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8",
}


def job_env(device: str, ifname: str | None) -> dict[str, str]:
    """Environment of every process of the job (also passed to Ray workers).

    PYTHONPATH keeps what is set (CANN's set_env.sh puts its Python packages there) and adds the
    repository. No VERL_USE_EXTERNAL_MODULES on accelerators: it would import the engine
    (megatron-core and, on Ascend, MindSpeed's global patches) in every reward, agent-loop and
    vLLM process; `actor_rollout_ref.model.external_lib` loads it in the workers that build the
    actor. On cpu it names the CPU platform and rollout, which every process must register.
    """
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in pythonpath:
        pythonpath.append(str(REPO))
    env = {
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "RAY_AUTH_MODE": ray_auth_mode(),
        "TQ_NUM_THREADS": transferqueue_threads(),
    }
    if warnings := os.environ.get("PYTHONWARNINGS"):
        # train_mcore.sh's filter (library UserWarnings: TE / Apex absent, engines verl lacks)
        # reaches the workers of raylets started elsewhere (ray_start_*.sh), not only the
        # embedded Ray its driver starts: 27 such lines reached the 2 x 4 cluster's console
        env["PYTHONWARNINGS"] = warnings
    if device == "npu":
        env.update(A2_ENV)
    if device == "cpu":
        env.update(CPU_ENV)
        if probe := os.environ.get(MEMORY_PROBE_ENV):  # the side by side's (ab_engines)
            env[MEMORY_PROBE_ENV] = probe
    if ifname:
        socket = "HCCL_SOCKET_IFNAME" if device == "npu" else "NCCL_SOCKET_IFNAME"
        env.update({socket: ifname, "GLOO_SOCKET_IFNAME": ifname})
    return env


def ray_auth_mode() -> str:
    """One Ray authentication mode for every node and client of the job: token unless set.

    Ray 2.60's `ray start --head` turns token authentication on by itself when it finds a
    token (~/.ray/auth_token, which any earlier local `ray.init()` writes), while `ray start
    --address`, `ray status` and `ray.init(address=...)` never do: without one explicit mode a
    worker cannot join such a head."""
    return os.environ.get("RAY_AUTH_MODE", "token")


def ensure_auth_token(env: dict[str, str]) -> None:
    """On the head: Ray's token (~/.ray/auth_token, or RAY_AUTH_TOKEN_PATH), made if missing
    (`ray get-auth-token --generate`); every other node and client needs a copy of it."""
    if env.get("RAY_AUTH_MODE") != "token":
        return
    cmd = [ray_executable(), "get-auth-token", "--generate"]  # prints the token: kept quiet
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, timeout=120)
    if done.returncode != 0:
        raise LaunchError(f"`ray get-auth-token --generate` failed: {done.stderr.decode()[-200:]}")


def transferqueue_threads() -> str:
    """TransferQueue's torch threads per put/get (TQ_NUM_THREADS): its default of 8, at most
    this machine's physical cores. Above them, transfer_queue.utils.common warns on every
    call (50k lines in 35 steps on 2 cores) and clamps; the nodes of a cluster are taken to be
    alike."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return str(min(TQ_DEFAULT_THREADS, cores))


def raise_open_files(limit: int = OPEN_FILES) -> None:
    """ulimit -n for this process and its children (HCCL opens many sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def ray_executable() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else "ray"


def ray_devices(status: str) -> dict[str, int]:
    """{"GPU": n, "NPU": m}: the cluster's totals in `ray status` output."""
    totals = {"GPU": 0.0, "NPU": 0.0}
    for _, total, kind in _DEVICES.findall(status):
        totals[kind] += float(total)
    return {kind: int(n) for kind, n in totals.items()}


def check_ray(device: str, expected: int, address: str | None = None, env=None) -> None:
    """The running Ray cluster (at `address`, or the one Ray finds from this node) offers at
    least `expected` devices of the kind the run's ranks ask for."""
    cmd = [ray_executable(), "status", *(["--address", address] if address else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                             env={**os.environ, **(env or {})})  # fmt: skip
    except FileNotFoundError:
        raise LaunchError(
            "`ray` is not installed here: run scripts/bootstrap.sh and launch from the repo"
        ) from None
    where = f" at {address}" if address else ""
    if out.returncode != 0 and "Authentication" in out.stderr:
        raise LaunchError(
            f"the Ray cluster{where} refused this client (token authentication): launch with "
            "RAY_AUTH_MODE=token and the head's token (~/.ray/auth_token or RAY_AUTH_TOKEN_PATH)"
        )
    if out.returncode != 0:
        raise LaunchError(
            f"no running Ray cluster{where}: start scripts/ray_start_head.sh on the head node "
            "and scripts/ray_start_worker.sh on the others"
            + ("" if address else " (or pass --ray-address HEAD_IP:PORT)")
        )
    kind, have = RAY_KIND[device], ray_devices(out.stdout)
    other = {k: n for k, n in have.items() if k != kind and n}
    if have[kind] < expected and other:
        ((wrong, n),) = other.items()
        raise LaunchError(
            f"Ray cluster{where} offers {have[kind]} {kind} and {n} {wrong}, the {device} plan "
            f"needs {expected} {kind} ({device} ranks ask Ray for {kind}): restart the {wrong} "
            f"node(s) with scripts/ray_start_worker.sh --device {device}"
        )
    if have[kind] < expected:
        raise LaunchError(
            f"Ray cluster{where} offers {have[kind]} {kind}, the plan needs {expected}: start "
            "scripts/ray_start_worker.sh on the missing nodes, or lower --nodes"
        )


def run_command(cmd: list[str], env: dict[str, str], console=None, watch=None) -> int:
    """The one place that starts the job's processes. SIGTERM and SIGINT to the launcher are
    passed on to the child (which stops its run and its Ray job), and the launcher waits for
    it; the exit status is the child's (128 + N when signal N ended it, as a shell reports),
    or 128 + N when the launcher itself got signal N (130 / 143: the user stopped the run,
    whatever status the child made of it; the console then shows no traceback).

    console (recipes.dapo.console.screen.Console): the child's stdout and stderr, merged, pass
    through its `feed` line by line; without one they go where this process's go. A
    checkpoint the engine refused (the Console's `refusal`) raises that CheckpointError here,
    in one line naming the log that holds the trainer's traceback.

    watch (recipes.dapo.cluster.lost_node.NodeWatch): follows the cluster's nodes meanwhile and stops
    the child once one of them died; the console's OomKills stops it once Ray killed workers for
    memory (recipes.dapo.cluster.ray_oom)."""
    piped = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    extra = {"PYTHONUNBUFFERED": "1"} if console else {}  # lines as they are printed
    child = subprocess.Popen(cmd, env={**os.environ, **env, **extra}, cwd=REPO,
                             **(piped if console else {}))  # fmt: skip
    if watch is not None:
        watch.follow(child)
    with _signals_to(child) as received:
        if console:
            reader = threading.Thread(target=_pass_lines, args=(child.stdout, console),
                                      daemon=True)  # fmt: skip
            reader.start()
        while (code := _wait(child)) is None:
            if console:
                console.tick()
                console.oom.police(child)  # a job that lost workers to Ray's OOM monitor
    if watch is not None:
        watch.close(failed=code != 0)
    code = 128 - code if code < 0 else code
    if received:  # the user stopped the run: its status says so, whatever the child made of it
        code = 128 + received[0]
    if console:
        # a process the child left behind may hold the pipe open: do not wait for it forever
        reader.join(timeout=READER_GRACE_S)
        console.child_done(code, interrupted=bool(received))
        if console.refusal:
            from backend.shared.errors import CheckpointError

            raise CheckpointError(
                f"{console.refusal} (the trainer's traceback: {console.log_path})"
            )
    return code


def interrupted_line(code: int, ckpt_dir: str | Path) -> str | None:
    """The one line of a run the user stopped (status 130 / 143), naming what resumes."""
    if code not in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        return None
    from recipes.dapo.cluster.lost_node import last_complete_checkpoint

    name = "SIGINT" if code == 128 + signal.SIGINT else "SIGTERM"
    last = last_complete_checkpoint(ckpt_dir)
    where = (f"the last complete checkpoint is {last}: relaunch with --resume to continue from "
             "it" if last else "no checkpoint was complete: a relaunch starts afresh")  # fmt: skip
    return f"stopped ({name}): {where}"


def _wait(child: subprocess.Popen, poll_s: float = 5.0) -> int | None:
    try:
        return child.wait(timeout=poll_s)
    except subprocess.TimeoutExpired:
        return None


def _pass_lines(stream, console) -> None:
    for line in stream:
        console.feed(line)


@contextmanager
def _signals_to(child: subprocess.Popen):
    """SIGINT / SIGTERM to this process go on to `child` meanwhile (main thread only); yields
    the signals received, in order."""
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        child.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in forwarded} if main_thread else {}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
