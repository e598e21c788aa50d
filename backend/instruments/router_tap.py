"""Observe every MoE router call of a megatron-core model, for the monitor and the aux loss.

megatron-core builds its TopKRouter inside MoELayer (no spec slot to swap it), so we
attach a forward hook to each router instance. The hook hands listeners a `RouterCall`:
the layer, the tokens' routing decisions, and router logits recomputed from the router's
input so that they are differentiable (probs from mcore are zero outside the top-k, and
balancing losses need the full softmax). The recompute costs one [T, H] x [H, E] matmul.

Token masks: the caller sets a [B, S] bool mask of the tokens that count (no padding;
optionally response tokens only). Router inputs are [S_local, B, H] in megatron's
sequence-first order; with sequence parallelism each TP rank holds a contiguous 1/tp of S,
so the tap slices the mask the same way before flattening.

Routing replay (backend.model.router_replay): built with `replay=True`, the tap routes every
router through ReplayRouting; `set_routes` then gives, per micro-batch, the experts to force
(`replay`) and the experts to compare with (`reference`, e.g. the rollout's). Listeners get
both the routing actually used (`routing_map_TE`: what the monitor counts) and the router's
own choice (`own_map_TE`: what the aux loss and the agreement metric use).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from backend.training.distributed import ProcessGroups


@dataclass
class RouterCall:
    layer: int  # global 0-based layer index
    routing_map_TE: torch.Tensor  # bool, True where a token was sent to an expert
    valid_T: torch.Tensor | None  # bool mask of tokens that count, None = all
    recompute: bool  # True when activation recompute replays the forward during backward
    make_logits: Callable[
        [], torch.Tensor
    ]  # computed only if a listener asks (the monitor does not)
    own_map_TE: torch.Tensor | None = None  # the router's own top-k (None: routing_map_TE)
    reference_TK: torch.Tensor | None = None  # expert ids to compare with (e.g. the rollout's)
    reference_T: torch.Tensor | None = None  # bool, tokens where reference_TK counts

    @property
    def chosen_map_TE(self) -> torch.Tensor:
        """The router's own top-k choice: the routing map itself unless replay overrode it."""
        return self.routing_map_TE if self.own_map_TE is None else self.own_map_TE

    @cached_property
    def logits_TE(self) -> torch.Tensor:
        """fp32 router logits [T, E], differentiable when grad is enabled."""
        return self.make_logits()


Listener = Callable[[RouterCall], None]


def in_backward() -> bool:
    # activation recompute replays forwards inside the autograd engine's backward pass
    return torch._C._current_graph_task_id() != -1


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class TapBase:
    """Listener bookkeeping shared by the megatron-core and transformers router taps."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self._handles: list = []

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def _emit(self, call: RouterCall) -> None:
        for listener in self.listeners:
            listener(call)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RouterTap(TapBase):
    """Forward hooks on all routers of `model`; listeners get one RouterCall per router call."""

    def __init__(self, model: torch.nn.Module, groups: ProcessGroups, replay: bool = False):
        from backend.model import router_replay

        super().__init__()
        self.groups = groups
        self._mask_SB: torch.Tensor | None = None
        self._replay = self._reference = None
        self._local: dict = {}  # (which, num_tokens) -> this rank's slice of the routes
        self.own_map_TE: torch.Tensor | None = None  # set by ReplayRouting, read by _hook
        routers = router_modules(model)
        self._handles = [r.register_forward_hook(self._hook) for r in routers]
        if not self._handles:
            raise ValueError("model has no MoE router (TopKRouter): is it a Qwen3-MoE GPTModel?")
        self._replaying, self._routers = replay, routers
        for router in routers if replay else ():
            router_replay.install(router, self)

    def remove(self) -> None:
        from backend.model import router_replay

        for router in self._routers:
            router_replay.uninstall(router)
        super().remove()

    def set_routes(self, replay=None, reference=None) -> None:
        """backend.model.router_replay.Routes to force / to compare with in the next forwards."""
        if replay is not None and not self._replaying:
            raise ValueError("this tap was built without replay=True: it cannot force routes")
        self._replay, self._reference, self._local = replay, reference, {}

    def _routes_local(self, which: str, num_tokens: int):
        routes = self._replay if which == "replay" else self._reference
        if routes is None:
            return None
        key = (which, num_tokens)
        if key not in self._local:
            tp = self.groups.size("tp") if self.groups is not None else 1
            rank = self.groups.rank("tp") if self.groups is not None else 0
            experts_TLK, use_T = routes.local_TLK(tp, rank, num_tokens)
            self._local[key] = experts_TLK, use_T, routes.first_layer
        return self._local[key]

    def replay_target(self, layer: int, num_tokens: int):
        """(expert ids [T, K], use [T]) to force at (global) `layer`, None when not replaying."""
        local = self._routes_local("replay", num_tokens)
        return None if local is None else (local[0][:, layer - local[2]], local[1])

    def set_token_mask(self, valid_BS: torch.Tensor | None) -> None:
        """Tokens that count for the next forward passes ([B, S] bool), None for all."""
        self._mask_SB = None if valid_BS is None else valid_BS.t().contiguous()

    def _local_valid_T(self, num_tokens: int) -> torch.Tensor | None:
        if self._mask_SB is None:
            return None
        mask_SB = self._mask_SB
        if mask_SB.numel() != num_tokens:  # sequence parallel: this TP rank's slice of S
            mask_SB = mask_SB.chunk(self.groups.size("tp"), dim=0)[self.groups.rank("tp")]
        if mask_SB.numel() != num_tokens:
            raise ValueError(f"token mask covers {mask_SB.numel()} tokens, router saw {num_tokens}")
        return mask_SB.reshape(-1)

    def _hook(self, router, args, output) -> None:
        if not self.listeners:
            self.own_map_TE = None
            return
        hidden_TH = args[0].reshape(-1, args[0].shape[-1])
        _, routing_map_TE = output
        own_map_TE, self.own_map_TE = self.own_map_TE, None
        layer = router.layer_number - 1
        reference = self._routes_local("reference", hidden_TH.shape[0])
        call = RouterCall(
            layer=layer,
            routing_map_TE=routing_map_TE,
            valid_T=self._local_valid_T(hidden_TH.shape[0]),
            recompute=in_backward(),
            make_logits=lambda: torch.nn.functional.linear(
                hidden_TH.float(), router.weight.float()
            ),
            own_map_TE=own_map_TE,
            reference_TK=None if reference is None else reference[0][:, layer - reference[2]],
            reference_T=None if reference is None else reference[1],
        )
        self._emit(call)
