"""Gradient synchronisation and clipping across TP / DP / EP for a megatron-core model.

What megatron-core's DDP + finalize_model_grads do, written against our explicit groups so
that the same code runs on CPU (gloo) and on accelerators:
- dense parameters are replicated over the attention DP group: average over dp;
- expert parameters are replicated over the expert DP group: average over edp;
- with sequence parallelism each TP rank saw a slice of the tokens, so norms and the router
  (tagged `sequence_parallel`) and the q/k norms (heads split over TP) sum over tp.
Losses are expected to be already normalised by the global token count, so DP ranks *sum*.
"""

import torch
import torch.distributed as dist

from backend.distributed import ProcessGroups


def is_expert(param: torch.Tensor) -> bool:
    """An expert weight: tagged `is_expert` by backend.model.build_model, or by megatron-core
    `allreduce=False` (expert-parallel replicas)."""
    return getattr(param, "is_expert", False) or not getattr(param, "allreduce", True)


def _tp_partial(name: str, param: torch.Tensor) -> bool:
    return (
        getattr(param, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name
    )


def sync_grads(model: torch.nn.Module, groups: ProcessGroups) -> None:
    """Sum gradients over the ranks that hold copies of each parameter (in place)."""
    tp = groups.size("tp")
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        replicas = "edp" if is_expert(param) else "dp"
        if groups.size(replicas) > 1:
            dist.all_reduce(param.grad, group=getattr(groups, replicas))
        if tp > 1 and _tp_partial(name, param):
            dist.all_reduce(param.grad, group=groups.tp)


def _owned_square_sum(model: torch.nn.Module, groups: ProcessGroups, experts: bool) -> torch.Tensor:
    """Sum of squared grads this rank owns (a replica counts on the first rank of its split group)."""
    split_group = "etp" if experts else "tp"
    first_in_split = groups.rank(split_group) == 0
    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is None or is_expert(param) != experts:
            continue
        if getattr(param, "tensor_model_parallel", False) or first_in_split:
            total += param.grad.detach().double().pow(2).sum().cpu()
    return total


def global_grad_norm(model: torch.nn.Module, groups: ProcessGroups) -> float:
    """L2 norm of the full model's gradient, equal on every rank (call after sync_grads)."""
    device = next(model.parameters()).device
    dense = _owned_square_sum(model, groups, experts=False).to(device)
    expert = _owned_square_sum(model, groups, experts=True).to(device)
    for group in ("tp", "pp"):
        if groups.size(group) > 1:
            dist.all_reduce(dense, group=getattr(groups, group))
    for group in ("etp", "ep", "pp"):
        if groups.size(group) > 1:
            dist.all_reduce(expert, group=getattr(groups, group))
    return float((dense + expert).sqrt())


def clip_grads(model: torch.nn.Module, groups: ProcessGroups, max_norm: float) -> float:
    """Scale gradients so the global norm is at most max_norm; return the norm before clipping."""
    norm = global_grad_norm(model, groups)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(scale)
    return norm
