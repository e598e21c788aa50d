"""converters.sharding.iter_full in buckets: the same (name, full tensor) pairs in the same
order, gathered with one collective per group and bucket instead of one per tensor.

A bucket is a run of consecutive parameters whose full tensors hold at most `bucket_bytes`
(parallel.weight_sync.plan_buckets, which the sync's cost model counts with). Per bucket:
its TP-split shards go in one all-gather over TP, its expert-TP shards in one over ETP (each
shard's bytes, back to back in a uint8 buffer), then its experts' full tensors in one
all-gather over EP. The values are the per-tensor path's, bit for bit: only where the bytes
travel together changes.
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist

from backend.training.distributed import ProcessGroups
from converters.sharding import (
    _mapping,
    expanded_parameters,
    expert_slice,
    global_expert_name,
    global_name,
    layer_offsets,
)
from converters.table import ExpertSlice, rows_by_name
from parallel.weight_sync import plan_buckets

ALIGN = 16  # bytes: every tensor starts aligned in a bucket's buffer (views of any dtype)


def iter_full_buckets(
    model: torch.nn.Module, groups: ProcessGroups, spec, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(world-size-1 mcore name, full tensor) of this PP stage, as iter_full yields them.
    Collective: every rank of the stage iterates to the end."""
    for bucket in iter_buckets(model, groups, spec, bucket_bytes):
        yield from bucket


def iter_buckets(
    model: torch.nn.Module, groups: ProcessGroups, spec, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """iter_full_buckets, one bucket's pairs at a time."""
    offsets, rows = layer_offsets(model), rows_by_name(spec, expert_slice(spec, groups))
    entries = []
    for name, param, tensor in expanded_parameters(model):
        key = global_name(name, offsets)
        mapping = _mapping(rows, key, name)
        split = mapping.tp_group if getattr(param, "tensor_model_parallel", False) else None
        entries.append((key, mapping, param, tensor, split))
    sizes = [_full_bytes(e, groups) for e in entries]
    for bucket in plan_buckets(sizes, bucket_bytes):
        yield list(_bucket(entries[bucket.start : bucket.stop], groups, spec))


def _full_bytes(entry, groups: ProcessGroups) -> int:
    _, mapping, _, tensor, split = entry
    ep = groups.size("ep") if mapping.is_expert else 1
    return tensor.numel() * tensor.element_size() * (groups.size(split) if split else 1) * ep


def _bucket(entries: list, groups: ProcessGroups, spec) -> Iterator[tuple[str, torch.Tensor]]:
    full = [tensor for _, _, _, tensor, _ in entries]
    for group in ("tp", "etp"):
        picked = [i for i, e in enumerate(entries) if e[4] == group and groups.size(group) > 1]
        gathered = all_gather_many([full[i] for i in picked], groups, group)
        for i, parts in zip(picked, gathered, strict=True):
            full[i] = entries[i][1].unshard(parts, entries[i][2].partition_dim)
    experts = [i for i, e in enumerate(entries) if e[1].is_expert]
    ep = groups.size("ep")
    per_rank = dict(zip(experts, all_gather_many([full[i] for i in experts], groups, "ep"),
                        strict=True)) if ep > 1 else {i: [full[i]] for i in experts}  # fmt: skip
    for i, (key, mapping, *_) in enumerate(entries):
        if not mapping.is_expert:
            yield key, full[i]
            continue
        for ep_rank, part in enumerate(per_rank[i]):
            yield global_expert_name(key, ExpertSlice(spec.num_experts, ep, ep_rank)), part


def all_gather_many(
    tensors: list[torch.Tensor], groups: ProcessGroups, group: str
) -> list[list[torch.Tensor]]:
    """Every rank's version of each tensor (same shapes and dtypes on every rank of the
    group), in one all-gather of their bytes; [] without tensors (no collective)."""
    if not tensors:
        return []
    size = groups.size(group)
    buffer, places = pack(tensors)
    parts = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(parts, buffer, group=getattr(groups, group))
    return [[unpack(p, place) for p in parts] for place in places]


def layout(shapes_dtypes: list[tuple]) -> tuple[int, list[tuple]]:
    """(buffer bytes, per tensor (offset, nbytes, shape, dtype)): the tensors back to back,
    each start aligned; from shapes and dtypes alone, so a receiver can lay out a buffer."""
    places, at = [], 0
    for shape, dtype in shapes_dtypes:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        places.append((at, nbytes, tuple(shape), dtype))
        at += -(-nbytes // ALIGN) * ALIGN
    return at, places


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """The tensors' bytes in one uint8 buffer (`layout`), and where each lies."""
    total, places = layout([(t.shape, t.dtype) for t in tensors])
    buffer = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, (offset, nbytes, _, _) in zip(tensors, places, strict=True):
        buffer[offset : offset + nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return buffer, places


def unpack(buffer: torch.Tensor, place: tuple) -> torch.Tensor:
    """One tensor of a packed buffer (a view of it)."""
    offset, nbytes, shape, dtype = place
    return buffer[offset : offset + nbytes].view(dtype).reshape(shape)
