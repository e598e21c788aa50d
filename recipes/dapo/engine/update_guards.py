"""The opt-in loss guards (backend.training.loss_guards) inside the mcore_ep engine's update.

verl's loss of each micro-batch is computed first, unchanged; EngineGuards.loss adds the
guards' terms on the same outputs (entropy from the lean head, which the engine computes in
the update while the entropy floor is on; the KL from verl's own kl_penalty against the
batch's ref_log_prob), and end_step, after each optimizer step, reduces the step's token means
over DP, returns them with the coefficients the step used as `guard/*` metrics (verl logs
`actor/guard/*`), and moves the coefficients for the next step.

The KL guard needs verl's reference log-probs in the batch: `actor.use_kl_loss=True` with a
reference (`actor_rollout_ref.ref`), and `actor.kl_loss_coef=0`, since the guard owns the
coefficient (verl would add its own constant one on top).
"""

import logging

import torch
import torch.distributed as dist

from backend.instruments.router_instruments import config_logger
from backend.training.loss_guards import (
    AdaptiveKL,
    EntropyFloor,
    GuardConfigError,
    GuardSettings,
    entropy_bonus,
    kl_term,
    masked_sum_count,
)

logger = logging.getLogger(__name__)


def _response_lengths(data) -> torch.Tensor:
    responses = data["responses"]
    if responses.is_nested:
        return responses.offsets().diff()
    return data["attention_mask"][:, -responses.shape[1] :].sum(-1)


def _mask_BR(data, width: int, device) -> torch.Tensor:
    """Response-token mask [B, width] of the padded layout verl's no_padding_2_padding makes."""
    lengths_B = _response_lengths(data).to(device)
    return torch.arange(width, device=device)[None, :] < lengths_B[:, None]


def _padded_BR(data, key: str, width: int) -> torch.Tensor:
    values = data.select(key).to_padded_tensor()[key]
    if values.shape[1] < width:
        values = torch.nn.functional.pad(values, (0, width - values.shape[1]))
    return values[:, :width]


class EngineGuards:
    """The entropy floor and the adaptive KL of one engine (either may be off)."""

    def __init__(self, settings: dict | None):
        self.settings = GuardSettings.from_dict(settings)
        s = self.settings
        self.floor = EntropyFloor(s.entropy_floor) if s.entropy_floor else None
        self.kl = AdaptiveKL(s.kl) if s.kl else None
        self._sums = None  # [entropy, kl] x [sum, count] of this step, on the loss's device
        if self.on:
            config_logger.info("mcore_ep: config: %s", s.describe())

    @property
    def on(self) -> bool:
        return self.floor is not None or self.kl is not None

    @property
    def needs_entropy(self) -> bool:
        return self.floor is not None

    def loss(self, model_output: dict, data, verl_metrics: dict):
        """The guards' terms of one micro-batch's loss (a scalar tensor), or None when off."""
        from verl.workers.utils.padding import no_padding_2_padding

        if not self.on:
            return None
        logp_BR = no_padding_2_padding(model_output["log_probs"], data)
        mask_BR = _mask_BR(data, logp_BR.shape[1], logp_BR.device)
        tokens, dp = data["batch_num_tokens"], data["dp_size"]
        if self._sums is None:
            self._sums = torch.zeros(2, 2, dtype=torch.float32, device=logp_BR.device)
        terms = []
        if self.floor is not None:
            entropy_BR = no_padding_2_padding(model_output["entropy"], data)
            self._sums[0] += masked_sum_count(entropy_BR, mask_BR)
            terms.append(entropy_bonus(entropy_BR, mask_BR, self.floor.coef, tokens, dp))
        if self.kl is not None:
            kl_BR = self._kl_BR(logp_BR, data, verl_metrics)
            self._sums[1] += masked_sum_count(kl_BR, mask_BR)
            terms.append(kl_term(kl_BR, mask_BR, self.kl.coef, tokens, dp))
        return sum(terms)

    def _kl_BR(self, logp_BR, data, verl_metrics: dict) -> torch.Tensor:
        from verl.trainer.ppo.core_algos import kl_penalty

        if "ref_log_prob" not in data.keys():
            raise GuardConfigError(
                "mcore_ep.guards.kl needs the reference log-probs: set "
                "actor_rollout_ref.actor.use_kl_loss=True with a reference model "
                "(actor_rollout_ref.ref) and kl_loss_coef=0"
            )
        verl_coef = verl_metrics.get("kl_coef")
        if verl_coef not in (None, 0, 0.0):
            raise GuardConfigError(
                f"mcore_ep.guards.kl sets the KL coefficient, but actor.kl_loss_coef={verl_coef} "
                "adds verl's own on top: set actor_rollout_ref.actor.kl_loss_coef=0"
            )
        ref_BR = _padded_BR(data, "ref_log_prob", logp_BR.shape[1]).to(logp_BR)
        return kl_penalty(logp_BR, ref_BR, self.kl.config.kl_type)

    def end_step(self, dp_group, device) -> dict[str, float]:
        """After an optimizer step (every rank): its `guard/*` metrics; the next coefficients."""
        if not self.on:
            return {}
        sums = torch.zeros(2, 2, device=device) if self._sums is None else self._sums.to(device)
        if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)  # stages without the loss add zeros
        sums, self._sums = sums.cpu(), None
        metrics = {}
        for name, guard, (total, count) in (("entropy", self.floor, sums[0]),
                                            ("kl", self.kl, sums[1])):  # fmt: skip
            if guard is None or count == 0:  # off, or a stage without the loss
                continue
            mean = float(total / count)
            metrics.update({f"guard/{name}": mean, f"guard/{name}_coef": guard.coef})
            guard.update(mean)
        return metrics
