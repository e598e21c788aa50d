"""A routing report of a skewed run at any shape, built the way the engine records one: each
update's router calls (top-k routing maps of T tokens) counted per layer, a trainer step's
updates folded into backend.monitor's LoadHistory, the report built and saved by its code.

The router: per layer, logits of a lognormal-ish spread, a few hot experts (+2.5), some dead
ones (never picked), each token's top-k by Gumbel sampling: a few experts near 10x the mean,
a long tail, zeros. tests/backend/test_monitor_experts.py renders it at 128 experts x 4 and 48 layers.
"""

import torch

from backend.monitor.history import LoadHistory
from backend.monitor.report import build_report, save_report

PHASES = ("update", "old_log_prob")


def plan_of(ep: int, dp: int = 8) -> dict:
    return {"tp": 1, "ep": ep, "pp": 1, "cp": 1, "dp": dp, "etp": 1, "edp": dp // ep, "world": dp}


def router_logits_LE(num_layers: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """Per layer: spread logits, 3 hot experts, up to 4 dead ones (-inf)."""
    gen = torch.Generator().manual_seed(seed)
    logits_LE = 0.6 * torch.randn(num_layers, num_experts, generator=gen, dtype=torch.float64)
    for layer in range(num_layers):
        order = torch.randperm(num_experts, generator=gen)
        logits_LE[layer, order[:3]] += torch.tensor([2.5, 2.0, 1.5], dtype=torch.float64)
        logits_LE[layer, order[3 : 3 + layer % 5]] = -torch.inf
    return logits_LE


def route_counts_LE(logits_LE: torch.Tensor, tokens: int, top_k: int, gen) -> torch.Tensor:
    """Tokens per expert of one pass: each token's top-k of Gumbel-perturbed logits."""
    num_layers, num_experts = logits_LE.shape
    gumbel = -torch.log(-torch.log(torch.rand(tokens, num_layers, num_experts, generator=gen,
                                              dtype=torch.float64)))  # fmt: skip
    top_TLK = (logits_LE + gumbel).topk(top_k, dim=-1).indices
    routing_TLE = torch.zeros(tokens, num_layers, num_experts, dtype=torch.int64)
    routing_TLE.scatter_(-1, top_TLK, 1)
    return routing_TLE.sum(0)


def skewed_run(path, num_layers: int, num_experts: int = 128, top_k: int = 8, ep: int = 4,
               trainer_steps: int = 6, updates: int = 2, tokens: int = 256, seed: int = 0,
               model: str = "/models/Qwen3-30B-A3B"):  # fmt: skip
    """Save the report of `trainer_steps` steps of `updates` optimizer updates each."""
    logits_LE = router_logits_LE(num_layers, num_experts, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    history = LoadHistory(PHASES, num_layers, num_experts, ep, window_steps=4)
    for update in range(1, trainer_steps * updates + 1):
        step = (update - 1) // updates + 1
        counts_PLE = torch.zeros(len(PHASES), num_layers, num_experts, dtype=torch.int64)
        counts_PLE[0] = route_counts_LE(logits_LE, tokens, top_k, gen)
        if update % updates == 1 or updates == 1:  # the old-log-prob pass: once a step
            counts_PLE[1] = route_counts_LE(logits_LE, tokens * updates, top_k, gen)
        history.add(update, counts_PLE, {"moe/aux_loss/total": 0.01 + 0.001 * update},
                    trainer_step=step)  # fmt: skip
    name = f"qwen3-moe-{num_layers}x{num_experts}-ep{ep}"
    report = build_report(history, plan_of(ep), model=model, top_k=top_k, run=name,
                          trainer_steps=trainer_steps)  # fmt: skip
    return save_report(report, path)
