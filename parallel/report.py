"""Text summaries of a plan, its model fit and its rank layout."""

from parallel.params import param_counts
from parallel.plan import ModelFit
from parallel.rank_layout import GROUP_NAMES, RankLayout


def members(group: tuple[int, ...]) -> str:
    """Compact member list: 0-3, 0,8..24 (arithmetic) or the ranks."""
    if len(group) == 1:
        return str(group[0])
    step = group[1] - group[0]
    if all(b - a == step for a, b in zip(group, group[1:], strict=False)):
        if step == 1:
            return f"{group[0]}-{group[-1]}"
        if len(group) > 3:
            return f"{group[0]},{group[1]}..{group[-1]}"
    return ",".join(map(str, group))


def model_summary(name: str, fit: ModelFit) -> str:
    spec, counts = fit.spec, param_counts(fit.spec)
    return (
        f"model: {name}: {counts.total / 1e9:.2f}B params, {counts.active / 1e9:.2f}B active; "
        f"{spec.num_layers} layers, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_heads} q / {spec.num_kv_heads} kv heads"
    )


def plan_summary(fit: ModelFit, device_label: str) -> str:
    plan = fit.plan
    if len(set(fit.stage_layers)) > 1:
        stages = "layers per stage " + ",".join(map(str, fit.stage_layers))
    else:
        stages = f"{fit.stage_layers[0]} layers on each of {plan.pp} pipeline stage(s)"
    return "\n".join(
        [
            f"plan: {plan.describe()} ({device_label})",
            f"  sequence_parallel={fit.sequence_parallel}, padded vocab {fit.padded_vocab} "
            f"(from {fit.spec.vocab_size}), {fit.experts_per_rank} experts per EP rank, {stages}",
        ]
    )


def layout_summary(layout: RankLayout, first_ranks: int = 4) -> str:
    lines = [
        f"layout (megatron-core order {layout.order}; rank r is on node "
        f"r // {layout.plan.devices_per_node}):",
        f"  {'group':<6}{'size':>5}{'groups':>8}  {'crosses nodes':<14}example",
    ]
    for name in GROUP_NAMES:
        groups = layout.groups(name)
        spans = layout.nodes_spanned(name)
        crosses = f"yes ({spans})" if spans > 1 else "no"
        lines.append(
            f"  {name:<6}{len(groups[0]):>5}{len(groups):>8}  {crosses:<14}"
            f"{members(layout.group(0, name))}"
        )
    for rank in range(min(first_ranks, layout.plan.world)):
        c = layout.coords(rank)
        coords = " ".join(f"{n}={getattr(c, n)}" for n in GROUP_NAMES)
        lines.append(f"  rank {rank}: node {c.node} {coords}")
    return "\n".join(lines)
