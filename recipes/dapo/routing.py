"""The engine's router instruments: expert-load monitor and router aux-loss hook.

Both listen to one RouterTap on the model. Per optimizer step:
  start_step(masks) -> [counting pass] -> per micro-batch set_tokens + fwd/bwd -> end_step()
and forward-only passes (old log-probs, reference) are counted under their own phase.
Either instrument is off when its package is absent or its setting says so; the startup
log line says which.
"""

import logging
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from backend.distributed import ProcessGroups

logger = logging.getLogger(__name__)


class Routing:
    def __init__(self, module, groups: ProcessGroups, spec, aux_loss: dict, monitor: dict):
        self.tap = self.monitor = self.hook = None
        self.updates = 0
        want_monitor = bool(monitor.get("enable"))
        want_aux = aux_loss.get("mode", "off") != "off"
        if not (want_monitor or want_aux):
            logger.warning("mcore_ep: expert-load monitor and router aux loss are off")
            return
        from backend.router_tap import RouterTap

        self.tap = RouterTap(module, groups)
        if want_monitor:
            self.monitor = _monitor(spec, groups, monitor, self.tap)
        if want_aux:
            from backend.aux_loss import AuxLossConfig, mcore_aux_loss

            config = AuxLossConfig(**aux_loss)
            self.hook = mcore_aux_loss(
                module, self.tap, config, groups, grad_scale=groups.size("dp")
            )
            logger.warning("mcore_ep: %s", config.describe())

    @property
    def needs_counting_pass(self) -> bool:
        return self.hook is not None and self.hook.config.needs_counting_pass

    def phase(self, name: str):
        return self.monitor.phase(name) if self.monitor else nullcontext()

    def set_tokens(self, valid_BS: torch.Tensor, response_BS: torch.Tensor | None) -> None:
        if self.hook:
            self.hook.set_tokens(self.hook.valid_tokens(valid_BS, response_BS))
        elif self.tap:
            self.tap.set_token_mask(valid_BS)

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
        """Metrics of this optimizer step (collective over the world when instruments are on)."""
        aux = self.hook.end_step() if self.hook else {}
        if self.tap:
            self.tap.set_token_mask(None)
        if not self.monitor:
            return aux
        self.updates += 1
        return self.monitor.step_end(self.updates, aux_losses=aux)

    def add_warning(self, warning) -> None:
        """A backend.monitor RunWarning (e.g. the comm share's): one log line on the first
        rank, kept in the routing report's warnings when the monitor is on."""
        if self.monitor:
            self.monitor.add_warning(warning)
        elif dist.get_rank() == 0:
            logger.warning(warning.line())

    def write_report(self, path, model: str) -> None:
        if self.monitor:
            self.monitor.write_report(path, model=model)


def _monitor(spec, groups: ProcessGroups, settings: dict, tap):
    """The monitor, with a SkewGuard holding the EP skew the plan's memory verdict assumed
    (settings["assumed_ep_skew"], parallel.skew's default otherwise)."""
    from backend.monitor import ExpertLoadMonitor, SkewGuard, tensorboard_writer
    from parallel.skew import DEFAULT_EP_SKEW

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
