"""The router instruments: one object owning the router tap, the expert-load monitor, the
router aux-loss hook, the phase labels and the aux loss's counting pass.

The monitor and the hook listen to one RouterTap on the model. Per optimizer step:
  start_step(masks) -> [counting pass] -> per micro-batch set_tokens + fwd/bwd -> end_step()
and forward-only passes (old log-probs, reference) are counted under their own phase; with
aux_loss.global_counts="old_log_prob" the old-log-prob phase also counts the global_batch f
of the trainer step's updates (no counting pass), forgotten at end_trainer_step().
Either instrument is off when its package is absent or its setting says so; the startup
log line says which. How the optimizer reduces gradients over DP is declared data
(`dp_reduction`, e.g. backend.training.optim.DP_REDUCTION), from which aux_grad_scale derives the aux
loss's gradient scale.

Routing replay (mcore_ep.router_replay, see docs/routing_replay.md): the same tap forces the
experts (backend.model.router_replay) where `set_routes` gives some; the monitor counts the
experts actually used, the aux loss reads the router's own choice and probabilities. Two
more listeners: RouteRecorder (R2: the old-log-prob pass's own routes) and two
AgreementMeters against the rollout's routes: the router's own top-k set in the old-log-prob
pass (`moe/routing_agreement/*`) and the experts used in the update, after any replay
(`moe/update_route_match/*`; 1.0 under R3).
"""

import logging
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from backend.model.router_replay import AgreementMeter, RouteRecorder, route_dtype
from backend.training.distributed import ProcessGroups

logger = logging.getLogger(__name__)
# the engine's configuration, at INFO whatever the root's level (verl sets WARNING): a
# `mcore_ep: config: ...` line, which the launcher's console shows as configuration
config_logger = logging.getLogger(f"{__name__}.config")
config_logger.setLevel(logging.INFO)
REPLAY_MODES = ("disabled", "R2", "R3")
DP_REDUCTIONS = ("mean", "sum")


def aux_grad_scale(dp_reduction: str, dp_size: int) -> float:
    """The aux loss's gradient scale when the optimizer reduces gradients over DP by
    `dp_reduction`.

    The aux objective J is normalised by the step's global token (or sequence) count, so the
    per-rank gradients *summed* over DP give dJ/dθ; a reduction that averages divides by the DP
    size, which the scale undoes (as verl multiplies its token-mean loss by dp_size):

        scale = dp_size   if dp_reduction == "mean"   (megatron-core's DDP, backend.training.optim)
        scale = 1         if dp_reduction == "sum"    (tests/support/reference_actor.py)
    """
    if dp_reduction not in DP_REDUCTIONS:
        raise ValueError(f"dp_reduction={dp_reduction!r}: choose one of {', '.join(DP_REDUCTIONS)}")
    return float(dp_size) if dp_reduction == "mean" else 1.0


class RouterInstruments:
    """The router instruments of one model (stage): tap, monitor, aux-loss hook, replay."""

    def __init__(
        self,
        module,
        groups: ProcessGroups,
        spec,
        aux_loss: dict,
        monitor: dict,
        *,
        dp_reduction: str,
        replay: str = "disabled",
    ):
        """dp_reduction: how the optimizer reduces gradients over DP, "mean" or "sum"."""
        from backend.instruments.router_tap import RouterTap

        if replay not in REPLAY_MODES:
            raise ValueError(f"router_replay={replay!r}: choose one of {', '.join(REPLAY_MODES)}")
        self.aux_grad_scale = aux_grad_scale(dp_reduction, groups.size("dp"))
        self.groups, self.replay_mode = groups, replay
        self.monitor = self.hook = None
        self.updates = 0
        self.trainer_steps = 0  # ended so far (a resumed run starts at its checkpoint's)
        self.run_name = str(monitor.get("run_name") or "")
        self.pending: dict[str, float] = {}  # old-log-prob metrics, reported with the update
        self.tap = RouterTap(module, groups, replay=replay != "disabled")
        self.agreement = AgreementMeter(spec.num_layers, spec.num_experts)
        self.update_match = AgreementMeter(spec.num_layers, spec.num_experts, used=True)
        self.recorder = RouteRecorder(spec.top_k, route_dtype(spec.num_experts))
        self.tap.add_listener(self.agreement)
        self.tap.add_listener(self.update_match)
        self.tap.add_listener(self.recorder)
        if replay != "disabled":
            config_logger.info("mcore_ep: config: router replay %s", replay)
        want_monitor = bool(monitor.get("enable"))
        want_aux = aux_loss.get("mode", "off") != "off"
        if not (want_monitor or want_aux):
            logger.warning("mcore_ep: expert-load monitor and router aux loss are off")
            return
        if want_monitor:
            self.monitor = _monitor(spec, groups, monitor, self.tap)
        if want_aux:
            from backend.aux_loss import AuxLossConfig, mcore_aux_loss

            config = AuxLossConfig(**aux_loss)
            self.hook = mcore_aux_loss(
                module, self.tap, config, groups, grad_scale=self.aux_grad_scale
            )
            config_logger.info("mcore_ep: config: %s", config.describe())

    @property
    def needs_counting_pass(self) -> bool:
        return self.hook is not None and self.hook.config.needs_counting_pass

    @contextmanager
    def phase(self, name: str):
        """A forward pass of this phase: monitored; "old_log_prob" counts the aux loss's f
        when it is taken from there, and its agreement; "update" its route match."""
        self.agreement.on, self.update_match.on = name == "old_log_prob", name == "update"
        try:
            with self.monitor.phase(name) if self.monitor else nullcontext():
                with self._step_counts() if name == "old_log_prob" else nullcontext():
                    yield
        finally:
            self.agreement.on = self.update_match.on = False

    def _step_counts(self):
        if self.hook is None or not self.hook.config.counts_from_old_log_prob:
            return nullcontext()
        return self.hook.old_log_prob_counts()

    def end_trainer_step(self) -> None:
        """After a trainer step's last update: its old-log-prob counts are spent."""
        self.trainer_steps += 1
        if self.hook:
            self.hook.drop_old_log_prob_counts()

    def set_tokens(self, valid_BS: torch.Tensor, response_BS: torch.Tensor | None) -> None:
        if self.hook:
            self.hook.set_tokens(self.hook.valid_tokens(valid_BS, response_BS))
        elif self.tap:
            self.tap.set_token_mask(valid_BS)

    def set_routes(self, replay=None, reference=None, record: bool = False) -> None:
        """Routes to force and to compare with in the next micro-batch; `record`: keep the
        router's own routes for RouteRecorder.take_BSLK."""
        self.tap.set_routes(replay=replay, reference=reference)
        self.recorder.on = record

    def take_agreement(self) -> dict[str, float]:
        """Agreement of the forwards since the last call (collective over the world)."""
        return self.agreement.take(self.groups)

    def start_step(self, micro_batches) -> None:
        if self.hook:
            self.hook.start_step(
                [self.hook.valid_tokens(mb.valid_BS, mb.response_BS) for mb in micro_batches]
            )

    @contextmanager
    def counting(self):
        """The aux loss's counting pass: counted by the hook, not by the monitor."""
        with self.monitor.unmonitored() if self.monitor else nullcontext():
            with self.hook.counting() if self.needs_counting_pass else nullcontext():
                yield

    def end_step(self) -> dict[str, float]:
        """Metrics of this optimizer step (collective over the world when instruments are on),
        with the pending old-log-prob metrics (agreement, log-prob mismatch) of this step and
        its update's route match."""
        aux = self.hook.end_step() if self.hook else {}
        self.set_routes()
        self.tap.set_token_mask(None)
        extra, self.pending = {**self.pending, **self.update_match.take(self.groups)}, {}
        if not self.monitor:
            return {**aux, **extra}
        self.updates += 1
        return self.monitor.step_end(
            self.updates, aux_losses=aux, extra=extra, trainer_step=self.trainer_steps + 1
        )

    def add_warning(self, warning) -> None:
        """A backend.monitor RunWarning (e.g. the comm share's): one log line on the first
        rank, kept in the routing report's warnings when the monitor is on."""
        if self.monitor:
            self.monitor.add_warning(warning)
        elif dist.get_rank() == 0:
            logger.warning(warning.line())

    def write_report(self, path, model: str) -> None:
        if self.monitor:
            self.monitor.write_report(path, model=model, router_replay=self.replay_mode,
                                      run=self.run_name, trainer_steps=self.trainer_steps)  # fmt: skip


def _monitor(spec, groups: ProcessGroups, settings: dict, tap):
    """The monitor, with a SkewGuard holding the EP skew the plan's memory verdict assumed
    (settings["assumed_ep_skew"], the fresh-run default otherwise)."""
    from backend.monitor import ExpertLoadMonitor, SkewGuard, tensorboard_writer
    from backend.shared.names import DEFAULT_EP_SKEW

    log_dir = settings.get("log_dir")
    writer = tensorboard_writer(log_dir, groups) if log_dir else None
    guard = SkewGuard(
        float(settings.get("assumed_ep_skew") or DEFAULT_EP_SKEW),
        every_n_steps=int(settings.get("skew_warn_every", 50)),
    )
    monitor = ExpertLoadMonitor(
        spec.num_layers, spec.num_experts, groups, writer=writer, top_k=spec.top_k,
        skew_guard=guard,
    )  # fmt: skip
    return monitor.attach(tap)
