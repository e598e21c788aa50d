"""Enumerate the legal plans for a cluster and rank them.

Ranking: plans that fit (update peak within the headroom) first; then the least
inter-node traffic on the per-layer collectives (TP worst, then EP, ETP, CP; DP gradient
reduction and PP point-to-point crossing nodes is expected); then the fewest pipeline
bubbles (smaller pp); then less per-layer communication (smaller tp*cp), then the most
memory headroom.
"""

from dataclasses import dataclass
from itertools import product

from backend.qwen3_moe import Qwen3MoeSpec
from parallel.memory import MemoryEstimate, MemoryOptions, estimate_memory, least_recompute
from parallel.plan import ModelFit, ParallelPlan, PlanError, check_against_model, divisors
from parallel.rank_layout import RankLayout


@dataclass(frozen=True)
class Candidate:
    fit: ModelFit
    layout: RankLayout
    memory: MemoryEstimate

    @property
    def cross_node(self) -> tuple[int, ...]:
        """Nodes spanned by the tp, ep, etp and cp groups, most expensive first."""
        return tuple(self.layout.nodes_spanned(n) for n in ("tp", "ep", "etp", "cp"))

    def rank_key(self) -> tuple:
        plan = self.fit.plan
        return (
            not self.memory.fits,
            self.cross_node,
            plan.pp,
            plan.tp * plan.cp,
            self.memory.update_bytes,
        )


def _choices(fixed: int | None, options: list[int]) -> list[int]:
    return [fixed] if fixed is not None else options


def candidate_plans(
    spec: Qwen3MoeSpec,
    nodes: int,
    devices_per_node: int,
    fixed: dict[str, int | None] | None = None,
) -> list[ParallelPlan]:
    """Legal plans (etp=1, no vpp unless fixed) for the cluster; `fixed` pins dimensions."""
    fixed = fixed or {}
    world = nodes * devices_per_node
    sizes = {
        "tp": [d for d in divisors(world) if spec.num_kv_heads % d == 0],
        "pp": [d for d in divisors(world) if spec.num_layers % d == 0],
        "cp": [d for d in divisors(world, limit=8)],
        "ep": [d for d in divisors(world) if spec.num_experts % d == 0],
        "etp": [1],
    }
    plans = []
    for tp, pp, cp, ep, etp in product(*(_choices(fixed.get(k), v) for k, v in sizes.items())):
        try:
            plan = ParallelPlan(
                tp=tp,
                pp=pp,
                cp=cp,
                ep=ep,
                etp=etp,
                vpp=fixed.get("vpp"),
                nodes=nodes,
                devices_per_node=devices_per_node,
            )
            check_against_model(plan, spec)
        except PlanError:
            continue
        plans.append(plan)
    return plans


def rank_plans(
    spec: Qwen3MoeSpec,
    nodes: int,
    devices_per_node: int,
    options: MemoryOptions,
    fixed: dict[str, int | None] | None = None,
    auto_recompute: bool = False,
) -> list[Candidate]:
    """Every legal plan, best first; auto_recompute: each with the least recompute that fits
    (parallel.memory.least_recompute) instead of options.recompute."""
    candidates = []
    for plan in candidate_plans(spec, nodes, devices_per_node, fixed):
        fit = check_against_model(plan, spec)
        memory = (
            least_recompute(fit, options).estimate
            if auto_recompute
            else estimate_memory(fit, options)
        )
        candidates.append(Candidate(fit, RankLayout(plan), memory))
    if not candidates:
        raise PlanError(
            f"no legal plan for {nodes}x{devices_per_node} devices with the "
            "pinned dimensions: unpin some of --tp/--pp/--cp/--ep/--etp/--vpp"
        )
    return sorted(candidates, key=Candidate.rank_key)
