"""The packed (THD) row layout of a micro-batch, from its sequences' real lengths (no verl).

A packed micro-batch is its sequences concatenated into one [1, T] row, T the real total
rounded up to a multiple of tp (sequence parallelism splits T over the TP ranks) and, with a
packed-length ladder (`step`, mcore_ep.packed_length_step), of that many tokens. The tail
T - real, when there is one, is one more pseudo-sequence (masked out by callers), so
cu_seqlens is int32 [N + 1] without a tail and [N + 2] with one: sequence starts, then T.
megatron-core's PackedSeqParams (qkv_format "thd") carries it to attention (per sequence) and
RoPE (positions restart at each start: backend.model.forward.packed_position_ids).

recipes/dapo/batches.packed_micro_batch builds the same layout from verl's batches
(tests/backend/test_packing.py checks they agree).
"""

from dataclasses import dataclass
from math import lcm

import torch

from backend.shared.integers import round_up

# the packed-length ladder's step by device (mcore_ep.packed_length_step unset): Ascend's
# operators recompile (or refuse) on every new shape, so its packed totals are multiples of
# 512 tokens (a bounded set of shapes); elsewhere off (1)
LADDER_STEP = {"npu": 512}


class BatchError(ValueError):
    """A batch this engine cannot split or run."""


def ladder_step(device: str, setting: int | None = None) -> int:
    """The packed-length step: the setting (0 or 1: off), else the device's default."""
    if setting is None:
        return LADDER_STEP.get(device, 1)
    if setting < 0:
        raise ValueError(f"packed_length_step={setting} must be >= 0 (0 or 1: off)")
    return max(setting, 1)


def packed_multiple(tp: int, step: int = 1) -> int:
    """What a packed total is rounded up to: a multiple of tp (sequence parallelism) on the
    ladder of `step` tokens."""
    return lcm(tp, max(step, 1))


@dataclass(frozen=True)
class PackedLayout:
    lengths: tuple[int, ...]  # real lengths, in row order
    cu_seqlens: torch.Tensor  # int32 [N + 1] (or [N + 2] with the tp tail), on the device
    real: int  # sum of lengths
    total: int  # real rounded up to tp: the packed row's length T
    max_seqlen: int  # longest sequence, the tail included

    @property
    def tail(self) -> int:
        return self.total - self.real

    @property
    def params(self):
        """megatron-core's PackedSeqParams (THD, self-attention: q and kv share cu_seqlens)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def pack(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """1-D sequences (these lengths, in order) -> one [1, T] row, the tail zero-filled."""
        if [len(s) for s in seqs] != list(self.lengths):
            raise ValueError(f"sequence lengths {[len(s) for s in seqs]} != {list(self.lengths)}")
        return torch.cat([*seqs, seqs[0].new_zeros(self.tail)])[None]

    def has_next(self) -> torch.Tensor:
        """bool [1, T] on cu_seqlens' device: a real token of the same sequence follows
        (where a next-token log-prob means something); False at each sequence's last token
        and over the tail."""
        ends = torch.tensor(self.lengths).cumsum(0) - 1
        has_next = torch.arange(self.total) < self.real - 1
        has_next[ends] = False
        return has_next[None].to(self.cu_seqlens.device)


def packed_layout(lengths: list[int], tp: int = 1, device=None, step: int = 1) -> PackedLayout:
    """The packed row layout of sequences of these real lengths (each >= 1), T a multiple
    of tp and of the ladder's `step` (packed_multiple); cu_seqlens on `device` (CPU when
    None)."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"packing needs one or more non-empty sequences, got {list(lengths)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    real = sum(lengths)
    total = round_up(real, packed_multiple(tp, step))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] + ([total] if total > real else [])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedLayout(lengths, cu_seqlens, real, total, max(max(lengths), total - real))


# ---- micro-batch planning (recipes.dapo.engine.batches plans verl's batches with these) ----------
# A "multiple" is what a micro-batch is rounded up to: tp for padded rows, packed_multiple
# for packed ones.


def _check_fits(longest: int, budget: int, multiple: int) -> None:
    if round_up(longest, multiple) > budget:
        raise BatchError(
            f"a sequence of {longest} tokens exceeds max_token_len_per_gpu="
            f"{budget}: raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu "
            "to at least max_prompt_length + max_response_length"
        )


def micro_batch_slots(lengths: list[int], multiple: int, packed: bool) -> int:
    """Token slots one micro-batch's activations hold, the unit every planner budgets: padded,
    rows x longest row (rounded up to the multiple); packed, the real total rounded up."""
    if not lengths:
        return 0
    if packed:
        return round_up(sum(lengths), multiple)
    return len(lengths) * round_up(max(lengths), multiple)


def plan_by_tokens(lengths: list[int], budget: int, multiple: int) -> list[list[int]]:
    """Longest first, greedily: padded slots (rows x padded longest row) <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    _check_fits(lengths[order[0]] if order else 0, budget, multiple)
    plans: list[list[int]] = []
    for i in order:
        widest = round_up(lengths[plans[-1][0]], multiple) if plans else 0
        if plans and (len(plans[-1]) + 1) * widest <= budget:  # micro_batch_slots, padded
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


def packed_slot_budget(lengths: list[int], budget: int, multiple: int) -> int:
    """The slots a packed micro-batch may hold: the largest micro-batch of the padded plan of the
    same rows and budget (<= budget). Packing then never needs more activation memory than
    padding would for the same batch and settings."""
    plans = plan_by_tokens(lengths, budget, multiple)
    return max(
        (micro_batch_slots([lengths[i] for i in p], multiple, False) for p in plans), default=0
    )


def plan_by_real_tokens(lengths: list[int], budget: int, multiple: int) -> list[list[int]]:
    """Packed micro-batches, each of micro_batch_slots(packed) <= budget: as few as first fit
    (longest first) needs, then balanced (longest first onto the least filled) when that fits
    too, so the largest holds as few tokens as the count allows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    _check_fits(lengths[order[0]] if order else 0, budget, multiple)
    plans: list[list[int]] = []
    used: list[int] = []
    for i in order:
        fit = next(
            (k for k, u in enumerate(used) if round_up(u + lengths[i], multiple) <= budget), None
        )
        if fit is None:
            plans.append([i])
            used.append(lengths[i])
        else:
            plans[fit].append(i)
            used[fit] += lengths[i]
    balanced = _balance(lengths, order, len(plans))
    if all(micro_batch_slots([lengths[i] for i in p], multiple, True) <= budget for p in balanced):
        return balanced
    return plans


def _balance(lengths: list[int], order: list[int], count: int) -> list[list[int]]:
    """Longest processing time first: each row onto the micro-batch with the fewest tokens."""
    plans: list[list[int]] = [[] for _ in range(count)]
    used = [0] * count
    for i in order:
        k = min(range(count), key=used.__getitem__)
        plans[k].append(i)
        used[k] += lengths[i]
    return [p for p in plans if p]


def plan_lengths(
    lengths: list[int], budget: int, multiple: int, packed: bool, step: int = 1
) -> list[list[int]]:
    """The dynamic-batch plan of one rank (max_token_len_per_gpu = budget). Padded: slots <=
    budget. Packed (totals on the ladder, packed_multiple(multiple, step)): slots <=
    packed_slot_budget rounded up to that ladder (it adds at most step - 1 slots), and never
    more micro-batches than the padded plan (whose micro-batches, packed, fit that too)."""
    padded = plan_by_tokens(lengths, budget, multiple)
    if not packed:
        return padded
    rung = packed_multiple(multiple, step)
    cap = round_up(packed_slot_budget(lengths, budget, multiple), rung)
    plans = plan_by_real_tokens(lengths, cap, rung)
    return plans if len(plans) <= len(padded) else padded
