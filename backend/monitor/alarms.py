"""Run-health alarms: rules over each trainer step's metrics (verl's and the monitor's).

    alarms = HealthAlarms(AlarmRules())            # thresholds: one frozen object, defaults
    for step, metrics in stream:                   # verl's step metrics, flat, as it logs them
        for alarm in alarms.observe(step, metrics):  # RunWarning, level "alarm"
            print(alarm.line())

Keys are verl's and the expert-load monitor's names, with or without verl's "actor/" prefix.
An alarm fires on the first step its condition holds and again only after a step where it
does not: one line per episode, not one per step.

Rules (names of AlarmRules fields in brackets):
- entropy_floor: the policy's entropy (actor/entropy: token mean, nats) below [entropy_floor];
- entropy_drop: its mean over the last [smooth] steps is lower by more than [entropy_drop]
  (a fraction) than that mean [entropy_window] steps before;
- kl: the KL loss (actor/kl_loss) above [kl_max], or without a KL loss the update's ppo_kl
  above [ppo_kl_max];
- mismatch: mean |rollout - actor log-prob| over response tokens
  (actor/rollout_logprob_abs_diff/mean) above [mismatch_max];
- grad_norm: actor/grad_norm above [grad_norm_factor] x the median of the previous
  [grad_norm_window] steps' (once [grad_norm_min_steps] steps are there);
- routing: per layer of the update pass, means of [smooth] steps [routing_window] steps
  apart: normalised expert entropy down by more than [routing_entropy_drop], top-10 share up
  by more than [routing_top10_rise], or dead experts up by at least [routing_dead_rise];
- val_stale: between the last [val_window] + 1 validations the validation reward moved by
  less than [val_flat] while the training score (critic/score/mean, mean of [smooth] steps)
  rose by more than [score_rise].
"""

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, fields

from backend.monitor.alerts import RunWarning

ENTROPY, KL_LOSS, PPO_KL, GRAD_NORM = "entropy", "kl_loss", "ppo_kl", "grad_norm"
MISMATCH = "rollout_logprob_abs_diff/mean"
SCORE = "critic/score/mean"
VAL_REWARD = re.compile(r"^val-(?:core|aux)/[^/]+/reward/mean@\d+$")
ROUTING = re.compile(r"^(?:actor/)?moe/update/layer_(\d+)/(entropy|top10_share|dead)$")
GUARD = "mcore_ep.guards"  # where the opt-in entropy floor and adaptive KL live
CAUSES = {
    "entropy": "entropy collapse: lr too high, clip_ratio_high too low, too many updates per "
    f"batch, easy or repeated prompts; a floor: {GUARD}.entropy_floor",
    "kl": "the policy runs away (reward may still rise while text quality falls): lr too "
    f"high, too many updates per batch, a bad batch; read samples; {GUARD}.kl adapts the KL "
    "coefficient",
    "mismatch": "rollout and actor disagree: a stale or partial weight sync, rollout dtype "
    "(bf16) or kernels, routing differences (mcore_ep.router_replay R2/R3)",
    "grad_norm": "a batch unlike the others (lengths, rewards), lr too high, a loss spike",
    "routing": "routing concentrates on few experts: aux loss off or too weak; late in a run "
    "it comes with entropy collapse",
    "val_stale": "stale data (off-policy rollouts) or overfitting to the training prompts",
}
KEEP = object()  # a rule's answer for a step that says nothing either way (no validation)


@dataclass(frozen=True)
class AlarmRules:
    """Thresholds of the run-health alarms (module doc), defaults for a DAPO run."""

    entropy_floor: float = 0.05
    entropy_drop: float = 0.5
    entropy_window: int = 10
    kl_max: float = 0.1
    ppo_kl_max: float = 0.1
    mismatch_max: float = 0.1
    grad_norm_factor: float = 5.0
    grad_norm_window: int = 20
    grad_norm_min_steps: int = 5
    routing_window: int = 10
    routing_entropy_drop: float = 0.15
    routing_top10_rise: float = 0.15
    routing_dead_rise: float = 3.0
    val_window: int = 2
    val_flat: float = 0.02
    score_rise: float = 0.3
    smooth: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and not value >= 1:
                raise ValueError(f"AlarmRules.{f.name}={value} must be a whole number >= 1")
            if f.type is float and not (math.isfinite(value) and value > 0):
                raise ValueError(f"AlarmRules.{f.name}={value} must be a positive number")
        if self.entropy_drop >= 1:
            raise ValueError(f"AlarmRules.entropy_drop={self.entropy_drop}: a fraction below 1")


def lookup(metrics: Mapping[str, float], name: str) -> float | None:
    """`name` or `actor/<name>` (verl prefixes the actor's metrics), as a finite float."""
    for key in (name, f"actor/{name}"):
        value = metrics.get(key)
        if value is not None and math.isfinite(float(value)):
            return float(value)
    return None


def val_reward(metrics: Mapping[str, float]) -> float | None:
    """The validation reward of a step that validated (the first data source's), else None."""
    keys = sorted(k for k in metrics if VAL_REWARD.match(k))
    return float(metrics[keys[0]]) if keys else None


class _Series:
    """One metric's values at the steps that logged it."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[float] = []

    def add(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)

    def mean(self, n: int, back: int = 0) -> float | None:
        """Mean of the n values ending `back` values before the last, None if too few."""
        end = len(self.values) - back
        return statistics.fmean(self.values[end - n : end]) if end - n >= 0 else None

    def mean_until(self, step: int, n: int) -> float | None:
        """Mean of the n values logged at or before `step`, None if there are none."""
        upto = [v for s, v in zip(self.steps, self.values, strict=True) if s <= step][-n:]
        return statistics.fmean(upto) if upto else None


class HealthAlarms:
    """The rules of AlarmRules over a stream of trainer steps (see the module doc)."""

    def __init__(self, rules: AlarmRules | None = None):
        self.rules = rules or AlarmRules()
        self.series: dict[str, _Series] = {}
        self.fired: list[RunWarning] = []
        self._active: set[str] = set()  # episodes in progress: alarm ids whose condition holds

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[RunWarning]:
        """The alarms this step raises (also kept in `fired`)."""
        found: list[tuple[str, object]] = [  # (alarm id, RunWarning | None | KEEP)
            *self._entropy(step, metrics),
            self._kl(step, metrics),
            self._mismatch(step, metrics),
            self._grad_norm(step, metrics),
            *self._routing(step, metrics),
            self._val_stale(step, metrics),
        ]
        raised = []
        for alarm_id, alarm in found:
            if alarm is KEEP:
                continue
            if alarm is None:
                self._active.discard(alarm_id)
            elif alarm_id not in self._active:
                self._active.add(alarm_id)
                raised.append(alarm)
        self.fired += raised
        return raised

    def _add(self, name: str, step: int, value: float | None) -> _Series | None:
        if value is None:
            return None
        series = self.series.setdefault(name, _Series())
        series.add(step, value)
        return series

    def _alarm(self, kind: str, step: int, text: str, cause: str, **values) -> RunWarning:
        return RunWarning(kind, step, f"{text}; usual causes: {CAUSES[cause]}", values, "alarm")

    def _entropy(self, step, metrics):
        r = self.rules
        series = self._add(ENTROPY, step, lookup(metrics, ENTROPY))
        if series is None:
            return [("entropy_floor", None), ("entropy_drop", None)]
        value = series.values[-1]
        floor = None
        if value < r.entropy_floor:
            floor = self._alarm("entropy_floor", step, f"policy entropy {value:.3g} is below "
                                f"the floor {r.entropy_floor:g}", "entropy", measured=value,
                                threshold=r.entropy_floor)  # fmt: skip
        now, before = series.mean(r.smooth), series.mean(r.smooth, back=r.entropy_window)
        drop = None
        if before and now is not None and (before - now) / before > r.entropy_drop:
            fall = (before - now) / before
            drop = self._alarm("entropy_drop", step, f"policy entropy fell {fall:.1%} in "
                               f"{r.entropy_window} steps ({before:.3g} -> {now:.3g}), faster "
                               f"than {r.entropy_drop:.0%}", "entropy", measured=fall,
                               threshold=r.entropy_drop)  # fmt: skip
        return [("entropy_floor", floor), ("entropy_drop", drop)]

    def _kl(self, step, metrics):
        r = self.rules
        kl_loss, ppo_kl = lookup(metrics, KL_LOSS), lookup(metrics, PPO_KL)
        name, value, limit = (KL_LOSS, kl_loss, r.kl_max) if kl_loss is not None else (
            PPO_KL, ppo_kl, r.ppo_kl_max)  # fmt: skip
        if value is None or value <= limit:
            return "kl", None
        text = f"{name} {value:.3g} is above {limit:g}"
        return "kl", self._alarm("kl", step, text, "kl", measured=value, threshold=limit)

    def _mismatch(self, step, metrics):
        limit, value = self.rules.mismatch_max, lookup(metrics, MISMATCH)
        if value is None or value <= limit:
            return "mismatch", None
        text = f"rollout vs actor |log-prob diff| mean {value:.3g} is above {limit:g}"
        return "mismatch", self._alarm("mismatch", step, text, "mismatch", measured=value,
                                       threshold=limit)  # fmt: skip

    def _grad_norm(self, step, metrics):
        r = self.rules
        value = lookup(metrics, GRAD_NORM)
        series = self.series.get(GRAD_NORM)
        past = series.values[-r.grad_norm_window :] if series else []
        self._add(GRAD_NORM, step, value)
        if value is None or len(past) < r.grad_norm_min_steps:
            return "grad_norm", None
        median = statistics.median(past)
        if value <= r.grad_norm_factor * median:
            return "grad_norm", None
        text = (f"grad norm {value:.3g} is {value / median:.1f}x the median {median:.3g} of "
                f"the previous {len(past)} steps (limit {r.grad_norm_factor:g}x)")  # fmt: skip
        return "grad_norm", self._alarm("grad_norm", step, text, "grad_norm", measured=value,
                                        threshold=r.grad_norm_factor * median)  # fmt: skip

    def _routing(self, step, metrics):
        per_layer: dict[int, dict[str, float]] = {}
        for key, value in metrics.items():
            if (m := ROUTING.match(key)) and math.isfinite(float(value)):
                per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = float(value)
        return [self._routing_layer(step, layer, values)
                for layer, values in sorted(per_layer.items())]  # fmt: skip

    def _routing_layer(self, step: int, layer: int, values: dict[str, float]):
        r = self.rules
        moved = []
        for name, value in values.items():
            series = self._add(f"routing/{layer}/{name}", step, value)
            now, before = series.mean(r.smooth), series.mean(r.smooth, back=r.routing_window)
            if before is not None and self._concentrates(name, now - before):
                moved.append((name, before, now))
        alarm_id = f"routing/layer_{layer}"
        if not moved:
            return alarm_id, None
        parts = ", ".join(f"{name} {a:.3g} -> {b:.3g}" for name, a, b in moved)
        limits = (f"limits: entropy -{r.routing_entropy_drop:g}, top10_share "
                  f"+{r.routing_top10_rise:g}, dead +{r.routing_dead_rise:g}")  # fmt: skip
        text = (
            f"layer {layer} routing concentrates over {r.routing_window} steps: {parts} ({limits})"
        )
        name, before, now = moved[0]
        return alarm_id, self._alarm("routing", step, text, "routing", layer=layer, metric=name,
                                     measured=now - before)  # fmt: skip

    def _concentrates(self, name: str, change: float) -> bool:
        r = self.rules
        if name == "entropy":
            return change < -r.routing_entropy_drop
        if name == "top10_share":
            return change > r.routing_top10_rise
        return change >= r.routing_dead_rise

    def _val_stale(self, step, metrics):
        r = self.rules
        self._add(SCORE, step, lookup(metrics, SCORE))
        vals = self._add("val_reward", step, val_reward(metrics))
        if vals is None:  # no validation this step: an episode neither starts nor ends
            return "val_stale", KEEP
        if len(vals.values) <= r.val_window:
            return "val_stale", None
        old_step, old = vals.steps[-1 - r.val_window], vals.values[-1 - r.val_window]
        scores = self.series.get(SCORE)
        then = scores.mean_until(old_step, r.smooth) if scores else None
        now = scores.mean(r.smooth) if scores else None
        moved = abs(vals.values[-1] - old)
        if then is None or now is None or moved >= r.val_flat or now - then <= r.score_rise:
            return "val_stale", None
        text = (f"validation reward flat over {r.val_window} validations (steps {old_step}-"
                f"{step}: moved {moved:.3g} < {r.val_flat:g}) while the training score rose "
                f"{now - then:.3g} (> {r.score_rise:g})")  # fmt: skip
        return "val_stale", self._alarm("val_stale", step, text, "val_stale", measured=moved,
                                        threshold=r.val_flat, score_rise=now - then)  # fmt: skip
