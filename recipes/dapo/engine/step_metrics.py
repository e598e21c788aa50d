"""The engine's metrics beyond verl's loss: a trainer step's timing/* (summed over its
optimizer steps, the maximum over ranks, a comm share over 30% warned into the routing
report) and the old-log-prob pass's agreement and log-prob mismatch."""

import torch
import torch.distributed as dist

from backend.instruments.comm_share import (
    add_steps,
    comm_layout,
    comm_share_warning,
    max_over_ranks,
)
from backend.instruments.dispatch_timing import MoEDispatchTimer
from backend.instruments.router_instruments import RouterInstruments
from backend.instruments.timing import SECTIONS, StepTimer
from backend.training.distributed import ProcessGroups
from backend.training.schedule import is_last_stage

DISPATCH_SECTIONS = ("moe_dispatch", "moe_combine")
COMM_WARN_EVERY = 50  # optimizer steps between two comm-share warnings


def as_lists(metrics: dict) -> dict[str, list]:
    """verl's metrics dict: one value per key, as a list."""
    return {k: [v] for k, v in metrics.items()}


def from_last_stage(metrics: dict[str, float], groups: ProcessGroups) -> dict[str, float]:
    """The last stage's metrics on every stage (the monitor's report is written by rank 0)."""
    pp = groups.size("pp")
    if pp == 1:
        return metrics
    box = [metrics]  # our own floats, not a user file
    dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, pp - 1), group=groups.pp)
    return box[0]


class StepMetrics:
    """The step timer's sections summed into a trainer step's timing/*, and the metrics the
    routing report keeps between passes."""

    def __init__(
        self,
        timer: StepTimer,
        routing: RouterInstruments,
        groups: ProcessGroups,
        device: torch.device,
        dispatch_timer: MoEDispatchTimer | None = None,
        layout=None,
    ):
        self.timer, self.routing, self.groups, self.device = timer, routing, groups, device
        self.dispatch_timer = dispatch_timer
        self.layout = layout  # backend.instruments.comm_share.CommLayout, once timing is on
        self._timing: dict[str, float] = {}  # this trainer step's optimizer steps so far
        self._comm_warned_at: int | None = None

    @classmethod
    def start(cls, engine_config, module, routing, groups, device: torch.device) -> "StepMetrics":
        """The step timer: the trained engine's only (a forward-only one never steps)."""
        on = engine_config.timing and not engine_config.forward_only
        timer = StepTimer(device, enabled=on)
        # the comm-share warning's advice: nodes spanned or not
        layout = comm_layout(groups) if on else None
        dispatch = MoEDispatchTimer(module, timer) if on and engine_config.timing_dispatch else None
        return cls(timer, routing, groups, device, dispatch, layout)

    def end_optimizer_step(self) -> None:
        self._timing = add_steps(self._timing, self.timer.step_end())

    def trainer_step_timing(self) -> dict[str, float]:
        """The trainer step's timing/*: every section the engine times (0 if it did not run),
        the maximum over ranks; warns when the communication share is over 30%."""
        step, self._timing = self._timing, {}
        if not self.timer.enabled:
            return {}
        sections = [s for s in SECTIONS if self.dispatch_timer or s not in DISPATCH_SECTIONS]
        metrics = {f"timing/{s}_s": 0.0 for s in sections} | {"timing/unclosed_sections": 0.0}
        metrics.update(step)
        if dist.get_world_size() > 1:
            metrics = max_over_ranks(metrics, self.device)
        if not metrics["timing/unclosed_sections"]:
            del metrics["timing/unclosed_sections"]
        self.warn_comm_share(metrics)
        return metrics

    def warn_comm_share(self, metrics: dict[str, float]) -> None:
        step, last = self.timer.steps, self._comm_warned_at
        if last is not None and step - last < COMM_WARN_EVERY:
            return
        warning = comm_share_warning(step, metrics, layout=self.layout)
        if warning is not None:
            self._comm_warned_at = step
            self.routing.add_warning(warning)

    def old_log_prob(self, out: dict, data) -> None:
        """Agreement and log-prob mismatch of this pass: returned in its metrics and kept
        for the next update step's (verl reads only the update's metrics)."""
        from recipes.dapo.engine.mismatch import rollout_logprob_abs_diff

        metrics = self.routing.take_agreement()
        if "routed_experts" in data.keys():  # the rollout's routes, as they reached the engine
            metrics["moe/rollout_routes/id_bytes"] = float(data["routed_experts"].dtype.itemsize)
        if is_last_stage(self.groups) and "rollout_log_probs" in data.keys():
            metrics.update(
                rollout_logprob_abs_diff(out["model_output"]["log_probs"], data, self.groups.dp)
            )
        metrics = from_last_stage(metrics, self.groups)
        self.routing.pending = dict(metrics)
        out["metrics"].update(as_lists(metrics))
