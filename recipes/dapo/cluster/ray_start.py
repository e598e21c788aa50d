"""Ray's local start failing on a busy machine: retried, then one line (docs/exit_codes.md,
"Ray's start under load").

In the embedded run verl's driver starts its own Ray head (ray.init in verl's main_ppo). Under
load that start can time out: Ray waits 30 s for the GCS to publish its port and 30 s for the
raylet to register ("The current node timed out during startup"); recipes.dapo.console.tracebacks'
RAY_START_FAILURES name Ray's words. It fails before any worker exists, so nothing was trained
and the same command is what to run again (a --resume run resumes the same checkpoint): the
launcher ends what the attempt left (recipes.dapo.cluster.run_scope's reap), waits PAUSE_S and runs it
again, ATTEMPTS times in all, a console line each time. Then it stops with one line naming the
cause and the fix, exit 2 (an environment fault), Ray's traceback in the run's log. A child that
failed any other way (a training crash) is never retried: its status is the launcher's.
"""

import time

from recipes.dapo.cluster import ray_job
from recipes.dapo.errors import LaunchError

ATTEMPTS = 3
PAUSE_S = 10.0  # before the next attempt: a busy machine gets a moment


class RayStartError(LaunchError):
    """Ray's local start failed ATTEMPTS times; the message says what to do."""


def run_retrying(cmd: list[str], env: dict[str, str], console, reap=None,
                 attempts: int = ATTEMPTS) -> int:  # fmt: skip
    """ray_job.run_command through `console`, again while Ray's start is what failed (reap():
    end what the failed attempt left, before the next); the status of the last attempt, or
    RayStartError after `attempts` failed starts."""
    for attempt in range(1, attempts + 1):
        code = ray_job.run_command(cmd, env, console)
        cause = console.start_failure if code else None
        if cause is None:
            return code
        if reap is not None:
            reap()
        if attempt < attempts:
            time.sleep(PAUSE_S)
            console.next_attempt(
                f"Ray's start {cause} (machine busy?): retrying ({attempt + 1} of {attempts})"
            )
    raise RayStartError(
        f"Ray's local start {cause} {attempts} times: the machine is too busy (or its temp dir "
        f"is full); free CPU or space and rerun the same command (Ray's traceback: "
        f"{console.log_path})"
    )
