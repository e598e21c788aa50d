"""What the monitor keeps across steps: cumulative counts, per-window counts, per-step metrics.

Per-step counts are not kept (48 layers x 128 experts x phases x steps is too much JSON);
each step keeps its per-layer imbalance curves instead, windows keep the counts.
"""

from dataclasses import dataclass, field

import torch

from backend.monitor.metrics import layer_metrics, overall_metrics

# per-layer curves kept for every step (the report's "imbalance over steps" plot)
STEP_CURVES = ("max_over_mean", "cv", "entropy", "ep_max_over_mean")


@dataclass
class Window:
    start_step: int
    end_step: int
    counts_PLE: torch.Tensor  # int64, summed over the window's steps
    complete: bool = True


def phase_metrics(counts_PLE: torch.Tensor, phases: tuple[str, ...], ep: int) -> dict:
    """phase -> (overall, per-layer) metrics, for the phases that saw tokens."""
    out = {}
    for i, name in enumerate(phases):
        if counts_PLE[i].sum() > 0:
            per_layer = layer_metrics(counts_PLE[i], ep)
            out[name] = (overall_metrics(counts_PLE[i], ep, per_layer), per_layer)
    return out


def step_summary(overall: dict[str, float], per_layer: dict[str, torch.Tensor]) -> dict:
    """What a step keeps of one phase: overall metrics and the per-layer curves."""
    return {"overall": overall, "layers": {name: per_layer[name].tolist() for name in STEP_CURVES}}


@dataclass
class LoadHistory:
    phases: tuple[str, ...]
    num_layers: int
    num_experts: int
    ep: int
    window_steps: int
    cumulative_PLE: torch.Tensor = field(init=False)
    windows: list[Window] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    _open: Window | None = None
    _open_len: int = 0

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"window_steps={self.window_steps} must be >= 1")
        shape = (len(self.phases), self.num_layers, self.num_experts)
        self.cumulative_PLE = torch.zeros(shape, dtype=torch.int64)

    def add(
        self,
        step: int,
        counts_PLE: torch.Tensor,
        aux_loss: dict[str, float],
        metrics: dict | None = None,
        mismatch: dict[str, float] | None = None,
        trainer_step: int | None = None,
    ) -> None:
        """Fold in one step's reduced counts; `metrics`: its phase_metrics if already computed;
        `mismatch`: its routing agreement / rollout log-prob metrics, kept when given;
        `trainer_step`: the trainer step the (optimizer) step belongs to, kept when given."""
        self.cumulative_PLE += counts_PLE
        if self._open is None:
            self._open = Window(step, step, torch.zeros_like(counts_PLE), complete=False)
        self._open.counts_PLE += counts_PLE
        self._open.end_step = step
        self._open_len += 1
        if self._open_len == self.window_steps:
            self._open.complete = True
            self.windows.append(self._open)
            self._open, self._open_len = None, 0
        if metrics is None:
            metrics = phase_metrics(counts_PLE, self.phases, self.ep)
        summaries = {name: step_summary(*m) for name, m in metrics.items()}
        entry = {"step": step, "phases": summaries, "aux_loss": aux_loss}
        if trainer_step is not None:
            entry["trainer_step"] = trainer_step
        if mismatch:
            entry["mismatch"] = dict(mismatch)
        self.steps.append(entry)

    def all_windows(self) -> list[Window]:
        """Closed windows, then the open (partial) one if it has steps."""
        return self.windows + ([self._open] if self._open is not None else [])
