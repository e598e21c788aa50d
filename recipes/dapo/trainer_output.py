"""The training child's output: all of it to the run's log file, the console as before, and a
checkpoint the engine refused told in one line.

The engine refuses a checkpoint with converters' CheckpointError (or a subclass) inside an actor
worker. Through Ray it reaches verl's driver as a RayTaskError, which the trainer prints on
stderr (Hydra's "Error executing job ..." and ~95 lines of traceback) before it exits with
status 1. `TrainerOutput` copies the child's stdout and stderr line by line to the console
and the log, but holds a top-level traceback back from the console: when the child has
exited, `finish()` returns that error's message if the traceback ends in one (the launcher
then stops with it in one line, exit 2); any other held lines are printed as they came, and
so are held lines of a child that keeps running (a traceback it logged and survived). With
`debug` nothing is held.
"""

import re
import sys
import threading
import time
from collections import deque
from pathlib import Path

LOG_NAME = "trainer.log"  # in the run's directory: --ckpt-dir (the local run's out dir too)
HOLD_S = 30.0  # a child still running this long after a traceback survived it
TAIL = 400  # stderr lines kept for finding a refusal
# where an uncaught error's report starts in the child's own stderr (torch.distributed prefixes
# "[rankN]: "; Ray's worker lines carry a "(Name pid=N)" prefix: not the child's own)
_STARTS = re.compile(
    rb"(\[rank\d+\]: )?(Error executing job with overrides:|Traceback \(most recent)"
)
_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*(\(\w+ pid=\d+[^)]*\)|\[rank\d+\]:)(\x1b\[[0-9;]*m)* ?")


def refusal_classes() -> tuple[str, ...]:
    """`module.Class` of CheckpointError and every subclass the engine's checks raise."""
    import converters.manifest  # noqa: F401  (ManifestError)
    import converters.safe_pickle  # noqa: F401  (UnsafeCheckpointError)
    from converters.hf_io import CheckpointError

    found, todo = [], [CheckpointError]
    while todo:
        cls = todo.pop()
        found.append(f"{cls.__module__}.{cls.__qualname__}")
        todo += cls.__subclasses__()
    return tuple(found)


def refusal_in(lines) -> str | None:
    """The message of the last CheckpointError a traceback in `lines` (text) ends with."""
    prefixes = tuple(f"{name}: " for name in refusal_classes())
    found = None
    for line in lines:
        text = _PREFIX.sub("", line).strip()
        for prefix in prefixes:
            if text.startswith(prefix):
                found = text[len(prefix) :]
    return found


class TrainerOutput:
    """Copies a child's stdout and stderr pipes to the console and `log` (see the module)."""

    def __init__(self, child, log: Path, debug: bool = False):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._log = open(log, "ab")
        self._lock = threading.Lock()
        self._debug = debug
        self._held: list[bytes] = []
        self._held_since: float | None = None
        self.tail: deque[str] = deque(maxlen=TAIL)
        self._threads = [
            threading.Thread(
                target=self._copy, args=(child.stdout, sys.stdout, False), daemon=True
            ),
            threading.Thread(target=self._copy, args=(child.stderr, sys.stderr, True), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _copy(self, pipe, console, is_stderr: bool) -> None:
        for raw in iter(pipe.readline, b""):
            with self._lock:
                self._log.write(raw)
                self._log.flush()
                if is_stderr:
                    self.tail.append(raw.decode(errors="replace"))
                    if not self._debug and self._held_since is None and _STARTS.match(raw):
                        self._held_since = time.monotonic()
                    if self._held_since is not None:
                        self._held.append(raw)
                        continue
                _write(console, raw)

    def release_stale(self) -> None:
        """Print held lines the child has outlived by HOLD_S (called while it runs)."""
        with self._lock:
            if self._held_since is not None and time.monotonic() - self._held_since > HOLD_S:
                self._release()

    def _release(self) -> None:
        for raw in self._held:
            _write(sys.stderr, raw)
        self._held, self._held_since = [], None

    def finish(self, code: int) -> str | None:
        """After the child exited with `code`: the refusal its output ends with (its traceback
        stays in the log only), or None (held lines, if any, are printed now)."""
        for thread in self._threads:
            thread.join()
        self._log.close()
        message = refusal_in(self.tail) if code != 0 else None
        if message is None or self._debug:
            self._release()
        return message


def _write(console, raw: bytes) -> None:
    try:
        console.buffer.write(raw)
        console.flush()
    except (AttributeError, ValueError):  # a console without a byte buffer (tests' capture)
        console.write(raw.decode(errors="replace"))
