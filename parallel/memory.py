"""Per-device memory of a Qwen3-MoE actor under a parallel plan.

Terms, per device of the heaviest pipeline stage (megatron DDP + distributed optimizer):
  params      2 B per parameter (bf16)
  grads       4 B per parameter (fp32 main-grad buffer, full size on every rank)
  optimizer   12 B per parameter (fp32 master copy + Adam m and v), sharded over the
              data-parallel group: dp*cp ranks for dense params, edp ranks for experts
  activations parallel.activations (per layer per token, top-k replication, tp/sp, cp);
              the expert side scaled by the EP routing skew s (ep_skew, capped at ep)
  dispatch    the dispatch/combine buffers of the MoE layer in flight, scaled by s
  logits      last stage: T/cp tokens x padded_vocab/tp x LOGIT_BYTES (bf16 logits, their
              fp32 copy and the fp32 softmax kept for the log-prob/entropy backward), plus the
              final-norm and output-layer inputs
  runtime     device context and communicator buffers (RUNTIME_GIB, an allowance)
Two columns: the peak during an actor update, and what stays on the device between
updates while rollout runs. verl's param_offload copies params to host and releases the
grad buffers between updates; optimizer_offload moves the optimizer state. Both load
everything back for the update, so they shrink the second column, not the first.
"""

from dataclasses import dataclass

from parallel.activations import (
    ACCELERATOR_KERNELS,
    Kernels,
    dispatch_buffer_bytes,
    stage_activation_bytes,
)
from parallel.params import DeviceParams, device_params
from parallel.plan import ModelFit

GIB = 2**30
DEVICE_MEMORY_GIB = {"npu": 64.0, "cuda": 80.0}  # Ascend A2, H100 SXM
DEVICE_LABELS = {"npu": "Ascend A2", "cuda": "H100", "cpu": "CPU"}
HEADROOM = 0.9  # past this share of device memory, fragmentation and transient buffers bite
LOGIT_BYTES = 10
RUNTIME_GIB = 2.0


@dataclass(frozen=True)
class MemoryOptions:
    device_memory_gib: float | None  # None: report the breakdown without a fit verdict
    micro_batch_tokens: int = 8192  # tokens of one micro-batch of one data-parallel replica
    recompute: bool = False  # full recompute, one layer per checkpoint
    offload_params: bool = False  # verl param_offload
    offload_optimizer: bool = False  # verl optimizer_offload
    kernels: Kernels = ACCELERATOR_KERNELS
    activation_bytes: int = 2  # bf16
    # tokens on the busiest EP rank / the EP mean (1: balanced); parallel.skew picks it
    ep_skew: float = 1.0

    def __post_init__(self) -> None:
        if not self.ep_skew >= 1.0:  # also rejects NaN
            raise ValueError(f"ep_skew={self.ep_skew} must be >= 1 (busiest EP rank over the mean)")

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
class MemoryEstimate:
    stage: int  # the heaviest pipeline stage, which the rows describe
    params: DeviceParams
    rows: tuple[MemoryRow, ...]
    device_memory_gib: float | None

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


def _logits_bytes(fit: ModelFit, stage: int, options: MemoryOptions) -> float:
    if stage != fit.plan.pp - 1:
        return 0.0
    plan, tokens = fit.plan, options.micro_batch_tokens
    head_inputs = 2 * tokens / (plan.tp * plan.cp) * fit.spec.hidden_size * options.activation_bytes
    return tokens / plan.cp * fit.padded_vocab / plan.tp * LOGIT_BYTES + head_inputs


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
    recompute = "full recompute" if options.recompute else "no recompute"
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
        MemoryRow("logits and output layer", _logits_bytes(fit, stage, options), 0.0, 0.0),
        MemoryRow("runtime (context, comm buffers)", runtime, runtime, 0.0),
    )


def estimate_memory(fit: ModelFit, options: MemoryOptions) -> MemoryEstimate:
    """Memory of the pipeline stage with the highest update peak."""
    estimates = []
    for stage in range(fit.plan.pp):
        params = device_params(fit, stage)
        rows = stage_rows(fit, stage, params, options)
        estimates.append(MemoryEstimate(stage, params, rows, options.device_memory_gib))
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
    if estimate.utilization is not None:
        verdict = "fits" if estimate.fits else f"does NOT fit (limit {HEADROOM:.0%})"
        lines.append(
            f"  update peak {estimate.utilization:.0%} of "
            f"{estimate.device_memory_gib:g} GiB: {verdict}"
        )
    return "\n".join(lines)
