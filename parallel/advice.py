"""What a practitioner should know about a legal plan before launching it."""

from parallel.memory import HEADROOM, MemoryEstimate
from parallel.plan import ModelFit
from parallel.rank_layout import RankLayout

# group kind -> the traffic that crosses the slow inter-node link when it spans nodes
_CROSS_NODE_COST = {
    "tp": "tensor-parallel all-gather/reduce-scatter on every layer",
    "cp": "context-parallel ring attention exchange on every layer",
    "ep": "MoE token all-to-all (dispatch and combine) on every layer",
    "etp": "expert tensor-parallel all-gather/reduce-scatter on every MoE layer",
}


def cross_node_warnings(layout: RankLayout) -> list[str]:
    per_node = layout.plan.devices_per_node
    out = []
    for name, cost in _CROSS_NODE_COST.items():
        nodes = layout.nodes_spanned(name)
        if nodes > 1:
            out.append(
                f"{name} groups span {nodes} nodes: {cost} crosses the inter-node link; "
                f"keep each {name} group within one node's {per_node} devices"
            )
    return out


def _expert_rows(fit: ModelFit, micro_batch_tokens: int) -> tuple[float, float]:
    """(expected tokens per expert per micro-batch, rows of one expert GEMM on its EP rank)."""
    plan, spec = fit.plan, fit.spec
    per_expert = micro_batch_tokens * spec.top_k / spec.num_experts
    # an EP group pools the micro-batches of ep*etp/(tp*cp) attention replicas
    return per_expert, per_expert * plan.ep * plan.etp / (plan.tp * plan.cp)


def expert_notes(fit: ModelFit, micro_batch_tokens: int) -> list[str]:
    """Information about the expert load (printed under "notes:", not "warnings:")."""
    plan, spec = fit.plan, fit.spec
    per_expert, rows = _expert_rows(fit, micro_batch_tokens)
    return [
        f"{fit.experts_per_rank} experts per EP rank ({spec.num_experts} experts / ep={plan.ep})",
        f"expected tokens per expert: {per_expert:.0f} per micro-batch of {micro_batch_tokens} "
        f"tokens (x top-{spec.top_k} / {spec.num_experts}); each expert GEMM gets about "
        f"{rows:.0f} rows per micro-batch on its EP rank",
    ]


def expert_warnings(fit: ModelFit, micro_batch_tokens: int) -> list[str]:
    _, rows = _expert_rows(fit, micro_batch_tokens)
    if rows >= 128:
        return []
    return [
        f"only ~{rows:.0f} tokens per expert GEMM: expert matmuls are small and "
        "routing imbalance is large; raise --micro-batch-tokens or ep"
    ]


def memory_warnings(estimate: MemoryEstimate, recompute: str = "none") -> list[str]:
    use = estimate.utilization
    if use is None or use <= HEADROOM:
        return []
    more = {"none": "--recompute selective or full, ", "selective": "--recompute full, "}
    return [
        f"update peak {use:.0%} of {estimate.device_memory_gib:g} GiB is above "
        f"{HEADROOM:.0%}: {more.get(recompute, '')}lower --micro-batch-tokens or raise tp/ep/pp"
    ]


def plan_warnings(
    fit: ModelFit,
    layout: RankLayout,
    estimate: MemoryEstimate,
    micro_batch_tokens: int,
    recompute: str = "none",
) -> list[str]:
    """Cross-node groups, small expert GEMMs and memory pressure, one line each."""
    return (
        cross_node_warnings(layout)
        + expert_warnings(fit, micro_batch_tokens)
        + memory_warnings(estimate, recompute)
    )


def listed(title: str, lines: list[str]) -> list[str]:
    """`title:` and its lines as `  - ...`, or `  (none)`."""
    return [f"{title}:", *([f"  - {line}" for line in lines] or ["  (none)"])]
