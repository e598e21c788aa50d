"""Workers Ray's memory monitor killed (recipes.dapo.cluster.ray_oom): the job that would wait
for them forever is stopped in bounded time, with one line naming the kills, the last
complete checkpoint and what frees memory."""

import sys
import time

from recipes.dapo.cluster import ray_job, ray_oom
from tests.recipes.test_console import console

# as Ray's raylet prints it into the job's output (a world-8 CPU run hung after it)
RAYLET = (
    "\x1b[33m(raylet)\x1b[0m [2026-12-06 14:27:43,751 E 22146 22146] (raylet) "
    "node_manager.cc:3517: 4 Workers (tasks / actors) killed due to memory pressure (OOM), "
    "0 Workers crashed due to other reasons at node (ID: 22e8af2b8e, IP: 192.0.2.2) over the "
    "last time period."
)


def test_a_job_that_hangs_after_ray_killed_its_workers_is_stopped(tmp_path, monkeypatch):
    """Bug caught: the run waiting forever on a rollout whose agent loop and vLLM server Ray
    killed (verl does not fail by itself), or a stop reported as the user's (status 143)."""
    monkeypatch.setattr(ray_oom, "GRACE_S", 1.0)
    monkeypatch.setattr(ray_oom, "TERM_S", 1.0)
    child = f"import time\nprint({RAYLET!r}, flush=True)\ntime.sleep(600)\n"
    con, _ = console(tmp_path)
    start = time.monotonic()
    code = ray_job.run_command([sys.executable, "-c", child], {}, con)
    assert code == 143 and time.monotonic() - start < 30
    (tmp_path / "ckpt").mkdir()
    line = con.oom.failure_line(tmp_path / "ckpt", "relaunch with --resume")
    assert line == (
        "error: Ray killed 4 workers for memory (its OOM monitor: the node passed 95% of its "
        "memory), so the launcher stopped the job; no complete checkpoint yet: free memory "
        "(stop other programs, or run fewer ranks), then launch again"
    )


def test_kills_are_summed_and_a_job_without_them_is_left_alone():
    kills = ray_oom.OomKills()
    kills.seen("step:3 - actor/entropy:0.5")
    assert kills.failure_line("/nonexistent", "x") is None
    for _ in range(2):
        kills.seen(RAYLET)
    assert kills.workers == 8

    class Child:
        calls: list = []

        def terminate(self):
            self.calls.append("term")

        def kill(self):
            self.calls.append("kill")

    child, t0 = Child(), kills.first_at
    kills.police(child, now=t0 + ray_oom.GRACE_S - 1)  # verl may still fail by itself
    kills.police(child, now=t0 + ray_oom.GRACE_S)
    kills.police(child, now=t0 + ray_oom.GRACE_S + ray_oom.TERM_S)
    assert child.calls == ["term", "kill"] and kills.stopped_job
