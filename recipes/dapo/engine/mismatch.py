"""Train-vs-rollout log-prob mismatch: `actor/rollout_logprob_abs_diff/{mean,p99,max}`.

Trainer side: the old-log-prob pass's log-probs (the same weights the rollout sampled with,
before this step's updates). Rollout side: `rollout_log_probs` (rollout.calculate_log_probs).
Over response tokens (response_mask), every DP rank's rows (TP ranks hold the same rows).
p99 is the nearest-rank 99th percentile.
"""

import math

import torch
import torch.distributed as dist
from tensordict import TensorDict

from recipes.dapo.engine.batches import response_lengths_B

PREFIX = "actor/rollout_logprob_abs_diff"


def _rows(tensor: torch.Tensor, lengths_B: torch.Tensor) -> list[torch.Tensor]:
    """Each row's first n values, for a nested or a right-padded [B, R] tensor."""
    rows = tensor.unbind() if tensor.is_nested else list(tensor)
    return [row[:n] for row, n in zip(rows, lengths_B.tolist(), strict=True)]


def abs_diffs(log_probs: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """|trainer - rollout| log-prob of every response token of this rank's rows (1-D fp32).

    log_probs: nested [B, len], position t holds log p(token t + 1) (verl's convention)."""
    responses_B = response_lengths_B(data)
    rollout = _rows(data["rollout_log_probs"], responses_B)
    masks = (
        _rows(data["response_mask"], responses_B)
        if "response_mask" in data.keys()
        else [torch.ones(len(r), dtype=torch.bool) for r in rollout]
    )
    pieces = []
    for ours, theirs, mask, r in zip(
        log_probs.unbind(), rollout, masks, responses_B.tolist(), strict=True
    ):
        n = ours.shape[0]
        trainer_R = ours[n - r - 1 : n - 1].float().cpu()
        diff_R = (trainer_R - theirs.float().cpu()).abs()
        pieces.append(diff_R[mask.cpu().bool()])
    return torch.cat(pieces) if pieces else torch.zeros(0)


def gather_values(values: torch.Tensor, group) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every rank of `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    device = "cpu" if dist.get_backend(group) == "gloo" else torch.accelerator.current_accelerator()
    count = torch.tensor([values.numel()], device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    width = int(max(c.item() for c in counts))
    padded = torch.zeros(width, device=device)
    padded[: values.numel()] = values.to(device)
    parts = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts, strict=True)]).cpu()


def summary(diffs: torch.Tensor) -> dict[str, float]:
    if diffs.numel() == 0:
        return {}
    ordered = diffs.double().sort().values
    p99 = ordered[max(0, math.ceil(0.99 * ordered.numel()) - 1)]
    return {
        f"{PREFIX}/mean": float(ordered.mean()),
        f"{PREFIX}/p99": float(p99),
        f"{PREFIX}/max": float(ordered[-1]),
    }


def rollout_logprob_abs_diff(log_probs: torch.Tensor, data: TensorDict, dp_group) -> dict:
    """The metrics over the whole batch (collective over `dp_group`)."""
    return summary(gather_values(abs_diffs(log_probs, data), dp_group))
