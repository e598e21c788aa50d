"""The launcher's console: the job's whole output goes to a log file, the screen gets a short view.

Every line of the training child (verl's driver, Ray, every worker and server, whatever
prints them) passes through `Console.feed`, which writes it to `<run>/logs/launch_NNN.log`
and shows on the console only:
- for each trainer step verl logs (its console logger's `step:N - key:value - ...` line), one
  compact line (recipes.dapo.console.step_line), after its legend once;
- each distinct warning or error line once (numbers and Ray's nested process prefixes
  masked to tell them apart), and after the child ended the counts of the most repeated ones
  (all of them at the end of the log); library notices that do not apply to the run, the
  engine's `config:` lines and the start-up lines until the first step line are
  recipes.dapo.console.filters';
- the run-health alarms (backend.monitor.alarms) that the step metrics raise, also appended
  to `<run>/alarms.jsonl` and written to tensorboard (recipes.dapo.console.alarm_log), whence the
  routing report takes them (recipes.dapo.console.health_report);
- a traceback of the child's own in full, once it is known not to be a checkpoint refusal
  (recipes.dapo.console.tracebacks holds it until the child ended or outlived it); a refusal is left
  in the log, its message in `refusal` for the launcher's one line (`debug=True`: its
  traceback is shown as well);
- on a failure, the last lines of the log (from the dying traceback's start when longer); a
  failed start of Ray (recipes.dapo.cluster.ray_start retries it, `next_attempt`) shows nothing: the
  launcher says it in one line.
On a terminal a status line (progress, elapsed time, the latest line) shows the run is alive.
`verbose=True` shows every line as it comes (the stream as it was), alarms included; the
child's tracebacks are held as without it.
`capture()` treats what the launcher itself prints meanwhile (the run's finish) the same way,
so that the summary, printed after `close()`, is the last thing on the console.
"""

import io
import re
import sys
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from backend.monitor.alarms import AlarmRules, HealthAlarms
from recipes.dapo.cluster.ray_oom import OomKills
from recipes.dapo.console.alarm_log import ALARMS, AlarmLog
from recipes.dapo.console.filters import Startup, config_text, held_back_line, not_applicable
from recipes.dapo.console.step_line import LAG_LEGEND, LEGEND, lag_parts, progress_bar, step_line
from recipes.dapo.console.tracebacks import Tracebacks

# Hydra's own last line after an error: nothing for a person to act on (the cause is shown)
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# one or nested: (vLLMHttpServer pid=1) (EngineCore pid=2) WARNING ...
RAY_PREFIX = re.compile(r"^(?:\((?:[\w.:-]+(?: pid=\d+)?|pid=\d+)(?:, ip=[\w.:-]+)?\)\s?)+")
STEP_LINE = re.compile(r"^step:(\d+) - (.*)$")
TOTAL_STEPS = re.compile(r"Total training steps: (\d+)")
NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
# a level or category word, not the same word inside a value ('NCCL_DEBUG': 'WARN')
WARNING = re.compile(
    r"(?:^|[\s\[(|:,-])(?:WARNING|WARN|ERROR|CRITICAL)(?:[\s\]):|,-]|$)"
    r"|\b[A-Z]\w*(?:Warning|Error): |^(?:Warning|Error): |^\[?[WE]\d{4} "
)
# 2026-12-01 17:35:41,415 (logging, Ray) or 12-01 17:35:41 (vLLM), with the colons around it
TIMESTAMP = re.compile(r":?(?:\d{4}-)?\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)?:?\s*")
SITE_PACKAGES = re.compile(r"\S*/site-packages/")
# what varies between repeats of one warning: request uids, Ray's hex ids, numbers
NUMBER = re.compile(
    r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}|\b[0-9a-f]{12,}\b|0x[0-9a-f]+"
    r"|\d+(?:\.\d+)?(?:e[-+]?\d+)?",
    re.IGNORECASE,
)
SHOWN_WIDTH = 200  # characters of a warning shown on the console
REPEATED_SHOWN = 10  # the most repeated warnings counted on the console (all in the log)
TAIL_LINES = 25  # of the log, shown when the child fails
TICK_S = 1.0  # between two status-line updates on a terminal


def clean(raw: str) -> str:
    """A child's line without colours, Ray's `(Actor pid=N)` prefixes and the line end."""
    return RAY_PREFIX.sub("", ANSI.sub("", raw.rstrip("\r\n")), count=1).strip("\r")


def number(text: str) -> float | None:
    """A value of verl's console line (pformat: 0.5, nan, np.float64(0.5)); None otherwise."""
    m = NUMPY_SCALAR.match(text)
    text = m.group(1) if m else text
    try:
        return float(text)
    except ValueError:
        return None


def parse_step(text: str) -> tuple[int, dict[str, float]] | None:
    """verl's console-logger line `step:N - key:value - ...` -> (N, metrics), else None."""
    m = STEP_LINE.match(text)
    if not m:
        return None
    metrics = {}
    for item in m.group(2).split(" - "):
        key, _, value = item.rpartition(":")
        if key and (parsed := number(value)) is not None:
            metrics[key] = parsed
    return int(m.group(1)), metrics


def warning_text(text: str) -> str | None:
    """The line as shown once (timestamps dropped, package paths shortened), if a warning."""
    if not WARNING.search(text):
        return None
    shown = re.sub(" {2,}", " ", SITE_PACKAGES.sub("", TIMESTAMP.sub(" ", text))).strip()
    return shown if len(shown) <= SHOWN_WIDTH else shown[: SHOWN_WIDTH - 3] + "..."


@dataclass
class Console:
    """The filter between the child's output and the screen (module doc)."""

    log: TextIO
    log_path: Path
    out: TextIO = field(default_factory=lambda: sys.stdout)
    verbose: bool = False
    debug: bool = False
    total_steps: int | None = None
    alarms: HealthAlarms = field(default_factory=HealthAlarms)
    alarm_log: AlarmLog | None = None
    device: str | None = None  # the notices held back are those that do not apply to it
    clock: object = time.perf_counter  # seconds; `_started` on it is the launcher's start
    warnings: Counter = field(default_factory=Counter)
    shown: dict[str, str] = field(default_factory=dict)  # warning key -> its first text
    held: Counter = field(default_factory=Counter)  # notices held back -> their count
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    steps: int = 0
    tracebacks: Tracebacks = field(default_factory=Tracebacks)  # the child's own, held
    refusal: str | None = None  # the checkpoint refusal the failed child's traceback ends with
    start_failure: str | None = None  # how Ray's start failed, if that ended the child
    cause: str | None = None  # the failed child's innermost exception (Tracebacks.cause)
    oom: OomKills = field(default_factory=OomKills)  # workers Ray killed for memory
    _started: float = field(default_factory=time.perf_counter)
    startup: Startup | None = None
    _status_at: float = 0.0
    _status_on: bool = False
    child_over: bool = False
    lag_told: bool = False  # LAG_LEGEND said (at the first off-policy step)
    # the reader thread feeds, the launcher's thread ticks and ends: one at a time
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self):
        self.startup = self.startup or Startup(self._started)

    def header(self, text: str, shown_lines: int = 2) -> None:
        """The launcher's own description of the run: all of it to the log; on the console
        its first lines (all of it with verbose) and where the log is."""
        self.log.write(text + "\n")
        lines = text.splitlines()
        self.say(*(lines if self.verbose else lines[:shown_lines]))
        self.say(f"log: {self.log_path} (every line of verl, Ray and the workers)")

    def feed(self, raw: str) -> None:
        """One line of the child's output (the one place every line passes through)."""
        with self._lock:
            if self.child_over:  # a process the child left behind, still printing
                return
            self._release_stale()
            if self.tracebacks.hold(raw):
                self._record(raw)
            else:
                self._take(raw)

    def tick(self) -> None:
        """While the child runs (the launcher calls it every few seconds): a traceback the
        child has outlived is shown."""
        with self._lock:
            if not self.child_over:
                self._release_stale()
                self._startup()

    def _startup(self) -> None:
        if not self.verbose and (line := self.startup.line(self.clock())) is not None:
            self.say(line)

    def _release_stale(self) -> None:
        if self.tracebacks.stale():
            self._show_held(self.tracebacks.release())

    def _show_held(self, held: list[str]) -> None:
        """Lines held from a traceback on, as they would have been shown, but the child's own
        (the traceback and what it printed around it) in full."""
        for raw in held:
            text = clean(raw)
            own = not RAY_PREFIX.match(ANSI.sub("", raw))
            if own and not self.verbose and parse_step(text) is None:
                self.say(text)
            else:
                self._show(raw, text)

    def _record(self, raw: str) -> str:
        """To the log and the tail; the line's text."""
        self.log.write(raw if raw.endswith("\n") else raw + "\n")
        text = clean(raw)
        self.tail.append(text)
        self.oom.seen(text)
        return text

    def _take(self, raw: str) -> None:
        with self._lock:
            self._show(raw, self._record(raw))

    def _show(self, raw: str, text: str) -> None:
        if self.verbose:
            self.say(raw.rstrip("\n"))
        if (m := TOTAL_STEPS.search(text)) and self.total_steps is None:
            self.total_steps = int(m.group(1))
        step = parse_step(text)
        self.startup.observe(text, self.clock())
        if step is not None:
            self._step(*step)
        elif (config := config_text(text)) is not None:
            self._warning(config)
        elif (shown := warning_text(text)) is not None:
            self._warning(shown)
        if not self.child_over:
            self._startup()
        self._status(text)

    def _step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps = max(self.steps, step)
        if not self.startup.done and not self.verbose:
            self.say(LEGEND)
        self.startup.done = True
        if not self.verbose and not self.lag_told and lag_parts(metrics):
            self.say(LAG_LEGEND)  # once, at the first off-policy step
            self.lag_told = True
        if not self.verbose:
            self.say(step_line(step, self.total_steps, metrics))
        for alarm in self.alarms.observe(step, metrics):
            self.say(alarm.line())
            if self.alarm_log is not None:
                self.alarm_log.write(alarm)

    def _warning(self, shown: str) -> None:
        key = NUMBER.sub("#", shown)
        if (notice := not_applicable(shown, self.device)) is not None:
            self.held[(key, notice.reason)] += 1
            self.shown.setdefault(key, shown)
            return
        self.warnings[key] += 1
        if key not in self.shown:
            self.shown[key] = shown
            if not self.verbose:
                self.say(shown)

    def child_done(self, code: int, interrupted: bool = False) -> None:
        """After the child ended: a refusal its traceback ends with (kept in `refusal`, not
        shown), else the traceback held till now; the most repeated warnings with their
        counts (all of them in the log), the alarms, the end of the log on a failure."""
        with self._lock:
            self.child_over = True
            self._clear_status()
            self.refusal = self.tracebacks.refusal() if code != 0 else None
            failed_start = code != 0 and not self.steps and not interrupted  # Ray's start?
            self.start_failure = self.tracebacks.start_failure() if failed_start else None
            failed = code != 0 and not self.refusal and not self.start_failure and not interrupted
            self.cause = self.tracebacks.cause() if failed else None
            held = self.tracebacks.release()
            if (self.refusal or self.start_failure or interrupted) and not self.debug:
                held = []  # in the log; the launcher tells the refusal / the stop in one line
            if self.start_failure:  # the launcher retries, or stops with one line
                self._show_held(held)
                return
            failed = code != 0 and not self.refusal and not interrupted and not self.verbose
            if not failed:
                self._show_held(held)
            self._summarise(code, held if failed else None)

    def _summarise(self, code: int, held: list[str] | None) -> None:
        repeated = [(n, self.shown[k]) for k, n in self.warnings.most_common() if n > 1]
        if repeated:
            self.log.write(f"repeated warnings ({len(repeated)} of {len(self.warnings)} "
                           "distinct):\n" + "".join(f"  {n}x {t}\n" for n, t in repeated))  # fmt: skip
        if repeated and not self.verbose:
            more = len(repeated) - REPEATED_SHOWN
            self.say(f"repeated warnings ({len(repeated)} of {len(self.warnings)} distinct"
                     + (f"; {more} more in the log" if more > 0 else "") + "):")  # fmt: skip
            self.say(*(f"  {n}x {text[:120]}" for n, text in repeated[:REPEATED_SHOWN]))
        fired = self.alarms.fired
        kinds = Counter(a.kind for a in fired)
        self.say("alarms: " + (", ".join(f"{k} x{n}" for k, n in kinds.items()) or "none")
                 + (f" ({self.alarm_log.path})" if fired and self.alarm_log else ""))  # fmt: skip
        if self.held:
            self.log.write("held back (do not apply to this run):\n" + "".join(
                f"  {n}x {self.shown[k]} ({why})\n" for (k, why), n in self.held.items()))  # fmt: skip
            self.say(held_back_line(len(self.held), self.device, self.log_path))
        if held is not None:  # a failure that is not a refusal: the end of its log
            self.say(f"the training job exited with status {code}; the log ends with:")
            ending = [clean(raw) for raw in held] if len(held) > len(self.tail) else self.tail
            self.say(*(f"  {line}" for line in ending if not line.startswith(HYDRA_HINT)))
        self.say(f"log: {self.log_path}")

    def failure_line(self, code: int) -> str:
        """The launcher's error line for a training child that failed: its status, the
        innermost exception of its traceback (the cause) and where the whole log is."""
        cause = f": {self.cause}" if self.cause else ""
        return f"error: verl's trainer exited with status {code}{cause} (log: {self.log_path})"

    def next_attempt(self, note: str) -> None:
        """The same command is run again (recipes.dapo.cluster.ray_start): `note` on the console and in
        the log; the last child's state forgotten (its warnings stay shown once)."""
        with self._lock:
            self.log.write(f"--- {note} ---\n")
            self.say(note)
            self.child_over, self.start_failure = False, None
            self.tracebacks = Tracebacks()
            self.tail.clear()

    @contextmanager
    def capture(self):
        """This process's own output meanwhile (the run's finish) is handled as the child's:
        to the log, warnings shown once, the rest not shown."""
        lines = _Lines(self._take)
        try:
            with redirect_stdout(lines), redirect_stderr(lines):
                yield
        finally:
            lines.finish()

    def close(self) -> None:
        self.log.close()
        if self.alarm_log is not None:
            self.alarm_log.close()

    def say(self, *lines: str) -> None:
        self._clear_status()
        for line in lines:
            print(line, file=self.out, flush=True)

    def _status(self, text: str) -> None:
        """A terminal's last line: progress, elapsed time, the latest line (never logged)."""
        now = self.clock()
        if self.verbose or not self.out.isatty() or now - self._status_at < TICK_S:
            return
        self._status_at, self._status_on = now, True
        elapsed = tqdm.format_interval(now - self._started)
        latest = text.strip()[:60]
        self.out.write(f"\r\x1b[K{progress_bar(self.steps, self.total_steps)} {elapsed} {latest}")
        self.out.flush()

    def _clear_status(self) -> None:
        if self._status_on:
            self.out.write("\r\x1b[K")
            self._status_on = False


class _Lines(io.TextIOBase):
    """A text stream that hands each complete line (ended by a newline or a carriage return,
    as progress bars end theirs) to `take`; `finish` hands what is left."""

    def __init__(self, take):
        self.take, self.rest = take, ""

    def write(self, text: str) -> int:
        parts = re.split(r"[\r\n]", self.rest + text)
        self.rest = parts.pop()
        for part in parts:
            if part:
                self.take(part)
        return len(text)

    def finish(self) -> None:
        if self.rest:
            self.take(self.rest)
            self.rest = ""


def next_index(logs: Path) -> int:
    """The next launch number in <run>/logs (one log per launch: a resume gets its own)."""
    return len(list(logs.glob("launch_*.log"))) if logs.is_dir() else 0


def open_console(run_dir: Path, index: int, verbose: bool, total_steps: int | None,
                 tensorboard_dir: str | None, rules: AlarmRules | None = None,
                 debug: bool = False, device: str | None = None,
                 started: float | None = None) -> Console:  # fmt: skip
    """A Console logging to <run_dir>/logs/launch_<index>.log, alarms (by `rules`, the defaults
    without) to <run_dir>/alarms.jsonl and tensorboard; `debug`: a refusal's traceback shown;
    `device`: the notices not applying to it held back; `started`: the launcher's start
    (time.perf_counter), whence the start-up lines count."""
    log_path = run_dir / "logs" / f"launch_{index:03d}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w", buffering=1)
    alarm_log = AlarmLog(run_dir / ALARMS, tensorboard_dir)
    return Console(log, log_path, verbose=verbose, debug=debug, total_steps=total_steps,
                   alarms=HealthAlarms(rules), alarm_log=alarm_log, device=device,
                   _started=time.perf_counter() if started is None else started)  # fmt: skip
