"""Activation memory of the decoder layers on one device, for one micro-batch.

Notation: T tokens in a micro-batch of one data-parallel replica, h hidden size,
q = heads * head_dim, kv = kv_heads * head_dim, f = moe_intermediate_size, k = top-k,
E = experts, b = bytes per activation value (2 for bf16), s the EP routing skew (below).

Saved for backward by one layer, per token (values of b bytes unless noted):
  attention side, on T / (tp*cp) tokens per device (tp shards features inside the TP
  region and sequence parallel shards tokens outside it, so both divide by tp):
      layer input h + normed QKV input h + QKV output (q + 2kv, q/k-norm inputs and v)
      + normed, rotated q and k (q + kv) + attention output q + pre-MLP norm input h
      + router input h                                              = 4h + 3q + 3kv
      fp32 norm statistics (2 + heads + kv_heads) * 4 B and attention log-sum-exp heads * 4 B
      router state: fp32 probs E*4 B + routing map E B + top-k probs and indices k*12 B,
      and with the alltoall dispatcher the token permutation's indices k*8 B (kept by the
      sending rank, which un-permutes the combined outputs)
  expert side, on s * T * k * etp / (tp*cp) routed tokens per device (every token goes to k
  experts; the etp ranks of one expert shard all see its tokens; s = 1 is balanced routing):
      expert input h + fc1 output 2f/etp (fused weighted SwiGLU keeps only its input)
      + fc2 input f/etp                                             = h + 3f/etp
      + the token's routing prob in fp32, 4 B
      + with the allgather dispatcher, the permutation index of each received token, 8 B
        (alltoall's sort by local expert is a split and a cat: nothing kept)
  kernels that are not fused keep more (parallel.activations.Kernels):
  - unfused norms and RoPE (torch RMSNorm, megatron's unfused rotary: both the local spec and
    ours): the norms' normalized copies (2h + q + kv), a split copy of q (q), cos/sin (4 head_dim);
  - unfused attention (megatron-core's local DotProductAttention): K and V repeated to every
    head in place of the rotated k (2q - kv) and the softmax probabilities (heads * seq_len),
    instead of the flash kernels' fp32 log-sum-exp; the seq x seq boolean mask (shared by all
    layers) is left out;
  - unfused SwiGLU, per routed token: megatron-core's MLP keeps three f-sized tensors
    (3f/etp), ours (silu(gate) * up * prob) two, the SiLU output and the product before
    the prob (2f/etp).
With full recompute (megatron's "full"/"uniform", one layer per checkpoint) a layer keeps
only its input, h on T/(tp*cp) tokens, and one layer at a time is re-run in backward.
Selective recompute (backend.model.recompute: megatron's "core_attn" and the experts' "moe_act")
keeps every layer's tensors above except what those two re-run in backward:
  - core attention keeps only its inputs q, k, v (counted above: rotated q and k, and v in the
    QKV output) and its output is kept by the output projection (counted), so it drops
    flash / fused attention: the fp32 log-sum-exp, heads * 4 B per token (little: flash never
    stores the scores);
    unfused attention: the repeated K and V and the softmax probabilities,
    (2q - kv) + heads * seq_len values per token;
  - moe_act keeps the SwiGLU's input (the fc1 output, 2f/etp) and the router prob and drops
    its output, the fc2 input f/etp, and whatever an unfused SwiGLU keeps inside
    (unfused_swiglu_values * f/etp), per routed token; only where the experts do it
    (Kernels.moe_act_recompute: ours; not megatron-core's SequentialMLP nor the TE spec's,
    which megatron refuses moe_act without moe_grouped_gemm).
So A' = A - a and X' = X - x per layer, with a and x the dropped bytes above, and
    selective:      layers * (A' + s*X') + s*D
the same shape as no recompute: every layer's expert side still scales with s.

Routing skew. s = tokens received by the busiest EP rank / the mean over the EP group
(monitor metric `ep_max_over_mean`; 1 <= s <= ep). The sending side of dispatch is the same
on every rank (each rank routes its own T/(tp*cp) tokens), so only what lives on the
receiving rank scales with s:
  - the expert-side saved tensors above (all per routed token received),
  - the permutation state kept per received token (allgather: its 8 B index),
  - the dispatch/combine buffers of the layer in flight (dispatch_buffer_bytes): the
    received tokens and the expert outputs sent back, 2h per received routed token, which
    live only while that layer's MoE block runs forward or backward.
The attention side, the router state and the recompute checkpoints (layer inputs, on the
attention side) do not scale. So at `layers` layers in flight:
    no recompute:   layers * (A + s*X) + s*D
    selective:      layers * (A' + s*X') + s*D   (A' < A, X' < X: above)
    full recompute: layers * C + (A + s*X) + s*D
with A the attention side, X the expert side, D the buffers and C the checkpoint of one
layer: recompute leaves one layer's expert activations exposed to skew instead of all of
them. One s for every layer bounds the busiest rank: its load summed over layers is at most
the sum of each layer's maximum (exact for the single recomputed layer, conservative for the
sum without recompute, where the busiest rank differs between layers).

1F1B pipelining keeps (pp - stage) micro-batches in flight on a stage; the interleaved
schedule keeps 2(pp - stage - 1) + (vpp - 1)pp + 1 model chunks (megatron's warm-up count
plus one), L/(pp*vpp) layers each.
"""

from dataclasses import dataclass

from backend.model.recompute import recompute_mode
from backend.qwen3_moe import Qwen3MoeSpec
from parallel.plan import ModelFit, ParallelPlan

DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class Kernels:
    flash_attention: bool = True  # flash / fused attention: no s x s probabilities, GQA K/V as is
    fused_swiglu: bool = True  # megatron's (weighted) bias_swiglu fusion: keeps only the fc1 output
    fused_norm_rope: bool = False  # TE's fused RMSNorm and RoPE: no normalized or split copies
    unfused_swiglu_values: int = 3  # f-sized tensors an unfused SwiGLU keeps (megatron's 3, ours 2)
    dispatcher: str = "alltoall"  # megatron's token dispatcher: where the permutation state lives
    # the experts re-run their SwiGLU under selective recompute (ours; not megatron's
    # SequentialMLP, nor TE's grouped MLP, which megatron gives moe_act only with grouped GEMM)
    moe_act_recompute: bool = True

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={self.dispatcher!r}: choose one of {DISPATCHERS}")


# what backend.model.build builds on accelerators: our SDPAttention and GroupedExperts with megatron's
# fused weighted SwiGLU, torch RMSNorm and megatron's unfused RoPE
ACCELERATOR_KERNELS = Kernels()
# megatron-core's local spec on CPU (the reference modules), and our modules on CPU; the CPU
# build uses the allgather dispatcher (alltoall creates CUDA streams)
LOCAL_SPEC_KERNELS = Kernels(
    flash_attention=False, fused_swiglu=False, dispatcher="allgather", moe_act_recompute=False
)
OURS_ON_CPU_KERNELS = Kernels(
    flash_attention=True, fused_swiglu=False, unfused_swiglu_values=2, dispatcher="allgather"
)
TE_KERNELS = Kernels(fused_norm_rope=True, moe_act_recompute=False)
PERMUTATION_INDEX_BYTES = 8  # int64 index per routed token


def attention_side_bytes_per_token(
    spec: Qwen3MoeSpec, b: int, kernels: Kernels, seq_len: int, selective: bool = False
) -> float:
    h, hd, heads = spec.hidden_size, spec.head_dim, spec.num_heads
    q, kv = heads * hd, spec.num_kv_heads * hd
    values = 4 * h + 3 * q + 3 * kv
    fp32_bytes = (2 + heads + spec.num_kv_heads) * 4
    if not kernels.fused_norm_rope:
        values += (2 * h + q + kv) + q + 4 * hd
    # selective recompute re-runs core attention: only its inputs (counted) stay
    if kernels.flash_attention and not selective:
        fp32_bytes += heads * 4
    elif not kernels.flash_attention and not selective:
        values += (2 * q - kv) + heads * seq_len
    router_bytes = spec.num_experts * 5 + spec.top_k * 12
    if kernels.dispatcher == "alltoall":  # the sender keeps the indices to un-permute
        router_bytes += spec.top_k * PERMUTATION_INDEX_BYTES
    return values * b + fp32_bytes + router_bytes


def expert_side_bytes_per_routed_token(
    spec: Qwen3MoeSpec, etp: int, b: int, kernels: Kernels, selective: bool = False
) -> float:
    f = spec.moe_ffn_hidden_size / etp
    inside = 0 if kernels.fused_swiglu else kernels.unfused_swiglu_values * f
    if selective and kernels.moe_act_recompute:  # moe_act: SwiGLU output (fc2 input) and inside
        values = spec.hidden_size + 2 * f
    else:
        values = spec.hidden_size + 3 * f + inside
    permutation = PERMUTATION_INDEX_BYTES if kernels.dispatcher == "allgather" else 0
    return values * b + 4 + permutation


def routed_tokens(spec: Qwen3MoeSpec, plan: ParallelPlan, tokens: int, ep_skew: float) -> float:
    """Routed tokens one device's experts receive: s * T * k * etp / (tp*cp)."""
    return ep_skew * tokens / (plan.tp * plan.cp) * spec.top_k * plan.etp


def layer_activation_bytes(
    spec: Qwen3MoeSpec,
    plan: ParallelPlan,
    tokens: int,
    b: int = 2,
    kernels: Kernels = ACCELERATOR_KERNELS,
    seq_len: int | None = None,
    ep_skew: float = 1.0,
    selective: bool = False,
) -> float:
    """Bytes one decoder layer saves for backward on one device, for a micro-batch of `tokens`.

    ep_skew: this device's received tokens over the EP mean (the busiest rank's skew s; any
    load factor >= 0 works, e.g. 0 for a rank that receives nothing). seq_len matters only
    for unfused attention (default: one sequence of `tokens`). selective: what is left under
    selective recompute (module docstring).
    """
    local_tokens = tokens / (plan.tp * plan.cp)
    seq = seq_len or tokens
    attention = attention_side_bytes_per_token(spec, b, kernels, seq, selective)
    expert = expert_side_bytes_per_routed_token(spec, plan.etp, b, kernels, selective)
    return local_tokens * attention + routed_tokens(spec, plan, tokens, ep_skew) * expert


def dispatch_buffer_bytes(
    spec: Qwen3MoeSpec, plan: ParallelPlan, tokens: int, b: int = 2, ep_skew: float = 1.0
) -> float:
    """Dispatch/combine buffers of the one MoE layer in flight: 2h per received routed token."""
    return routed_tokens(spec, plan, tokens, ep_skew) * 2 * spec.hidden_size * b


def checkpoint_bytes(spec: Qwen3MoeSpec, plan: ParallelPlan, tokens: int, b: int = 2) -> float:
    """What full recompute keeps per layer: its sequence-parallel input."""
    return tokens / (plan.tp * plan.cp) * spec.hidden_size * b


def layers_in_flight(plan: ParallelPlan, stage_layers: tuple[int, ...], stage: int) -> float:
    """Decoder layers whose activations a stage holds at its peak (micro-batches >= pp)."""
    if plan.pp == 1:
        return stage_layers[0]
    if plan.vpp:
        chunks = 2 * (plan.pp - stage - 1) + (plan.vpp - 1) * plan.pp + 1
        return chunks * stage_layers[stage] / plan.vpp
    return (plan.pp - stage) * stage_layers[stage]


def stage_activation_bytes(
    fit: ModelFit,
    stage: int,
    tokens: int,
    recompute: str | bool,
    b: int = 2,
    kernels: Kernels = ACCELERATOR_KERNELS,
    ep_skew: float = 1.0,
) -> float:
    """Decoder activations saved by one device of `stage` at its peak (buffers excluded).

    recompute: "none" | "selective" | "full" (or the bool: True = full)."""
    mode = recompute_mode(recompute)
    layer = layer_activation_bytes(
        fit.spec, fit.plan, tokens, b, kernels, ep_skew=ep_skew, selective=mode == "selective"
    )
    layers = layers_in_flight(fit.plan, fit.stage_layers, stage)
    if mode != "full":
        return layers * layer
    return layers * checkpoint_bytes(fit.spec, fit.plan, tokens, b) + layer
