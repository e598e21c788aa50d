"""Routing replay for megatron-core's TopKRouter: forced top-k experts, differentiable probs.

`ReplayRouting` is a narrow, named wrapper of one router's `routing(logits, ...)` method
(megatron-core 0.12.1 and 0.16.1 both call `self.routing(logits[, padding_mask])` from
`TopKRouter.forward`). It always runs the router's own routing first, keeps that choice for
the listeners (`own_map_TE`), then, where replay targets are set, replaces the top-k set by
the targets and recomputes the probabilities the way megatron-core's RouterReplay does:
scores gathered at the replayed indices, so the router weight still gets a gradient through
them. Tokens without a target (padding, the rollout's unfed last token) keep the router's
own choice and probabilities bit for bit.

Replay targets are per micro-batch, not a queue: activation recompute replays a layer's
forward during backward and reads the same targets again, so it routes identically.
"""

from dataclasses import dataclass

import torch


class ReplayError(ValueError):
    """Routing replay asked of a router or a batch it cannot serve."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert id: uint8 up to 256 experts (vLLM's
    routed_experts dtype), then int16, then int32."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


@dataclass
class Routes:
    """Top-k expert ids for the tokens of one micro-batch, in [B, S] (batch-first) order, for
    the layers first_layer .. first_layer + L - 1 (a pipeline stage's own)."""

    experts_BSLK: torch.Tensor  # expert ids per token, layer and slot (route_dtype)
    use_BS: torch.Tensor  # bool, the tokens these ids are meant for
    first_layer: int = 0  # global index of the first layer covered

    def local_TLK(self, tp: int, tp_rank: int, num_tokens: int):
        """(experts [T, L, K], use [T]) in megatron's sequence-first order of this TP rank."""
        experts_SBLK = self.experts_BSLK.transpose(0, 1)
        use_SB = self.use_BS.t()
        if use_SB.numel() != num_tokens:  # sequence parallel: a contiguous 1/tp of S
            experts_SBLK = experts_SBLK.chunk(tp, dim=0)[tp_rank]
            use_SB = use_SB.chunk(tp, dim=0)[tp_rank]
        if use_SB.numel() != num_tokens:
            raise ReplayError(f"routes cover {use_SB.numel()} tokens, router saw {num_tokens}")
        return experts_SBLK.reshape(num_tokens, *experts_SBLK.shape[2:]), use_SB.reshape(-1)


def check_replayable(config) -> None:
    """Replay covers softmax top-k routing without groups, expert bias or token dropping."""
    unsupported = {
        "score function": config.moe_router_score_function != "softmax",
        "group-limited routing": bool(getattr(config, "moe_router_group_topk", None)),
        "expert bias": bool(getattr(config, "moe_router_enable_expert_bias", False)),
        "token dropping": getattr(config, "moe_expert_capacity_factor", None) is not None,
        "sinkhorn": config.moe_router_load_balancing_type == "sinkhorn",
    }
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ReplayError(f"routing replay does not cover this router's {', '.join(bad)}")


def map_to_indices_TK(map_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """The k chosen expert ids of each token, ascending (a set: order carries no meaning)."""
    order_TE = torch.sort(map_TE.to(torch.int8), dim=1, descending=True, stable=True).indices
    return order_TE[:, :top_k].sort(dim=1).values


def indices_to_map_TE(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    map_TE = torch.zeros(idx_TK.shape[0], num_experts, dtype=torch.bool, device=idx_TK.device)
    return map_TE.scatter(1, idx_TK, True)


def forced_probs_TE(logits_TE, idx_TK, pre_softmax: bool, scaling: float | None):
    """megatron-core's softmax top-k probabilities with the top-k set forced to idx_TK."""
    if pre_softmax:
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).type_as(logits_TE)
        probs_TK = scores_TE.gather(1, idx_TK)
    else:
        probs_TK = torch.softmax(logits_TE.gather(1, idx_TK), dim=-1, dtype=torch.float32)
        probs_TK = probs_TK.type_as(logits_TE)
    if scaling:
        probs_TK = probs_TK * scaling
    return torch.zeros_like(logits_TE).scatter(1, idx_TK, probs_TK)


class ReplayRouting:
    """Stands in for `router.routing`; `tap` supplies targets and receives the own choice."""

    def __init__(self, router, tap):
        self.router, self.tap = router, tap
        self.original = router.routing  # the bound method of megatron-core's TopKRouter

    def __call__(self, logits, *args, **kwargs):
        probs_TE, map_TE = self.original(logits, *args, **kwargs)
        self.tap.own_map_TE = map_TE
        target = self.tap.replay_target(self.router.layer_number - 1, map_TE.shape[0])
        if target is None:
            return probs_TE, map_TE
        idx_TK, use_T = target
        config = self.router.config
        if idx_TK.shape[-1] != config.moe_router_topk:  # another model's routes: never replayed
            raise ReplayError(
                f"routes hold {idx_TK.shape[-1]} experts a token, layer {self.router.layer_number}"
                f"'s router picks top-{config.moe_router_topk}: are the routes this model's?"
            )
        logits_TE = logits.reshape(-1, config.num_moe_experts)
        idx_TK = idx_TK.to(logits_TE.device, torch.long)
        # unused rows (padding): any valid index, their result is discarded by the where below
        idx_TK = torch.where(use_T[:, None], idx_TK, map_to_indices_TK(map_TE, idx_TK.shape[1]))
        forced_TE = forced_probs_TE(
            logits_TE,
            idx_TK,
            config.moe_router_pre_softmax,
            getattr(config, "moe_router_topk_scaling_factor", None),
        )
        use_T1 = use_T[:, None]
        probs_TE = torch.where(use_T1, forced_TE.type_as(probs_TE), probs_TE)
        map_TE = torch.where(use_T1, indices_to_map_TE(idx_TK, map_TE.shape[1]), map_TE)
        return probs_TE, map_TE


def install(router, tap) -> None:
    """Route `router` through ReplayRouting (idempotent; `uninstall` restores the method)."""
    if isinstance(router.__dict__.get("routing"), ReplayRouting):
        return
    check_replayable(router.config)
    router.routing = ReplayRouting(router, tap)


def uninstall(router) -> None:
    if isinstance(router.__dict__.get("routing"), ReplayRouting):
        del router.routing


class RouteRecorder:
    """Tap listener: the router's own top-k of every layer in the forwards while `on` (R2),
    kept as `dtype` (route_dtype: uint8 for up to 256 experts)."""

    def __init__(self, top_k: int, dtype: torch.dtype = torch.int64):
        self.top_k, self.dtype, self.on = top_k, dtype, False
        self._idx_LTK: dict[int, torch.Tensor] = {}

    def __call__(self, call) -> None:
        if self.on and not call.recompute:
            idx_TK = map_to_indices_TK(call.chosen_map_TE, self.top_k)
            self._idx_LTK[call.layer] = idx_TK.to(self.dtype)

    def take_BSLK(self, batch: int, groups) -> torch.Tensor:
        """This micro-batch's routes as [B, S, L, K] (S whole: gathered over sequence-parallel
        TP ranks); resets the recorder."""
        import torch.distributed as dist

        idx_TLK = torch.stack([self._idx_LTK[i] for i in sorted(self._idx_LTK)], dim=1)
        self._idx_LTK = {}
        idx_SBLK = idx_TLK.reshape(-1, batch, *idx_TLK.shape[1:])
        tp = groups.size("tp") if groups is not None else 1
        if tp > 1:
            parts = [torch.empty_like(idx_SBLK) for _ in range(tp)]
            dist.all_gather(parts, idx_SBLK.contiguous(), group=groups.tp)
            idx_SBLK = torch.cat(parts, dim=0)
        return idx_SBLK.transpose(0, 1)


class AgreementMeter:
    """Tap listener: per layer, the tokens whose top-k SET equals the reference's, counted
    while `on`. used=False compares the router's own choice (`moe/routing_agreement`), True
    the experts actually used, after any replay (`moe/update_route_match`)."""

    def __init__(self, num_layers: int, num_experts: int, used: bool = False):
        self.num_experts, self.used, self.on = num_experts, used, False
        self.prefix = "moe/update_route_match" if used else "moe/routing_agreement"
        self.same_L = torch.zeros(num_layers, dtype=torch.int64)
        self.total_L = torch.zeros(num_layers, dtype=torch.int64)

    def __call__(self, call) -> None:
        if not self.on or call.recompute or call.reference_TK is None:
            return
        map_TE = call.routing_map_TE if self.used else call.chosen_map_TE
        own_TE = map_TE.bool()
        ref_TE = indices_to_map_TE(call.reference_TK.to(own_TE.device, torch.long), own_TE.shape[1])
        counted_T = call.reference_T.to(own_TE.device)
        same_T = (own_TE == ref_TE).all(-1) & counted_T
        if self.same_L.device != own_TE.device:
            self.same_L, self.total_L = (
                self.same_L.to(own_TE.device),
                self.total_L.to(own_TE.device),
            )
        self.same_L[call.layer] += same_T.sum()
        self.total_L[call.layer] += counted_T.sum()

    def take(self, groups) -> dict[str, float]:
        """`<prefix>/...` over the whole world (every rank's router saw its own tokens, as in
        the monitor); {} when nothing was compared. Resets the meter."""
        import torch.distributed as dist

        counts_2L = torch.stack((self.same_L, self.total_L))
        self.same_L, self.total_L = torch.zeros_like(self.same_L), torch.zeros_like(self.total_L)
        if groups is not None and dist.get_world_size(groups.world) > 1:
            dist.all_reduce(counts_2L, group=groups.world)
        return agreement_metrics(counts_2L[0].cpu(), counts_2L[1].cpu(), self.prefix)


def agreement_metrics(
    same_L: torch.Tensor, total_L: torch.Tensor, prefix: str = "moe/routing_agreement"
) -> dict[str, float]:
    if int(total_L.sum()) == 0:
        return {}
    share_L = same_L.double() / total_L.clamp_min(1).double()
    out = {f"{prefix}/layer_{i:02d}": float(v) for i, v in enumerate(share_L)}
    out[f"{prefix}/mean"] = float(share_L.mean())
    out[f"{prefix}/min"] = float(share_L.min())
    return out
