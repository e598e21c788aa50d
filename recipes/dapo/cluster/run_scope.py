"""A run's id, its own temp dir and its reaper: what the run started ends with it, and what it
left is removed, after a clean finish, between two attempts and after a kill -9 of the
launcher (docs/exit_codes.md, "What a run leaves behind").

`RunScope` is entered right before verl's trainer starts (a run refused earlier has made
nothing). Its `env` goes into the training child's environment only (not into the Ray
runtime_env of the command: a cluster's other nodes have no such temp dir):
- MCORE_DAPO_RUN_ID: the run's id, inherited by every process the run starts on this machine,
  which is how the reaper (recipes.dapo.cluster.reaper) knows them;
- TMPDIR: <temp>/mcore_dapo_<id>, the run's own, so that what the libraries put in the temp
  dir (vLLM's vllm_dist_* files and ZMQ sockets, verl's checkpoint locks) is provably this
  run's; RAY_TMPDIR and TORCHINDUCTOR_CACHE_DIR stay where they were without it (Ray's
  sessions and their logs in <temp>/ray, torch's compile cache shared between runs).
The reaper runs in a session of its own; `reap()` (between attempts) and leaving the scope
ask it to clean up now and wait for its answer; a launcher that died is its signal to clean up.
"""

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from recipes.dapo.cluster.reaper import RUN_ID, SAMPLE_S

REAPER = Path(__file__).with_name("reaper.py")
READY_S = 60.0  # for the reaper's start (a busy machine)
REAP_S = 60.0  # for one clean-up: ending processes (<= 6 s) and reading every process's maps


def kept_dirs(env=os.environ) -> dict[str, str]:
    """The dirs that a new TMPDIR would move, pinned to where they are without it: Ray's temp
    root (ray._common.utils.get_default_system_temp_dir on Linux) and torch inductor's cache
    (torch._inductor.runtime.cache_dir_utils.default_cache_dir)."""
    import getpass
    import re

    base = tempfile.gettempdir()
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # no passwd entry: as torch names it
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return {
        "RAY_TMPDIR": env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp",
        "TORCHINDUCTOR_CACHE_DIR": env.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(base, f"torchinductor_{user}"),
    }


class RunScope:
    """This run's id, temp dir and reaper (module doc); a context manager."""

    def __init__(self, log_dir: Path, sample_s: float = SAMPLE_S):
        self.id = uuid.uuid4().hex[:16]  # the temp dir's path stays short (socket paths)
        self.tmp = Path(tempfile.gettempdir()) / f"mcore_dapo_{self.id}"
        self.env = {**kept_dirs(), RUN_ID: self.id, "TMPDIR": str(self.tmp)}
        self.log = Path(log_dir) / "cleanup.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(mode=0o700)
        self.reaper = self._start(float(sample_s)) if Path("/proc/self/stat").exists() else None

    def _start(self, sample_s: float) -> subprocess.Popen | None:
        start = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
        env = {k: v for k, v in os.environ.items() if k != RUN_ID}  # never one of the run
        args = [self.id, str(os.getpid()), start, str(self.tmp), str(self.log), str(sample_s)]
        with self.log.open("a") as errors:  # not the terminal: the launcher may be gone
            reaper = subprocess.Popen(
                [sys.executable, "-I", "-S", str(REAPER), *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=errors, env=env, cwd="/",
                start_new_session=True, bufsize=0,
            )  # fmt: skip
        if not (self._answer(reaper, READY_S) or "").startswith("ready"):
            print("warning: the run's reaper did not start: what the run leaves behind stays "
                  f"(see {self.log})", file=sys.stderr)  # fmt: skip
            reaper.kill()
            return None
        return reaper

    @staticmethod
    def _answer(reaper: subprocess.Popen, timeout: float) -> str | None:
        """The reaper's next line, or None (it ended, or timed out)."""
        line, deadline = b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([reaper.stdout], [], [], left)[0]:
                return None
            chunk = reaper.stdout.read(1)
            if not chunk:
                return None
            line += chunk
        return line.decode().strip()

    def _ask(self, command: str) -> str | None:
        if self.reaper is None:
            return None
        try:
            self.reaper.stdin.write(f"{command}\n".encode())
        except OSError:
            return None
        return self._answer(self.reaper, REAP_S)

    def reap(self) -> str | None:
        """End the run's processes and remove what they left, now (the run goes on: between
        two attempts); the reaper's line."""
        said = self._ask("reap")
        if self.reaper is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(mode=0o700, exist_ok=True)
        return said

    def close(self) -> str | None:
        """The run is over: the same clean-up, then the reaper exits."""
        said = self._ask("exit")
        if self.reaper is not None:
            try:
                self.reaper.stdin.close()
                self.reaper.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass  # it finishes by itself
            self.reaper.stdout.close()
        if said is None:  # no reaper: what the launcher can do itself
            shutil.rmtree(self.tmp, ignore_errors=True)
        return said

    def __enter__(self) -> "RunScope":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
