"""Does the plan fit beside the colocated vLLM rollout? Offload from parallel/'s memory model.

Two moments per device (HEADROOM of its memory usable):
- actor update (vLLM asleep): parallel.memory's update peak, for our local layer spec with
  full recompute and `micro_batch_tokens` padded tokens per micro-batch;
- rollout: what the actor keeps between updates + vLLM's weights (bf16, split over the
  rollout TP) + at least MIN_KV_CACHE_GIB of KV cache.
The least offload that satisfies both is chosen (none, optimizer, params and optimizer), and
vLLM's gpu_memory_utilization is what is left for it after the actor's residency.
"""

import math
from dataclasses import dataclass

from parallel.memory import DEVICE_MEMORY_GIB, GIB, HEADROOM, MemoryOptions, estimate_memory
from parallel.params import param_counts
from parallel.plan import ModelFit, PlanError

MIN_KV_CACHE_GIB = 16.0  # ~350k tokens of Qwen3-30B-A3B KV per device at rollout TP 2
OFFLOAD_CHOICES = ((False, False), (False, True), (True, True))  # (params, optimizer)


@dataclass(frozen=True)
class Fit:
    device_gib: float
    update_gib: float
    actor_idle_gib: float
    rollout_weights_gib: float
    kv_gib: float
    param_offload: bool
    optimizer_offload: bool

    @property
    def limit_gib(self) -> float:
        return HEADROOM * self.device_gib

    @property
    def gpu_memory_utilization(self) -> float:
        return math.floor((self.limit_gib - self.actor_idle_gib) / self.device_gib * 100) / 100

    def lines(self) -> list[str]:
        offload = {
            (False, False): "none",
            (False, True): "optimizer",
            (True, True): "params+grads and optimizer",
        }[(self.param_offload, self.optimizer_offload)]
        return [
            f"actor update peak {self.update_gib:.1f} GiB of {self.limit_gib:.1f} usable "
            f"({HEADROOM:.0%} of {self.device_gib:g})",
            f"rollout: actor keeps {self.actor_idle_gib:.1f} GiB + vLLM weights "
            f"{self.rollout_weights_gib:.1f} GiB -> KV cache {self.kv_gib:.1f} GiB "
            f"(>= {MIN_KV_CACHE_GIB:g} needed)",
            f"offload: {offload} (the least that fits); vLLM gpu_memory_utilization "
            f"{self.gpu_memory_utilization:.2f}",
        ]


def fit_rollout(fit: ModelFit, device: str, micro_batch_tokens: int, rollout_tp: int) -> Fit:
    """The least offload that fits, or PlanError naming what does not fit."""
    device_gib = DEVICE_MEMORY_GIB[device]
    weights_gib = param_counts(fit.spec).total * 2 / rollout_tp / GIB
    for params, optimizer in OFFLOAD_CHOICES:
        options = MemoryOptions(
            device_gib,
            micro_batch_tokens,
            recompute=True,
            offload_params=params,
            offload_optimizer=optimizer,
        )
        est = estimate_memory(fit, options)
        if not est.fits:
            raise PlanError(
                f"actor update needs {est.update_bytes / GIB:.1f} GiB per device, over "
                f"{HEADROOM:.0%} of {device_gib:g} GiB: raise tp or ep, "
                "or lower ppo_max_token_len_per_gpu"
            )
        idle_gib = est.idle_bytes / GIB
        kv_gib = HEADROOM * device_gib - idle_gib - weights_gib
        if kv_gib >= MIN_KV_CACHE_GIB:
            return Fit(
                device_gib, est.update_bytes / GIB, idle_gib, weights_gib, kv_gib, params, optimizer
            )
    raise PlanError(
        f"vLLM weights ({weights_gib:.1f} GiB per device at rollout TP {rollout_tp}) leave under "
        f"{MIN_KV_CACHE_GIB:g} GiB of KV cache even with full offload: raise the rollout TP"
    )
