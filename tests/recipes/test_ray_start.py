"""Ray's local start failing under load (recipes.dapo.cluster.ray_start): retried with one console
line per retry, then one line and exit 2 with Ray's traceback in the log only; a training crash
is never retried. The trainer is a script printing what verl's driver prints when ray.init
fails (Hydra's report, Ray's traceback), and once a real ray.init made to time out."""

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from backend.shared.cli_contract import run_cli
from recipes.dapo.cluster import ray_job, ray_start
from recipes.dapo.console.screen import open_console
from recipes.dapo.console.tracebacks import RAY_START_FAILURES, start_failure_in
from recipes.dapo.errors import LaunchError

pytestmark = pytest.mark.no_mcore

RAY_TIMEOUT = (
    "Exception: The current node timed out during startup. This could happen because some of "
    "the raylet failed to startup or the GCS has become overloaded."
)
# verl's driver failing in ray.init (attempts before `succeed_at` fail), or after a step
TRAINER = """
import sys
from pathlib import Path
count, succeed_at, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
attempt = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(attempt))
print("ray init kwargs: {'address': 'local'}", flush=True)
if attempt >= succeed_at:
    print("step:1 - actor/entropy:0.5", flush=True)
    sys.exit(0)
if how == "crash":
    print("step:1 - actor/entropy:0.5", flush=True)
err = sys.stderr
print("Error executing job with overrides: ['trainer.total_training_steps=2']", file=err)
print("Traceback (most recent call last):", file=err)
print('  File ".../ray/_private/node.py", line 440, in __init__', file=err)
print("    raise Exception(", file=err)
print(sys.argv[4], file=err)
print("", file=err)
print("Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=err)
sys.exit(1)
"""


def trainer(tmp_path: Path, succeed_at: int, how: str = "start", last: str = RAY_TIMEOUT):
    return [sys.executable, "-c", TRAINER, str(tmp_path / "count"), str(succeed_at), how, last]


@pytest.fixture
def console(tmp_path, monkeypatch):
    import io

    monkeypatch.setattr(ray_start, "PAUSE_S", 0.0)
    con = open_console(tmp_path, 0, False, 2, None)
    con.out = io.StringIO()
    yield con
    con.close()


def test_a_ray_start_timeout_is_retried_and_the_run_goes_on(tmp_path, console):
    """Catches issue 41's failed start: one Ray start that timed out under load ended the run
    (exit 1, a 20-line traceback). Now the attempt's leftovers are reaped, one line says it is
    retried, and the run goes on; the traceback is in the log only."""
    reaped = []
    code = ray_start.run_retrying(trainer(tmp_path, 2), {}, console, lambda: reaped.append(1))
    shown = console.out.getvalue().splitlines()
    assert code == 0 and reaped == [1]
    assert [s for s in shown if "retrying" in s] == [
        "Ray's start timed out (machine busy?): retrying (2 of 3)"
    ]
    assert not any("Traceback" in s or "timed out during" in s for s in shown)
    log = console.log_path.read_text()
    assert "Exception: The current node timed out during startup" in log
    assert "--- Ray's start timed out (machine busy?): retrying (2 of 3) ---" in log


def test_a_start_that_keeps_failing_is_one_line_and_exit_2(tmp_path, console, capsys):
    """Catches a retry without bound, or a last failure told as a crash (exit 1 and the
    traceback): three failed starts are two retry lines, then one error line naming the cause,
    the fix and the log, exit 2 (the environment); the traceback is in the log, 3 times."""
    code = run_cli(lambda: ray_start.run_retrying(trainer(tmp_path, 9), {}, console),
                   debug=False, user_errors=(LaunchError,))  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and (tmp_path / "count").read_text() == "3"
    assert err == [
        "error: Ray's local start timed out 3 times: the machine is too busy (or its temp dir is "
        "full); free CPU or space and rerun the same command (Ray's traceback: "
        f"{console.log_path})"
    ]
    shown = console.out.getvalue()
    assert shown.count("retrying") == 2 and "Traceback" not in shown
    assert console.log_path.read_text().count("timed out during startup") == 3


@pytest.mark.parametrize("how", ["crash", "worker"])
def test_a_training_crash_is_not_retried(tmp_path, console, how):
    """Catches a retry of a real failure: a crash after a step was trained, or a Ray worker's
    traceback naming a start timeout (not the driver's own), is the trainer's exit status at
    once, its traceback shown as before and its cause kept for the launcher's error line,
    nothing reaped."""
    last = "RuntimeError: boom" if how == "crash" else f"(TaskRunner pid=7) {RAY_TIMEOUT}"
    reaped = []
    code = ray_start.run_retrying(trainer(tmp_path, 9, how, last), {}, console, reaped.append)
    assert code == 1 and reaped == [] and (tmp_path / "count").read_text() == "1"
    shown = console.out.getvalue()
    assert "retrying" not in shown and "the training job exited with status 1" in shown
    assert console.cause == ("RuntimeError: boom" if how == "crash" else RAY_TIMEOUT)


def test_the_start_failures_are_rays_own_words():
    """Catches a Ray release that rewords them (the retry would silently stop): the words each
    of RAY_START_FAILURES looks for are in the installed Ray's source or its compiled core, and
    only the driver's own exception line is taken for one."""
    ray_dir = Path(importlib.util.find_spec("ray").origin).parent
    node = (ray_dir / "_private" / "node.py").read_bytes()
    core = (ray_dir / "_raylet.so").read_bytes()  # ray._raylet.wait_for_persisted_port
    assert b"The current node timed out during startup" in node
    assert b"Failed to {'start' if self.head else 'connect to'} GCS" in node
    assert b"Timed out waiting for file " in core and b"gcs_server_port" in core + node
    lines = {
        RAY_TIMEOUT: "timed out",
        "RuntimeError: Timed out waiting for file /tmp/ray/s/gcs_server_port_1f": "timed out",
        "RuntimeError: Failed to start GCS.  Last 0 lines of error files:": "failed (its GCS did "
        "not start)",
    }
    assert len(lines) == len(RAY_START_FAILURES)
    for line, cause in lines.items():
        assert start_failure_in(["Traceback (most recent call last):", line]) == cause
        assert start_failure_in([f"[rank0]: {line}", "RuntimeError: x"]) is None


@pytest.mark.slow
def test_a_real_ray_start_made_to_time_out(tmp_path, console):
    """Catches the retry missing what Ray really prints: ray.init told to wait 0 s for its GCS
    (RAY_gcs_server_port_wait_time_s=0) fails its start each time (~3 s): retried once, then
    RayStartError; nothing of the run's processes is left (recipes.dapo.cluster.run_scope)."""
    from recipes.dapo.cluster.run_scope import RunScope

    init = "import ray; ray.init(num_cpus=1, include_dashboard=False, address='local')"
    ray_tmp = tempfile.mkdtemp(prefix="rt")  # Ray's sessions (short: Ray's socket paths)
    try:
        with RunScope(tmp_path / "logs") as scope:
            env = {**scope.env, "RAY_TMPDIR": ray_tmp, "RAY_gcs_server_port_wait_time_s": "0"}
            with pytest.raises(ray_start.RayStartError, match="Ray's local start timed out 2 "):
                ray_start.run_retrying([sys.executable, "-c", init], env, console, scope.reap, 2)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert console.out.getvalue().count("retrying (2 of 2)") == 1
    assert "reaped:" in (tmp_path / "logs" / "cleanup.log").read_text()


def test_the_launcher_says_it_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    """Catches the local run not retrying or not exiting 2: `launch.main` on CPU with verl's
    trainer replaced by the failing one (in the run's environment: its id and temp dir)."""
    from recipes.launcher import launch

    real = ray_job.run_command
    seen = []

    def failing(cmd, env, console=None, watch=None):
        seen.append((env["MCORE_DAPO_RUN_ID"], env["TMPDIR"]))
        return real(trainer(tmp_path, 9), env, console, watch)

    monkeypatch.setattr(ray_job, "run_command", failing)
    monkeypatch.setattr(launch, "prepare_local", lambda *a: None)  # no model, no data: not read
    monkeypatch.setattr(ray_start, "PAUSE_S", 0.0)
    argv = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--ckpt-dir",
        str(tmp_path / "run"),
    ]
    assert launch.main(argv) == 2
    out, err = capsys.readouterr()
    assert len(seen) == 3 and len(set(seen)) == 1 and not Path(seen[0][1]).exists()
    assert len(err.splitlines()) == 1 and err.startswith("error: Ray's local start timed out 3")
    assert out.count("retrying") == 2 and "Traceback" not in out


# verl's driver on Ctrl-C: Ray's get() raises KeyboardInterrupt, Hydra prints the traceback,
# the process exits 1
INTERRUPTED = """
import signal, sys, time
def stop(signum, frame):
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "python/ray/includes/common.pxi", line 105, in check_status', file=sys.stderr)
    print("KeyboardInterrupt", file=sys.stderr)
    sys.exit(1)
signal.signal(signal.SIGINT, stop)
print("step:1 - actor/entropy:0.5", flush=True)
time.sleep(60)
"""


def test_ctrl_c_is_one_line_and_130_never_a_retry(tmp_path, console):
    """Catches issue 41's console on Ctrl-C: the driver's KeyboardInterrupt traceback on the
    screen and `exited with status 1`. The launcher got SIGINT: the status is 130 (the CLI
    contract), nothing retried, the traceback in the log only, and the line names what
    resumes."""
    import os
    import signal
    import threading

    def press_ctrl_c():
        while "step:1" not in console.log_path.read_text():
            threading.Event().wait(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    code = ray_start.run_retrying([sys.executable, "-c", INTERRUPTED], {}, console)
    assert code == 130
    shown = console.out.getvalue()
    assert "Traceback" not in shown and "KeyboardInterrupt" not in shown and "retrying" not in shown
    assert "KeyboardInterrupt" in console.log_path.read_text()
    assert ray_job.interrupted_line(code, tmp_path / "none") == (
        "stopped (SIGINT): no checkpoint was complete: a relaunch starts afresh"
    )
    assert ray_job.interrupted_line(1, tmp_path) is None
