"""The opt-in loss guards (backend.training.loss_guards, recipes.dapo.engine.update_guards) on the tiny Qwen3-MoE, through
the engine's verl interface (CPU, fp32): the entropy floor's bonus and the adaptive KL term
are added to verl's loss, their coefficients move as stated and are logged every step."""

import math
from functools import partial

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import response_from_nested

from backend.training.loss_guards import (
    AdaptiveKL,
    AdaptiveKLConfig,
    EntropyFloor,
    EntropyFloorConfig,
    GuardConfigError,
)
from tests.recipes.test_verl_engine import build_engine, dapo_actor_config

FLOOR = 3.0  # nats; the tiny model starts near log(128) = 4.85
TOLERANCE = 0.1  # of the floor, once the entropy first reached it
STEPS = 60


@pytest.fixture
def engine_for(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


def push_batch(seed: int):
    """8 sequences whose responses all repeat token 7, advantage +1: every update makes the
    policy surer of it, so its entropy falls step after step (a collapse, made fast)."""
    gen, rows = torch.Generator().manual_seed(seed), []
    for i in range(8):
        prompt = torch.randint(0, 128, (4 + i % 4,), generator=gen)
        n = 3 + (i * 2) % 3
        response, ones = torch.full((n,), 7), torch.ones(n, dtype=torch.long)
        ids = torch.cat([prompt, response])
        rows.append(dict(prompts=prompt, responses=response, input_ids=ids,
                         attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(ids)),
                         response_mask=ones, loss_mask=ones, advantages=torch.ones(n)))  # fmt: skip
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=64, temperature=1.0,
                         calculate_entropy=True, global_batch_size=len(rows))  # fmt: skip
    return data


def old_log_prob_pass(engine, data) -> float:
    """verl's old-log-prob pass (sets old_log_probs); the policy's token-mean entropy."""
    with engine.eval_mode():
        out = engine.infer_batch(data)["model_output"]
    mask = data["response_mask"]
    data["old_log_probs"] = response_from_nested(out["log_probs"], mask)
    tu.assign_non_tensor(data, calculate_entropy=False)  # DAPO's update: entropy_coeff 0
    return response_from_nested(out["entropy"], mask).values().mean().item()


def train(engine, steps: int, ref_shift: float | None = None, actor_config=None):
    """verl's trainer step as the V1 trainer makes it (old-log-prob pass, one update): the
    entropy before each update and each update's metrics."""
    loss_fn = partial(ppo_loss, config=actor_config or dapo_actor_config())
    entropies, metrics = [], []
    for step in range(steps):
        data = push_batch(step)
        entropies.append(old_log_prob_pass(engine, data))
        if ref_shift is not None:  # a reference that far below the policy on its tokens
            data["ref_log_prob"] = data["old_log_probs"] - ref_shift
        with engine.train_mode():
            metrics.append(engine.train_batch(data, loss_function=loss_fn)["metrics"])
            engine.lr_scheduler_step()
    return entropies, metrics


@pytest.mark.slow
def test_the_entropy_floor_holds_the_policy_near_it_where_the_bare_run_collapses(engine_for):
    floor = {"entropy_floor": {"enable": True, "floor": FLOOR}}
    bare, _ = train(engine_for(), STEPS)
    held, metrics = train(engine_for(guards=floor), STEPS)
    assert bare[-1] < 0.2 * FLOOR  # nothing stops the collapse without the floor
    reached = next(i for i, h in enumerate(held) if h <= FLOOR)
    assert reached < STEPS - 20  # and the floor then holds for 20 steps and more
    after = held[reached:]
    assert max(abs(h - FLOOR) for h in after) <= TOLERANCE * FLOOR, after
    coef = [m["guard/entropy_coef"][0] for m in metrics]  # logged with every update
    assert coef[0] == 0.0 and all(c > 0 for c in coef[reached:])
    measured = [m["guard/entropy"][0] for m in metrics]  # the update's own entropy
    assert measured == pytest.approx(held, rel=1e-4)  # = the pass before it (one update)


def test_the_guards_terms_are_added_to_verls_loss(engine_for):
    """loss = verl's + (-c_H * mean entropy) + beta * mean kl, over the response tokens."""
    engine = engine_for(guards={"entropy_floor": {"enable": True}, "kl": {"enable": True}})
    shift = 0.5
    data = push_batch(0)
    entropy = old_log_prob_pass(engine, data)
    data["ref_log_prob"] = data["old_log_probs"] - shift
    loss_fn = partial(ppo_loss, config=dapo_actor_config())

    def loss_with(c_entropy: float, beta: float) -> float:
        engine.guards.floor.coef, engine.guards.kl.coef = c_entropy, beta
        with engine.train_mode():  # forward + backward, no optimizer step
            out = engine.forward_backward_batch(data, loss_fn)
        engine.guards.end_step(engine.groups.dp, "cpu")
        return sum(out["loss"])

    bare, guarded = loss_with(0.0, 0.0), loss_with(0.5, 0.2)
    low_var_kl = math.exp(-shift) + shift - 1  # verl's kl_penalty "low_var_kl", on policy
    assert guarded - bare == pytest.approx(-0.5 * entropy + 0.2 * low_var_kl, rel=1e-4)


def test_the_kl_guard_raises_its_coefficient_above_the_band_and_lowers_it_below(engine_for):
    config = AdaptiveKLConfig()  # band [0.01, 0.05], from 0.01, at most x1.04 a step
    engine = engine_for(guards={"kl": {"enable": True}})
    phases = [(1.0, 3, 1 + config.max_error / config.horizon),  # kl 0.37: above the band
              (0.2, 1, 1.0),  # kl 0.019: inside, held
              (0.0, 3, 1 - config.max_error / config.horizon)]  # kl 0: below  # fmt: skip
    coef = [config.init_coef]
    for shift, steps, factor in phases:
        _, metrics = train(engine, steps, ref_shift=shift)
        for m in metrics:
            assert m["guard/kl"][0] == pytest.approx(math.exp(-shift) + shift - 1, abs=1e-5)
            assert m["guard/kl_coef"][0] == pytest.approx(coef[-1])  # what the update used
            coef.append(coef[-1] * factor)
    assert engine.guards.kl.coef == pytest.approx(coef[-1])
    assert coef[3] > coef[2] > coef[1] > coef[0] == coef[3] / 1.04**3


def test_the_kl_guard_needs_the_reference_and_owns_the_coefficient(engine_for):
    engine = engine_for(guards={"kl": {"enable": True}})
    with pytest.raises(GuardConfigError, match="use_kl_loss=True") as err:
        train(engine, 1)
    assert "\n" not in str(err.value)
    from recipes.dapo.engine.config import McoreEpActorConfig

    verl_kl = McoreEpActorConfig(rollout_n=1, use_dynamic_bsz=True, loss_agg_mode="token-mean",
                                 use_kl_loss=True, kl_loss_coef=0.1)  # fmt: skip
    with pytest.raises(GuardConfigError, match="kl_loss_coef=0") as err:
        train(engine_for(guards={"kl": {"enable": True}}), 1, ref_shift=0.5, actor_config=verl_kl)
    assert "\n" not in str(err.value)


def test_the_entropy_floors_coefficient_rises_below_and_decays_to_zero_above():
    floor = EntropyFloor(EntropyFloorConfig(floor=1.0, lead=0.0))
    assert [floor.update(h) for h in (2.0, 1.5)] == [0.0, 0.0]  # above: nothing to add
    rising = [floor.update(0.8) for _ in range(3)]
    assert rising[0] > 0 and rising == sorted(rising) and len(set(rising)) == 3
    falling = [floor.update(1.5) for _ in range(10)]
    assert falling == sorted(falling, reverse=True) and falling[-1] == 0.0
    early = EntropyFloor(EntropyFloorConfig(floor=1.0))  # lead: falling fast towards it
    assert [early.update(h) for h in (1.6, 1.3)][-1] > 0


def test_the_kl_coefficient_stays_within_its_bounds():
    kl = AdaptiveKL(AdaptiveKLConfig(init_coef=0.01, min_coef=0.005, max_coef=0.02))
    assert max(kl.update(10.0) for _ in range(50)) == 0.02
    assert min(kl.update(0.0) for _ in range(50)) == 0.005


@pytest.mark.parametrize(
    "guards, needle",
    [({"entropy": {}}, "unknown guard(s) entropy"),
     ({"entropy_floor": {"enable": True, "flor": 1}}, "unknown setting(s) flor"),
     ({"entropy_floor": {"enable": True, "floor": -1}}, "floor=-1"),
     ({"kl": {"enable": True, "low": 0.1, "high": 0.05}}, "must be below high")],
)  # fmt: skip
def test_guard_settings_that_cannot_work_are_refused_in_one_line(guards, needle):
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    with pytest.raises(EngineConfigError) as err:
        McoreEpEngineConfig(guards=guards)
    assert needle in str(err.value) and "\n" not in str(err.value)
