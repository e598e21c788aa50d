"""DAPO's pieces between rollout and optimizer: dynamic sampling, GRPO advantages, the loss.

verl supplies the math: compute_grpo_outcome_advantage, the "vanilla" policy loss (PPO
clip with DAPO's clip-higher and dual clip) and its token-mean agg_loss. Ours: the recipe's
filter_groups / keep-generating logic (RayDAPOTrainer lives in verl's recipe/, not in the
wheel) and the split into mini- and micro-batches over DP ranks.

Gradient scaling: verl's agg_loss multiplies by dp_size because DDP *averages* gradients
over DP; backend.grads.sync_grads *sums* them. So the loss gets dp_size=1 and the global
token count of the mini-batch, and the summed gradient is the token mean of the mini-batch
whatever the DP degree or micro-batch split.
"""

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def filter_groups(data, metric: str):
    """Keep the groups (same uid) whose `metric` varies, as the DAPO recipe does; (data, kept)."""
    values = defaultdict(list)
    for uid, value in zip(data.non_tensor_batch["uid"], data.non_tensor_batch[metric], strict=True):
        values[uid].append(value)
    kept = {uid for uid, vals in values.items() if np.std(vals) > 0 or len(vals) == 1}
    rows = [i for i, uid in enumerate(data.non_tensor_batch["uid"]) if uid in kept]
    return data[rows], len(kept)


@dataclass
class SampledBatch:
    batch: object | None  # DataProto of the kept groups, train_batch_size * n rows at most
    rollouts: list  # every generated DataProto of this step, kept or not (for metrics)
    num_gen_batches: int
    num_prompts: int  # kept groups in the batch


def collect_train_batch(
    generate: Callable[[], object],
    train_prompts: int,
    n: int,
    max_num_gen_batches: int,
    metric: str = "acc",
    mini_prompts: int = 1,
) -> SampledBatch:
    """Generate batches until `train_prompts` groups survive filter_groups (DAPO dynamic sampling).

    At max_num_gen_batches the recipe raises; here the step trains on the whole mini-batches
    it has (none: no update), because a policy that solves every prompt is the normal end
    of a run on a small task, not an error. A lone group is not trained on: AdamW would
    take a full-size step on its noisy gradient.
    """
    from verl import DataProto

    kept, rollouts, num_prompts, gen = [], [], 0, 0
    while num_prompts < train_prompts and (max_num_gen_batches <= 0 or gen < max_num_gen_batches):
        gen += 1
        data = generate()
        rollouts.append(data)
        data, num_kept = filter_groups(data, metric)
        if num_kept:
            kept.append(data)
            num_prompts += num_kept
    usable = (
        train_prompts if num_prompts >= train_prompts else num_prompts - num_prompts % mini_prompts
    )
    batch = DataProto.concat(kept)[: usable * n] if usable else None
    return SampledBatch(batch, rollouts, gen, usable)


def grpo_advantages(data) -> torch.Tensor:
    """Group-normalised outcome advantages [N, R] (verl's GRPO estimator, std-normalised)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    advantages_NR, _ = compute_grpo_outcome_advantage(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )
    return advantages_NR


def policy_loss_config(
    n: int, clip_low: float = 0.2, clip_high: float = 0.28, clip_c: float = 10.0
):
    """verl's ActorConfig carrying DAPO's clip-higher settings and token-mean aggregation."""
    from verl.workers.config.actor import ActorConfig

    return ActorConfig(strategy="megatron", rollout_n=n, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                       loss_agg_mode="token-mean")  # fmt: skip


def make_policy_loss(config, response_cols: slice):
    """loss_fn(log_probs [B, S-1], micro_batch) for McoreActor.train_step via verl's vanilla loss.

    The micro-batch carries old_log_probs, advantages and response_mask [B, R] and the
    mini-batch's global response-token count (all micro-batches, all DP ranks).
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    policy_loss = get_policy_loss_fn("vanilla")

    def loss_fn(log_probs_BT: torch.Tensor, mb: dict):
        global_tokens = int(mb["global_tokens"])
        # the config is frozen, its dict is not (verl fills it the same way)
        config.global_batch_info.update(dp_size=1, batch_num_tokens=global_tokens)
        loss, metrics = policy_loss(
            old_log_prob=mb["old_log_probs"],
            log_prob=log_probs_BT[:, response_cols],
            advantages=mb["advantages"],
            response_mask=mb["response_mask"],
            loss_agg_mode=config.loss_agg_mode,
            config=config,
        )
        # verl's metrics are micro-batch means: weight by token share so the actor's sum is the mean
        share = float(mb["response_mask"].sum()) / global_tokens
        out = {key: value * share for key, value in metrics.items()}
        out["actor/pg_loss"] = loss.detach()
        return loss, out

    return loss_fn


TRAIN_KEYS = ("input_ids", "attention_mask", "response_mask", "old_log_probs", "advantages")


def _pad_rows(tensors: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Append all-masked rows so every DP rank gets the same shapes (collective forwards)."""
    rows = next(iter(tensors.values())).shape[0]
    extra = -rows % multiple
    if not extra:
        return tensors
    return {k: torch.cat((v, v[:1].expand(extra, *v.shape[1:]) * 0)) for k, v in tensors.items()}


def rank_micro_batches(mini, micro_size: int, dp_size: int, dp_rank: int) -> list[dict]:
    """This DP rank's micro-batches of a mini-batch (a DataProto), with the global token count."""
    tensors = {k: mini.batch[k] for k in TRAIN_KEYS}
    global_tokens = tensors["response_mask"].sum()
    per_rank = -(-len(mini) // dp_size)
    per_rank = -(-per_rank // micro_size) * micro_size if per_rank > micro_size else per_rank
    tensors = _pad_rows(tensors, per_rank * dp_size)
    mine = {k: v[dp_rank * per_rank : (dp_rank + 1) * per_rank] for k, v in tensors.items()}
    return [
        {**{k: v[i : i + micro_size] for k, v in mine.items()}, "global_tokens": global_tokens}
        for i in range(0, per_rank, micro_size)
    ]
