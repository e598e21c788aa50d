"""Where a training step's time goes: named, nested sections timed per step.

StepTimer (one per actor process):

    timer = StepTimer(device)                    # "cpu", "cuda", "npu" or a torch.device
    with timer.between_steps("weight_sync"): ... # outside a step: counts in the next one
    timer.step_begin()
    with timer.section("forward_backward"): ...  # every micro-batch's forward + backward
    with timer.section("grad_reduce"): ...       # DP / EDP gradient reduction (finalize grads)
    with timer.section("optimizer"): ...
    metrics.update(timer.step_end())             # timing/* of this step

Sections nest: a section's time excludes the sections opened inside it, so the parts add up
to the covered time; `timing/other_s` is what no section covered (step_s minus the parts).
Work outside the step's span (weight sync, offload / onload, the old-log-prob pass: between two
optimizer steps, while the actor also waits for the rollout) is timed with `between_steps`
(or `timed_items` for a generator): each such section is its own window, and the next
step_end adds its time to the step's parts and to timing/step_s. So step_s is the actor's busy
time for this step (its own span plus those windows), never its idle time in between.
Metrics, seconds: timing/<section>_s for every section that ran, timing/step_s, timing/other_s,
and timing/comm_share (see backend.instruments.comm_share for exactly what counts). MoE dispatch / combine
sections come from backend.instruments.dispatch_timing.MoEDispatchTimer.

Clocks (backend.instruments.clocks): host timers on CPU, device events on accelerators, resolved at
step_end, which waits for the step's last event. Windows between steps are resolved then too
(or once MAX_WINDOWS are pending, with a wait).
"""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from backend.instruments.clocks import make_clock
from backend.instruments.comm_share import PREFIX, comm_share

SECTIONS = (
    "forward_backward",  # forward + backward compute of every micro-batch
    "moe_dispatch",  # MoE token dispatch (MoEDispatchTimer), forward and backward
    "moe_combine",  # MoE token combine (MoEDispatchTimer), forward and backward
    "grad_reduce",  # data-parallel gradient reduction
    "optimizer",  # optimizer step (and grad clipping)
    "weight_sync",  # actor weights to the rollout engine
    "offload",  # params / grads / optimizer state to host
    "onload",  # and back
    "old_log_prob",  # forward-only pass of the rollout's sequences (before the update)
)
MAX_WINDOWS = 1024  # between-step windows kept unresolved (device events) before a wait
# On by default: its cost is within 1% of a step, measured on the tiny model on CPU
# (scripts/bench/timing_overhead.py; figures in docs/timing.md).
TIMING_DEFAULT = True
_DONE = object()  # timed_items: the iterator is exhausted


@dataclass
class _Interval:
    name: str
    parent: int | None  # index of the enclosing interval in the step's list
    start: object
    end: object = None


class StepTimer:
    """Named, nested sections of one step (see module doc); `enabled=False` makes it a no-op."""

    def __init__(
        self,
        device: str | torch.device = "cpu",
        enabled: bool = True,
        sections: tuple[str, ...] = SECTIONS,
        clock=None,
    ):
        # clock: mark() / seconds(start, end) / wait(mark); default from the device
        self.clock = clock or make_clock(device)
        self.enabled, self.sections = enabled, tuple(sections)
        self._intervals: list[_Interval] = []  # between-step windows' sections, then the step's
        self._open: list[int] = []  # indices of open intervals, innermost last
        self._step_start = None
        self._step_first = 0  # index of the step's first interval
        self._window_start = None  # an open between-step window
        self._windows: list[tuple[object, object]] = []  # closed windows since the last step
        self._resolved: dict[str, float] = {}  # windows already resolved: seconds by section
        self._resolved_s = 0.0  # and their length
        self.steps = 0  # steps ended so far
        self.last_sections: list[str] = []  # the last step's sections, in the order they opened
        self.totals: dict[str, float] = {}  # seconds summed over every step so far, by metric

    def step_begin(self) -> None:
        if self._open:
            raise RuntimeError(f"sections still open: {self._open_names()}: close them first")
        if self._step_start is not None:  # the previous step never ended: drop its sections
            del self._intervals[self._step_first :]
        self._step_first = len(self._intervals)
        self._step_start = self.clock.mark() if self.enabled else None

    def start(self, name: str) -> None:
        """Open section `name` (for callbacks; prefer `with section(name)`)."""
        if not self.enabled or (self._step_start is None and self._window_start is None):
            return
        if name not in self.sections:
            raise ValueError(f"unknown section {name!r}: one of {self.sections}")
        parent = self._open[-1] if self._open else None
        self._intervals.append(_Interval(name, parent, self.clock.mark()))
        self._open.append(len(self._intervals) - 1)

    def stop(self, name: str, strict: bool = True) -> None:
        """Close the innermost open section `name` (strict=False: ignore it if none is open)."""
        if not self.enabled or (self._step_start is None and self._window_start is None):
            return
        for depth in range(len(self._open) - 1, -1, -1):
            interval = self._intervals[self._open[depth]]
            if interval.name == name:
                interval.end = self.clock.mark()
                del self._open[depth]
                return
        if strict:
            raise RuntimeError(f"section {name!r} is not open (open: {self._open_names()})")

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    @contextmanager
    def between_steps(self, name: str) -> Iterator[None]:
        """Section `name` outside a step, counted in the next step_end (its part and step_s).

        Inside a step or another window it is an ordinary section."""
        if not self.enabled or self._step_start is not None or self._window_start is not None:
            with self.section(name):
                yield
            return
        self._window_start = self.clock.mark()
        try:
            with self.section(name):
                yield
        finally:
            self._windows.append((self._window_start, self.clock.mark()))
            self._window_start = None
            if len(self._windows) >= MAX_WINDOWS:
                self._resolve_windows()

    def timed_items(self, name: str, items: Iterable) -> Iterator:
        """Yield from `items`, timing only the production of each item (`between_steps`)."""
        iterator = iter(items)
        while True:
            with self.between_steps(name):
                item = next(iterator, _DONE)
            if item is _DONE:
                return
            yield item

    def step_end(self) -> dict[str, float]:
        """This step's timing/* metrics (waits for the step's last device event)."""
        if not self.enabled or self._step_start is None:
            return {}
        end = self.clock.mark()
        # a backward mark whose partner never ran (a branch autograd pruned) leaves one open:
        # it ends here and is counted, rather than failing the training step
        unclosed = len(self._open)
        for index in self._open:
            self._intervals[index].end = end
        self._open.clear()
        self.clock.wait(end)
        step_s = self.clock.seconds(self._step_start, end) + self._windows_seconds()
        metrics = self._metrics(step_s)
        if unclosed:
            metrics[f"{PREFIX}/unclosed_sections"] = float(unclosed)
        self._step_start = None
        self.last_sections = [i.name for i in self._intervals]
        self._clear()
        self.steps += 1
        for key, value in metrics.items():
            if key.endswith("_s"):  # seconds add up over steps; shares do not
                self.totals[key] = self.totals.get(key, 0.0) + value
        return metrics

    def run_metrics(self) -> dict[str, float]:
        """timing/* over every step so far (sums, and the run's comm share): the run summary."""
        return {**self.totals, f"{PREFIX}/comm_share": comm_share(self.totals)}

    def _open_names(self) -> list[str]:
        return [self._intervals[i].name for i in self._open]

    def _windows_seconds(self) -> float:
        windows = sum(self.clock.seconds(start, end) for start, end in self._windows)
        return self._resolved_s + windows

    def _resolve_windows(self) -> None:
        """Fold the closed windows into seconds (outside a step: all intervals are theirs)."""
        self.clock.wait(self._windows[-1][1])
        self._resolved_s, self._resolved = self._windows_seconds(), self._own_seconds()
        self._intervals.clear()
        self._windows.clear()

    def _clear(self) -> None:
        self._intervals.clear()
        self._windows.clear()
        self._resolved, self._resolved_s, self._step_first = {}, 0.0, 0

    def _own_seconds(self) -> dict[str, float]:
        """Seconds by section name, each interval less the intervals opened inside it."""
        durations = [self.clock.seconds(i.start, i.end) for i in self._intervals]
        own = list(durations)
        for interval, duration in zip(self._intervals, durations, strict=True):
            if interval.parent is not None:
                own[interval.parent] -= duration
        parts = dict(self._resolved)
        for interval, seconds in zip(self._intervals, own, strict=True):
            parts[interval.name] = parts.get(interval.name, 0.0) + seconds
        return parts

    def _metrics(self, step_s: float) -> dict[str, float]:
        parts = self._own_seconds()
        metrics = {f"{PREFIX}/{name}_s": seconds for name, seconds in parts.items()}
        metrics[f"{PREFIX}/step_s"] = step_s
        metrics[f"{PREFIX}/other_s"] = step_s - sum(parts.values())
        metrics[f"{PREFIX}/comm_share"] = comm_share(metrics)
        return metrics
