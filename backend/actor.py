"""The megatron-core actor: log-probs, micro-batched forward/backward with a given loss, optimizer step.

Batches are dicts of tensors with `input_ids` [B, S] (right-padded) plus whatever the loss
needs; a loss function receives the micro-batch and its next-token log-probs [B, S-1] and
returns (loss, metrics). It must normalise by the *global* token count of the step (as
verl's token-mean with dynamic batch sizes does), so that gradient sums over micro-batches
and DP ranks give the token mean of the whole batch.
"""

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from backend.distributed import ProcessGroups
from backend.forward import next_token_log_probs
from backend.grads import clip_grads, sync_grads

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # no decay on norms (1-D), as Megatron and verl do
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class McoreActor:
    """One rank's share of the policy: model stage, optimizer, groups; pp = 1."""

    def __init__(self, model: torch.nn.Module, groups: ProcessGroups, optim: OptimConfig):
        if groups.size("pp") != 1:
            raise ValueError(
                "the actor runs pp=1 for now: pipeline stages need megatron's schedule"
            )
        self.model, self.groups, self.optim_cfg = model, groups, optim
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas, eps=optim.eps
        )
        warmup = max(optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    @torch.no_grad()
    def log_probs(self, micro_batches: Iterable[dict]) -> list[torch.Tensor]:
        """Next-token log-probs [B, S-1] per micro-batch, no graph kept."""
        self.model.eval()
        return [next_token_log_probs(self.model, mb["input_ids"]) for mb in micro_batches]

    def train_step(
        self,
        micro_batches: list[dict],
        loss_fn: LossFn,
        before_micro_batch: Callable[[dict], object] | None = None,
    ) -> dict:
        """Accumulate gradients over micro-batches, sync, clip, step. Returns summed metrics.

        before_micro_batch(mb) may return a context manager (e.g. the router tap's token mask).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for mb in micro_batches:
            ctx = before_micro_batch(mb) if before_micro_batch else None
            with ctx or nullcontext():
                loss, mb_metrics = loss_fn(next_token_log_probs(self.model, mb["input_ids"]), mb)
                loss.backward()
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        sync_grads(self.model, self.groups)
        metrics["actor/grad_norm"] = clip_grads(self.model, self.groups, self.optim_cfg.grad_clip)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
