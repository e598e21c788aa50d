"""verl's packed (nested) batches <-> right-padded [B, S] micro-batches for our actor.

verl hands the engine a TensorDict whose `input_ids` is a jagged nested tensor (one row per
sequence, no padding) plus scalar settings (use_dynamic_bsz, max_token_len_per_gpu,
micro_batch_size_per_gpu, temperature, ...). Our megatron-core model runs right-padded
[B, S] batches (causal mask: real tokens never see the padding), so:
- micro-batches are planned on *padded* tokens (rows x longest row, S rounded up to a
  multiple of tp for sequence parallelism), longest sequences first;
- every DP rank runs the same number of micro-batches: expert-parallel all-to-alls pair the
  k-th forward of every rank of an EP group, which spans DP replicas;
- model outputs go back to verl as nested tensors in the caller's row order.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu


class BatchError(ValueError):
    """A batch this engine cannot split or run."""


@dataclass
class MicroBatch:
    rows: list[int]  # row indices into the step's batch
    data: TensorDict  # those rows, as verl's loss functions expect them
    ids_BS: torch.Tensor  # right-padded input ids
    lengths_B: torch.Tensor  # real lengths
    valid_BS: torch.Tensor  # bool, real tokens
    response_BS: torch.Tensor | None  # bool, response tokens (when `responses` is in the batch)

    @property
    def has_next_BS(self) -> torch.Tensor:
        """bool: a real token follows (where a next-token log-prob means something)."""
        return torch.nn.functional.pad(self.valid_BS[:, 1:], (0, 1))


def _lengths(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_nested:
        return tensor.offsets().diff().cpu()
    return torch.full((tensor.shape[0],), tensor.shape[1], dtype=torch.long)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_by_tokens(lengths: list[int], budget: int, multiple: int) -> list[list[int]]:
    """Longest first, greedily: rows x padded longest row <= budget (padded tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if order and _round_up(lengths[order[0]], multiple) > budget:
        raise BatchError(
            f"a sequence of {lengths[order[0]]} tokens exceeds max_token_len_per_gpu="
            f"{budget}: raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu "
            "to at least max_prompt_length + max_response_length"
        )
    plans: list[list[int]] = []
    for i in order:
        widest = _round_up(lengths[plans[-1][0]], multiple) if plans else 0
        if plans and (len(plans[-1]) + 1) * widest <= budget:
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


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


def plan_micro_batches(data: TensorDict, tp: int, dp_group, device="cpu") -> list[list[int]]:
    """Row indices of each micro-batch, the same count on every rank of `dp_group`."""
    lengths = _lengths(data["input_ids"]).tolist()
    if tu.get_non_tensor_data(data, "use_dynamic_bsz", True):
        budget = tu.get_non_tensor_data(data, "max_token_len_per_gpu", None)
        if budget is None:
            raise BatchError(
                "use_dynamic_bsz needs max_token_len_per_gpu: set ppo_max_token_len_per_gpu"
            )
        plans = plan_by_tokens(lengths, int(budget), tp)
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
    width = _round_up(int(lengths_B.max()), tp)
    ids_BS = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids_BS[row, : len(seq)] = seq.cpu()
    valid_BS = torch.arange(width)[None] < lengths_B[:, None]
    response_BS = _response_mask(sub, lengths_B, width)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MicroBatch(rows, sub, to(ids_BS), lengths_B, to(valid_BS), to(response_BS))


def to_nested(values_BS: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """[B, S] -> jagged nested [B, j] keeping each row's first length values (differentiable)."""
    pieces = [values_BS[row, :n] for row, n in enumerate(lengths_B.tolist())]
    offsets = torch.cat((lengths_B.new_zeros(1), lengths_B.cumsum(0))).to(values_BS.device)
    return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets)


def restore_rows(per_mb: list[torch.Tensor], plans: list[list[int]]) -> torch.Tensor:
    """Nested outputs of the micro-batches -> one nested tensor in the caller's row order."""
    rows = [row for plan in plans for row in plan]
    pieces = [t for nested in per_mb for t in nested.unbind()]
    ordered = [None] * len(rows)
    for row, piece in zip(rows, pieces, strict=True):
        ordered[row] = piece
    return torch.nested.as_nested_tensor(ordered, layout=torch.jagged)


def padded_routes(routes, lengths_B: torch.Tensor, width: int, device, fed_only: bool):
    """Per-row expert ids (verl's nested `routed_experts`, [len or len - 1, L, K] a row) as
    backend.router_replay.Routes over the right-padded [B, width] micro-batch.

    fed_only: a rollout's routes: its last token was never fed to the model (its row is a
    placeholder or absent), so it is not used; the recorded routes of a full forward are.
    """
    from backend.router_replay import Routes

    rows = routes.unbind() if routes.is_nested else list(routes)
    num_layers, top_k = rows[0].shape[-2:]
    experts_BSLK = torch.zeros(len(rows), width, num_layers, top_k, dtype=torch.long)
    use_BS = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (row, n) in enumerate(zip(rows, lengths_B.tolist(), strict=True)):
        if row.shape[0] not in (n, n - 1):
            raise BatchError(
                f"routed_experts row {b} has {row.shape[0]} positions for {n} tokens: "
                "expected one per token (or all but the last)"
            )
        m = min(row.shape[0], n - 1 if fed_only else n)
        experts_BSLK[b, :m] = row[:m].long().cpu()
        use_BS[b, :m] = True
    return Routes(experts_BSLK.to(device), use_BS.to(device))


def routes_to_nested(experts_BSLK: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Recorded [B, S, L, K] routes -> verl's nested routed_experts rows ([len, L, K] each)."""
    pieces = [experts_BSLK[b, :n] for b, n in enumerate(lengths_B.tolist())]
    return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)
