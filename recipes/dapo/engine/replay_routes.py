"""Router replay per micro-batch: which pass this is, the routes its routers force, compare
with and record (R2/R3), and R2's recorded routes gathered onto the last pipeline stage."""

from dataclasses import replace

import torch
import torch.distributed as dist

from backend.training.distributed import ProcessGroups
from recipes.dapo.engine import batches


def phase_of(forward_only: bool, reference_engine: bool) -> str:
    """The pass: "update" (forward-backward), "ref" (a forward-only engine: the reference
    policy) or "old_log_prob" (the trained engine's forward-only pass)."""
    if not forward_only:
        return "update"
    return "ref" if reference_engine else "old_log_prob"


def micro_batch_routes(
    mb, phase: str, mode: str, device: torch.device, layers: range, num_experts: int
) -> dict:
    """set_routes arguments of a micro-batch: what to force, compare with and record.

    R3: old-log-prob pass and update force the rollout's routes (every token the rollout
    fed to its model: prompt and response but each row's last). R2: the old-log-prob pass
    records the router's own routes (returned as `routed_experts`, which verl's trainer
    hands back to the update), the update forces them. Padding keeps the router's own
    choice. The rollout's routes are the reference, on response tokens, of the agreement
    metric (old-log-prob pass: the rollout's weights) and of the update's route match
    (the experts the update used); never in the ref pass."""
    keys = mb.data.keys()
    if phase == "ref":
        return {}
    has_routes = "routed_experts" in keys
    if mode in ("R2", "R3") and phase == "update" and not has_routes:
        raise ValueError(
            f"router_replay={mode}: the update batch has no routed_experts "
            + (
                "(R2: the old-log-prob pass records them; is it skipped?)"
                if mode == "R2"
                else "(R3: set actor_rollout_ref.rollout.enable_rollout_routing_replay=True)"
            )
        )
    if phase == "old_log_prob" and mode == "R2" and has_routes:
        raise ValueError(
            "router_replay=R2 records its own routes in the old-log-prob pass, but the "
            "batch already has the rollout's routed_experts: use R3, or turn "
            "enable_rollout_routing_replay off"
        )
    if phase == "old_log_prob" and mode == "R3" and not has_routes:
        raise ValueError(
            "router_replay=R3 needs the rollout's routed_experts: set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
        )
    if not has_routes:
        return {"record": mode == "R2"}
    recorded = mode == "R2"  # R2's update: our own routes of every token
    routes = batches.micro_batch_routes(
        mb.data["routed_experts"], mb, device, not recorded, layers, num_experts
    )
    out = {"replay": routes if mode != "disabled" else None}
    if not recorded:  # the rollout's routes: agreement (old log-probs), route match (update)
        counted_BS = routes.use_BS if mb.response_BS is None else routes.use_BS & mb.response_BS
        out["reference"] = replace(routes, use_BS=counted_BS)
    return out


def all_stages_routes(
    routes_BSLK: torch.Tensor, groups: ProcessGroups, last_stage: bool
) -> torch.Tensor | None:
    """R2's recorded routes of this stage's layers (route_dtype: uint8 for <= 256
    experts) -> every layer's on the last stage, the one whose outputs verl reads
    (gathered there over PP); None on the other stages."""
    pp = groups.size("pp")
    if pp == 1:
        return routes_BSLK
    last = dist.get_global_rank(groups.pp, pp - 1)
    parts = [torch.empty_like(routes_BSLK) for _ in range(pp)] if last_stage else None
    dist.gather(routes_BSLK.contiguous(), parts, dst=last, group=groups.pp)
    return torch.cat(parts, dim=2) if last_stage else None
