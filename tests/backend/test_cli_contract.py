"""The exit contract's mechanics: signals end a CLI in one line with 130/143, a closed stdout
ends it without a traceback, the launcher passes SIGTERM on to its child and waits for it."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.shared.cli_contract import BROKEN_PIPE, run_cli
from recipes.dapo.cluster import ray_job

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_during_a_run_is_one_line_and_143_and_cleanup_runs(capsys):
    cleaned = []

    def body() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this
            return 0
        finally:
            cleaned.append(True)

    assert run_cli(body, debug=False, user_errors=()) == 143
    assert capsys.readouterr().err == "interrupted (SIGTERM): nothing half-written was left\n"
    assert cleaned == [True] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_bug_is_one_line_exit_3_without_debug(capsys):
    assert run_cli(lambda: [][1], debug=False, user_errors=()) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: internal error IndexError: list index out of range"
    )


def test_closed_stdout_is_not_a_traceback():
    run = subprocess.Popen(
        [sys.executable, "-m", "parallel", "--nodes", "4", "--tp", "4", "--ep", "8"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    run.stdout.close()  # as `| head -0` does
    err = run.stderr.read().decode()
    assert (
        run.wait(timeout=120) == BROKEN_PIPE and "Traceback" not in err and "Exception" not in err
    ), err


def test_the_launcher_passes_sigterm_on_to_its_child_and_waits(tmp_path):
    mark = tmp_path / "child-got-sigterm"
    child = (
        "import signal, sys, time, pathlib\n"
        f"def stop(*a): pathlib.Path({str(mark)!r}).write_text('x'); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('x')\n"
        "time.sleep(60)\n"
    )

    def terminate_when_ready() -> None:
        while not (tmp_path / "ready").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to the launcher, as `kill <launcher pid>` does

    threading.Thread(target=terminate_when_ready, daemon=True).start()
    # the child stopped with its own 7; the launcher, signalled, reports the signal (130 / 143)
    assert ray_job.run_command([sys.executable, "-c", child], {}) == 143
    assert mark.read_text() == "x" and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
