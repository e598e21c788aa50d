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
- routing: per layer of the update pass, on the monitor's metrics made shape-free by the
  model's E experts and top-k K (moe/num_experts, moe/top_k; backend.monitor.metrics), so one
  value means the same at 8 experts top-2 and 128 top-8. A level, on the mean of the last
  [smooth] steps (a run's first step alone): the busiest expert picked by more than
  [routing_hot_share_max] of the tokens, or a load concentration (0 even, 1 all on K experts)
  above [routing_concentration_max]. A drop, means of [smooth] steps [routing_window] steps
  apart: concentration up by more than [routing_concentration_rise], or dead experts up by
  more than [routing_dead_rise] of E. Up to trainer step [routing_window] the cause line
  reads it as the router as it came, later as training's doing. A stream without E and K
  (recorded before the monitor published them) is not checked for routing;
- staleness: in verl's async modes, the trained tokens' worst lag (verl's
  training/off_policy/trajectory_staleness_worst/max: weight versions between the oldest
  weights that generated a trained response and the step's) above [lag_max];
- val_stale: between the last [val_window] + 1 validations the validation reward moved by
  less than [val_flat] while the training score (critic/score/mean, mean of [smooth] steps)
  rose by more than [score_rise], unless one of those validations reached [val_ceiling]: a
  solved validation set cannot climb, it flips a sample or two (DAPO's rewards are at most 1;
  the local runs validate 128 samples, 0.016 each).
"""

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, fields

from backend.monitor.metrics import concentration, experts_in_use, hot_share
from backend.monitor.run_warnings import RunWarning

ENTROPY, KL_LOSS, PPO_KL, GRAD_NORM = "entropy", "kl_loss", "ppo_kl", "grad_norm"
MISMATCH = "rollout_logprob_abs_diff/mean"
LAG = "training/off_policy/trajectory_staleness_worst/max"
SCORE = "critic/score/mean"
VAL_REWARD = re.compile(r"^val-(?:core|aux)/[^/]+/reward/mean@\d+$")
ROUTING = re.compile(r"^(?:actor/)?moe/update/layer_(\d+)/(entropy|max_over_mean|dead)$")
NUM_EXPERTS, TOP_K = "moe/num_experts", "moe/top_k"
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
    "routing_start": "at a run's start, the router as it came: near-identical prompts give its "
    "inputs one direction, which a random router sends to the same experts (a pretrained one "
    "should not: check the router weights were converted); a stronger aux loss spreads it "
    "(mcore_ep.aux_loss coeff, docs/aux_loss.md); held past the first steps it is a collapse",
    "routing": "training concentrated the routing: aux loss off or too weak (mcore_ep.aux_loss "
    "coeff, docs/aux_loss.md); it often comes with a policy entropy collapse",
    "val_stale": "stale data (off-policy rollouts) or overfitting to the training prompts",
    "staleness": "the rollout runs ahead of the trainer: too many prompts in flight "
    "(num_warmup_batches, max_inflight_gen_batches) or a long tail of responses that span "
    "updates; verl's trainer.v1.<mode>.max_off_policy_threshold bounds it (drop or wait)",
}
ROUTING_SHARES = ("routing_hot_share_max", "routing_concentration_max", "routing_level_clear",
                  "routing_concentration_rise", "routing_dead_rise")  # fmt: skip
KEEP = object()  # a rule's answer for a step that says nothing either way (no validation)


@dataclass(frozen=True)
class AlarmRules:
    """Thresholds of the run-health alarms (module doc), defaults for a DAPO run.

    The routing values are shares (backend.monitor.metrics), the same at any E experts and
    top-k K: hot_share_max 0.85, the busiest expert in the top-k of 85% of the tokens (max/mean
    3.4 of 4 at 8 experts top-2, 13.6 of 16 at 128 top-8; even routing is K/E, 25% and 6%);
    concentration_max 0.5, the load's entropy that of an even load on sqrt(E K) experts (4 of
    8, 32 of 128); concentration_rise 0.25, a quarter of the way from even to all on K in
    routing_window steps (the old normalised-entropy drop of 0.15 is 0.22 at 8 top-2, 0.26
    at 128 top-8); dead_rise 0.15 of E, 1.2 of 8 or 19 of 128 experts newly without tokens.
    level_clear 0.1: a level episode ends only once its share is that far below its limit
    (hot share under 75%, concentration under 0.4), so a level hovering at its limit is one
    alarm, not one each time it crosses (the toy run's layers sat at 85% +- 2%)."""

    entropy_floor: float = 0.05
    entropy_drop: float = 0.5
    entropy_window: int = 10
    kl_max: float = 0.1
    ppo_kl_max: float = 0.1
    mismatch_max: float = 0.1
    grad_norm_factor: float = 5.0
    grad_norm_window: int = 20
    grad_norm_min_steps: int = 5
    routing_hot_share_max: float = 0.85
    routing_concentration_max: float = 0.5
    routing_level_clear: float = 0.1
    routing_window: int = 10
    routing_concentration_rise: float = 0.25
    routing_dead_rise: float = 0.15
    val_window: int = 2
    val_flat: float = 0.02
    score_rise: float = 0.3
    val_ceiling: float = 0.9
    lag_max: int = 4
    smooth: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and not value >= 1:
                raise ValueError(f"AlarmRules.{f.name}={value} must be a whole number >= 1")
            if f.type is float and not (math.isfinite(value) and value > 0):
                raise ValueError(f"AlarmRules.{f.name}={value} must be a positive number")
        for name in ("entropy_drop", *ROUTING_SHARES):
            if getattr(self, name) >= 1:
                raise ValueError(f"AlarmRules.{name}={getattr(self, name)}: a fraction below 1")


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


def shape_free(values: Mapping[str, float], num_experts: float, top_k: float) -> dict:
    """A layer's monitor metrics (entropy, max_over_mean, dead) -> concentration, hot_share,
    dead_share: 0 .. 1 at any E and K (backend.monitor.metrics)."""
    forms = {"entropy": ("concentration", concentration),
             "max_over_mean": ("hot_share", hot_share),
             "dead": ("dead_share", lambda dead, e, _: dead / e)}  # fmt: skip
    return {forms[k][0]: forms[k][1](v, num_experts, top_k) for k, v in values.items()}


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

    def recent(self, n: int) -> float:
        """Mean of the last n values, or of all there are."""
        return statistics.fmean(self.values[-n:])

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
            self._staleness(step, metrics),
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

    def _staleness(self, step, metrics):
        limit, value = self.rules.lag_max, lookup(metrics, LAG)
        if value is None or value <= limit:
            return "staleness", None
        text = (f"trained tokens up to {value:.0f} weight versions old (the oldest weights "
                f"that generated a response of this step), above {limit}")  # fmt: skip
        return "staleness", self._alarm("staleness", step, text, "staleness", measured=value,
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
        num_experts, top_k = lookup(metrics, NUM_EXPERTS), lookup(metrics, TOP_K)
        if num_experts is None or top_k is None or not 1 <= top_k < num_experts:
            return []
        per_layer: dict[int, dict[str, float]] = {}
        for key, value in metrics.items():
            if (m := ROUTING.match(key)) and math.isfinite(float(value)):
                per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = float(value)
        shape = (num_experts, top_k)
        return [self._routing_layer(step, layer, shape_free(values, *shape), shape)
                for layer, values in sorted(per_layer.items())]  # fmt: skip

    def _routing_layer(self, step: int, layer: int, values: dict[str, float], shape):
        r = self.rules
        alarm_id = f"routing/layer_{layer}"
        ongoing = alarm_id in self._active
        found = []  # (metric, what it says, measured, threshold)
        for name, value in values.items():
            series = self._add(f"routing/{layer}/{name}", step, value)
            found += self._routing_level(name, series, shape, ongoing)
            found += self._routing_rise(name, series)
        if not found:
            return alarm_id, None
        text = f"layer {layer} routing is concentrated: " + "; ".join(f[1] for f in found)
        cause = "routing_start" if step <= r.routing_window else "routing"
        name, _, measured, limit = found[0]
        return alarm_id, self._alarm("routing", step, text, cause, layer=layer, metric=name,
                                     measured=measured, threshold=limit)  # fmt: skip

    def _routing_level(self, name: str, series: _Series, shape, ongoing: bool) -> list[tuple]:
        """A level over its limit; in an ongoing episode, one not yet `level_clear` below it."""
        r, (num_experts, top_k) = self.rules, shape
        limits = {"hot_share": r.routing_hot_share_max,
                  "concentration": r.routing_concentration_max}  # fmt: skip
        level, n = series.recent(r.smooth), min(r.smooth, len(series.values))
        if name not in limits or level <= limits[name] - r.routing_level_clear * ongoing:
            return []
        over, limit = f"over {n} step{'s' * (n > 1)}", limits[name]
        if name == "hot_share":
            text = (f"the busiest expert is picked by {level:.0%} of tokens {over} (max/mean "
                    f"{level * num_experts / top_k:.2f} of {num_experts / top_k:.3g}; limit "
                    f"{limit:.0%})")  # fmt: skip
        else:
            in_use = experts_in_use(level, num_experts, top_k)
            text = (f"load concentration {level:.2f} {over} (as if {in_use:.3g} of "
                    f"{num_experts:g} experts, top-{top_k:g}; limit {limit:g})")  # fmt: skip
        return [(name, text, level, limit)]

    def _routing_rise(self, name: str, series: _Series) -> list[tuple]:
        r = self.rules
        limits = {"concentration": r.routing_concentration_rise,
                  "dead_share": r.routing_dead_rise}  # fmt: skip
        now, before = series.mean(r.smooth), series.mean(r.smooth, back=r.routing_window)
        if name not in limits or before is None or now - before <= limits[name]:
            return []
        limit = limits[name]
        what, most = ((f"load concentration {before:.2f} -> {now:.2f}", f"{limit:g}")
                      if name == "concentration" else
                      (f"dead experts {before:.0%} -> {now:.0%} of E", f"{limit:.0%}"))  # fmt: skip
        text = f"{what} in {r.routing_window} steps (limit +{most})"
        return [(name, text, now - before, limit)]

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
        if max(vals.values[-1 - r.val_window :]) >= r.val_ceiling:  # solved: no stall
            return "val_stale", None
        text = (f"validation reward flat over {r.val_window} validations (steps {old_step}-"
                f"{step}: moved {moved:.3g} < {r.val_flat:g}) while the training score rose "
                f"{now - then:.3g} (> {r.score_rise:g})")  # fmt: skip
        return "val_stale", self._alarm("val_stale", step, text, "val_stale", measured=moved,
                                        threshold=r.val_flat, score_rise=now - then)  # fmt: skip
