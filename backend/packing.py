"""The packed (THD) row layout of a micro-batch, from its sequences' real lengths (no verl).

A packed micro-batch is its sequences concatenated into one [1, T] row, T the real total
rounded up to a multiple of tp (sequence parallelism splits T over the TP ranks). The tail
T - real, when there is one, is one more pseudo-sequence (masked out by callers), so
cu_seqlens is int32 [N + 1] without a tail and [N + 2] with one: sequence starts, then T.
megatron-core's PackedSeqParams (qkv_format "thd") carries it to attention (per sequence) and
RoPE (positions restart at each start: backend.forward.packed_position_ids).

recipes/dapo/batches.packed_micro_batch builds the same layout from verl's batches
(tests/test_packing.py checks they agree).
"""

from dataclasses import dataclass

import torch

from backend.common import round_up


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


def packed_layout(lengths: list[int], tp: int = 1, device=None) -> PackedLayout:
    """The packed row layout of sequences of these real lengths (each >= 1), T a multiple
    of tp; cu_seqlens on `device` (CPU when None)."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"packing needs one or more non-empty sequences, got {list(lengths)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    real = sum(lengths)
    total = round_up(real, tp)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] + ([total] if total > real else [])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedLayout(lengths, cu_seqlens, real, total, max(max(lengths), total - real))
