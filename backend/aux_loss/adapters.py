"""Build an AuxLossHook for a megatron-core GPTModel or a transformers Qwen3-MoE model."""

import torch

from backend.aux_loss.attach import mcore_sites
from backend.aux_loss.config import AuxLossConfig
from backend.aux_loss.hf_tap import HFRouterTap
from backend.aux_loss.hook import AuxLossHook
from backend.instruments.router_tap import RouterTap
from backend.training.distributed import ProcessGroups


def mcore_aux_loss(
    model: torch.nn.Module,
    tap: RouterTap,
    config: AuxLossConfig,
    groups: ProcessGroups,
    grad_scale: float = 1.0,
) -> AuxLossHook:
    """The hook on every TopKRouter of `model`; `tap` must be a RouterTap of the same model.

    grad_scale: 1 when DP ranks sum gradients (tests/support/reference_actor.py), the DP size under
    megatron-core's averaging DDP (backend.training.optim); backend.instruments.router_instruments.aux_grad_scale derives
    it from the reduction. See AuxLossHook.
    """
    sites = mcore_sites(model)
    if not sites:
        raise ValueError("model has no MoE router (TopKRouter): is it a Qwen3-MoE GPTModel?")
    cfg = sites[0].module.config
    return AuxLossHook(
        tap,
        sites,
        config,
        groups,
        num_experts=cfg.num_moe_experts,
        top_k=cfg.moe_router_topk,
        num_layers=cfg.num_layers,
        layout="sb",
        sequence_parallel=cfg.sequence_parallel,
        grad_scale=grad_scale,
    )


def hf_aux_loss(
    model: torch.nn.Module, config: AuxLossConfig, tap: HFRouterTap | None = None
) -> AuxLossHook:
    """The hook on a transformers Qwen3MoeForCausalLM (one process; tap built if not given)."""
    tap = tap or HFRouterTap(model)
    hf = model.config
    return AuxLossHook(
        tap,
        tap.sites,
        config,
        None,
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        num_layers=hf.num_hidden_layers,
        layout="bs",
    )
