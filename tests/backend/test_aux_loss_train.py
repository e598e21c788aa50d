"""Behaviour: with the hook on, a few dozen Adam steps on skewed inputs end with more evenly
loaded experts than the same run with it off (same seed, same data)."""

import pytest
import torch

from backend.aux_loss import AuxLossConfig
from backend.instruments.router_tap import RouterTap
from backend.model.forward import next_token_log_probs
from tests.backend.test_aux_loss_hook import (
    _tiny_mcore,
    aux_step,
    one_thread,  # noqa: F401 (autouse fixture)
)

pytestmark = pytest.mark.mcore_compat

STEPS, LR = 30, 1e-3
SKEW_VOCAB = 16  # inputs use 16 of the 128 tokens: routing collapses onto few experts


def skewed_batch(seed: int):
    ids = torch.randint(0, SKEW_VOCAB, (8, 32), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)


def step_token_mean_nll(lp_BS, loss_mask_BS):
    return -(lp_BS * loss_mask_BS[:, 1:]).sum() / (8 * 31)  # over the step's 8 x 31 targets


def tokens_per_expert_cv(model, groups) -> float:
    """The monitor's coefficient of variation of tokens per expert (mean over layers), held-out batch."""
    from backend.monitor.metrics import cv_L

    tap = RouterTap(model, groups)
    counts = {}
    tap.add_listener(
        lambda call: counts.setdefault(call.layer, call.routing_map_TE.sum(0).double())
    )
    with torch.no_grad():
        next_token_log_probs(model, skewed_batch(seed=999)[0])
    tap.remove()
    counts_LE = torch.stack([counts[layer] for layer in sorted(counts)])
    return cv_L(counts_LE).mean().item()


def train(groups, hf_dir, cfg: AuxLossConfig) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = _tiny_mcore(groups, hf_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        metrics, grads = aux_step(
            model, groups, cfg, *skewed_batch(step), [4, 4], main=step_token_mean_nll
        )
        for name, param in model.named_parameters():
            param.grad = grads.get(name)
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return tokens_per_expert_cv(model, groups), metrics


@pytest.mark.slow
def test_balancing_lowers_routing_imbalance(world1, tiny_hf_dir):
    cv_off, _ = train(world1, tiny_hf_dir, AuxLossConfig())
    cv_on, metrics = train(
        world1, tiny_hf_dir, AuxLossConfig(mode="on", type="global_batch", coeff=0.1)
    )
    assert cv_on < 0.75 * cv_off, (cv_on, cv_off)
    assert metrics["moe/aux_loss/load_balancing/mean"] < 1.1
