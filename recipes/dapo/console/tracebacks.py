"""The training child's dying traceback: held back from the console until the child's end
says what it was, a checkpoint the engine refused told in one line.

The engine refuses a checkpoint with converters' CheckpointError (or a subclass) inside an actor
worker. Through Ray it reaches verl's driver as a RayTaskError, which the trainer prints
(Hydra's "Error executing job ..." and ~95 lines of traceback) before it exits with status 1.
The launcher's console (recipes.dapo.console.screen) hands every line of the child to `Tracebacks`:
from the start of a traceback of the child's own (not a Ray worker's prefixed one) the lines
are held. When the child exited and they end in a refusal, `refusal()` is its message (the
launcher stops with it in one line, exit 2; the traceback stays in the run's log, and reaches
the console too with --debug); otherwise the console shows them, and so it does when the
child outlives them by HOLD_S (a traceback it logged and survived).
A failed start of the embedded Ray (`start_failure`, Ray's own words in RAY_START_FAILURES) is
told apart the same way: recipes.dapo.cluster.ray_start retries it.
Any other failure: `cause()` is the innermost exception of that traceback (a Ray worker's
error inside the driver's RayTaskError, the root of a chained one) as `Type: message` on one
line, which the launcher's error line carries.
"""

import re
import time
from collections import deque
from dataclasses import dataclass, field

HOLD_S = 30.0  # a child still running this long after a traceback survived it
RECOGNISED_LINES = 400  # of the last traceback on, where a refusal is looked for
# where an uncaught error's report starts in the child's own output (torch.distributed prefixes
# "[rankN]: "; Ray's worker lines carry a "(Name pid=N)" prefix: not the child's own)
STARTS = re.compile(
    r"(\[rank\d+\]: )?(Error executing job with overrides:|Traceback \(most recent)"
)
# Ray's words when its local start fails (ray/_private/node.py, ray._raylet's port wait), as the
# exception line of the child's own traceback, -> the launcher's words for it
RAY_START_FAILURES = (
    (re.compile(r"^Exception: The current node timed out during startup"), "timed out"),
    (re.compile(r"^RuntimeError: Timed out waiting for file \S*gcs_server_port"), "timed out"),
    (re.compile(r"^RuntimeError: Failed to start GCS"), "failed (its GCS did not start)"),
)
# an exception's own line: `pkg.mod.Type: message` or a bare `...Error: message`
EXCEPTION = re.compile(
    r"^((?:[A-Za-z_]\w*\.)+[A-Z]\w*|[A-Z]\w*(?:Error|Exception|Exit|Interrupt)|Exception)"
    r"(\(\w+\))?: (.+)$"
)
# Hydra's report of a config target that raised: `SomeError('message')` on a line of its own
INSTANTIATED = re.compile(r"""^([A-Z]\w*(?:Error|Exception))\((['"])(.*)\2\)$""")
RAY_WRAPPERS = ("RayTaskError", "RayActorError", "ActorDiedError", "ActorUnavailableError")
CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
CAUSE_CHARS = 240  # the cause as the error line shows it
_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*(\(\w+ pid=\d+[^)]*\)|\[rank\d+\]:)(\x1b\[[0-9;]*m)* ?")


def refusal_classes() -> tuple[str, ...]:
    """`module.Class` of CheckpointError and every subclass the engine's checks raise."""
    import converters.manifest  # noqa: F401  (ManifestError)
    import converters.pickles.safe_pickle  # noqa: F401  (UnsafeCheckpointError)
    from backend.shared.errors import CheckpointError

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


def cause_in(lines) -> str | None:
    """`Type: message` of the innermost exception in `lines` (a traceback as printed, Ray's
    worker prefixes and all): the root of a chain (before its first "direct cause" / "during
    handling" line), else the last one that is not Ray's wrapper of a worker's error;
    shortened to CAUSE_CHARS."""
    text = [_PREFIX.sub("", line).strip() for line in lines]
    found = [
        (i, f"{m[1]}: {m[3]}")
        for i, line in enumerate(text)
        if (m := EXCEPTION.match(line) or INSTANTIATED.match(line))
        and not m[1].endswith(RAY_WRAPPERS)
    ]
    chain = next((i for i, line in enumerate(text) if line.startswith(CHAINED)), None)
    rooted = [f for f in found if chain is not None and f[0] < chain]
    if not (rooted or found):
        return None
    cause = (rooted or found)[-1][1]
    return cause if len(cause) <= CAUSE_CHARS else cause[: CAUSE_CHARS - 3] + "..."


def start_failure_in(lines) -> str | None:
    """How Ray's local start failed (RAY_START_FAILURES' words) if a traceback of the child's
    own in `lines` ends that way; None otherwise (a Ray worker's prefixed line is not one)."""
    found = None
    for line in lines:
        if _PREFIX.match(line):
            continue
        text = line.strip()
        found = next((cause for p, cause in RAY_START_FAILURES if p.match(text)), found)
    return found


@dataclass
class Tracebacks:
    """The child's lines from its last traceback on, and those held back from the console."""

    held: list[str] = field(default_factory=list)
    held_since: float | None = None
    last: deque | None = None  # the lines from the last traceback's start (None: none yet)

    def hold(self, raw: str) -> bool:
        """Note a line of the child's; True when it is held back (shown by `release`)."""
        if STARTS.match(raw) and self.held_since is None:  # not a chained part of the held
            self.last = deque(maxlen=RECOGNISED_LINES)
            self.held_since = time.monotonic()
        if self.last is not None:
            self.last.append(raw)
        if self.held_since is None:
            return False
        self.held.append(raw)
        return True

    def stale(self) -> bool:
        """The child has outlived the held lines by HOLD_S."""
        return self.held_since is not None and time.monotonic() - self.held_since > HOLD_S

    def release(self) -> list[str]:
        """The held lines, to be shown now; nothing is held after."""
        held, self.held, self.held_since = self.held, [], None
        return held

    def refusal(self) -> str | None:
        """The refusal the last traceback ends with (asked once the child has failed)."""
        return refusal_in(self.last) if self.last else None

    def cause(self) -> str | None:
        """The innermost exception the last traceback names (asked once the child failed)."""
        return cause_in(self.last) if self.last else None

    def start_failure(self) -> str | None:
        """How Ray's start failed, if the last traceback says so (asked once the child failed)."""
        return start_failure_in(self.last) if self.last else None
