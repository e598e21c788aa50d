"""Bytes one rank moves in a DAPO step's collectives, by group (TP / EP / DP) and phase: the
model beside what backend.instruments.comm_bytes counts in a run.

A collective's bytes are its larger buffer on the rank (nccl-tests' message size): the input
of an all-reduce or reduce-scatter, the output of an all-gather. Per rank, with T the tokens
of a pass on it (its micro-batches' padded sequences), t = T / tp its sequence-parallel
share, L layers, H hidden, E experts, k top-k, b bytes a value (4 in the CPU run's fp32, 2 in
bf16), g = etp * ep the MoE dispatch group, and megatron-core's sequence parallelism on
whenever tp > 1:

  forward, TP   T*H*b (the embedding's reduce-scatter) + L * 2*T*H*b (attention's input
                all-gather, its output reduce-scatter) + T*H*b (the head's input all-gather)
                + 16*T (the vocab-parallel log-prob's fp32 all-reduces: 4 values a token)
  forward, EP   allgather dispatcher: L * g*t * (E + 4E + 2*H*b) (routing map, fp32 probs,
                tokens gathered; the outputs reduce-scattered); alltoall: L * 2*t*k*H*b
  backward      TP: T*H*b + L * 3*T*H*b + T*H*b (sequence parallelism re-gathers the
                attention input for its weight gradient); EP: L * g*t * (2*H*b + 4E);
                with full recompute (the engine's `recompute: full`) each layer's forward
                terms again
  gradients     TP: the all-reduce of the replicated parameters' grads (router, norms);
                DP: the reduce-scatter of this rank's dense grads over dp and its expert grads
                over edp; then the parameter all-gather, `param_gathers` times (megatron-core
                0.16's chained optimizer gathers every bucket once per optimizer: dense and
                expert, so twice)
  weight sync   the TP-sharded weights gathered over tp, the experts over ep (etp 1)

Grads are fp32 (4 bytes); routing metadata (shape agreement, token counts) is left out.
Pipeline stages are not modelled (pp must be 1).
"""

from dataclasses import dataclass

from parallel.params import param_counts
from parallel.plan import ModelFit

LOGPROB_BYTES_PER_TOKEN = 16  # max and sum-exp / target-logit all-reduces, fp32
GRAD_BYTES = 4
KINDS = ("tp", "ep", "dp")


@dataclass(frozen=True)
class Settings:
    """How the engine runs: bytes a value (4 in the CPU run's fp32, 2 in bf16), megatron's
    token dispatcher, parameter gathers per update, activation recompute."""

    value_bytes: int
    dispatcher: str = "allgather"  # the accelerators': alltoall
    param_gathers: int = 2
    recompute: str = "none"  # "full" repeats each layer's forward in the backward


@dataclass(frozen=True)
class StepTokens:
    """Tokens one rank runs per step: the old-log-prob pass and the update (padded)."""

    old_log_prob: int
    update: int


def _forward(fit: ModelFit, tokens: int, b: int, dispatcher: str) -> dict[str, float]:
    s, p = fit.spec, fit.plan
    layers, h, e, g = s.num_layers, s.hidden_size, s.num_experts, p.etp * p.ep
    local = tokens / p.tp
    tp = tokens * h * b * (2 + 2 * layers) + LOGPROB_BYTES_PER_TOKEN * tokens if p.tp > 1 else 0
    if g == 1:
        ep = 0.0
    elif dispatcher == "allgather":
        ep = layers * g * local * (5 * e + 2 * h * b)
    else:
        ep = layers * 2 * local * s.top_k * h * b
    return {"tp": tp, "ep": ep, "dp": 0.0}


def _backward(
    fit: ModelFit, tokens: int, b: int, dispatcher: str, recompute: str
) -> dict[str, float]:
    s, p = fit.spec, fit.plan
    layers, h, e, g = s.num_layers, s.hidden_size, s.num_experts, p.etp * p.ep
    local = tokens / p.tp
    tp = tokens * h * b * (2 + 3 * layers) if p.tp > 1 else 0
    if g == 1:
        ep = 0.0
    elif dispatcher == "allgather":
        ep = layers * g * local * (2 * h * b + 4 * e)
    else:
        ep = layers * 2 * local * s.top_k * h * b
    if recompute == "full":  # the layers' forward again (embedding and head are not)
        forward = _forward(fit, tokens, b, dispatcher)
        tp += tokens * h * b * 2 * layers if p.tp > 1 else 0
        ep += forward["ep"]
    return {"tp": tp, "ep": ep, "dp": 0.0}


def _split(fit: ModelFit) -> tuple[int, int, int]:
    """(TP-sharded, TP-replicated, expert) parameters of the whole model as the engine builds
    it: the HF vocab, unpadded (megatron-core's GPTModel pads nothing; tp divides it)."""
    counts, layers = param_counts(fit.spec), fit.spec.num_layers
    sharded = counts.embedding + counts.lm_head
    sharded += layers * (counts.attention - counts.attention_replicated)
    replicated = counts.final_norm
    replicated += layers * (counts.router + counts.layer_norms + counts.attention_replicated)
    return sharded, replicated, layers * fit.spec.num_experts * counts.expert


def _gradients(fit: ModelFit, b: int, param_gathers: int) -> dict[str, float]:
    p = fit.plan
    sharded, replicated, experts = _split(fit)
    tp = replicated * GRAD_BYTES if p.tp > 1 else 0
    dense = (sharded // p.tp + replicated) * (p.dp > 1)
    expert = experts // (p.ep * p.etp) * (p.edp > 1)
    dp = (dense + expert) * (GRAD_BYTES + param_gathers * b)
    return {"tp": tp, "ep": 0.0, "dp": dp}


def _weight_sync(fit: ModelFit, b: int) -> dict[str, float]:
    p = fit.plan
    sharded, _, experts = _split(fit)
    experts //= p.etp
    return {
        "tp": sharded * b if p.tp > 1 else 0,
        "ep": experts * b if p.ep > 1 else 0,
        "dp": 0.0,
    }


def phase_bytes(fit: ModelFit, phase: str, tokens: int, how: Settings) -> dict[str, float]:
    """Bytes per rank of one engine call: an old-log-prob pass or an update over `tokens`
    (with its gradient reduce and parameter gather), or a weight sync."""
    if fit.plan.pp != 1:
        raise ValueError(f"the traffic model covers pp=1, not pp={fit.plan.pp}")
    b, dispatcher = how.value_bytes, how.dispatcher
    if phase == "old_log_prob":
        return _forward(fit, tokens, b, dispatcher)
    if phase == "weight_sync":
        return _weight_sync(fit, b)
    if phase != "update":
        raise ValueError(f"no model of phase {phase!r}: old_log_prob, update or weight_sync")
    parts = (
        _forward(fit, tokens, b, dispatcher),
        _backward(fit, tokens, b, dispatcher, how.recompute),
        _gradients(fit, b, how.param_gathers),
    )
    return {k: sum(part[k] for part in parts) for k in KINDS}


def step_bytes(fit: ModelFit, tokens: StepTokens, how: Settings) -> dict[str, dict[str, float]]:
    """Bytes per rank of a step of one update: {phase: {kind: bytes}}."""
    calls = (("old_log_prob", tokens.old_log_prob), ("update", tokens.update), ("weight_sync", 0))
    return {phase: phase_bytes(fit, phase, n, how) for phase, n in calls}
