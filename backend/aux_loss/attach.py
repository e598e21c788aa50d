"""Carry an aux loss's gradient on a router output without adding to the loss value.

The router output that weights the expert outputs (megatron-core's probs, transformers'
routing scores) is in every backward pass of the main loss, including the backward that
activation recompute runs on replayed layers; a gradient injected there reaches the
aux loss's own graph (router logits -> router weight and hidden states) exactly when the
layer's backward runs.
"""

from dataclasses import dataclass

import torch


class AttachAuxGrad(torch.autograd.Function):
    """Identity on `activation`; its backward also sends d(total)/d(aux) = `scale` to `aux`,
    and adds `scale` to `carried` (a float64 scalar) when given: what the backward passes
    actually carried, as the hook reports it.

    megatron-core's MoEAuxLossAutoScaler does the same with a process-global scale that its
    pipeline schedule resets every micro-batch; this one takes the scale explicitly.
    """

    @staticmethod
    def forward(ctx, activation, aux, scale: float, carried=None) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale, ctx.carried = scale, carried
        return activation

    @staticmethod
    def backward(ctx, grad_activation: torch.Tensor):
        (aux,) = ctx.saved_tensors
        if ctx.carried is not None:
            ctx.carried += ctx.scale
        return grad_activation, torch.full_like(aux, ctx.scale), None, None


@dataclass(frozen=True)
class RouterSite:
    """A router module whose output `output_index` carries the routing weights."""

    layer: int  # global 0-based layer index, as in RouterCall.layer
    module: torch.nn.Module
    output_index: int


def with_aux_grad(output: tuple, index: int, aux: torch.Tensor, scale: float, carried=None):
    """`output` with element `index` replaced by its aux-gradient-carrying identity."""
    identity = AttachAuxGrad.apply(output[index], aux, scale, carried)
    return (*output[:index], identity, *output[index + 1 :])


def mcore_sites(model: torch.nn.Module) -> list[RouterSite]:
    """megatron-core TopKRouter: forward returns (probs, routing_map); probs weight the experts."""
    from backend.instruments.router_tap import router_modules

    return [RouterSite(r.layer_number - 1, r, 0) for r in router_modules(model)]
