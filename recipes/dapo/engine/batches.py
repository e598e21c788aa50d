"""verl's packed (nested) batches <-> right-padded [B, S] micro-batches for our actor.

verl hands the engine a TensorDict whose `input_ids` is a jagged nested tensor (one row per
sequence, no padding) plus scalar settings (use_dynamic_bsz, max_token_len_per_gpu,
micro_batch_size_per_gpu, temperature, ...). Our megatron-core model runs either
right-padded [B, S] batches (causal mask: real tokens never see the padding) or, with
`mcore_ep.packed`, packed ones: a micro-batch's sequences concatenated into one [1, T] row
with megatron-core's PackedSeqParams (THD; attention per sequence, RoPE restarting), only
the total padded to a multiple of tp (that tail is one more pseudo-sequence, masked out):
- one budget rule (`micro_batch_slots`): the token slots a micro-batch's activations hold,
  rows x longest row for padded ones (S rounded up to a multiple of tp for sequence
  parallelism), the real total rounded up to tp for packed ones. Padded micro-batches hold at
  most max_token_len_per_gpu slots (longest sequences first, greedily); packed ones at most
  the largest padded micro-batch of the same rows (`packed_slot_budget`), so packing never
  raises peak activation memory: as few micro-batches as first fit needs, then balanced;
- every DP rank runs the same number of micro-batches: expert-parallel all-to-alls pair the
  k-th forward of every rank of an EP group, which spans DP replicas;
- model outputs go back to verl as nested tensors in the caller's row order.
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from backend.model.packing import (  # noqa: F401  (the planners: pure, in backend.model.packing)
    BatchError,
    micro_batch_slots,
    packed_slot_budget,
    plan_by_real_tokens,
    plan_by_tokens,
    plan_lengths,
)
from backend.shared.integers import round_up


@dataclass
class MicroBatch:
    rows: list[int]  # row indices into the step's batch
    data: TensorDict  # those rows, as verl's loss functions expect them
    ids_BS: torch.Tensor  # right-padded input ids
    lengths_B: torch.Tensor  # real lengths
    valid_BS: torch.Tensor  # bool, real tokens
    response_BS: torch.Tensor | None  # bool, response tokens (when `responses` is in the batch)
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [B + 2] sequence starts, tp tail last

    @property
    def has_next_BS(self) -> torch.Tensor:
        """bool: a real token of the same sequence follows (where a next-token log-prob means
        something)."""
        has_next_BS = torch.nn.functional.pad(self.valid_BS[:, 1:], (0, 1))
        if self.cu_seqlens is not None:
            has_next_BS[0, self.cu_seqlens[1:-1].long() - 1] = False
        return has_next_BS

    @property
    def places(self) -> list[tuple[int, int, int]]:
        """(row of ids_BS, first position, length) of each sequence."""
        lengths = self.lengths_B.tolist()
        if self.cu_seqlens is None:
            return [(b, 0, n) for b, n in enumerate(lengths)]
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        return [(0, s, n) for s, n in zip(starts, lengths, strict=True)]

    @property
    def packed(self):
        """megatron-core's PackedSeqParams (THD) of a packed micro-batch, None when padded."""
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        tail = self.ids_BS.shape[1] - int(self.lengths_B.sum())
        max_len = max(int(self.lengths_B.max()), tail)  # host values: no device sync
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )

    def to_nested(self, values_BS: torch.Tensor) -> torch.Tensor:
        """[B, S] (or packed [1, T]) -> jagged nested [B, j] per sequence (differentiable)."""
        return _nested([values_BS[r, s : s + n] for r, s, n in self.places], values_BS.device)


def _lengths(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_nested:
        return tensor.offsets().diff().cpu()
    return torch.full((tensor.shape[0],), tensor.shape[1], dtype=torch.long)


def plan_by_rows(num_rows: int, rows_per_mb: int) -> list[list[int]]:
    return [list(range(s, min(s + rows_per_mb, num_rows))) for s in range(0, num_rows, rows_per_mb)]


def split_to(plans: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count` (same count on every DP rank)."""
    plans = [list(p) for p in plans]
    while len(plans) < count:
        big = max(range(len(plans)), key=lambda i: len(plans[i]))
        if len(plans[big]) < 2:
            raise BatchError(
                f"{len(plans)} rows on this rank cannot make {count} micro-batches: "
                "give every DP rank the same number of rows"
            )
        half = len(plans[big]) // 2
        plans[big : big + 1] = [plans[big][:half], plans[big][half:]]
    return plans


def plan_micro_batches(
    data: TensorDict, tp: int, dp_group, device="cpu", packed: bool = False, step: int = 1
) -> list[list[int]]:
    """Row indices of each micro-batch, the same count on every rank of `dp_group` (step:
    the packed-length ladder, backend.model.packing)."""
    lengths = _lengths(data["input_ids"]).tolist()
    if tu.get_non_tensor_data(data, "use_dynamic_bsz", True):
        budget = tu.get_non_tensor_data(data, "max_token_len_per_gpu", None)
        if budget is None:
            raise BatchError(
                "use_dynamic_bsz needs max_token_len_per_gpu: set ppo_max_token_len_per_gpu"
            )
        plans = plan_lengths(lengths, int(budget), tp, packed, step)
    else:
        plans = plan_by_rows(
            len(lengths), int(tu.get_non_tensor_data(data, "micro_batch_size_per_gpu", 1))
        )
    count = torch.tensor([len(plans)], device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    return split_to(plans, int(count))


def response_lengths_B(data: TensorDict) -> torch.Tensor | None:
    """Response tokens per row: nested `responses`, or (verl's padded layout) the attention
    mask's count past the prompt width, as verl's no_padding_2_padding reads it."""
    if "responses" not in data.keys():
        return None
    responses = data["responses"]
    keys = data.keys()
    if not responses.is_nested and "attention_mask" in keys and "prompts" in keys:
        mask = data["attention_mask"]
        if not mask.is_nested and not data["prompts"].is_nested:
            return mask[:, data["prompts"].shape[1] :].sum(1).cpu().long()
    return _lengths(responses)


def _response_mask(data: TensorDict, lengths_B: torch.Tensor, width: int) -> torch.Tensor | None:
    responses_B = response_lengths_B(data)
    if responses_B is None:
        return None
    pos_S = torch.arange(width)
    return (pos_S >= (lengths_B - responses_B)[:, None]) & (pos_S < lengths_B[:, None])


def micro_batch(data: TensorDict, rows: list[int], tp: int, device) -> MicroBatch:
    """Rows of `data` as a right-padded micro-batch on `device` (S a multiple of tp)."""
    sub = tu.index_select_tensor_dict(data, rows)
    ids = sub["input_ids"]
    seqs = ids.unbind() if ids.is_nested else list(ids)
    lengths_B = torch.tensor([len(s) for s in seqs])
    width = round_up(int(lengths_B.max()), tp)
    ids_BS = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids_BS[row, : len(seq)] = seq.cpu()
    valid_BS = torch.arange(width)[None] < lengths_B[:, None]
    response_BS = _response_mask(sub, lengths_B, width)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MicroBatch(rows, sub, to(ids_BS), lengths_B, to(valid_BS), to(response_BS))


def agree_over(mbs: list[MicroBatch], group) -> list[MicroBatch]:
    """Micro-batch k of every rank of `group` padded to their largest [B, S] (packed: [1, T]).

    megatron-core's allgather token dispatcher (the CPU choice) all-gathers the tokens over
    TP x EP, which needs the same token count on every rank there; EP ranks are other DP
    replicas, with other sequences. Padding rows and positions are masked like any padding
    (valid False; a packed row's tail pseudo-sequence grows)."""
    shapes = torch.tensor([list(mb.ids_BS.shape) for mb in mbs], dtype=torch.long)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    return [_padded_to(mb, b, s) for mb, (b, s) in zip(mbs, shapes.tolist(), strict=True)]


def _padded_to(mb: MicroBatch, b: int, s: int) -> MicroBatch:
    B, S = mb.ids_BS.shape
    if (B, S) == (b, s):
        return mb

    def pad(t_BS):
        out = t_BS.new_zeros(b, s)
        out[:B, :S] = t_BS
        return out

    cu_seqlens = mb.cu_seqlens
    if cu_seqlens is not None:  # the tail pseudo-sequence now ends at s
        real = int(mb.lengths_B.sum())
        starts = cu_seqlens[:-1] if S > real else cu_seqlens
        cu_seqlens = torch.cat([starts, cu_seqlens.new_tensor([s])])
    response = None if mb.response_BS is None else pad(mb.response_BS)
    return replace(mb, ids_BS=pad(mb.ids_BS), valid_BS=pad(mb.valid_BS), response_BS=response,
                   cu_seqlens=cu_seqlens)  # fmt: skip


def packed_micro_batch(
    data: TensorDict, rows: list[int], tp: int, device, step: int = 1
) -> MicroBatch:
    """Rows of `data` concatenated into one [1, T] row (T the real total rounded up to tp and
    to the packed-length ladder's step)."""
    from backend.model.packing import packed_layout

    sub = tu.index_select_tensor_dict(data, rows)
    ids = sub["input_ids"]
    seqs = [s.cpu() for s in (ids.unbind() if ids.is_nested else list(ids))]
    layout = packed_layout([len(s) for s in seqs], tp, step=step)
    lengths_B = torch.tensor(layout.lengths)
    valid_1T = torch.arange(layout.total)[None] < layout.real
    response_1T = _packed_response_mask(sub, lengths_B, layout.total)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MicroBatch(rows, sub, to(layout.pack(seqs)), lengths_B, to(valid_1T),
                      to(response_1T), to(layout.cu_seqlens))  # fmt: skip


def _packed_response_mask(data: TensorDict, lengths_B: torch.Tensor, total: int):
    responses_B = response_lengths_B(data)
    if responses_B is None:
        return None
    rows = [
        torch.arange(n) >= n - r
        for n, r in zip(lengths_B.tolist(), responses_B.tolist(), strict=True)
    ]
    return torch.nn.functional.pad(torch.cat(rows), (0, total - int(lengths_B.sum())))[None]


def _nested(pieces: list[torch.Tensor], device) -> torch.Tensor:
    lengths_B = torch.tensor([len(p) for p in pieces])
    offsets = torch.cat((lengths_B.new_zeros(1), lengths_B.cumsum(0))).to(device)
    return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets)


def restore_rows(per_mb: list[torch.Tensor], plans: list[list[int]]) -> torch.Tensor:
    """Nested outputs of the micro-batches -> one nested tensor in the caller's row order."""
    rows = [row for plan in plans for row in plan]
    pieces = [t for nested in per_mb for t in nested.unbind()]
    ordered = [None] * len(rows)
    for row, piece in zip(rows, pieces, strict=True):
        ordered[row] = piece
    return torch.nested.as_nested_tensor(ordered, layout=torch.jagged)


def micro_batch_routes(
    routes, mb: MicroBatch, device, fed_only: bool, layers: range, num_experts: int
):
    """Per-row expert ids (verl's nested `routed_experts`, [len or len - 1, L, K] a row, any
    integer dtype: vLLM's uint8, the CPU rollout's int16, R2's recorded ones) as
    backend.model.router_replay.Routes over the micro-batch's ids_BS (padded [B, S] or packed
    [1, T]) for `layers` only (a pipeline stage's), in route_dtype(num_experts): what moves
    to the device is a stage's share of the routes at one byte per id (<= 256 experts).

    fed_only: a rollout's routes: its last token was never fed to the model (its row is a
    placeholder or absent), so it is not used; the recorded routes of a full forward are.
    """
    from backend.model.router_replay import Routes, route_dtype

    rows = routes.unbind() if routes.is_nested else list(routes)
    if rows[0].dim() != 3:  # vLLM's routed_experts: [positions, layers, top-k] a request
        raise BatchError(
            f"routed_experts rows are {tuple(rows[0].shape)}: expected [positions, layers, "
            "top-k] a row, as vLLM returns them"
        )
    _check_routes(routes, rows[0].shape[-2], layers, num_experts)
    dtype, top_k = route_dtype(num_experts), rows[0].shape[-1]
    experts_BSLK = torch.zeros(*mb.ids_BS.shape, len(layers), top_k, dtype=dtype)
    use_BS = torch.zeros(*mb.ids_BS.shape, dtype=torch.bool)
    for i, (row, (b, s, n)) in enumerate(zip(rows, mb.places, strict=True)):
        if row.shape[0] not in (n, n - 1):
            raise BatchError(
                f"routed_experts row {i} has {row.shape[0]} positions for {n} tokens: "
                "expected one per token (or all but the last)"
            )
        m = min(row.shape[0], n - 1 if fed_only else n)
        experts_BSLK[b, s : s + m] = row[:m, layers.start : layers.stop].cpu().to(dtype)
        use_BS[b, s : s + m] = True
    return Routes(experts_BSLK.to(device), use_BS.to(device), layers.start)


def _check_routes(routes, num_layers: int, layers: range, num_experts: int) -> None:
    """A damaged routed_experts (another model's, ids out of range, a float tensor) is
    refused in one line, never replayed."""
    values = routes.values() if routes.is_nested else routes
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise BatchError(f"routed_experts is {values.dtype}: expected integer expert ids")
    if num_layers < layers.stop:
        raise BatchError(
            f"routed_experts covers {num_layers} layers, the model has more (up to layer "
            f"{layers.stop - 1}): are the routes this model's?"
        )
    if values.dtype in (torch.uint16, torch.uint32, torch.uint64):  # vLLM's > 256 experts
        values = values.to(torch.int32)  # torch has no min / max for them: the check only
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= num_experts):
        raise BatchError(
            f"routed_experts holds expert ids {int(values.min())}..{int(values.max())}, the "
            f"model has {num_experts} experts: are the routes this model's?"
        )


def routes_to_nested(experts_BSLK: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Recorded routes over ids_BS ([B, S, L, K]) -> verl's nested routed_experts rows
    ([len, L, K] each)."""
    pieces = [experts_BSLK[b, s : s + n] for b, s, n in mb.places]
    return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)
