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

REPO = Path(__file__).resolve().parents[2]
# Ascend A2: generous HCCL timeouts (rollouts keep ranks away from collectives for minutes),
# the task-queue optimisation, vLLM's V1 engine (vllm-ascend)
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
RAY_KIND = {"cuda": "GPU", "npu": "NPU"}


class LaunchError(RuntimeError):
    """The cluster is not ready for the run; the message says what to do."""


def job_env(device: str, ifname: str | None) -> dict[str, str]:
    """Environment of every process of the job (also passed to Ray workers).

    PYTHONPATH keeps what is set (CANN's set_env.sh puts its Python packages there) and adds the
    repository. No VERL_USE_EXTERNAL_MODULES: it would import the engine (megatron-core and, on
    Ascend, MindSpeed's global patches) in every reward, agent-loop and vLLM process;
    `actor_rollout_ref.model.external_lib` loads it in the workers that build the actor.
    """
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in pythonpath:
        pythonpath.append(str(REPO))
    env = {"PYTHONPATH": os.pathsep.join(pythonpath), "TQ_NUM_THREADS": transferqueue_threads()}
    if device == "npu":
        env.update(A2_ENV)
    if ifname:
        socket = "HCCL_SOCKET_IFNAME" if device == "npu" else "NCCL_SOCKET_IFNAME"
        env.update({socket: ifname, "GLOO_SOCKET_IFNAME": ifname})
    return env


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


def ray_devices(status: str, device: str) -> int:
    """Total GPUs / NPUs in `ray status` output."""
    kind = RAY_KIND[device]
    return int(sum(float(total) for _, total, k in _DEVICES.findall(status) if k == kind))


def check_ray(device: str, expected: int) -> None:
    """The running Ray cluster offers at least `expected` devices of the right kind."""
    try:
        out = subprocess.run(
            [ray_executable(), "status"], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise LaunchError(
            "`ray` is not installed here: run scripts/bootstrap.sh and launch from the repo"
        ) from None
    if out.returncode != 0:
        raise LaunchError(
            "no running Ray cluster: start scripts/ray_start_head.sh on this node and "
            "scripts/ray_start_worker.sh on the others"
        )
    have = ray_devices(out.stdout, device)
    if have < expected:
        raise LaunchError(
            f"Ray cluster offers {have} {RAY_KIND[device]}s, the plan needs {expected}: start "
            "scripts/ray_start_worker.sh on the missing nodes, or lower --nodes"
        )


def run_command(cmd: list[str], env: dict[str, str], console=None) -> int:
    """The one place that starts the job's processes. SIGTERM and SIGINT to the launcher are
    passed on to the child (which stops its run and its Ray job), and the launcher waits for
    it; the exit status is the child's (128 + N when signal N ended it, as a shell reports).

    console (recipes.dapo.console.Console): the child's stdout and stderr, merged, pass
    through its `feed` line by line; without one they go where this process's go. A
    checkpoint the engine refused (the Console's `refusal`) raises that CheckpointError here,
    in one line naming the log that holds the trainer's traceback."""
    piped = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    extra = {"PYTHONUNBUFFERED": "1"} if console else {}  # lines as they are printed
    child = subprocess.Popen(cmd, env={**os.environ, **env, **extra}, cwd=REPO,
                             **(piped if console else {}))  # fmt: skip
    with _signals_to(child):
        if console:
            reader = threading.Thread(target=_pass_lines, args=(child.stdout, console),
                                      daemon=True)  # fmt: skip
            reader.start()
        while (code := _wait(child)) is None:
            if console:
                console.tick()
    code = 128 - code if code < 0 else code
    if console:
        # a process the child left behind may hold the pipe open: do not wait for it forever
        reader.join(timeout=READER_GRACE_S)
        console.child_done(code)
        if console.refusal:
            from converters.hf_io import CheckpointError

            raise CheckpointError(
                f"{console.refusal} (the trainer's traceback: {console.log_path})"
            )
    return code


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
    """SIGINT / SIGTERM to this process go on to `child` meanwhile (main thread only)."""

    def forward(signum, frame) -> None:
        child.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in forwarded} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
