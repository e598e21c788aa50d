"""Run warnings: one-line, rate-limited, and kept in the routing report.

- RunWarning: what happened, at which step; `line()` is the log line, `as_dict()` the report
  entry (the report's top-level "warnings" list; render.py shows them). Its level is
  "warning", or "alarm" for the run-health alarms (alarms.py).
- SkewGuard: compares the measured EP skew of every layer (monitor metric ep_max_over_mean,
  tokens on the busiest EP rank / the mean) with the skew the memory plan assumed
  (parallel.skew). A step whose worst layer exceeds it raises a warning naming the step, the
  layer and both skews, at most once per `every_n_steps` steps; steps in between still count
  (`exceeded_steps`, and the next warning says how many were not logged).

The monitor owns the guard: `ExpertLoadMonitor(..., skew_guard=SkewGuard(2.0, 50))` checks it
in `step_end`, logs the line on the first rank and stores the warning in the report.
"""

import math
from dataclasses import dataclass, field

import torch

SKEW_PHASES = ("update",)  # the pass that keeps activations for backward


@dataclass(frozen=True)
class RunWarning:
    kind: str  # "ep_skew", "comm_share", ...
    step: int
    text: str  # the one-line message
    values: dict[str, float | int | str] = field(default_factory=dict)
    level: str = "warning"  # or "alarm" (alarms.HealthAlarms)

    def line(self) -> str:
        return f"{self.level.upper()} [{self.kind}] step {self.step}: {self.text}"

    def as_dict(self) -> dict:
        level = {"level": self.level} if self.level != "warning" else {}
        return {"kind": self.kind, "step": self.step, "text": self.text, **level, **self.values}


@dataclass
class SkewGuard:
    """Warn when a layer's measured EP skew exceeds the plan's assumption (see module doc)."""

    assumed_skew: float
    every_n_steps: int = 50
    phases: tuple[str, ...] = SKEW_PHASES
    exceeded_steps: int = 0  # steps over the assumption, logged or not
    worst: float = 1.0  # the highest skew measured so far in the checked phases
    _last_warned: int | None = None
    _unlogged: int = 0

    def __post_init__(self) -> None:
        if not self.assumed_skew >= 1.0:
            raise ValueError(f"assumed_skew={self.assumed_skew} must be >= 1 (1: balanced)")
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps={self.every_n_steps} must be >= 1")

    def check(self, step: int, skew_by_phase_L: dict[str, torch.Tensor]) -> RunWarning | None:
        """Per-layer ep_max_over_mean of this step, by phase -> a warning to log, or None."""
        over = self._worst_layer(skew_by_phase_L)
        if over is None:
            return None
        phase, layer, measured = over
        self.exceeded_steps += 1
        if self._last_warned is not None and step - self._last_warned < self.every_n_steps:
            self._unlogged += 1
            return None
        quiet, self._unlogged, self._last_warned = self._unlogged, 0, step
        return self._warning(step, phase, layer, measured, quiet)

    def _worst_layer(self, skew_by_phase_L) -> tuple[str, int, float] | None:
        worst = None
        for phase in self.phases:
            values_L = skew_by_phase_L.get(phase)
            if values_L is None:
                continue
            values_L = torch.nan_to_num(torch.as_tensor(values_L, dtype=torch.float64), nan=0.0)
            layer = int(values_L.argmax())
            if worst is None or values_L[layer] > worst[2]:
                worst = (phase, layer, float(values_L[layer]))
        if worst is None or math.isnan(worst[2]):
            return None
        self.worst = max(self.worst, worst[2])
        return worst if worst[2] > self.assumed_skew else None

    def _warning(self, step, phase, layer, measured, quiet) -> RunWarning:
        since = f"; {quiet} more step(s) over it since the last warning" if quiet else ""
        text = (
            f"EP skew {measured:.2f}x at layer {layer} ({phase}) exceeds the {self.assumed_skew:.2f}x "
            f"the memory plan assumed{since}: expect higher expert-side memory on the busiest EP "
            "rank (python -m parallel --skew-from the routing report gives the new margin)"
        )
        values = {
            "layer": layer,
            "phase": phase,
            "measured": measured,
            "assumed": self.assumed_skew,
            "unlogged_steps": quiet,
        }
        return RunWarning("ep_skew", step, text, values)
