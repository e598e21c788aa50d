"""ExpertLoadMonitor: tokens per expert per layer, per pass, reduced across ranks each step.

Counting is device-side and sync-free: each router call adds the column sums of its
routing map (valid tokens only) into a [phases, layers, experts] int64 tensor. Calls that
activation recompute replays inside backward are skipped: the forward already counted them.

Reduction: the router runs on the attention side, before token dispatch, so every rank's
router sees tokens no other rank sees for that layer: DP ranks hold different sequences,
TP ranks (sequence parallel, required for MoE with TP) different slices of S, CP ranks
different chunks of S. EP is folded out of those same ranks (expert side), so it adds no
copies, and PP stages count disjoint layers of the global [L, E] tensor. Summing over the
whole world is therefore exact; reducing over DP only would miss TP slices, and adding EP
on top would double count. tests/backend/test_monitor_multiproc.py checks this against world size 1.

Each step's metrics carry the model's shape, `moe/num_experts` and (given top_k) `moe/top_k`,
with the per-layer `moe/<phase>/layer_<l>/<metric>` (backend.monitor.metrics).
"""

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

import backend.monitor.tb as tb
from backend.instruments.router_tap import RouterCall, RouterTap
from backend.monitor.history import LoadHistory, phase_metrics
from backend.monitor.metrics import flatten, overall_metrics
from backend.monitor.run_warnings import RunWarning, SkewGuard
from backend.shared.names import AUX_LOSS_PREFIX
from backend.training.distributed import ProcessGroups

PHASES = ("update", "old_log_prob", "ref")
AUX_PREFIX = AUX_LOSS_PREFIX
log = logging.getLogger(__name__)


def reduce_counts_(counts: torch.Tensor, groups: ProcessGroups | None) -> torch.Tensor:
    """Sum counts in place over every rank holding distinct tokens: the world (see above)."""
    if groups is None or dist.get_world_size(groups.world) == 1:
        return counts
    if counts.device.type == "cpu" and dist.get_backend(groups.world) != "gloo":
        # nccl / hccl reduce device tensors only (a rank that has recorded nothing yet)
        on_device = counts.to(torch.accelerator.current_accelerator())
        dist.all_reduce(on_device, group=groups.world)
        return counts.copy_(on_device)
    dist.all_reduce(counts, group=groups.world)
    return counts


def plan_of(groups: ProcessGroups | None) -> dict[str, int]:
    names = ("tp", "ep", "pp", "cp", "dp", "etp", "edp")
    if groups is None:
        return {name: 1 for name in (*names, "world")}
    return {**{n: groups.size(n) for n in names}, "world": dist.get_world_size(groups.world)}


def _aux_values(aux_losses: Mapping[str, object] | None) -> dict[str, float]:
    out = {}
    for key, value in (aux_losses or {}).items():
        if not key.startswith(AUX_PREFIX):
            raise ValueError(f"aux-loss key {key!r} must start with {AUX_PREFIX!r}")
        out[key] = float(value.item() if isinstance(value, torch.Tensor) else value)
    return out


class ExpertLoadMonitor:
    """Attach to a RouterTap, label passes with `phase(...)`, call `step_end` once per step."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        groups: ProcessGroups | None,
        *,
        phases: tuple[str, ...] = PHASES,
        window_steps: int = 10,
        heatmap_every: int | None = None,
        per_layer_keys: bool = True,
        writer=None,
        top_k: int | None = None,
        device: str | torch.device = "cpu",
        skew_guard: SkewGuard | None = None,
    ):
        self.groups, self.plan = groups, plan_of(groups)
        self.skew_guard = skew_guard  # checked at every step_end (alerts.SkewGuard)
        self.trainer_step: int | None = None  # of the last step_end, when the caller names it
        self.warnings: list[RunWarning] = []  # what add_warning logged; kept in the report
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.phases, self.per_layer_keys, self.writer = tuple(phases), per_layer_keys, writer
        self.heatmap_every = heatmap_every or window_steps
        self.history = LoadHistory(
            self.phases, num_layers, num_experts, self.plan["ep"], window_steps
        )
        self._counts_PLE = torch.zeros(
            len(phases), num_layers, num_experts, dtype=torch.int64, device=device
        )
        self._phase: int | None = None
        self.unlabelled_calls = 0  # router calls outside any phase this step (not counted)
        self._skipping = False  # inside unmonitored()

    def attach(self, tap: RouterTap) -> "ExpertLoadMonitor":
        tap.add_listener(self.record)
        return self

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the router calls inside the block under `name` (update / old_log_prob / ref)."""
        if name not in self.phases:
            raise ValueError(f"unknown phase {name!r}: declare it in phases={self.phases}")
        if self._phase is not None:
            raise RuntimeError(f"phase {self.phases[self._phase]!r} is still open: close it first")
        self._phase = self.phases.index(name)
        try:
            yield
        finally:
            self._phase = None

    @contextmanager
    def unmonitored(self) -> Iterator[None]:
        """Router calls inside are deliberately not counted (e.g. the aux loss's counting
        pass, which repeats the update's forwards)."""
        self._skipping = True
        try:
            yield
        finally:
            self._skipping = False

    def record(self, call: RouterCall) -> None:
        """RouterTap listener: add this call's valid tokens to the open phase's counts."""
        if call.recompute or self._skipping:
            return
        if self._phase is None:
            self.unlabelled_calls += 1
            return
        routing_TE = call.routing_map_TE.bool()
        if routing_TE.shape[-1] != self.num_experts or not 0 <= call.layer < self.num_layers:
            raise ValueError(
                f"router call (layer {call.layer}, {routing_TE.shape[-1]} experts) "
                f"outside the monitor's {self.num_layers} x {self.num_experts}: "
                "build the monitor from the model's spec"
            )
        if call.valid_T is not None:
            routing_TE = routing_TE & call.valid_T.to(routing_TE.device, non_blocking=True)[:, None]
        if self._counts_PLE.device != routing_TE.device:
            self._counts_PLE = self._counts_PLE.to(routing_TE.device)
        self._counts_PLE[self._phase, call.layer].add_(routing_TE.sum(0))

    def step_end(
        self,
        step: int,
        aux_losses: Mapping[str, object] | None = None,
        extra: Mapping[str, float] | None = None,
        trainer_step: int | None = None,
    ) -> dict[str, float]:
        """Reduce this step's counts (collective: every rank calls it), log, return metrics.

        extra: already reduced scalars of this step (routing agreement, rollout log-prob
        mismatch): logged and kept in the report's step as `mismatch`. trainer_step: the
        trainer step this optimizer step belongs to (the report's shared step axis)."""
        self.trainer_step = trainer_step
        counts_PLE = reduce_counts_(self._counts_PLE, self.groups).to("cpu", copy=True)
        self._counts_PLE.zero_()
        aux = _aux_values(aux_losses)
        extra = {k: float(v) for k, v in (extra or {}).items()}
        per_phase = phase_metrics(counts_PLE, self.phases, self.plan["ep"])
        self.history.add(step, counts_PLE, aux, per_phase, mismatch=extra,
                         trainer_step=trainer_step)  # fmt: skip
        metrics = {**self._shape(), **self._step_metrics(counts_PLE, per_phase), **aux,
                   **self._cumulative_metrics()}  # fmt: skip
        metrics.update(extra)
        if self.unlabelled_calls:  # a pass the caller forgot to label: visible, not silent
            metrics["moe/unlabelled_router_calls"] = float(self.unlabelled_calls)
            self.unlabelled_calls = 0
        metrics.update(self._check_skew(step, per_phase))
        self._log(metrics, counts_PLE, step)
        return metrics

    def add_warning(self, warning: RunWarning) -> None:
        """Log `warning` in one line (first rank) and keep it for the routing report, with
        the trainer step of the last step_end that named one."""
        if self.trainer_step is not None:
            values = {**warning.values, "trainer_step": self.trainer_step}
            warning = RunWarning(warning.kind, warning.step, warning.text, values, warning.level)
        self.warnings.append(warning)
        if self.is_writer_rank():
            log.warning(warning.line())

    def _check_skew(self, step: int, per_phase: dict) -> dict[str, float]:
        if self.skew_guard is None:
            return {}
        skew_L = {name: per_layer["ep_max_over_mean"] for name, (_, per_layer) in per_phase.items()}
        warning = self.skew_guard.check(step, skew_L)
        if warning is not None:
            self.add_warning(warning)
        return {"moe/ep_skew_exceeded_steps": float(self.skew_guard.exceeded_steps)}

    def _shape(self) -> dict[str, float]:
        """E and the router's top-k: what the run-health alarms need to read the per-layer
        metrics the same way at any shape (backend.monitor.alarms)."""
        shape = {"moe/num_experts": float(self.num_experts)}
        return shape | ({"moe/top_k": float(self.top_k)} if self.top_k else {})

    def _step_metrics(self, counts_PLE: torch.Tensor, per_phase: dict) -> dict[str, float]:
        flat = {}
        for name, (overall, per_layer) in per_phase.items():
            flat.update(flatten(f"moe/{name}", overall, per_layer if self.per_layer_keys else None))
            if self.top_k:
                tokens = counts_PLE[self.phases.index(name), 0].sum().item() / self.top_k
                flat[f"moe/{name}/tokens"] = tokens
        return flat

    def _cumulative_metrics(self) -> dict[str, float]:
        out = {}
        for i, name in enumerate(self.phases):
            if self.history.cumulative_PLE[i].sum() > 0:
                overall = overall_metrics(self.history.cumulative_PLE[i], self.plan["ep"])
                out.update(flatten(f"moe/{name}/cumulative", overall, None))
        return out

    def _log(self, metrics: dict[str, float], counts_PLE: torch.Tensor, step: int) -> None:
        if self.writer is None:
            return
        tb.log_scalars(self.writer, metrics, step)
        if len(self.history.steps) % self.heatmap_every == 0:
            for i, name in enumerate(self.phases):
                if counts_PLE[i].sum() > 0:
                    tb.log_heatmap(self.writer, f"moe/{name}/heatmap", counts_PLE[i], step)
        self.writer.flush()

    def report(self, model: str = "", **extra) -> dict:
        """The routing-balance report (see backend.monitor.report) of everything so far."""
        from backend.monitor.report import build_report

        warnings = [w.as_dict() for w in self.warnings]
        return build_report(
            self.history, self.plan, model=model, top_k=self.top_k, warnings=warnings, **extra
        )

    def is_writer_rank(self) -> bool:
        return self.groups is None or dist.get_rank(self.groups.world) == 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def write_report(self, path, model: str = "", **extra):
        """Save the report on the first rank (atomic); returns the path there, None elsewhere."""
        from backend.monitor.report import save_report

        return save_report(self.report(model, **extra), path) if self.is_writer_rank() else None
