"""Reference computations only the tests use: whole-level router losses, full tensors
gathered from a sharded model, a monitor's unreduced counts, the tiny model's config."""

import torch
import torch.distributed as dist

from backend.aux_loss.losses import (
    balance_share,
    expert_fractions_E,
    routed_counts_E,
    sequence_share,
    sequence_stats,
    valid_count,
    z_share,
)
from backend.training.distributed import ProcessGroups
from converters.sharding import iter_full

# ---- whole-level losses (one call holds the whole level): the hook's sums checked against them


def switch_loss(logits_TE, routing_map_TE, top_k: int, valid_T=None) -> torch.Tensor:
    """L = E * sum_i f_i * P_i over the call's valid tokens (micro-batch level)."""
    n = valid_count(valid_T, logits_TE.shape[0])
    f_E = expert_fractions_E(routed_counts_E(routing_map_TE, valid_T), n, top_k)
    return balance_share(logits_TE, f_E, n, valid_T)


def sequence_loss(logits_TE, routing_map_TE, seq_T, num_seqs: int, top_k: int, valid_T=None):
    """Mean over sequences (with a valid token) of the per-sequence switch loss."""
    counts_BE, tokens_B = sequence_stats(routing_map_TE, seq_T, num_seqs, valid_T)
    total = int((tokens_B > 0).sum())
    return sequence_share(logits_TE, seq_T, counts_BE, tokens_B, total, top_k, valid_T)


def z_loss(logits_TE, valid_T=None) -> torch.Tensor:
    """Z = mean over valid tokens of logsumexp(logits_t)^2."""
    return z_share(logits_TE, valid_count(valid_T, logits_TE.shape[0]), valid_T)


def gather_full(
    model: torch.nn.Module, groups: ProcessGroups, spec, grads: bool = False
) -> dict[str, torch.Tensor]:
    """World-size-1 mcore names -> full tensors (params, or their .grad), on every rank.

    Collective over TP/ETP, EP and PP: every rank must call it.
    """
    full = {name: tensor.cpu() for name, tensor in iter_full(model, groups, spec, grads)}
    if groups.size("pp") > 1:  # each stage holds its own layers
        full = _merge_over(full, groups.pp, groups.size("pp"))
    return full


def _merge_over(local: dict[str, torch.Tensor], group, size: int) -> dict[str, torch.Tensor]:
    parts: list[dict[str, torch.Tensor] | None] = [None] * size
    dist.all_gather_object(parts, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def local_counts(monitor) -> torch.Tensor:
    """A monitor's unreduced counts of the current step on this rank, [phases, layers, experts]."""
    return monitor._counts_PLE.detach().cpu().clone()


def tiny_hf_config() -> dict:
    """The tiny model's config.json fields, in memory (recipes.local.task.built_models)."""
    from recipes.local.task.built_models import built_config

    return built_config("tiny")
