"""Per-device memory of a Qwen3-MoE actor under a parallel plan.

Terms, per device of the heaviest pipeline stage (megatron DDP + distributed optimizer):
  params      2 B per parameter (bf16)
  grads       4 B per parameter (fp32 main-grad buffer, full size on every rank)
  optimizer   12 B per parameter (fp32 master copy + Adam m and v), sharded over the
              data-parallel group: dp*cp ranks for dense params, edp ranks for experts
  activations parallel.activations (per layer per token, top-k replication, tp/sp, cp);
              the expert side scaled by the EP routing skew s (ep_skew, capped at ep)
  dispatch    the dispatch/combine buffers of the MoE layer in flight, scaled by s
  logits      last stage: the log-prob head (parallel.head_memory): the lean head's chunk buffers,
              hidden states and fp32 output-weight gradient (the engine's), or with
              lean_heads=False T/cp tokens x padded_vocab/tp x 10 B (bf16 logits, their fp32
              copy and the fp32 softmax kept for backward); plus the final-norm and
              output-layer inputs
  runtime     device context and communicator buffers (RUNTIME_GIB, an allowance)
Two columns: the peak during an actor update, and what stays on the device between
updates while rollout runs. Beside them, the peak of the log-prob pass (old log-probs with
entropy, no grad, log_prob_tokens per micro-batch) on the last stage, full logits and lean. verl's param_offload copies params to host and releases the
grad buffers between updates; optimizer_offload moves the optimizer state. Both load
everything back for the update, so they shrink the second column, not the first.
"""

from dataclasses import dataclass

from backend.model.recompute import recompute_mode
from parallel.activations import (
    ACCELERATOR_KERNELS,
    Kernels,
    dispatch_buffer_bytes,
    stage_activation_bytes,
)
from parallel.head_memory import head_bytes
from parallel.params import DeviceParams, device_params
from parallel.plan import ModelFit

GIB = 2**30
DEVICE_MEMORY_GIB = {"npu": 64.0, "cuda": 80.0}  # Ascend A2, H100 SXM
HEADROOM = 0.9  # past this share of device memory, fragmentation and transient buffers bite
RUNTIME_GIB = 2.0


@dataclass(frozen=True)
class MemoryOptions:
    device_memory_gib: float | None  # None: report the breakdown without a fit verdict
    micro_batch_tokens: int = 8192  # tokens of one micro-batch of one data-parallel replica
    # "none" | "selective" | "full" (backend.model.recompute; True / False: full / none)
    recompute: str | bool = "none"
    offload_params: bool = False  # verl param_offload
    offload_optimizer: bool = False  # verl optimizer_offload
    kernels: Kernels = ACCELERATOR_KERNELS
    activation_bytes: int = 2  # bf16
    # tokens on the busiest EP rank / the EP mean (1: balanced); parallel.skew picks it
    ep_skew: float = 1.0
    lean_heads: bool = True  # backend.model.lean_head (the engine's); False: full logits
    # tokens of one log-prob (no grad) micro-batch; None: twice micro_batch_tokens, as
    # recipes/dapo sets log_prob_max_token_len_per_gpu
    log_prob_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", recompute_mode(self.recompute))
        if not self.ep_skew >= 1.0:  # also rejects NaN
            raise ValueError(f"ep_skew={self.ep_skew} must be >= 1 (busiest EP rank over the mean)")

    @property
    def log_prob_micro_tokens(self) -> int:
        return self.log_prob_tokens or 2 * self.micro_batch_tokens

    def skew_for(self, ep: int) -> float:
        """The skew the plan can see: max over mean of ep ranks is at most ep."""
        return min(self.ep_skew, float(ep))


@dataclass(frozen=True)
class MemoryRow:
    name: str
    update: float  # bytes on the device at the update peak
    idle: float  # bytes left on the device between updates
    host: float  # bytes held in host memory between updates


@dataclass(frozen=True)
class LogProbPass:
    """Peak of the log-prob pass on the last stage: the head with full logits and lean, and
    what else is on the device then (params, grads and optimizer unless offloaded, runtime,
    the MoE dispatch buffers of the layer in flight)."""

    tokens: int
    full_head: float
    lean_head: float
    resident: float

    @property
    def ratio(self) -> float:
        return self.lean_head / self.full_head


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int  # the heaviest pipeline stage, which the rows describe
    params: DeviceParams
    rows: tuple[MemoryRow, ...]
    device_memory_gib: float | None
    log_prob_pass: LogProbPass | None = None

    @property
    def update_bytes(self) -> float:
        return sum(r.update for r in self.rows)

    @property
    def idle_bytes(self) -> float:
        return sum(r.idle for r in self.rows)

    @property
    def host_bytes(self) -> float:
        return sum(r.host for r in self.rows)

    @property
    def utilization(self) -> float | None:
        if not self.device_memory_gib:
            return None
        return self.update_bytes / (self.device_memory_gib * GIB)

    @property
    def fits(self) -> bool:
        """Update peak within HEADROOM of device memory (True when memory is unknown)."""
        return self.utilization is None or self.utilization <= HEADROOM


def _offloadable(name: str, nbytes: float, offloaded: bool, to_host: bool = True) -> MemoryRow:
    return MemoryRow(
        name, nbytes, 0.0 if offloaded else nbytes, nbytes if offloaded and to_host else 0.0
    )


def _logits_bytes(
    fit: ModelFit, stage: int, options: MemoryOptions, grad: bool = True, lean: bool | None = None
) -> float:
    if stage != fit.plan.pp - 1:
        return 0.0
    plan, h, b = fit.plan, fit.spec.hidden_size, options.activation_bytes
    tokens = options.micro_batch_tokens if grad else options.log_prob_micro_tokens
    lean = options.lean_heads if lean is None else lean
    head_inputs = 2 * tokens / (plan.tp * plan.cp) * h * b
    vocab_local = fit.padded_vocab / plan.tp
    return head_bytes(tokens / plan.cp, vocab_local, h, b, lean, grad) + head_inputs


def log_prob_pass(fit: ModelFit, options: MemoryOptions) -> LogProbPass:
    """The log-prob pass's peak on the last stage (LogProbPass)."""
    stage, plan = fit.plan.pp - 1, fit.plan
    params = device_params(fit, stage)
    optimizer = 12 * params.dense / (plan.dp * plan.cp) + 12 * params.expert / plan.edp
    tokens = options.log_prob_micro_tokens
    resident = (
        2 * params.total
        + (0.0 if options.offload_params else 4 * params.total)
        + (0.0 if options.offload_optimizer else optimizer)
        + RUNTIME_GIB * GIB
        + dispatch_buffer_bytes(fit.spec, plan, tokens, options.activation_bytes,
                                ep_skew=options.skew_for(plan.ep))
    )  # fmt: skip
    full, lean = (_logits_bytes(fit, stage, options, False, lean) for lean in (False, True))
    return LogProbPass(tokens, full, lean, resident)


def stage_rows(
    fit: ModelFit, stage: int, params: DeviceParams, options: MemoryOptions
) -> tuple[MemoryRow, ...]:
    plan = fit.plan
    optimizer = 12 * params.dense / (plan.dp * plan.cp) + 12 * params.expert / plan.edp
    skew = options.skew_for(plan.ep)
    activations = stage_activation_bytes(
        fit,
        stage,
        options.micro_batch_tokens,
        options.recompute,
        options.activation_bytes,
        options.kernels,
        ep_skew=skew,
    )
    buffers = dispatch_buffer_bytes(
        fit.spec, plan, options.micro_batch_tokens, options.activation_bytes, ep_skew=skew
    )
    recompute = "no recompute" if options.recompute == "none" else f"{options.recompute} recompute"
    runtime = RUNTIME_GIB * GIB
    return (
        _offloadable("params (bf16)", 2 * params.total, options.offload_params),
        # param_offload releases the grad buffers: nothing to copy back
        _offloadable(
            "grads (fp32 main grads)", 4 * params.total, options.offload_params, to_host=False
        ),
        _offloadable(
            "optimizer (fp32 master + Adam, sharded)", optimizer, options.offload_optimizer
        ),
        MemoryRow(f"activations ({recompute}, {skew:g}x EP skew)", activations, 0.0, 0.0),
        MemoryRow("MoE dispatch/combine buffers", buffers, 0.0, 0.0),
        MemoryRow(
            f"logits and output layer ({'lean head' if options.lean_heads else 'full logits'})",
            _logits_bytes(fit, stage, options),
            0.0,
            0.0,
        ),
        MemoryRow("runtime (context, comm buffers)", runtime, runtime, 0.0),
    )


def estimate_memory(fit: ModelFit, options: MemoryOptions) -> MemoryEstimate:
    """Memory of the pipeline stage with the highest update peak."""
    estimates = []
    passes = log_prob_pass(fit, options)
    for stage in range(fit.plan.pp):
        params = device_params(fit, stage)
        rows = stage_rows(fit, stage, params, options)
        estimates.append(MemoryEstimate(stage, params, rows, options.device_memory_gib, passes))
    return max(estimates, key=lambda e: e.update_bytes)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:8.2f}"


def format_memory(estimate: MemoryEstimate, pp: int) -> str:
    """The breakdown as a table (GiB per device)."""
    p = estimate.params
    lines = [
        f"memory per device, pipeline stage {estimate.stage} of {pp} (the heaviest), GiB; "
        f"{p.total / 1e9:.2f}B params here ({p.dense / 1e9:.2f}B dense, "
        f"{p.expert / 1e9:.2f}B expert)",
        f"  {'term':<42}{'update':>8}  {'between':>8}  {'host':>8}",
    ]
    for r in estimate.rows:
        lines.append(f"  {r.name:<42}{_gib(r.update)}  {_gib(r.idle)}  {_gib(r.host)}")
    lines.append(
        f"  {'total':<42}{_gib(estimate.update_bytes)}  {_gib(estimate.idle_bytes)}  "
        f"{_gib(estimate.host_bytes)}"
    )
    if estimate.log_prob_pass is not None:
        lines.append(log_prob_pass_line(estimate.log_prob_pass))
    if estimate.utilization is not None:
        verdict = "fits" if estimate.fits else f"does NOT fit (limit {HEADROOM:.0%})"
        lines.append(
            f"  update peak {estimate.utilization:.0%} of "
            f"{estimate.device_memory_gib:g} GiB: {verdict}"
        )
    return "\n".join(lines)


def log_prob_pass_line(p: LogProbPass) -> str:
    """One line: the log-prob pass's head and peak, full logits -> lean."""
    return (
        f"  log-prob pass (no grad, entropy, {p.tokens} tokens, last stage): head "
        f"{p.full_head / GIB:.2f} GiB full logits -> {p.lean_head / GIB:.2f} GiB lean "
        f"({p.ratio:.2f}x); peak {(p.resident + p.full_head) / GIB:.2f} -> "
        f"{(p.resident + p.lean_head) / GIB:.2f} GiB"
    )


@dataclass(frozen=True)
class RecomputeChoice:
    """The least recompute whose update peak fits, with what each lighter one needed."""

    mode: str
    estimate: MemoryEstimate
    tried: tuple[tuple[str, float | None], ...]  # (mode, utilization) in the order tried

    def line(self) -> str:
        """e.g. 'recompute: selective (auto, the least that fits 90%: none 98%, selective 86%,
        margin 2.6 GiB)'."""
        uses = ", ".join(f"{m} {u:.0%}" if u is not None else m for m, u in self.tried)
        est = self.estimate
        if est.utilization is None:
            return f"recompute: {self.mode} (auto; no device memory given, so no verdict)"
        if not est.fits:
            return (
                f"recompute: {self.mode} (auto: nothing fits {HEADROOM:.0%}: {uses}; "
                "full keeps the least)"
            )
        margin = (HEADROOM * est.device_memory_gib * GIB - est.update_bytes) / GIB
        return (
            f"recompute: {self.mode} (auto, the least that fits {HEADROOM:.0%}: {uses}; "
            f"margin {margin:.1f} GiB)"
        )


def least_recompute(fit: ModelFit, options: MemoryOptions) -> RecomputeChoice:
    """none if it fits, else selective, else full (full also when nothing fits)."""
    from dataclasses import replace

    from backend.model.recompute import RECOMPUTE_CHOICES

    tried = []
    for mode in RECOMPUTE_CHOICES:
        estimate = estimate_memory(fit, replace(options, recompute=mode))
        tried.append((mode, estimate.utilization))
        if estimate.fits:
            break
    return RecomputeChoice(mode, estimate, tuple(tried))
