"""What the packed-length ladder (mcore_ep.packed_length_step) costs: padding on a DAPO-like
length mix, and the shapes it leaves.

The mix (an assumption, not a measured rollout): prompts uniform in [128, 512] tokens,
responses log-normal with median 4.5k tokens (sigma 0.5) clipped to 6144 (the recipe's
max_response_length), which puts a sample near the 4.9k tokens the seed's runs averaged.
Packed micro-batches are planned as the engine plans them (backend.model.packing.plan_lengths).
"""

import random
from dataclasses import dataclass

from backend.model.packing import micro_batch_slots, packed_multiple, plan_lengths

PROMPTS = (128, 512)
RESPONSE_MEDIAN, RESPONSE_SIGMA, RESPONSE_MAX = 4500.0, 0.5, 6144


def dapo_like_lengths(rows: int, seed: int = 0, response_max: int = RESPONSE_MAX) -> list[int]:
    """Sequence lengths (prompt + response) of the mix above, deterministic in `seed`."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(rows):
        response = min(
            response_max, max(1, round(rng.lognormvariate(0, RESPONSE_SIGMA) * RESPONSE_MEDIAN))
        )
        lengths.append(rng.randint(*PROMPTS) + response)
    return lengths


@dataclass(frozen=True)
class LadderCost:
    step: int
    real: int  # real tokens of the mix
    packed: int  # packed slots without the ladder (totals rounded up to tp)
    laddered: int  # with it
    shapes: int  # distinct packed totals with it

    @property
    def extra(self) -> float:
        """Slots the ladder adds, as a share of the real tokens."""
        return (self.laddered - self.packed) / self.real

    def line(self, device: str, budget: int, rows: int) -> str:
        if self.step <= 1:
            return f"packed-length ladder (mcore_ep.packed_length_step): off on {device}"
        return (
            f"packed-length ladder (mcore_ep.packed_length_step): {self.step} tokens on {device}: "
            f"+{self.extra:.2%} slots over packing without it on a DAPO-like mix ({rows} "
            f"samples, {self.real / rows / 1e3:.1f}k tokens each on average, micro-batches of "
            f"<= {budget} tokens), {self.shapes} distinct packed lengths"
        )


def ladder_cost(step: int, budget: int, tp: int, rows: int = 512, seed: int = 0) -> LadderCost:
    """The mix of `rows` samples packed per rank at `budget` slots, with and without the
    ladder of `step` tokens (the whole batch on one rank: the ladder's cost per micro-batch
    does not depend on how the rows are spread)."""
    fits = budget // tp * tp  # the longest a padded row may be at this budget
    lengths = [min(n, fits) for n in dapo_like_lengths(rows, seed)]
    totals = {}
    for s in (1, step):
        rung = packed_multiple(tp, s)
        plans = plan_lengths(lengths, budget, tp, packed=True, step=s)
        totals[s] = [micro_batch_slots([lengths[i] for i in p], rung, True) for p in plans]
    return LadderCost(step, sum(lengths), sum(totals[1]), sum(totals[step]), len(set(totals[step])))
