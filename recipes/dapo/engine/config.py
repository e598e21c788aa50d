"""verl config dataclasses for the mcore_ep engine (hydra `_target_`s of the actor section).

verl builds `ActorConfig` objects from the `_target_` of `actor_rollout_ref.actor`; the worker
then asks EngineRegistry for `actor.engine.strategy`. We keep verl's default actor yaml (its
FSDP keys are accepted and unused, hence the FSDPActorConfig base) and swap in our engine
section `actor_rollout_ref.actor.mcore_ep`.
"""

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import ActorConfig, FSDPActorConfig
from verl.workers.config.engine import EngineConfig

from backend.instruments.dispatch_timing import DISPATCH_TIMING_DEFAULT
from backend.instruments.timing import TIMING_DEFAULT
from backend.model.recompute import recompute_mode
from backend.training.loss_guards import GuardSettings
from parallel.weight_sync import DEFAULT_BUCKET_MB
from recipes.dapo import BACKEND, check_actor_cp


class EngineConfigError(ValueError):
    """An mcore_ep engine setting this engine cannot run."""


TRIM_HEAP = ("phase", "step", "off")  # cpu_trim_heap's values


@dataclass
class McoreEpEngineConfig(EngineConfig):
    """Parallel plan and actor options of the mcore_ep engine.

    Parallel sizes use verl's megatron spellings. recompute: "none" | "selective" (core
    attention and the experts' SwiGLU) | "full" (one layer per checkpoint), backend.model.recompute;
    the bools of older configs mean full (True) and none (False). experts / attention: backend.model.build.BuildOptions' choices ("auto": our
    grouped-GEMM experts and SDPA attention where they pay, see there). aux_loss: backend.aux_loss.AuxLossConfig fields (mode, type, coeff,
    z_coeff, scope, global_counts); off by default, as verl's engines for Qwen3-MoE RL (the
    cluster recipe turns it on: docs/aux_loss.md). monitor: {"enable": bool, "log_dir": tensorboard dir or None}.
    timing: per-step `timing/*` metrics and the communication-share warning (backend.instruments.timing;
    on by default: its sections cost under 1% of a step). timing_dispatch: also time every MoE
    layer's token dispatch / combine (off by default: it costs more than that 1%; figures in
    docs/timing.md, "Overhead").
    router_replay: "disabled" | "R2" (the update reuses the old-log-prob pass's experts) |
    "R3" (old-log-prob pass and update use the rollout's `routed_experts`; needs the
    rollout's enable_rollout_routing_replay=True). See docs/routing_replay.md.
    packed: micro-batches as packed sequences (one [1, T] row, megatron-core THD
    PackedSeqParams; planned on real tokens) instead of right-padded [B, S]; needs our SDPA
    attention ("auto" then picks it on every device).
    weight_sync_bucket_mb: the rollout weight stream gathers its tensors in buckets of at
    most this many MiB of full tensors, one collective per group and bucket (0: one per
    tensor); the same names, values and order either way (parallel.weight_sync).
    packed_length_step: with packed, every micro-batch's packed total is rounded up to a
    multiple of this many tokens, so a run sees a bounded set of shapes (backend.model.packing);
    None: 512 on npu (whose operators recompile on new shapes), off elsewhere; 0 or 1: off.
    guards: the opt-in entropy floor and adaptive KL coefficient, off by default
    (backend.training.loss_guards: {"entropy_floor": {"enable": true, "floor": ...}, "kl": {...}}).
    resume_from: the actor checkpoint (global_step_N/actor) verl's resume will load, named by
    the launcher: checked when the engine starts, before the rollout does, so a damaged one
    is refused in a minute, not after the rollout's start-up (recipes.dapo.engine.checkpoint_io).
    updates_per_step: verl's parameter_sync_step (separate_async: a trainer step is that many
    mini-batch updates, and verl gives the optimizer total_training_steps times it); the
    run's last save, which returns sealed, is counted in trainer steps.
    cpu_threads: on device cpu, torch's intra-op threads for this rank (0: the process's own
    setting); the embedded run gives each rank its share of the cores (recipes.local.cpu_overrides).
    cpu_trim_heap: on device cpu, when to return the C library's free heap memory to the OS
    (backend.platform.host_heap): "phase", at each offload (the end of an update or an
    old-log-prob pass); "step", after every optimizer step too (lower peak, slower update);
    "off", glibc's retention.
    """

    strategy: str = BACKEND
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    recompute: str | bool = "none"
    experts: str = "auto"
    attention: str = "auto"
    aux_loss: dict[str, Any] = field(default_factory=lambda: {"mode": "off"})
    monitor: dict[str, Any] = field(default_factory=lambda: {"enable": True, "log_dir": None})
    checkpoint_shard_gb: float = 4.0
    timing: bool = TIMING_DEFAULT
    timing_dispatch: bool = DISPATCH_TIMING_DEFAULT
    router_replay: str = "disabled"
    packed: bool = False
    weight_sync_bucket_mb: float = DEFAULT_BUCKET_MB
    packed_length_step: int | None = None
    guards: dict[str, Any] = field(default_factory=dict)
    resume_from: str | None = None
    updates_per_step: int = 1
    cpu_threads: int = 0
    cpu_trim_heap: str = "phase"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != BACKEND:
            raise EngineConfigError(
                f"strategy={self.strategy!r} is not {BACKEND!r}: use McoreEpActorConfig "
                f"only with actor.strategy={BACKEND}"
            )
        try:
            check_actor_cp(self.context_parallel_size)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        try:
            recompute_mode(self.recompute)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        if self.router_replay not in ("disabled", "R2", "R3"):
            raise EngineConfigError(
                f"router_replay={self.router_replay!r}: choose disabled, R2 or R3"
            )
        if self.packed and self.attention == "local":
            raise EngineConfigError(
                "packed=True needs attention='sdpa' (or 'auto'): megatron-core's local "
                "attention has no packed-sequence (THD) path"
            )
        if not self.weight_sync_bucket_mb >= 0:
            raise EngineConfigError(
                f"weight_sync_bucket_mb={self.weight_sync_bucket_mb!r}: give the bucket size "
                "in MiB (0: gather one tensor at a time)"
            )
        if self.packed_length_step is not None and self.packed_length_step < 0:
            raise EngineConfigError(
                f"packed_length_step={self.packed_length_step!r}: give a token count "
                "(e.g. 512), 0 for none, or leave it unset for the device's default"
            )
        try:
            GuardSettings.from_dict(self.guards)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        if not (isinstance(self.updates_per_step, int) and self.updates_per_step >= 1):
            raise EngineConfigError(
                f"updates_per_step={self.updates_per_step!r}: give verl's parameter_sync_step "
                "(optimizer updates per trainer step, >= 1)"
            )
        if not (isinstance(self.cpu_threads, int) and self.cpu_threads >= 0):
            raise EngineConfigError(
                f"cpu_threads={self.cpu_threads!r}: give torch's thread count for a CPU rank "
                "(0: leave the process's own)"
            )
        if self.cpu_trim_heap not in TRIM_HEAP:
            raise EngineConfigError(
                f"cpu_trim_heap={self.cpu_trim_heap!r}: choose {', '.join(TRIM_HEAP)}"
            )
        if self.dtype not in ("bfloat16", "float32"):
            raise EngineConfigError(
                f"dtype={self.dtype!r}: choose bfloat16 (accelerators) or float32"
            )

    def plan(self, world: int):
        """The parallel.plan.ParallelPlan of these sizes over `world` ranks (validated there)."""
        from parallel.plan import ParallelPlan

        return ParallelPlan.for_world(
            world,
            tp=self.tensor_model_parallel_size,
            ep=self.expert_model_parallel_size,
            etp=self.expert_tensor_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp=self.context_parallel_size,
        )

    @property
    def resolved_attention(self) -> str:
        """`attention`, with "auto" -> "sdpa" when packed (the only packed-capable one)."""
        return "sdpa" if self.packed and self.attention == "auto" else self.attention


@dataclass
class McoreEpActorConfig(FSDPActorConfig):
    """verl's actor config with the mcore_ep engine as `engine` (its `fsdp_config` is unused)."""

    strategy: str = BACKEND
    mcore_ep: McoreEpEngineConfig = field(default_factory=McoreEpEngineConfig)

    def __post_init__(self) -> None:
        ActorConfig.__post_init__(self)
        if self.strategy != BACKEND:
            raise EngineConfigError(
                f"actor.strategy={self.strategy!r} with McoreEpActorConfig: set it to {BACKEND}"
            )
        self.engine = self.mcore_ep
