"""Workers Ray killed for memory: the job ends in bounded time with one line, never hangs.

Ray's memory monitor kills workers when a node's memory passes its threshold (95%), and its
raylet says so in the job's output: `4 Workers (tasks / actors) killed due to memory pressure
(OOM), ...`. verl does not always fail then: a rollout whose agent loop, load balancer or vLLM
server was killed waits for their answers forever (a world-8 CPU run hung so at its step-10
save). So the console counts those kills (OomKills.seen); the launcher's wait loop gives
verl GRACE_S to fail by itself, then stops it (SIGTERM, SIGKILL after TERM_S), and its line
names the kills, the last complete checkpoint and what frees memory.
"""

import re
import time
from dataclasses import dataclass
from pathlib import Path

GRACE_S, TERM_S = 60.0, 30.0
KILLED = re.compile(r"(\d+) Workers \(tasks / actors\) killed due to memory pressure \(OOM\)")


@dataclass
class OomKills:
    """The kills Ray reported in the job's output, and whether the launcher stopped the job."""

    workers: int = 0
    first_at: float | None = None  # time.monotonic() of the first report
    stopped_job: bool = False
    _terminated_at: float | None = None

    def seen(self, text: str) -> None:
        """One line of the job's output."""
        if m := KILLED.search(text):
            self.workers += int(m.group(1))
            if self.first_at is None:
                self.first_at = time.monotonic()

    def police(self, child, now: float | None = None) -> None:
        """While the job runs (every few seconds): stop it GRACE_S after the first kill, kill
        it TERM_S after that."""
        if self.first_at is None:
            return
        now = time.monotonic() if now is None else now
        if self._terminated_at is None and now - self.first_at >= GRACE_S:
            self.stopped_job, self._terminated_at = True, now
            child.terminate()
        elif self._terminated_at is not None and now - self._terminated_at >= TERM_S:
            child.kill()

    def failure_line(self, ckpt_dir: str | Path, resume: str) -> str | None:
        """The one line of a job that lost workers to Ray's memory monitor (None if none)."""
        if not self.workers:
            return None
        from recipes.dapo.cluster.lost_node import last_complete_checkpoint

        stopped = ", so the launcher stopped the job" if self.stopped_job else ""
        ckpt = last_complete_checkpoint(ckpt_dir)
        saved = f"last complete checkpoint: {ckpt}" if ckpt else "no complete checkpoint yet"
        return (
            f"error: Ray killed {self.workers} workers for memory (its OOM monitor: the node "
            f"passed 95% of its memory){stopped}; {saved}: free memory (stop other programs, or "
            f"run fewer ranks), then {resume if ckpt else 'launch again'}"
        )
