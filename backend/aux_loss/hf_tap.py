"""RouterTap's counterpart for transformers' Qwen3MoeForCausalLM (the reference model).

Hook point: `model.model.layers[i].mlp.gate` (Qwen3MoeTopKRouter). Its forward takes the
flattened hidden states [B*S, H] (batch-major) and returns (router_logits [T, E],
routing_weights [T, k], expert_indices [T, k]); the logits are already the full,
differentiable router logits, and the routing weights are what scales each expert output.
"""

import torch

from backend.aux_loss.attach import RouterSite
from backend.instruments.router_tap import RouterCall, TapBase, in_backward


def hf_sites(model: torch.nn.Module) -> list[RouterSite]:
    """The routers of a Qwen3MoeForCausalLM, with their output that carries the weights."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    sites = [
        RouterSite(i, layer.mlp.gate, 1)
        for i, layer in enumerate(layers)
        if hasattr(getattr(layer, "mlp", None), "gate")
    ]
    if not sites:
        raise ValueError(
            "model has no layers[i].mlp.gate router: is it a transformers Qwen3-MoE model?"
        )
    return sites


class HFRouterTap(TapBase):
    """Forward hooks on every gate; listeners get a RouterCall per call (batch-major tokens)."""

    layout = "bs"  # flattened token order: t = b * S + s (megatron-core's is s * B + b)

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.sites = hf_sites(model)
        self._valid_T: torch.Tensor | None = None
        self._handles = [
            s.module.register_forward_hook(self._hook_for(s.layer)) for s in self.sites
        ]

    def set_token_mask(self, valid_BS: torch.Tensor | None) -> None:
        """Tokens that count for the next forward passes ([B, S] bool), None for all."""
        self._valid_T = None if valid_BS is None else valid_BS.reshape(-1)

    def _hook_for(self, layer: int):
        def hook(gate, args, output) -> None:
            if not self.listeners:
                return
            logits_TE, _, indices_Tk = output
            routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
            routing_map_TE.scatter_(1, indices_Tk, True)
            valid_T = self._valid_T
            if valid_T is not None and valid_T.numel() != logits_TE.shape[0]:
                raise ValueError(
                    f"token mask covers {valid_T.numel()} tokens, router saw {logits_TE.shape[0]}"
                )
            self._emit(
                RouterCall(layer, routing_map_TE, valid_T, in_backward(), lambda: logits_TE.float())
            )

        return hook
