"""Where a training step's time goes: named, nested sections timed per step.

StepTimer (one per actor process):

    timer = StepTimer(device)                    # "cpu", "cuda", "npu" or a torch.device
    dispatch = MoEDispatchTimer(model, timer)    # optional: MoE dispatch/combine inside compute
    timer.step_begin()
    with timer.section("onload"): ...
    with timer.section("forward_backward"): ...  # every micro-batch's forward + backward
    with timer.section("grad_reduce"): ...       # DP / EDP gradient reduction (finalize grads)
    with timer.section("optimizer"): ...
    with timer.section("offload"): ...
    with timer.section("weight_sync"): ...       # actor -> rollout weights
    metrics.update(timer.step_end())             # timing/* of this step
    dispatch.remove()                            # when done: the dispatchers are as built

Sections nest: a section's time excludes the sections opened inside it, so the parts add up
to the covered time; `timing/other_s` is what no section covered (step_s minus the parts).
Metrics, seconds: timing/<section>_s for every section that ran, timing/step_s, timing/other_s,
and timing/comm_share = (moe_dispatch + moe_combine + grad_reduce + weight_sync) / step.

Clocks: time.perf_counter on CPU; device events (torch.<device>.Event(enable_timing=True),
recorded on the current stream) on accelerators, resolved at step_end, which waits for the
step's last event: host-side timestamps would measure kernel launches, not execution.

MoE dispatch/combine (MoEDispatchTimer) is timed inside megatron-core's token dispatcher by
wrapping two bound methods of each dispatcher instance (instance attributes shadowing the
class methods; `remove()` deletes them again):
  megatron-core >= 0.13 (0.16.1): token_dispatch / token_combine, the communication only;
  megatron-core 0.12.1: token_permutation / token_unpermutation, which also include the
  local permutation (that version has no separate communication method).
The backward of each is timed too: identity autograd marks on the method's input and output
start the section when the output's gradient arrives and stop it when the input's gradient
leaves, so the section covers the gradient all-to-all (plus whatever independent autograd
work the engine runs in between).
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SECTIONS = (
    "forward_backward",  # forward + backward compute of every micro-batch
    "moe_dispatch",  # MoE token dispatch (MoEDispatchTimer), forward and backward
    "moe_combine",  # MoE token combine (MoEDispatchTimer), forward and backward
    "grad_reduce",  # data-parallel gradient reduction
    "optimizer",  # optimizer step (and grad clipping)
    "weight_sync",  # actor weights to the rollout engine
    "offload",  # params / grads / optimizer state to host
    "onload",  # and back
)
COMM_SECTIONS = ("moe_dispatch", "moe_combine", "grad_reduce", "weight_sync")
COMM_SHARE_WARN = 0.30  # above it, communication is the first thing to fix
# On by default only where its cost is within 1% of a step, measured on the tiny model on CPU
# (scripts/bench/timing_overhead.py; figures in the README): StepTimer's sections are, the
# per-layer dispatch/combine instrument is not, so the engine attaches it on request.
TIMING_DEFAULT = True
DISPATCH_TIMING_DEFAULT = False
PREFIX = "timing"


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark) -> None:
        pass


class _DeviceClock:
    """Events on the current stream of `device` (torch.cuda.Event, torch.npu.Event, ...)."""

    def __init__(self, device: torch.device):
        self.event_type = torch.get_device_module(device).Event

    def mark(self):
        event = self.event_type(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def wait(self, mark) -> None:
        mark.synchronize()


def make_clock(device: str | torch.device):
    device = torch.device(device)
    return _HostClock() if device.type == "cpu" else _DeviceClock(device)


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
        self._intervals: list[_Interval] = []
        self._open: list[int] = []  # indices of open intervals, innermost last
        self._step_start = None
        self.totals: dict[str, float] = {}  # seconds summed over every step so far, by metric

    def step_begin(self) -> None:
        if self._open:
            raise RuntimeError(f"sections still open: {self._open_names()}: close them first")
        self._intervals.clear()
        self._step_start = self.clock.mark() if self.enabled else None

    def start(self, name: str) -> None:
        """Open section `name` (for callbacks; prefer `with section(name)`)."""
        if not self.enabled or self._step_start is None:
            return
        if name not in self.sections:
            raise ValueError(f"unknown section {name!r}: one of {self.sections}")
        parent = self._open[-1] if self._open else None
        self._intervals.append(_Interval(name, parent, self.clock.mark()))
        self._open.append(len(self._intervals) - 1)

    def stop(self, name: str, strict: bool = True) -> None:
        """Close the innermost open section `name` (strict=False: ignore it if none is open)."""
        if not self.enabled or self._step_start is None:
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
        metrics = self._metrics(self.clock.seconds(self._step_start, end))
        if unclosed:
            metrics[f"{PREFIX}/unclosed_sections"] = float(unclosed)
        self._step_start = None
        for key, value in metrics.items():
            if key.endswith("_s"):  # seconds add up over steps; shares do not
                self.totals[key] = self.totals.get(key, 0.0) + value
        return metrics

    def run_metrics(self) -> dict[str, float]:
        """timing/* over every step so far (sums, and the run's comm share): the run summary."""
        return {**self.totals, f"{PREFIX}/comm_share": comm_share(self.totals)}

    def _open_names(self) -> list[str]:
        return [self._intervals[i].name for i in self._open]

    def _metrics(self, step_s: float) -> dict[str, float]:
        durations = [self.clock.seconds(i.start, i.end) for i in self._intervals]
        own = list(durations)
        for interval, duration in zip(self._intervals, durations, strict=True):
            if interval.parent is not None:
                own[interval.parent] -= duration
        parts: dict[str, float] = {}
        for interval, seconds in zip(self._intervals, own, strict=True):
            parts[interval.name] = parts.get(interval.name, 0.0) + seconds
        metrics = {f"{PREFIX}/{name}_s": seconds for name, seconds in parts.items()}
        metrics[f"{PREFIX}/step_s"] = step_s
        metrics[f"{PREFIX}/other_s"] = step_s - sum(parts.values())
        metrics[f"{PREFIX}/comm_share"] = comm_share(metrics)
        return metrics


def comm_share(metrics: dict[str, float]) -> float:
    """(dispatch + combine + grad reduction + weight sync) / step time, from timing/* seconds."""
    step = metrics.get(f"{PREFIX}/step_s", 0.0)
    comm = sum(metrics.get(f"{PREFIX}/{name}_s", 0.0) for name in COMM_SECTIONS)
    return comm / step if step > 0 else 0.0


def comm_share_warning(step: int, metrics: dict[str, float], threshold: float = COMM_SHARE_WARN):
    """A RunWarning when timing/comm_share is above `threshold`, else None.

    For the run summary pass `timer.run_metrics()`; for the routing report hand the result
    to `ExpertLoadMonitor.add_warning`."""
    from backend.monitor.alerts import RunWarning

    share = metrics.get(f"{PREFIX}/comm_share", comm_share(metrics))
    if share <= threshold:
        return None
    parts = ", ".join(
        f"{name} {metrics.get(f'{PREFIX}/{name}_s', 0.0):.3g}s" for name in COMM_SECTIONS
    )
    text = (
        f"communication takes {share:.0%} of the step (over {threshold:.0%}): {parts} of "
        f"{metrics.get(f'{PREFIX}/step_s', 0.0):.3g}s; fix communication first (keep EP and TP "
        "inside a node, overlap grad reduction)"
    )
    return RunWarning("comm_share", step, text, {"comm_share": share, "threshold": threshold})


# ---- MoE dispatch / combine inside megatron-core's token dispatcher ----------------------

# (dispatch method, combine method) by megatron-core API generation, newest first
DISPATCHER_METHODS = (
    ("token_dispatch", "token_combine"),  # >= 0.13: communication only
    ("token_permutation", "token_unpermutation"),  # 0.12: permutation + communication
)


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `callback` (times the backward of the wrapped method)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def _mark(x, callback):
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        return _Mark.apply(x, callback)
    return x


def _timed(method, timer: StepTimer, name: str):
    def timed(hidden, *args, **kwargs):
        hidden = _mark(hidden, lambda: timer.stop(name, strict=False))  # its grad leaves last
        timer.start(name)
        try:
            out = method(hidden, *args, **kwargs)
        finally:
            timer.stop(name)
        start_backward = lambda: timer.start(name)  # noqa: E731 - the output's grad arrives first
        if isinstance(out, tuple):
            return (_mark(out[0], start_backward), *out[1:])
        return _mark(out, start_backward)

    return timed


class MoEDispatchTimer:
    """Times every MoE layer's token dispatch and combine into `timer` (see module doc)."""

    def __init__(self, model: torch.nn.Module, timer: StepTimer):
        self.timer = timer
        self._wrapped: list[tuple[object, str]] = []
        dispatchers = [
            m.token_dispatcher
            for m in model.modules()
            if getattr(m, "token_dispatcher", None) is not None
        ]
        if not dispatchers:
            raise ValueError("model has no MoE token dispatcher: is it a megatron-core MoE model?")
        for dispatcher in dispatchers:
            self._wrap(dispatcher)

    def _wrap(self, dispatcher) -> None:
        methods = [pair for pair in DISPATCHER_METHODS if hasattr(type(dispatcher), pair[0])]
        if not methods:
            raise TypeError(
                f"{type(dispatcher).__name__} has none of the known dispatch methods "
                f"{DISPATCHER_METHODS}: megatron-core version not supported"
            )
        dispatch, combine = methods[0]
        for method, section in ((dispatch, "moe_dispatch"), (combine, "moe_combine")):
            if method in vars(dispatcher):
                raise RuntimeError(
                    f"{type(dispatcher).__name__}.{method} is already wrapped: "
                    "remove the other MoEDispatchTimer first"
                )
            setattr(dispatcher, method, _timed(getattr(dispatcher, method), self.timer, section))
            self._wrapped.append((dispatcher, method))

    @property
    def num_dispatchers(self) -> int:
        return len(self._wrapped) // 2

    def remove(self) -> None:
        """Restore the dispatchers' own methods."""
        for dispatcher, method in self._wrapped:
            delattr(dispatcher, method)
        self._wrapped.clear()
