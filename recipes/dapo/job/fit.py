"""Does the plan fit beside the colocated vLLM rollout? Offload from parallel/'s memory model.

Two moments per device (HEADROOM of its memory usable):
- actor update (vLLM asleep): parallel.memory's update peak, for our local layer spec with
  the least recompute that fits it (none, selective, full: backend.model.recompute; offload does
  not move this peak, so recompute is chosen first) and `micro_batch_tokens` padded tokens
  per micro-batch;
- rollout: what the actor keeps between updates + vLLM's weights (bf16, split over the
  rollout TP) + at least MIN_KV_CACHE_GIB of KV cache.
The least offload that satisfies both is chosen (none, optimizer, params and optimizer), and
vLLM's gpu_memory_utilization is what is left for it after the actor's residency.

Both moments also carry what sits on every chip beside the actor's tensors and is not in
parallel/'s RUNTIME_GIB allowance (the actor process's own context and allocator slack):
- the second device context: colocated, the vLLM engine runs in its own process on the chip
  (verl's server-mode rollout), with its own runtime context and kernels;
- collective buffers: each communicator a rank is in reserves its buffers for its lifetime.
  HCCL: 2 x HCCL_BUFFSIZE (default 200 MB) per communicator (CANN HCCL user guide,
  "HCCL_BUFFSIZE"); NCCL: NCCL_BUFFSIZE (4 MiB) per channel per peer for each protocol, about
  0.5 GiB per communicator at H100 channel counts (an estimate from NCCL's documented defaults).
  Counted: the actor's TP, DP, EP, expert-DP and world groups (size > 1) and vLLM's TP and
  world groups.
The per-context figures are allowances, not measurements: 1 GiB on Ascend (torch_npu + ACL
runtime, aclnn workspaces, ATB tiling buffers: about 0.1 GiB per rank, vllm-ascend issue
#14300), 0.75 GiB on CUDA (CUDA context + cuBLAS workspaces, commonly 0.5-0.8 GiB per process).
Measure them (npu-smi / nvidia-smi per process) before trusting the last decimal.
"""

import math
from dataclasses import dataclass, replace

from backend.model.recompute import RECOMPUTE_CHOICES
from parallel.memory import (
    DEVICE_MEMORY_GIB,
    GIB,
    HEADROOM,
    LogProbPass,
    MemoryOptions,
    estimate_memory,
    log_prob_pass_line,
)
from parallel.params import param_counts
from parallel.plan import ModelFit, PlanError

MIN_KV_CACHE_GIB = 16.0  # ~350k tokens of Qwen3-30B-A3B KV per device at rollout TP 2
SECOND_CONTEXT_GIB = {"npu": 1.0, "cuda": 0.75}  # the vLLM process's device context (allowance)
COMM_BUFFER_GIB = {"npu": 2 * 200 / 1024, "cuda": 0.5}  # per communicator, see above
OFFLOAD_CHOICES = ((False, False), (False, True), (True, True))  # (params, optimizer)


def communicators(plan, rollout_tp: int) -> int:
    """Communicators each chip's ranks are in: the actor's groups of size > 1, and vLLM's."""
    actor = sum(size > 1 for size in (plan.tp, plan.dp, plan.ep, plan.edp, plan.world))
    return actor + sum(size > 1 for size in (rollout_tp, rollout_tp))  # vLLM: TP and its world


@dataclass(frozen=True)
class Fit:
    device_gib: float
    update_gib: float
    actor_idle_gib: float
    rollout_weights_gib: float
    kv_gib: float
    param_offload: bool
    optimizer_offload: bool
    context_gib: float = 0.0  # the second device context (vLLM's process)
    comm_gib: float = 0.0  # collective buffers of every communicator on the chip
    comms: int = 0
    log_prob: LogProbPass | None = None  # the old-log-prob pass's peak, full logits and lean
    recompute: str = "full"  # the least that fits the update (backend.model.recompute choices)
    recompute_tried: tuple[tuple[str, float], ...] = ()  # (mode, update GiB + shared) tried

    @property
    def shared_gib(self) -> float:
        """On the chip in both moments, beside the actor's tensors."""
        return self.context_gib + self.comm_gib

    @property
    def limit_gib(self) -> float:
        return HEADROOM * self.device_gib

    @property
    def gpu_memory_utilization(self) -> float:
        left = self.limit_gib - self.actor_idle_gib - self.shared_gib
        return math.floor(left / self.device_gib * 100) / 100

    def lines(self) -> list[str]:
        offload = {
            (False, False): "none",
            (False, True): "optimizer",
            (True, True): "params+grads and optimizer",
        }[(self.param_offload, self.optimizer_offload)]
        return [
            f"per chip beside the actor: second device context (vLLM) {self.context_gib:.2f} GiB"
            f" + collective buffers {self.comm_gib:.2f} GiB ({self.comms} communicators)",
            f"actor update peak {self.update_gib:.1f} GiB + {self.shared_gib:.1f} GiB of "
            f"{self.limit_gib:.1f} usable ({HEADROOM:.0%} of {self.device_gib:g})",
            f"rollout: actor keeps {self.actor_idle_gib:.1f} GiB + vLLM weights "
            f"{self.rollout_weights_gib:.1f} GiB -> KV cache {self.kv_gib:.1f} GiB "
            f"(>= {MIN_KV_CACHE_GIB:g} needed)",
            *self._recompute_line(),
            f"offload: {offload} (the least that fits); vLLM gpu_memory_utilization "
            f"{self.gpu_memory_utilization:.2f}",
        ] + ([log_prob_pass_line(self.log_prob).strip()] if self.log_prob else [])

    def _recompute_line(self) -> list[str]:
        if not self.recompute_tried:
            return []
        tried = ", ".join(f"{mode} {gib:.1f}" for mode, gib in self.recompute_tried)
        return [
            f"recompute: {self.recompute} (the least whose update fits at the assumed EP skew, "
            f"GiB with the shared: {tried} of {self.limit_gib:.1f})"
        ]


def least_recompute(fit: ModelFit, options: MemoryOptions, shared_gib: float, limit_gib: float):
    """(none | selective | full, [(mode, update GiB + shared_gib) tried]): the first whose
    update peak fits limit_gib, full when none does."""
    tried = []
    for mode in RECOMPUTE_CHOICES:
        need = estimate_memory(fit, replace(options, recompute=mode)).update_bytes / GIB
        tried.append((mode, need + shared_gib))
        if need + shared_gib <= limit_gib:
            break
    return mode, tuple(tried)


def fit_rollout(
    fit: ModelFit, device: str, micro_batch_tokens: int, rollout_tp: int, ep_skew: float = 1.0
) -> Fit:
    """The least offload that fits, or PlanError naming what does not fit. The recompute is
    the least whose update peak fits at ep_skew (the EP skew the run assumes), so that the
    skew verdict holds too; the rest is at balanced routing, as before."""
    device_gib = DEVICE_MEMORY_GIB[device]
    weights_gib = param_counts(fit.spec).total * 2 / rollout_tp / GIB
    comms = communicators(fit.plan, rollout_tp)
    context_gib, comm_gib = SECOND_CONTEXT_GIB[device], comms * COMM_BUFFER_GIB[device]
    shared_gib = context_gib + comm_gib
    at_skew = MemoryOptions(device_gib, micro_batch_tokens, ep_skew=ep_skew)
    recompute, tried = least_recompute(fit, at_skew, shared_gib, HEADROOM * device_gib)
    for params, optimizer in OFFLOAD_CHOICES:
        options = MemoryOptions(
            device_gib,
            micro_batch_tokens,
            recompute=recompute,
            offload_params=params,
            offload_optimizer=optimizer,
        )
        est = estimate_memory(fit, options)
        if est.update_bytes / GIB + shared_gib > HEADROOM * device_gib:
            raise PlanError(
                f"actor update needs {est.update_bytes / GIB + shared_gib:.1f} GiB per device "
                f"(with {shared_gib:.1f} GiB of vLLM context and collective buffers), over "
                f"{HEADROOM:.0%} of {device_gib:g} GiB: raise tp or ep, "
                "or lower ppo_max_token_len_per_gpu"
            )
        idle_gib = est.idle_bytes / GIB
        kv_gib = HEADROOM * device_gib - idle_gib - shared_gib - weights_gib
        if kv_gib >= MIN_KV_CACHE_GIB:
            return Fit(
                device_gib, est.update_bytes / GIB, idle_gib, weights_gib, kv_gib, params,
                optimizer, context_gib, comm_gib, comms, est.log_prob_pass, recompute, tried,
            )  # fmt: skip
    raise PlanError(
        f"vLLM weights ({weights_gib:.1f} GiB per device at rollout TP {rollout_tp}) leave under "
        f"{MIN_KV_CACHE_GIB:g} GiB of KV cache even with full offload: raise the rollout TP"
    )
