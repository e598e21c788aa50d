"""The EP routing skew a plan must survive: where it comes from, and how much the plan can take.

s = tokens received by the busiest EP rank / the EP mean (parallel.activations says what it
scales). Two sources:
- a routing report of an earlier run (`--skew-from run/routing_report.json`): the
  REPORT_PERCENTILE-th percentile of `ep_max_over_mean` over every (step, layer) of the update
  phase, i.e. a value that 1 in 20 layer-steps exceeds. The monitor sums a step's counts over
  all ranks and micro-batches, which smooths out per-micro-batch peaks: a high percentile, not
  the mean, compensates;
- otherwise DEFAULT_EP_SKEW (backend.shared.names, where the monitor's guard reads it too) for a
  fresh run: the tiny run's worst layer-step was 1.77, and a step-level figure under-states
  a single micro-batch, so the default rounds up to 2 (the busiest EP rank receives twice
  its share).

The margin is the largest s in [1, ep] at which the update peak still fits (bisection on the
memory model's verdict; s cannot exceed ep, every token on one rank).
"""

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from backend.shared.names import DEFAULT_EP_SKEW
from parallel.memory import MemoryOptions, estimate_memory
from parallel.plan import ModelFit

REPORT_PERCENTILE = 95
REPORT_PHASE = "update"  # the phase that runs backward, so keeps activations
MARGIN_TOLERANCE = 1e-3


@dataclass(frozen=True)
class SkewAssumption:
    value: float
    origin: str  # where the value comes from, printed beside it

    def __post_init__(self) -> None:
        if not self.value >= 1.0:
            raise ValueError(f"EP skew {self.value} must be >= 1 (busiest rank over the mean)")


def default_skew() -> SkewAssumption:
    return SkewAssumption(
        DEFAULT_EP_SKEW, "default for a fresh run; --skew-from a routing report measures it"
    )


def skew_from_report(
    path: str | Path,
    percentile: float = REPORT_PERCENTILE,
    phase: str = REPORT_PHASE,
    ep: int | None = None,
) -> SkewAssumption:
    """The percentile of per-layer, per-step `ep_max_over_mean` in a routing report, measured
    at the run's EP. With `ep` (the plan's) the report's window counts are split into that
    many ranks too, and the larger value holds: a finer split averages fewer experts per rank,
    so the skew grows with EP (the mini model's ep 2 run on CPU: 1.14 at ep 2, 1.50 at ep 4,
    1.68 at ep 8 from the same counts, where its steps' p95 at ep 2 was 1.16), and a report
    from an ep 2 run alone would under-state an ep 8 plan's. Window sums smooth a step's peaks,
    hence the max over windows and layers. A report of an ep 1 run serves through its counts."""
    from backend.monitor.report import ReportError, load_report

    report = load_report(path)
    steps, curve_SL = report.step_curve(phase, "ep_max_over_mean")
    values = curve_SL[~np.isnan(curve_SL)]
    if values.size == 0:
        raise ReportError(f"{path}: no {phase!r} steps with tokens: nothing to take the skew from")
    resplit = _resplit(report, phase, ep) if ep is not None and ep != report.ep else None
    if report.ep == 1 and resplit is None:
        raise ReportError(
            f"{path} was measured at ep=1, where EP skew is 1 by definition: "
            "use a report of a run with ep > 1, or give the plan's ep"
        )
    measured = float(np.percentile(values, percentile)) if report.ep > 1 else 1.0
    origin = (
        f"p{percentile:g} of ep_max_over_mean over {len(steps)} steps x "
        f"{report.shape[0]} layers of {path}, measured at ep={report.ep}"
    )
    if resplit is not None:
        windows, split = resplit
        origin = (
            f"the larger of {origin} ({measured:.2f}) and its counts split into this plan's "
            f"ep={ep} ranks, max over {windows} window(s) x {report.shape[0]} layers ({split:.2f})"
        )
        measured = max(measured, split)
    return SkewAssumption(max(1.0, measured), origin)


def _resplit(report, phase: str, ep: int) -> tuple[int, float] | None:
    """(windows, max over windows and layers of busiest / mean EP rank) of the report's
    window counts split into `ep` contiguous blocks of experts, as EP ranks hold them."""
    import torch

    from backend.monitor.metrics import ep_max_over_mean_L

    num_experts = report.shape[1]
    windows = [w["counts"] for w in report.windows(phase)]
    if ep < 2 or num_experts % ep or not windows:
        return None
    curves = [ep_max_over_mean_L(torch.tensor(c, dtype=torch.float64), ep) for c in windows]
    values = torch.cat(curves)
    values = values[~torch.isnan(values)]
    return (len(windows), float(values.max())) if values.numel() else None


def skew_margin(fit: ModelFit, options: MemoryOptions) -> float | None:
    """Largest EP skew at which the update peak fits; None when even s = 1 does not fit."""

    def fits(skew: float) -> bool:
        return estimate_memory(fit, replace(options, ep_skew=skew)).fits

    low, high = 1.0, float(fit.plan.ep)
    if not fits(low):
        return None
    if fits(high):
        return high
    while high - low > MARGIN_TOLERANCE:
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def margin_text(margin: float | None, ep: int) -> str:
    if margin is None:
        return "does not fit even with balanced routing"
    if margin >= ep:
        return f"fits even with every token on one EP rank ({ep}x)"
    return f"fits up to {math.floor(margin * 100) / 100:.2f}x EP skew"


def skew_lines(fit: ModelFit, options: MemoryOptions, skew: SkewAssumption) -> list[str]:
    """The verdict at the assumed skew and the skew margin, for a dry run or `python -m parallel`."""
    head = f"routing skew: {skew.value:.2f}x EP skew assumed ({skew.origin})"
    if options.device_memory_gib is None:
        return [head, "  no device memory given: no verdict"]
    at_skew = replace(options, ep_skew=skew.value)
    estimate = estimate_memory(fit, at_skew)
    verdict = "fits" if estimate.fits else "does NOT fit"
    peak = (
        f"{estimate.utilization:.0%} of {estimate.device_memory_gib:g} GiB"
        if estimate.utilization is not None
        else f"{estimate.update_bytes / 2**30:.1f} GiB"
    )
    return [
        head,
        f"  at {skew.value:.2f}x: update peak {peak}: {verdict}; "
        f"{margin_text(skew_margin(fit, options), fit.plan.ep)}",
    ]
