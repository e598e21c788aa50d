"""The finish's export and reload check, ready when verl's processes end.

After its last step verl's trainer returns and its driver ends Ray (2-12 s on the 2-core
machine), while the launcher only waits; then the finish exported the last checkpoint to HF
and checked the reload (`recipes.local.export.check_export`, ~7 s, ~10 s with its imports).
`ExportAhead` runs that export in a process of its own (`python -m recipes.local.export_ahead`)
as soon as the final step's checkpoint is sealed (recipes.dapo.checkpoints.files.is_complete)
and verl's file logger has that step's row (its validation is over: the export takes no core
from it). With `preload` (the launcher's choice up to 4 ranks) the process starts with the run
and imports torch, megatron-core and transformers during verl's start-up, when a core is idle
(~0.35 GB held meanwhile); without, where memory binds, it starts when the checkpoint is ready.

The finish takes the result when it is of the checkpoint it would export; otherwise (no such
step, a failed export) it exports as before. A run that fails cancels it: the process is
ended, and the converters' atomic output leaves no half-written export.
"""

import json
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.5
# the process's niceness: Ray starts verl's workers at 15 (its worker_niceness), the launcher
# and verl's driver stay at 0; at 19 the preload's imports never delay verl's start-up chain
NICE = 19


@dataclass(frozen=True)
class Exported:
    actor: Path  # the checkpoint exported
    export: Path
    diff: float  # max |logits| megatron-core against transformers
    output: str  # the export process's stdout and stderr but its result line


def logged_step(metrics: Path, step: int) -> bool:
    """Whether verl's file logger (one JSON row a step) has written `step`'s row."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    for line in reversed(lines[-3:]):
        try:
            if json.loads(line).get("step") == step:
                return True
        except json.JSONDecodeError:  # a row being written
            continue
    return False


def final_checkpoint(root: Path, step: int) -> Path | None:
    """<root>/global_step_<step>/actor once sealed, else None."""
    from recipes.dapo.checkpoints.files import is_complete

    actor = root / f"global_step_{step}" / "actor"
    return actor if (actor / "meta.json").is_file() and is_complete(actor) else None


def ready(checkpoints: Path, metrics: Path, steps: int) -> Path | None:
    actor = final_checkpoint(checkpoints, steps)
    return actor if actor is not None and logged_step(metrics, steps) else None


class ExportAhead:
    """The export process of a run's final checkpoint, started early (`preload`) or once the
    checkpoint is ready; `take` its result, `cancel` it."""

    def __init__(self, checkpoints: Path, metrics: Path, steps: int, template: Path, out: Path,
                 preload: bool = True):  # fmt: skip
        self.args = [str(checkpoints), str(metrics), str(steps), str(template), str(out)]
        self.checkpoints, self.metrics, self.steps = checkpoints, metrics, steps
        self.preload = preload
        self._ended, self._cancelled = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._output: str | None = None
        self._thread = threading.Thread(target=self._run, name="export-ahead", daemon=True)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "recipes.local.export_ahead", *self.args]

    def start(self) -> "ExportAhead":
        self._thread.start()
        return self

    def last_look(self) -> None:
        """The run ended: the export looks once more (starting if the checkpoint is ready)
        and otherwise ends; does not wait (the finish meanwhile does its other work)."""
        self._ended.set()
        with self._lock:
            if self._proc is not None and self._proc.stdin and not self._proc.stdin.closed:
                self._proc.stdin.close()  # the process's signal that the run ended

    def take(self, actor: Path) -> Exported | None:
        """The export of `actor` if it was ready by the last look and succeeded (waits for
        it), else None."""
        self.last_look()
        self._thread.join()
        lines = (self._output or "").splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            return None
        exported = Exported(Path(result["actor"]), Path(result["export"]), float(result["diff"]),
                            "\n".join(lines[:-1]))  # fmt: skip
        return exported if exported.actor == actor else None

    def cancel(self) -> None:
        """End the export (its temp dir goes with it)."""
        self._cancelled.set()
        self.last_look()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
        self._thread.join()

    def _run(self) -> None:
        while not self.preload:  # start the process only once the checkpoint is ready
            if ready(self.checkpoints, self.metrics, self.steps) is not None:
                break
            if self._ended.is_set() or self._cancelled.is_set():
                return
            self._ended.wait(POLL_S)
        with self._lock:
            if self._cancelled.is_set():
                return
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)  # fmt: skip
            if self._ended.is_set():
                self._proc.stdin.close()
        self._output = self._proc.stdout.read()
        if self._proc.wait() != 0:
            self._output = None


def _run_ended() -> bool:
    """The launcher closed this process's stdin (ExportAhead.last_look)."""
    readable, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(readable) and sys.stdin.read(1) == ""


def main(argv: list[str] | None = None) -> int:
    """CHECKPOINTS METRICS STEPS TEMPLATE OUT: the heavy imports, then a wait for the final
    checkpoint (until stdin closes), then check_export; one JSON line last on stdout."""
    import os
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # atomic_dir's cleanup runs
    os.nice(NICE - os.nice(0))  # below Ray's workers: the imports take only an idle core
    checkpoints, metrics, steps, template, out = argv or sys.argv[1:]
    from recipes.local.export import check_export, preload

    preload()
    look = lambda: ready(Path(checkpoints), Path(metrics), int(steps))  # noqa: E731
    while (actor := look()) is None:
        if _run_ended():  # one more look: the checkpoint may have come since the last
            if (actor := look()) is None:
                return 0
            break
        time.sleep(POLL_S)
    export, diff = check_export(actor, Path(template), Path(out))
    print(json.dumps({"actor": str(actor), "export": str(export), "diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
