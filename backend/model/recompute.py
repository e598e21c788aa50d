"""Activation recompute choices: none | selective | full (no torch import; parallel/ uses it).

- "none": every layer keeps what its backward needs.
- "selective": megatron-core's recompute_granularity="selective" with recompute_modules
  ["core_attn"] (megatron re-runs core attention in backward: the unfused local attention's
  softmax probabilities and repeated K/V are not kept; flash / SDPA keeps only its fp32
  log-sum-exp beside q, k, v, so there it saves little), plus the MoE experts' activation
  ("moe_act": the SwiGLU output is discarded after fc2 and recomputed from the fc1 output
  in backward). megatron-core 0.12.1 and 0.16.1 both take these module names, but accept
  "moe_act" only with moe_grouped_gemm (their TEGroupedMLP); our GroupedExperts does the same
  recompute itself (megatron's CheckpointWithoutOutput), so megatron gets ["core_attn"] and
  megatron-core's SequentialMLP (the CPU reference experts) and the TE spec's experts keep
  their activations. Both are cheap to re-run: no GEMM, no communication.
- "full": megatron's "full"/"uniform", one layer per checkpoint (the whole layer re-runs).
The bools of older configs still work: True is "full", False "none".
"""

RECOMPUTE_CHOICES = ("none", "selective", "full")
SELECTIVE_MODULES = ("core_attn", "moe_act")  # what "selective" recomputes
MEGATRON_SELECTIVE_MODULES = ["core_attn"]  # passed to megatron; moe_act is GroupedExperts'


def recompute_mode(value: "str | bool | None") -> str:
    """'none' | 'selective' | 'full' from a choice or the legacy bool (True = full)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if isinstance(value, str) and value.lower() in RECOMPUTE_CHOICES:
        return value.lower()
    raise ValueError(f"recompute={value!r}: choose one of {RECOMPUTE_CHOICES} (or a bool)")
