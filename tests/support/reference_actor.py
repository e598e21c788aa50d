"""A hand-written reference actor: the tests' independent check of what the engine's optimizer
(backend.training.optim: megatron-core DDP + finalize_model_grads + distributed optimizer) does.

Log-probs, micro-batched forward/backward with a given loss, then gradient synchronisation
and clipping written out against our explicit groups (same code on gloo and accelerators),
torch AdamW and backend.training.optim's warm-up. Used to cross-check parallel plans (tests/
parallel_ranks.py, test_actor.py, test_aux_loss_hook.py); the engine never runs it.

- dense parameters are replicated over the attention DP group: sum over dp;
- expert parameters are replicated over the expert DP group: sum over edp;
- with sequence parallelism each TP rank saw a slice of the tokens, so norms and the router
  (tagged `sequence_parallel`) and the q/k norms (heads split over TP) sum over tp.
Losses are expected to be already normalised by the global token count, so DP ranks *sum*
(backend.training.optim.DP_REDUCTION is "mean": megatron's DDP averages, verl scales its loss by dp).

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
import torch.distributed as dist

from backend.model.build import is_expert
from backend.model.forward import next_token_log_probs
from backend.training.distributed import ProcessGroups
from backend.training.optim import warmup_factor

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
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_factor(step, optim.warmup_steps)
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


# ---- gradient synchronisation and clipping (what DDP + finalize_model_grads + clip do) ----


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
