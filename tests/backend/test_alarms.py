"""Run-health alarms (backend.monitor.alarms) on a recorded metric stream and on the monitor.

tests/data/dapo_cpu_metrics.jsonl: the main job's 35 steps (`bash scripts/train_mcore.sh`,
verl's file logger, the keys the alarms and the console read): validation reward -1.88 -> 1.0
(vLLM's bf16 rollout). Its policy is healthy; its routing is not: layer 1's busiest expert is
picked by 93% of the tokens at step 1 and by 86-100% (5-step means) to the end, layer 0's
climbs to 87% by step 29. Each test injects one collapse into a copy of it and checks which
alarm fires at which step. It was recorded before the monitor published the model's shape
(moe/num_experts, moe/top_k): the replay adds the tiny model's.

The routing rules are also run on the expert-load monitor itself (the key names and values it
publishes), fed synthetic router outputs at the tiny model's shape (8 experts, top-2) and at
Qwen3-30B-A3B's (128, top-8), with the same rule values.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from backend.instruments.router_tap import RouterCall
from backend.monitor import ExpertLoadMonitor
from backend.monitor.alarms import AlarmRules, HealthAlarms
from parallel.models import TINY_QWEN3_MOE
from recipes.dapo.console.screen import step_line
from recipes.local.cpu_overrides import TOY_ALARMS

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

STREAM = Path(__file__).parents[1] / "data" / "dapo_cpu_metrics.jsonl"
VAL = "val-aux/math_dapo/reward/mean@8"
TINY_SHAPE = {  # what the monitor publishes for the tiny model
    "actor/moe/num_experts": float(TINY_QWEN3_MOE["num_experts"]),
    "actor/moe/top_k": float(TINY_QWEN3_MOE["num_experts_per_tok"]),
}
SHAPES = {"8 experts top-2": (8, 2), "128 experts top-8": (128, 8)}  # tiny, Qwen3-30B-A3B


def recorded(shape: dict | None = TINY_SHAPE) -> list[tuple[int, dict]]:
    rows = map(json.loads, STREAM.read_text().splitlines())
    return [(row["step"], {**row["data"], **(shape or {})}) for row in rows]


def replay(inject=None, rules: AlarmRules | None = None, shape=TINY_SHAPE) -> HealthAlarms:
    alarms = HealthAlarms(rules or AlarmRules(**TOY_ALARMS))
    for step, metrics in recorded(shape):
        if inject:
            inject(step, metrics)
        alarms.observe(step, metrics)
    return alarms


def fired(alarms: HealthAlarms) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in alarms.fired]


ROUTING = [("routing", 1), ("routing", 29)]  # what the recorded run's routing fires


def test_the_recorded_main_job_fires_its_concentrated_routing_only():
    steps = recorded()
    assert [s for s, _ in steps] == list(range(36))
    assert steps[0][1][VAL] < -1.8 and steps[-1][1][VAL] == 1.0
    alarms = replay()
    assert fired(alarms) == ROUTING
    start, late = alarms.fired
    assert start.values["layer"] == 1 and start.values["metric"] == "hot_share"
    assert "busiest expert is picked by 93% of tokens over 1 step (max/mean 3.73 of 4" in (
        start.text
    )
    assert "at a run's start, the router as it came: near-identical prompts" in start.text
    assert late.values["layer"] == 0 and "87% of tokens over 5 steps" in late.text
    assert "training concentrated the routing" in late.text
    assert not replay(shape=None).fired  # without E and K the routing is not read at all


def test_the_default_floor_calls_the_toy_tasks_deterministic_answers_a_collapse():
    """Why the CPU run sets its own policy-entropy rules (recipes.local.cpu_overrides.TOY_ALARMS):
    its solved policy answers one digit, near deterministically. Its routing rules are the
    defaults."""
    assert fired(replay(rules=AlarmRules())) == [
        ("routing", 1),
        ("entropy_drop", 15),
        ("routing", 29),
        ("entropy_drop", 35),
    ]
    assert not any(name.startswith("routing") for name in TOY_ALARMS)


def _set(key: str, value: float, steps):
    def inject(step: int, metrics: dict) -> None:
        if step in steps and key in metrics:
            metrics[key] = value

    return inject


def _each(*injects):
    def inject(step: int, metrics: dict) -> None:
        for one in injects:
            one(step, metrics)

    return inject


LATE = range(20, 36)
CASES = {
    # below the floor at once; the 5-step mean is 90% lower once all 5 steps are collapsed
    "entropy collapse": (_set("actor/entropy", 0.002, LATE),
                         [("routing", 1), ("entropy_floor", 20), ("entropy_drop", 24), ("routing", 29)]),
    "KL spike": (_set("actor/ppo_kl", 0.5, {12}), [("routing", 1), ("kl", 12), ("routing", 29)]),
    "rollout-actor mismatch": (_set("actor/rollout_logprob_abs_diff/mean", 0.3, LATE[:-2]),
                               [("routing", 1), ("mismatch", 20), ("routing", 29)]),
    "grad-norm jump": (_set("actor/grad_norm", 40.0, {25}),
                       [("routing", 1), ("grad_norm", 25), ("routing", 29)]),
    # layer 0's entropy to 0.4 (concentration 0.9): its 5-step mean past 0.5 at step 21
    "expert entropy falls": (_set("actor/moe/update/layer_0/entropy", 0.4, LATE),
                             [("routing", 1), ("routing", 21)]),
    # layer 0's busiest expert picked by every token: the 5-step mean past 85% at step 22
    "one expert takes every token": (_set("actor/moe/update/layer_0/max_over_mean", 4.0, LATE),
                                     [("routing", 1), ("routing", 22)]),
    # 6 of layer 0's 8 experts dead: the 5-step mean up by more than 15% of E at step 21
    "experts die": (_set("actor/moe/update/layer_0/dead", 6.0, LATE),
                    [("routing", 1), ("routing", 21)]),
    # validations at 20, 25, 30 all 0.625 while the training score (5-step mean) climbs by more than 0.3
    "validation stalls": (_set(VAL, 0.625, {20, 25, 30}),
                          [("routing", 1), ("routing", 29), ("val_stale", 30)]),
    # the same flat validations at the top: a solved set (the mini runs' 1.0, 1.0, 0.984 and
    # 0.922, 1.0, 0.938 while the training score climbed at temperature 1 fired it)
    "validation solved": (_set(VAL, 0.984, {20, 25, 30}), [("routing", 1), ("routing", 29)]),
    "validation solved, one sample off": (
        _each(_set(VAL, 0.922, {20}), _set(VAL, 1.0, {25}), _set(VAL, 0.938, {30})),
        [("routing", 1), ("routing", 29)]),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_an_injected_collapse_fires_its_alarm_at_its_step(case):
    inject, expected = CASES[case]
    alarms = replay(inject)
    assert fired(alarms) == expected
    for alarm in alarms.fired:
        line = alarm.line()
        assert line.startswith(f"ALARM [{alarm.kind}] step {alarm.step}: ") and "\n" not in line
        assert "usual causes: " in line
        assert alarm.as_dict()["level"] == "alarm" and "measured" in alarm.values


def test_each_alarm_line_states_the_value_against_its_threshold():
    line = replay(_set("actor/ppo_kl", 0.5, {12})).fired[1].line()
    assert "ppo_kl 0.5 is above 0.1" in line
    line = replay(_set("actor/grad_norm", 40.0, {25})).fired[1].line()
    assert "grad norm 40 is" in line and "x the median" in line and "(limit 5x)" in line
    kl_loss = HealthAlarms().observe(3, {"actor/kl_loss": 0.4, "actor/ppo_kl": 0.5})
    assert [a.kind for a in kl_loss] == ["kl"] and "kl_loss 0.4 is above 0.1" in kl_loss[0].text


def test_one_line_per_episode_and_again_after_recovery():
    alarms = HealthAlarms()
    for step, kl in enumerate([0.01, 0.3, 0.4, 0.5, 0.01, 0.2]):
        alarms.observe(step, {"actor/ppo_kl": kl})
    assert fired(alarms) == [("kl", 1), ("kl", 5)]


@pytest.mark.parametrize(
    "bad", [dict(entropy_floor=0.0), dict(entropy_drop=1.5), dict(smooth=0),
            dict(grad_norm_factor=float("nan")), dict(routing_hot_share_max=1.0),
            dict(routing_dead_rise=3.0)],
)  # fmt: skip
def test_meaningless_thresholds_are_refused_in_one_line(bad):
    with pytest.raises(ValueError) as err:
        AlarmRules(**bad)
    assert "\n" not in str(err.value) and next(iter(bad)) in str(err.value)


# --- the routing rules on the expert-load monitor at both shapes ---------------------------


def even(num_experts: int, top_k: int) -> torch.Tensor:
    """Router picks [tokens, top_k]: every expert chosen equally often."""
    return on_experts(num_experts, top_k, num_experts)


def on_experts(num_experts: int, top_k: int, used: int) -> torch.Tensor:
    """Every token routed to top_k distinct experts among the first `used`, evenly."""
    return (torch.arange(used)[:, None] * top_k + torch.arange(top_k)) % used


def hot_expert(num_experts: int, top_k: int, share: float, tokens: int = 200) -> torch.Tensor:
    """`share` of the tokens pick expert 0; every other pick spread over experts 1..E-1."""
    rest = torch.arange(tokens * top_k).reshape(tokens, top_k) % (num_experts - 1) + 1
    picks = rest.clone()
    picks[: round(share * tokens), 0] = 0
    return picks


def monitored(num_experts: int, top_k: int, picks_TK: torch.Tensor, step: int) -> dict:
    """One trainer step's metrics as verl logs them: the expert-load monitor (one layer) fed
    a router call that sent token t to experts picks_TK[t], prefixed `actor/`."""
    monitor = ExpertLoadMonitor(1, num_experts, None, top_k=top_k)
    routing_TE = torch.zeros(len(picks_TK), num_experts, dtype=torch.bool)
    routing_TE.scatter_(1, picks_TK, True)
    assert (routing_TE.sum(1) == top_k).all()  # top_k distinct experts per token
    with monitor.phase("update"):
        monitor.record(RouterCall(0, routing_TE, None, False, lambda: None))
    return {f"actor/{key}": value for key, value in monitor.step_end(step).items()}


def run(shape, loads, rules: AlarmRules | None = None) -> HealthAlarms:
    """HealthAlarms over trainer steps 1.. whose router outputs are `loads` (picks each)."""
    alarms = HealthAlarms(rules)
    for step, picks_TK in enumerate(loads, 1):
        alarms.observe(step, monitored(*shape, picks_TK, step))
    return alarms


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_a_router_collapsed_as_it_came_fires_at_step_1(shape):
    """The issue: `route 4.00x L1` (8 experts, top-2) and `route 16.00x L3` (128, top-8), the
    most max/mean can be, fired nothing: the rules watched for a change, not a level."""
    num_experts, top_k = shape
    for picks_TK in (hot_expert(*shape, 1.0), on_experts(*shape, top_k)):
        metrics = monitored(*shape, picks_TK, 1)
        assert f"route {num_experts / top_k:.2f}x/{num_experts // top_k} L0" in step_line(
            1, 10, metrics
        )
        (alarm,) = HealthAlarms().observe(1, metrics)
        assert alarm.kind == "routing" and alarm.step == 1 and alarm.values["layer"] == 0
        assert "busiest expert is picked by 100% of tokens over 1 step" in alarm.text
        assert "at a run's start, the router as it came" in alarm.text


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_even_routing_fires_nothing(shape):
    metrics = monitored(*shape, even(*shape), 1)
    assert metrics["actor/moe/update/layer_0/max_over_mean"] == 1.0
    assert run(shape, [even(*shape)] * 25).fired == []


# used experts whose load concentration is ~0.3 at each shape: no level rule, a rise of 0.3
SPREAD = {(8, 2): 5, (128, 8): 56}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_routing_that_concentrates_during_training_fires_on_the_rise(shape):
    loads = [even(*shape)] * 10 + [on_experts(*shape, SPREAD[shape])] * 10
    (alarm,) = run(shape, loads).fired
    assert alarm.step == 15 and alarm.values["metric"] == "concentration"  # 5 steps in
    assert 0.25 < alarm.values["measured"] < 0.35 and "load concentration 0.00 -> 0.3" in alarm.text
    assert "training concentrated the routing" in alarm.text  # step 15: past the start


def _concentration(shape, picks_TK) -> float:
    metrics = monitored(*shape, picks_TK, 1)
    entropy = metrics["actor/moe/update/layer_0/entropy"]
    return (1 - entropy) * math.log(shape[0]) / math.log(shape[0] / shape[1])


# an even load on E^(1-x) K^x experts has concentration x: the same x at both shapes
EQUAL = {0.0: {(8, 2): 8, (128, 8): 128}, 0.5: {(8, 2): 4, (128, 8): 32},
         1.0: {(8, 2): 2, (128, 8): 8}}  # fmt: skip


@pytest.mark.parametrize("limit", [0.25, 0.45, 0.55, 0.75, 0.95])
def test_equally_concentrated_loads_get_the_same_verdict_at_both_shapes(limit):
    rules = AlarmRules(routing_concentration_max=limit, routing_hot_share_max=0.999)
    for level, used in EQUAL.items():
        verdicts = set()
        for shape in SHAPES.values():
            picks_TK = on_experts(*shape, used[shape])
            assert _concentration(shape, picks_TK) == pytest.approx(level, abs=1e-9)
            verdicts.add(bool(run(shape, [picks_TK], rules).fired))
        assert verdicts == {level > limit}, (level, limit)
    for share in (0.5, 0.8, 0.84, 0.86, 0.9, 1.0):  # the busiest expert's share of tokens
        verdicts = {
            bool(run(shape, [hot_expert(*shape, share)]).fired) for shape in SHAPES.values()
        }
        assert verdicts == {share > AlarmRules().routing_hot_share_max}, share


def test_the_same_fraction_of_experts_is_not_the_same_concentration():
    """A quarter of 8 experts at top-2 is all the load on K experts, concentration 1 (every
    token's choice fixed); a quarter of 128 at top-8 is 4 K of them, 0.5. A rule normalised by
    E alone would give both one verdict."""
    rules = AlarmRules(routing_concentration_max=0.75)
    quarter = {shape: on_experts(*shape, shape[0] // 4) for shape in SHAPES.values()}
    assert [_concentration(*item) for item in quarter.items()] == pytest.approx([1.0, 0.5])
    assert [bool(run(shape, [picks_TK], rules).fired) for shape, picks_TK in quarter.items()] == [
        True,
        False,
    ]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_a_level_hovering_at_its_limit_is_one_alarm_until_it_clears(shape):
    """The main job's layers sat at 85% +- 2% (5-step means) and fired each time they crossed
    back over 85%: five routing alarms in 35 steps for two layers. A level episode now ends
    only `routing_level_clear` below its limit; a real recovery and relapse fires again."""
    hover = [hot_expert(*shape, share) for share in (0.9, 0.8, 0.9, 0.8, 0.9, 0.8, 0.9)]
    smooth1 = AlarmRules(smooth=1)  # each step's level alone, so the shares above are the levels
    assert [a.step for a in run(shape, hover, smooth1).fired] == [1]
    relapse = hover + [hot_expert(*shape, 0.6)] + [hot_expert(*shape, 0.9)]
    assert [a.step for a in run(shape, relapse, smooth1).fired] == [1, 9]
    no_clear = AlarmRules(smooth=1, routing_level_clear=1e-9)  # the old behaviour
    assert [a.step for a in run(shape, hover, no_clear).fired] == [1, 3, 5, 7]


def test_staleness_fires_when_trained_tokens_lag_past_the_limit_once_per_episode():
    """Bug caught: an async run whose rollout runs many weight versions ahead of the trainer
    (verl's default max_off_policy_threshold is off) with nothing said on the console."""
    lag = "training/off_policy/trajectory_staleness_worst/max"
    alarms = HealthAlarms(AlarmRules(lag_max=2))
    seen = [
        (s, [a.kind for a in alarms.observe(s, {lag: v})])
        for s, v in enumerate([0, 1, 2, 3, 5, 1, 4], 1)
    ]
    assert [(s, k) for s, k in seen if k] == [(4, ["staleness"]), (7, ["staleness"])]
    line = alarms.fired[0].line()
    assert line.startswith("ALARM [staleness] step 4: trained tokens up to 3 weight versions old")
    assert "above 2; usual causes: the rollout runs ahead" in line
    assert HealthAlarms().observe(1, {lag: 4}) == []  # the default limit: 4 versions
