"""Opt-in loss guards: an entropy floor and an adaptive KL coefficient, off by default.

The engine adds their terms to verl's loss of each micro-batch (verl's policy loss is left as
it is) and, after each optimizer step, hands each controller that step's token mean over all
ranks, which sets the coefficient of the next step:

    loss_mb += entropy_bonus(H, m, c_H, N, dp) + kl_term(kl, m, beta, N, dp)

    entropy floor (floor F, gain g, decay d, cap c_max), after a step that measured H:
        H < F:   c_H <- min(c_max, c_H + g (F - H) / F)     (rises while below the floor)
        H >= F:  c_H <- d c_H, and 0 once below c_min       (decays back to zero above it)
    adaptive KL (band [lo, hi], horizon h, largest error e; verl's AdaptiveKLController
    with a band instead of a single target), after a step that measured kl:
        err = clip(kl / hi - 1, 0, e) above the band, clip(kl / lo - 1, -e, 0) below it, 0 inside
        beta <- clip(beta (1 + err / h), beta_min, beta_max)

Settings (`mcore_ep.guards`): {"entropy_floor": {"enable": bool, **EntropyFloorConfig fields},
"kl": {"enable": bool, **AdaptiveKLConfig fields}}.
"""

import math
from dataclasses import dataclass, fields

import torch


class GuardConfigError(ValueError):
    """A guard setting that cannot work; the message names the fix."""


def entropy_bonus(entropy_BR, mask_BR, coef: float, num_tokens: int, dp_size: int):
    """-coef * sum_{b,r} H[b,r] m[b,r] / N * dp: verl's global token-mean ("token-mean" with
    batch_num_tokens N over all DP ranks), so that summed over micro-batches and averaged over
    DP by the gradient reduction it is -coef * (the step's mean entropy)."""
    return -coef * (entropy_BR * mask_BR).sum() / num_tokens * dp_size


def kl_term(kl_BR, mask_BR, beta: float, num_tokens: int, dp_size: int):
    """beta * sum_{b,r} kl[b,r] m[b,r] / N * dp (the same global token-mean as entropy_bonus)."""
    return beta * (kl_BR * mask_BR).sum() / num_tokens * dp_size


def _check(owner: str, config, positive: tuple[str, ...]) -> None:
    for name in positive:
        value = getattr(config, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise GuardConfigError(f"mcore_ep.guards.{owner}.{name}={value!r}: a positive number")


@dataclass(frozen=True)
class EntropyFloorConfig:
    """The entropy floor's controller (module doc); entropy in nats, token mean."""

    floor: float = 0.2
    gain: float = 0.1
    kp: float = 2.0
    lead: float = 8.0
    slope_smoothing: float = 0.5
    max_coef: float = 1.0

    def __post_init__(self) -> None:
        _check("entropy_floor", self, ("floor", "gain", "max_coef"))
        for name in ("kp", "lead"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise GuardConfigError(
                    f"mcore_ep.guards.entropy_floor.{name}={getattr(self, name)!r}: a number >= 0"
                )
        if not 0 <= self.slope_smoothing < 1:
            raise GuardConfigError(
                f"mcore_ep.guards.entropy_floor.slope_smoothing={self.slope_smoothing!r}: "
                "a factor in [0, 1)"
            )


@dataclass(frozen=True)
class AdaptiveKLConfig:
    """The KL coefficient's controller (module doc); kl as verl's kl_penalty of `kl_type`."""

    low: float = 0.01
    high: float = 0.05
    init_coef: float = 0.01
    horizon: float = 5.0
    max_error: float = 0.2
    min_coef: float = 1e-4
    max_coef: float = 10.0
    kl_type: str = "low_var_kl"

    def __post_init__(self) -> None:
        _check("kl", self, ("low", "high", "init_coef", "horizon", "max_error", "min_coef",
                            "max_coef"))  # fmt: skip
        if self.low >= self.high:
            raise GuardConfigError(
                f"mcore_ep.guards.kl: low={self.low} must be below high={self.high} (the band)"
            )


class EntropyFloor:
    """The entropy bonus's coefficient (module doc); 0 until the entropy first nears the floor."""

    def __init__(self, config: EntropyFloorConfig):
        self.config, self.coef, self.integral = config, 0.0, 0.0
        self.last: float | None = None
        self.slope = 0.0  # smoothed change of the measured entropy per step

    def update(self, measured: float) -> float:
        c = self.config
        if self.last is not None:
            self.slope += (1 - c.slope_smoothing) * (measured - self.last - self.slope)
        self.last = measured
        error = (c.floor - (measured + c.lead * self.slope)) / c.floor
        self.integral = min(c.max_coef, max(0.0, self.integral + c.gain * error))
        self.coef = min(c.max_coef, self.integral + c.kp * max(0.0, error))
        return self.coef


class AdaptiveKL:
    """The KL term's coefficient (module doc), starting at init_coef."""

    def __init__(self, config: AdaptiveKLConfig):
        self.config, self.coef = config, config.init_coef

    def update(self, kl: float) -> float:
        c = self.config
        if kl > c.high:
            error = min(kl / c.high - 1, c.max_error)
        elif kl < c.low:
            error = max(kl / c.low - 1, -c.max_error)
        else:
            error = 0.0
        self.coef = min(c.max_coef, max(c.min_coef, self.coef * (1 + error / c.horizon)))
        return self.coef


def _section(settings: dict, name: str, config_type):
    """The guard's config when its section says enable, else None (unknown keys refused)."""
    section = dict(settings.get(name) or {})
    on = section.pop("enable", False)
    known = {f.name for f in fields(config_type)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise GuardConfigError(
            f"mcore_ep.guards.{name}: unknown setting(s) {', '.join(unknown)}; "
            f"known: enable, {', '.join(sorted(known))}"
        )
    return config_type(**section) if on else None


@dataclass(frozen=True)
class GuardSettings:
    """Which guards are on, with their settings (None: off)."""

    entropy_floor: EntropyFloorConfig | None = None
    kl: AdaptiveKLConfig | None = None

    @classmethod
    def from_dict(cls, settings: dict | None) -> "GuardSettings":
        settings = dict(settings or {})
        unknown = sorted(set(settings) - {"entropy_floor", "kl"})
        if unknown:
            raise GuardConfigError(
                f"mcore_ep.guards: unknown guard(s) {', '.join(unknown)}; known: entropy_floor, kl"
            )
        return cls(_section(settings, "entropy_floor", EntropyFloorConfig),
                   _section(settings, "kl", AdaptiveKLConfig))  # fmt: skip

    def describe(self) -> str:
        parts = []
        if self.entropy_floor:
            e = self.entropy_floor
            parts.append(
                f"entropy floor {e.floor:g} (gain {e.gain:g}, kp {e.kp:g}, lead {e.lead:g})"
            )
        if self.kl:
            k = self.kl
            parts.append(f"adaptive KL band [{k.low:g}, {k.high:g}] from {k.init_coef:g}")
        return "guards: " + (", ".join(parts) or "off")


@torch.no_grad()
def masked_sum_count(values_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """[sum of values over the mask, mask count] (fp32, as every backend reduces it)."""
    mask = mask_BR.to(torch.float32)
    return torch.stack([(values_BR.detach().to(torch.float32) * mask).sum(), mask.sum()])
