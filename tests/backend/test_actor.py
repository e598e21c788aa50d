"""The reference actor (tests/support/reference_actor.py): synced, clipped gradients and their norm
agree across micro-batch splits, plans and torch.

Gradients are compared after the step (train_step leaves them in .grad): Adam's first update
is lr * sign(g) for tiny g, so comparing updated parameters would test rounding noise.
"""

import pytest
import torch

from backend.model.build import build_model
from backend.model.forward import next_token_log_probs
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.hf_io import read_state_dict
from converters.sharding import load_hf_into_model
from tests.support.multiproc import run_ranks
from tests.support.parallel_ranks import global_batch, nll_token_mean, run_actor_step
from tests.support.reference_actor import McoreActor, OptimConfig

MAX_NORM = 0.5


def _world1_step(world1, hf_dir, max_norm):
    """(metrics, torch's norm of the gradients the step left (clipped), model)."""
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, world1)
    load_hf_into_model(model, read_state_dict(hf_dir), spec)
    actor = McoreActor(model, world1, OptimConfig(lr=1e-2, grad_clip=max_norm))
    ids = global_batch(spec.vocab_size)
    metrics = actor.train_step([{"input_ids": ids}], nll_token_mean)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    return metrics, clipped, model


def _torch_grad_norm(world1, hf_dir) -> float:
    """torch's total norm of the same loss's gradients on a fresh model: unclipped."""
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, world1)
    load_hf_into_model(model, read_state_dict(hf_dir), spec)
    ids = global_batch(spec.vocab_size)
    loss, _ = nll_token_mean(next_token_log_probs(model, ids), None)
    loss.backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


def test_world1_grad_norm_is_torchs_and_clipping_applies(world1, tiny_hf_dir):
    """The reported norm is torch's norm of the unclipped gradients; clipping leaves them at
    max_norm. Catches a reported norm that is not the one clipped by (clip_grads returning
    norm ** 2: clipping stays right and the norm still exceeds max_norm)."""
    metrics, clipped, model = _world1_step(world1, tiny_hf_dir, MAX_NORM)
    assert metrics["actor/grad_norm"] == pytest.approx(
        _torch_grad_norm(world1, tiny_hf_dir), rel=1e-6
    )
    assert metrics["actor/grad_norm"] > MAX_NORM  # the tiny model's first step is clipped
    assert clipped == pytest.approx(MAX_NORM, rel=1e-4)  # grads left at max_norm
    assert metrics["loss"] > 0


def test_micro_batch_split_gives_the_same_gradients(world1, tiny_hf_dir):
    spec = load_qwen3_moe_spec(tiny_hf_dir)
    ids = global_batch(spec.vocab_size)
    grads = []
    for splits in (1, 2):
        model = build_model(spec, world1)
        load_hf_into_model(model, read_state_dict(tiny_hf_dir), spec)
        actor = McoreActor(model, world1, OptimConfig(lr=1e-2, grad_clip=MAX_NORM))
        actor.train_step([{"input_ids": c} for c in ids.chunk(splits)], nll_token_mean)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def _plan_matches_world1(world1, hf_dir, world: int, tp: int, ep: int) -> None:
    """One clipped step at tp x ep on `world` gloo ranks against world 1: the grad norm on
    every rank, and every full (gathered) gradient."""
    metrics, _, model = _world1_step(world1, hf_dir, MAX_NORM)
    results = run_ranks(run_actor_step, world, str(hf_dir), tp, ep, MAX_NORM)
    for r in results:
        assert r["grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert results[0]["grads"].keys() == ref.keys()
    for name, value in results[0]["grads"].items():
        torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_tp2xep2_gradients_and_norm_match_world1(world1, tiny_hf_dir):
    _plan_matches_world1(world1, tiny_hf_dir, 4, 2, 2)


# Qwen3-30B-A3B's routing (128 experts, top-8) and GQA 8:1 at 4 KV heads (so tp 4 divides them)
MISSION_SHAPE = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=16, num_experts=128,
                     num_experts_per_tok=8, vocab_size=64)  # fmt: skip


@pytest.mark.slow
def test_the_missions_plan_tp4_ep8_at_world_8_matches_world1(world1, tmp_path):
    """tp4 x ep8 (dp 2, edp 1) on 8 gloo ranks, one clipped AdamW step of the actor on a
    random 2-layer Qwen3-MoE at the mission's routing: the grad norm and every full gradient
    equal world 1's. Catches experts permuted across EP ranks, TP shards concatenated in the
    wrong order, or the wrong group's gradients reduced, at the plan the cluster runs."""
    from tests.support.model_dirs import built

    _plan_matches_world1(world1, built(tmp_path / "mission_shape", MISSION_SHAPE), 8, 4, 8)
