"""The trainer step's one console line (recipes.dapo.console.screen) and its legend.

step_line: a progress bar, reward, validation reward when the step validated, entropy, KL
(the KL loss, or the update's ppo_kl), grad norm, rollout-vs-actor |log-prob diff|, routing
agreement, the worst layer's routing concentration (max/mean of its expert loads, over the
most it can be, E/K: `route 3.73x/4 L1`), EP skew, step time and communication share.
LEGEND says so in one line, shown once before the first step line.
"""

import math
import re

from tqdm import tqdm

from backend.monitor.alarms import NUM_EXPERTS, TOP_K, lookup, val_reward

BAR = 20  # characters of the progress bar

LEGEND = (
    "step line: reward = train batch reward | val = validation reward (steps that validate) | "
    "entropy = policy entropy | ppo_kl (or kl) = the update's KL | grad = grad norm | "
    "|dlogp| = max |rollout - actor log-prob| | agree = routing agreement rollout vs actor | "
    "route 3.76x/4 L1 = busiest expert's load over the mean (E/K at most), worst layer | "
    "ep = busiest EP rank's load over the mean | s = step seconds | comm = communication share"
)
LAG_LEGEND = (
    "off-policy steps: lag 0.4/1 = weight versions between the trained tokens' oldest weights "
    "and the step's (mean/max) | spans 6% = responses generated across a weight update "
    "(spans 1.25v: versions per response, mean, once one spans more than two)"
)
LAG = "training/off_policy/trajectory_staleness_worst"  # verl's (trainer_base.py _compute_metrics)
SPANS = "training/off_policy/trajectory_spans"


def progress_bar(step: int, total: int | None) -> str:
    """`[####......] step/total` (tqdm's bar, '#' done); `step N` while the total is unknown."""
    if not total:
        return f"step {step}"
    # the bar alone: tqdm drops the total of a count past it (a resume may run past --steps)
    bar = tqdm.format_meter(min(step, total), total, 0, bar_format=f"[{{bar:{BAR}}}]", ascii=".#")
    return f"{bar} {step:>{len(str(total))}}/{total}"


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4):
        return f"{value:.1e}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _worst_layer(metrics: dict[str, float], name: str) -> tuple[float, int | None] | None:
    """The highest per-layer `name` of the update pass, and its layer (monitor keys)."""
    pattern = re.compile(rf"^(?:actor/)?moe/update/layer_(\d+)/{name}$")
    layers = [(v, int(m.group(1))) for k, v in metrics.items() if (m := pattern.match(k))]
    layers = [(v, layer) for v, layer in layers if math.isfinite(v)]
    if layers:
        return max(layers)
    whole = lookup(metrics, f"moe/update/{name}_max")
    return (whole, None) if whole is not None else None


def step_line(step: int, total: int | None, metrics: dict[str, float]) -> str:
    """One compact line of a trainer step's metrics (the ones it has)."""
    parts = [progress_bar(step, total)]

    def add(label: str, value: float | None, fmt=_fmt) -> None:
        if value is not None:
            parts.append(f"{label} {fmt(value)}")

    add("reward", lookup(metrics, "critic/rewards/mean"))
    add("val", val_reward(metrics))
    add("entropy", lookup(metrics, "entropy"))
    kl_loss = lookup(metrics, "kl_loss")
    if kl_loss is not None:
        add("kl", kl_loss)
    else:
        add("ppo_kl", lookup(metrics, "ppo_kl"))
    add("grad", lookup(metrics, "grad_norm"))
    add("|dlogp|", lookup(metrics, "rollout_logprob_abs_diff/max"))
    add("agree", lookup(metrics, "moe/routing_agreement/mean"), lambda v: f"{v:.3f}")
    worst = _worst_layer(metrics, "max_over_mean")
    if worst is not None:
        where = f" L{worst[1]}" if worst[1] is not None else ""
        experts, top_k = lookup(metrics, NUM_EXPERTS), lookup(metrics, TOP_K)
        most = f"/{experts / top_k:.3g}" if experts and top_k else ""  # E/K: every token
        parts.append(f"route {worst[0]:.2f}x{most}{where}")
    skew = _worst_layer(metrics, "ep_max_over_mean")
    if skew is not None:
        parts.append(f"ep {skew[0]:.2f}x")
    parts += lag_parts(metrics)
    add("", lookup(metrics, "timing_s/step"), lambda v: f"{v:.1f}s")
    add("comm", lookup(metrics, "timing/comm_share"), lambda v: f"{v:.0%}")
    return " | ".join(p.strip() for p in parts)


def lag_parts(metrics: dict[str, float]) -> list[str]:
    """`lag mean/max` and `spans` of an off-policy step; nothing on-policy (sync). verl logs
    the versions per response as mean / max only: while none spans more than two, the
    share of responses generated across an update is exactly mean - 1."""
    mean, most = lookup(metrics, f"{LAG}/mean"), lookup(metrics, f"{LAG}/max")
    spans, spans_max = lookup(metrics, f"{SPANS}/mean"), lookup(metrics, f"{SPANS}/max")
    if not most and not (spans and spans > 1):
        return []
    parts = [f"lag {mean or 0:.2g}/{most or 0:.0f}"]
    if spans is not None and spans_max is not None and spans_max <= 2:
        parts.append(f"spans {spans - 1:.0%}")
    elif spans is not None:
        parts.append(f"spans {spans:.2f}v")
    return parts
