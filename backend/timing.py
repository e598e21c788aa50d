"""Where a training step's time goes: named, nested sections timed per step.

StepTimer (one per actor process):

    timer = StepTimer(device)                    # "cpu", "cuda", "npu" or a torch.device
    dispatch = MoEDispatchTimer(model, timer)    # optional: MoE dispatch/combine inside compute
    with timer.between_steps("weight_sync"): ... # outside a step: counts in the next one
    timer.step_begin()
    with timer.section("forward_backward"): ...  # every micro-batch's forward + backward
    with timer.section("grad_reduce"): ...       # DP / EDP gradient reduction (finalize grads)
    with timer.section("optimizer"): ...
    metrics.update(timer.step_end())             # timing/* of this step
    dispatch.remove()                            # when done: the dispatchers are as built

Sections nest: a section's time excludes the sections opened inside it, so the parts add up
to the covered time; `timing/other_s` is what no section covered (step_s minus the parts).
Work outside the step's span (weight sync, offload / onload, the old-log-prob pass: between two
optimizer steps, while the actor also waits for the rollout) is timed with `between_steps`
(or `timed_items` for a generator): each such section is its own window, and the next
step_end adds its time to the step's parts and to timing/step_s. So step_s is the actor's busy
time for this step (its own span plus those windows), never its idle time in between.
Metrics, seconds: timing/<section>_s for every section that ran, timing/step_s, timing/other_s,
and timing/comm_share (see `comm_share` for exactly what counts).

Clocks: time.perf_counter on CPU; device events (torch.<device>.Event(enable_timing=True),
recorded on the current stream) on accelerators, resolved at step_end, which waits for the
step's last event: host-side timestamps would measure kernel launches, not execution.
Windows between steps are resolved then too (or once MAX_WINDOWS are pending, with a wait).

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
from collections.abc import Iterable, Iterator
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
    "old_log_prob",  # forward-only pass of the rollout's sequences (before the update)
)
COMM_SECTIONS = ("moe_dispatch", "moe_combine", "grad_reduce", "weight_sync")
MAX_WINDOWS = 1024  # between-step windows kept unresolved (device events) before a wait
COMM_SHARE_WARN = 0.30  # above it, communication is the first thing to fix
# On by default only where its cost is within 1% of a step, measured on the tiny model on CPU
# (scripts/bench/timing_overhead.py; figures in docs/timing.md): StepTimer's sections are, the
# per-layer dispatch/combine instrument is not, so the engine attaches it on request.
TIMING_DEFAULT = True
DISPATCH_TIMING_DEFAULT = False
PREFIX = "timing"
_DONE = object()  # timed_items: the iterator is exhausted


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


def comm_share(metrics: dict[str, float]) -> float:
    """(moe_dispatch + moe_combine + grad_reduce + weight_sync) / step_s, from timing/* seconds.

    What counts (COMM_SECTIONS), as the mcore_ep engine times them:
    - grad_reduce: megatron-core's finalize_model_grads (DDP's DP / expert-DP reduce-scatter,
      the TP all-reduce of layer-norm and q/k-norm grads);
    - moe_dispatch / moe_combine: only with the dispatch instrument on (`timing_dispatch`);
      on megatron-core 0.12.1 they include the local token permutation;
    - weight_sync: producing every HF tensor for the rollout, whole: the TP / EP gathers are
      interleaved with the local renaming and splitting per tensor (at world size 1 it is all
      local work).
    What does not: the distributed optimizer's parameter all-gather and grad-norm all-reduce
    (inside `optimizer`), the tensor-parallel all-reduces inside forward / backward, the DP
    token count of the loss (inside `forward_backward` / `old_log_prob`), offload / onload
    (host <-> device copies)."""
    step = metrics.get(f"{PREFIX}/step_s", 0.0)
    comm = sum(metrics.get(f"{PREFIX}/{name}_s", 0.0) for name in COMM_SECTIONS)
    return comm / step if step > 0 else 0.0


def add_steps(total: dict[str, float], step: dict[str, float]) -> dict[str, float]:
    """Two spans' timing/* as one: seconds (and unclosed sections) summed, the share anew."""
    share = f"{PREFIX}/comm_share"
    out = {k: total.get(k, 0.0) + step.get(k, 0.0) for k in {*total, *step} if k != share}
    return {**out, share: comm_share(out)}


@dataclass(frozen=True)
class CommLayout:
    """Where the job's ranks are: what the communication advice depends on.

    spanning: the parallel groups (e.g. "tp", "ep") whose ranks are on more than one node."""

    world: int
    nodes: int = 1
    spanning: tuple[str, ...] = ()

    def advice(self) -> str:
        if self.spanning:
            return (f"{'/'.join(self.spanning)} groups span nodes: keep EP and TP inside a "
                    "node, overlap grad reduction")  # fmt: skip
        if self.world == 1:
            return ("one rank, no collective: weight_sync is the local gather and renaming of "
                    "the weights for the rollout; sync fewer, larger buckets")  # fmt: skip
        where = "one node" if self.nodes == 1 else f"{self.nodes} nodes, every TP/EP group in one"
        return (f"{where}: overlap grad reduction with backward, fewer and larger weight-sync "
                "buckets, longer micro-batches")  # fmt: skip


def comm_layout(groups) -> CommLayout:
    """This job's CommLayout from its ranks' host names (collective over the world: every rank
    calls it; backend.distributed.ProcessGroups)."""
    import socket

    import torch.distributed as dist

    world = dist.get_world_size(groups.world)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=groups.world)
    spanning = tuple(
        name for name in ("tp", "ep", "etp")
        if len({hosts[r] for r in dist.get_process_group_ranks(getattr(groups, name))}) > 1
    )  # fmt: skip
    return CommLayout(world, len(set(hosts)), spanning)


def comm_share_warning(step: int, metrics: dict[str, float], threshold: float = COMM_SHARE_WARN,
                       layout: CommLayout | None = None):  # fmt: skip
    """A RunWarning when timing/comm_share is above `threshold`, else None; its advice follows
    `layout` (nodes spanned or not), or is the general one without it.

    For the run summary pass `timer.run_metrics()`; for the routing report hand the result
    to `ExpertLoadMonitor.add_warning`."""
    from backend.monitor.alerts import RunWarning

    share = metrics.get(f"{PREFIX}/comm_share", comm_share(metrics))
    if share <= threshold:
        return None
    parts = ", ".join(
        f"{name} {metrics.get(f'{PREFIX}/{name}_s', 0.0):.3g}s" for name in COMM_SECTIONS
    )
    advice = layout.advice() if layout else "keep EP and TP inside a node, overlap grad reduction"
    text = (
        f"communication takes {share:.0%} of the step (over {threshold:.0%}): {parts} of "
        f"{metrics.get(f'{PREFIX}/step_s', 0.0):.3g}s; fix communication first ({advice})"
    )
    return RunWarning("comm_share", step, text, {"comm_share": share, "threshold": threshold})


def max_over_ranks(metrics: dict[str, float], device, group=None) -> dict[str, float]:
    """Every value's maximum over the ranks of `group` (the slowest rank's seconds, the highest
    share; float32 on the wire, as every backend reduces it). Collective: every rank calls it
    with the same keys."""
    import torch.distributed as dist

    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, values.tolist(), strict=True))


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
