"""Run-health alarms (backend.monitor.alarms) on a recorded metric stream.

tests/data/dapo_cpu_metrics.jsonl: the main job's 35 steps (`bash scripts/train_mcore.sh`,
verl's file logger, the keys the alarms and the console read), a healthy run: validation
reward -1.88 -> 1.0 (vLLM's bf16 rollout). Each test injects one collapse into a copy of it and checks which alarm
fires at which step; the healthy stream fires none.
"""

import json
from pathlib import Path

import pytest

from backend.monitor.alarms import AlarmRules, HealthAlarms
from recipes.local.overrides import TOY_ALARMS

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

STREAM = Path(__file__).parent / "data" / "dapo_cpu_metrics.jsonl"
VAL = "val-aux/math_dapo/reward/mean@8"


def recorded() -> list[tuple[int, dict]]:
    return [(row["step"], row["data"]) for row in map(json.loads, STREAM.read_text().splitlines())]


def replay(inject=None, rules: AlarmRules | None = None) -> HealthAlarms:
    alarms = HealthAlarms(rules or AlarmRules(**TOY_ALARMS))
    for step, metrics in recorded():
        metrics = dict(metrics)
        if inject:
            inject(step, metrics)
        alarms.observe(step, metrics)
    return alarms


def fired(alarms: HealthAlarms) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in alarms.fired]


def test_the_recorded_main_job_is_healthy_and_fires_none():
    steps = recorded()
    assert [s for s, _ in steps] == list(range(36))
    assert steps[0][1][VAL] < -1.8 and steps[-1][1][VAL] == 1.0
    assert replay().fired == []


def test_the_default_floor_calls_the_toy_tasks_deterministic_answers_a_collapse():
    """Why the CPU run sets its own entropy and routing rules (recipes.local.overrides.
    TOY_ALARMS): its solved policy answers one digit, near deterministically, and its 8-expert
    router specialises meanwhile."""
    assert fired(replay(rules=AlarmRules())) == [
        ("entropy_drop", 15),
        ("routing", 15),
        ("entropy_drop", 35),
    ]


def _set(key: str, value: float, steps):
    def inject(step: int, metrics: dict) -> None:
        if step in steps and key in metrics:
            metrics[key] = value

    return inject


LATE = range(20, 36)
CASES = {
    # below the floor at once; the 5-step mean is 90% lower once all 5 steps are collapsed
    "entropy collapse": (_set("actor/entropy", 0.002, LATE),
                         [("entropy_floor", 20), ("entropy_drop", 24)]),
    "KL spike": (_set("actor/ppo_kl", 0.5, {12}), [("kl", 12)]),
    "rollout-actor mismatch": (_set("actor/rollout_logprob_abs_diff/mean", 0.3, LATE[:-2]),
                               [("mismatch", 20)]),
    "grad-norm jump": (_set("actor/grad_norm", 40.0, {25}), [("grad_norm", 25)]),
    # a 5-step mean: over the limit once 4 of its 5 steps (20-23) have the collapsed layer
    "expert entropy falls": (_set("actor/moe/update/layer_1/entropy", 0.1, LATE),
                             [("routing", 23)]),
    "top-10 share rises": (_set("actor/moe/update/layer_0/top10_share", 0.9, LATE),
                           [("routing", 21)]),
    "experts die": (_set("actor/moe/update/layer_0/dead", 6.0, LATE), [("routing", 22)]),
    # validations at 20, 25, 30 all 0.625 while the training score (5-step mean) climbs by more than 0.3
    "validation stalls": (_set(VAL, 0.625, {20, 25, 30}), [("val_stale", 30)]),
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
    line = replay(_set("actor/ppo_kl", 0.5, {12})).fired[0].line()
    assert "ppo_kl 0.5 is above 0.1" in line
    line = replay(_set("actor/grad_norm", 40.0, {25})).fired[0].line()
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
            dict(grad_norm_factor=float("nan"))],
)  # fmt: skip
def test_meaningless_thresholds_are_refused_in_one_line(bad):
    with pytest.raises(ValueError) as err:
        AlarmRules(**bad)
    assert "\n" not in str(err.value) and next(iter(bad)) in str(err.value)
