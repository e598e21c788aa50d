"""One DAPO training step on the megatron-core actor, and the prompt stream that feeds it.

The loop follows verl's recipe/dapo RayDAPOTrainer.fit: generate n responses per prompt,
score (DAPO reward manager), filter groups, keep generating until the batch is full, old
log-probs (no grad), GRPO advantages, PPO mini-batches with the clip-higher loss. No KL
(DAPO uses none), no reference model. Every rank holds the whole batch (rollouts are
identical across ranks); the update splits each mini-batch over DP ranks.

Routing is watched through one RouterTap: the expert-load monitor (phases rollout,
old_log_prob, update) and the aux-loss hook. Passes that every DP rank repeats (rollout,
old_log_prob) count tokens on DP rank 0 only, so the monitor's world-sum stays exact.
"""

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from backend.actor import McoreActor
from backend.aux_loss import AuxLossHook
from backend.distributed import ProcessGroups
from backend.forward import forward_logits
from backend.monitor import ExpertLoadMonitor
from backend.router_tap import RouterTap
from recipes.local import algorithm
from recipes.local.rollout import Layout, generate
from recipes.local.task import CharTokenizer, Problem, prompt_batch

PHASES = ("rollout", "old_log_prob", "update")
REDUCED_OVER_DP = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


@dataclass(frozen=True)
class StepConfig:
    n: int = 8
    train_prompts: int = 16  # data.train_batch_size
    gen_prompts: int = 32  # data.gen_batch_size
    max_num_gen_batches: int = 4
    mini_prompts: int = 8  # actor.ppo_mini_batch_size (prompts; x n sequences)
    micro_size: int = 64  # sequences per micro-batch on one rank
    temperature: float = 1.0
    filter_metric: str = "acc"


class PromptStream:
    """Prompts in a fresh seeded permutation each epoch; its state is two integers."""

    def __init__(self, problems: list[Problem], seed: int):
        self.problems, self.seed, self.epoch, self.cursor = problems, seed, 0, 0

    def _order(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.problems), generator=gen).tolist()

    def take(self, count: int) -> list[Problem]:
        out = []
        while len(out) < count:
            order = self._order()
            grab = order[self.cursor : self.cursor + count - len(out)]
            out += [self.problems[i] for i in grab]
            self.cursor += len(grab)
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def _extra_info_array(values: list) -> np.ndarray:
    if values and isinstance(values[0], bool | float | int | torch.Tensor):
        return np.array([float(v) for v in values])
    return np.array(values, dtype=object)


@contextmanager
def _without_listener(tap: RouterTap, listener):
    saved = list(tap.listeners)
    tap.listeners[:] = [x for x in saved if x != listener]
    try:
        yield
    finally:
        tap.listeners[:] = saved


class DapoTrainer:
    def __init__(
        self,
        actor: McoreActor,
        groups: ProcessGroups,
        tap: RouterTap,
        monitor: ExpertLoadMonitor,
        aux_hook: AuxLossHook,
        reward_fn,
        layout: Layout,
        stream: PromptStream,
        cfg: StepConfig,
        policy_config,
        sampler: torch.Generator,
    ):
        self.actor, self.groups, self.tap = actor, groups, tap
        self.monitor, self.aux, self.reward_fn = monitor, aux_hook, reward_fn
        self.layout, self.stream, self.cfg, self.sampler = layout, stream, cfg, sampler
        self.tokenizer = CharTokenizer()
        self.loss_fn = algorithm.make_policy_loss(policy_config, layout.log_prob_cols())
        self.counts_here = groups.rank("dp") == 0  # repeated passes count on one DP rank

    # ---- rollout + reward ---------------------------------------------------------------

    def rollout(self, uid_prefix: str):
        """One generation batch, scored: a DataProto as the recipe has after compute_reward."""
        from verl import DataProto

        prompts = prompt_batch(self.stream.take(self.cfg.gen_prompts), self.tokenizer)
        n = self.cfg.n
        with self.monitor.phase("rollout"):
            out = generate(
                self.actor.model, self.groups, prompts.pop("prompt_ids_BP"), n, self.layout,
                eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                gen=self.sampler, temperature=self.cfg.temperature,
                before_forward=self._mask_repeated_pass,
            )  # fmt: skip
        self.tap.set_token_mask(None)
        uids = np.array(
            [f"{uid_prefix}.{i}" for i in range(len(prompts["data_source"]))], dtype=object
        )
        non_tensors = {k: np.repeat(v, n) for k, v in {**prompts, "uid": uids}.items()}
        data = DataProto.from_dict(tensors=out, non_tensors=non_tensors)
        scored = self.reward_fn(data, return_dict=True)
        data.batch["token_level_scores"] = scored["reward_tensor"]
        data.batch["token_level_rewards"] = scored["reward_tensor"]  # no KL in reward (DAPO)
        data.non_tensor_batch.update(
            {k: _extra_info_array(v) for k, v in scored["reward_extra_info"].items()}
        )
        # the recipe's other filter metrics: summed token_level_scores / _rewards (no KL: equal)
        data.non_tensor_batch["seq_final_reward"] = scored["reward_tensor"].sum(-1).numpy()
        data.non_tensor_batch["seq_reward"] = data.non_tensor_batch["seq_final_reward"]
        return data

    def _mask_repeated_pass(self, valid_BS: torch.Tensor) -> None:
        self.tap.set_token_mask(valid_BS.bool() & self.counts_here)

    # ---- update -------------------------------------------------------------------------

    def old_log_probs(self, batch) -> torch.Tensor:
        """Response log-probs [N, R] under the weights that sampled them (no grad)."""
        out = []
        with self.monitor.phase("old_log_prob"):
            for mb in batch.split(self.cfg.micro_size):
                self._mask_repeated_pass(mb.batch["attention_mask"])
                out.append(self.actor.log_probs([{"input_ids": mb.batch["input_ids"]}])[0])
        self.tap.set_token_mask(None)
        return torch.cat(out)[:, self.layout.log_prob_cols()]

    def update(self, batch) -> dict[str, float]:
        batch.batch["response_mask"] = batch.batch["attention_mask"][:, self.layout.response_cols()]
        batch.batch["old_log_probs"] = self.old_log_probs(batch)
        batch.batch["advantages"] = algorithm.grpo_advantages(batch)
        per_mini = [
            self.train_mini_batch(mini) for mini in batch.split(self.cfg.mini_prompts * self.cfg.n)
        ]
        metrics = {k: float(np.mean([m[k] for m in per_mini])) for k in per_mini[0]}
        metrics["actor/num_optimizer_steps"] = float(len(per_mini))
        return metrics

    def train_mini_batch(self, mini) -> dict[str, float]:
        mbs = algorithm.rank_micro_batches(
            mini, self.cfg.micro_size, self.groups.size("dp"), self.groups.rank("dp")
        )
        masks = [mb["attention_mask"].bool() for mb in mbs]
        self.aux.start_step(masks)
        if self.aux.config.needs_counting_pass:  # global-batch balance needs the step's counts
            with _without_listener(self.tap, self.monitor.record), self.aux.counting():
                for mb, valid_BS in zip(mbs, masks, strict=True):
                    self.aux.set_tokens(valid_BS)
                    forward_logits(self.actor.model, mb["input_ids"])
        with self.monitor.phase("update"):
            metrics = self.actor.train_step(mbs, self.loss_fn, before_micro_batch=self._set_tokens)
        metrics.update(self.aux.end_step())
        self._sum_over_dp(metrics)
        return metrics

    def _set_tokens(self, mb: dict) -> None:
        self.aux.set_tokens(mb["attention_mask"].bool())

    def _sum_over_dp(self, metrics: dict[str, float]) -> None:
        keys = [k for k in REDUCED_OVER_DP if k in metrics]
        if self.groups.size("dp") == 1 or not keys:
            return
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(values, group=self.groups.dp)
        metrics.update(zip(keys, values.tolist(), strict=True))

    # ---- one step -----------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        """Dynamic sampling, then the update when a mini-batch of groups survived; metrics."""
        gen_index = itertools.count(1)
        sampled = algorithm.collect_train_batch(
            lambda: self.rollout(f"{step}.{next(gen_index)}"),
            self.cfg.train_prompts, self.cfg.n, self.cfg.max_num_gen_batches,
            self.cfg.filter_metric, self.cfg.mini_prompts,
        )  # fmt: skip
        metrics = rollout_metrics(sampled, self.cfg.train_prompts)
        aux = {}
        if sampled.batch is not None:
            update = self.update(sampled.batch)
            aux = {k: v for k, v in update.items() if k.startswith("moe/aux_loss")}
            metrics.update({k: v for k, v in update.items() if k not in aux})
        metrics.update(self.monitor.step_end(step, aux_losses=aux))
        return metrics


def rollout_metrics(sampled: algorithm.SampledBatch, train_prompts: int) -> dict[str, float]:
    """Reward and length over every response generated this step, and the filter's yield."""
    from verl import DataProto

    every = DataProto.concat(sampled.rollouts)
    reward_N = every.batch["token_level_rewards"].sum(-1)
    length_N = every.batch["attention_mask"][:, every.batch["prompts"].shape[1] :].sum(-1).float()
    out = {
        "rollout/reward_mean": reward_N.mean().item(),
        "rollout/acc_mean": float(np.mean(every.non_tensor_batch["acc"])),
        "rollout/score_mean": float(np.mean(every.non_tensor_batch["score"])),
        "rollout/response_length_mean": length_N.mean().item(),
        "rollout/overlong_frac": float(np.mean(every.non_tensor_batch.get("overlong", [0.0]))),
        "dapo/num_gen_batches": float(sampled.num_gen_batches),
        "dapo/kept_prompts": float(sampled.num_prompts),
        "dapo/batch_full": float(sampled.num_prompts >= train_prompts),
    }
    if sampled.batch is not None:
        out["critic/score_mean"] = sampled.batch.batch["token_level_rewards"].sum(-1).mean().item()
    return out
