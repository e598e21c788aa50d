"""One rollout weight sync: how its tensors are bucketed, and what it costs per rank.

The stream (recipes.dapo.engine.weights.hf_tensors) ends with every rank holding the whole model as
full tensors, what its co-located rollout loads. Each pipeline stage walks its parameters in
module order (grouped experts per expert) and groups consecutive tensors into buckets of at
most `bucket_bytes` of full tensors (`plan_buckets`; a larger tensor is a bucket of its own).
Per bucket, one all-gather of the bucket's TP-split shards over TP, one of its expert-TP
shards over ETP, one of its (full) expert tensors over EP; with pp > 1 each stage then
broadcasts the bucket over its PP group (the first sync also broadcasts each bucket's tensor
list once, kept for later syncs). bucket_bytes = 0 is the per-tensor stream: one collective
per tensor and group (converters.sharding.iter_full).

`sync_cost` counts the same collectives from the spec and the plan alone, with the bytes each
rank receives (from each member of a group: over NVLink / HCCS when both ranks share a node,
else over the inter-node network) and an alpha-beta time at stated link figures.
"""

from dataclasses import dataclass

from backend.qwen3_moe import Qwen3MoeSpec
from parallel.plan import ParallelPlan
from parallel.rank_layout import RankLayout

# the engine's default bucket (mcore_ep.weight_sync_bucket_mb): ~120 buckets for Qwen3-30B-A3B
DEFAULT_BUCKET_MB = 512


@dataclass(frozen=True)
class SyncItem:
    """One streamed tensor of a stage (an expert's: this EP rank's local expert)."""

    local_bytes: int  # what this rank holds
    split: str | None  # "tp" / "etp": the group it is split over (None: whole on every rank)
    expert: bool  # gathered over EP too (one tensor per EP rank)
    group_sizes: tuple[int, int, int]  # (tp, etp, ep)

    @property
    def full_bytes(self) -> int:
        """Bytes the stream yields for it: the full tensor, for every EP rank if an expert."""
        tp, etp, ep = self.group_sizes
        split = {"tp": tp, "etp": etp, None: 1}[self.split]
        return self.local_bytes * split * (ep if self.expert else 1)


def plan_buckets(full_bytes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive items, at most bucket_bytes of full tensors each (0: one item each)."""
    buckets, start, used = [], 0, 0
    for i, size in enumerate(full_bytes):
        if i > start and (bucket_bytes <= 0 or used + size > bucket_bytes):
            buckets.append(range(start, i))
            start, used = i, 0
        used += size
    if full_bytes:
        buckets.append(range(start, len(full_bytes)))
    return buckets


def bucket_collectives(items: list[SyncItem]) -> dict[str, int]:
    """The all-gathers one bucket makes on a rank: per group present and larger than 1."""
    tp, etp, ep = items[0].group_sizes
    wanted = {
        "tp": tp > 1 and any(i.split == "tp" for i in items),
        "etp": etp > 1 and any(i.split == "etp" for i in items),
        "ep": ep > 1 and any(i.expert for i in items),
    }
    return {g: int(on) for g, on in wanted.items()}


def stage_items(spec: Qwen3MoeSpec, plan: ParallelPlan, stage: int, dtype_bytes: int = 2):
    """The streamed tensors of pipeline stage `stage`, in module order (local spec, grouped
    experts: backend.model.experts.GroupedExperts, as on the accelerators)."""
    sizes = (plan.tp, plan.etp, plan.ep)
    item = lambda n, split=None, expert=False: SyncItem(  # noqa: E731
        n * dtype_bytes, split, expert, sizes
    )
    h, d, tp, etp = spec.hidden_size, spec.head_dim, plan.tp, plan.etp
    per_stage = spec.num_layers // plan.pp
    local_experts = spec.num_experts // plan.ep
    vocab = spec.vocab_size  # as backend.model.build builds it (unpadded, split over TP)
    items = [item(vocab // tp * h, "tp")] if stage == 0 else []
    for _ in range(per_stage):
        q, kv = spec.num_heads * d, spec.num_kv_heads * d
        items += [item(h), item(h * q // tp, "tp"), item((q + 2 * kv) // tp * h, "tp")]
        items += [item(d), item(d), item(h), item(spec.num_experts * h)]
        i = spec.moe_ffn_hidden_size
        items += [item(2 * i // etp * h, "etp", True) for _ in range(local_experts)]
        items += [item(h * i // etp, "etp", True) for _ in range(local_experts)]
    if stage == plan.pp - 1:
        items += [item(h), item(vocab // tp * h, "tp")]  # untied head (backend.qwen3_moe)
    return items


@dataclass(frozen=True)
class Links:
    """Link figures a sync's time is predicted at (per rank, one direction)."""

    name: str
    intra_gbps: float  # GB/s within a node (all-gather bus bandwidth)
    inter_gbps: float  # GB/s between nodes (per rank: its NIC)
    latency_us: float  # per collective

    def line(self) -> str:
        return (
            f"{self.name}: {self.intra_gbps:g} GB/s within a node, {self.inter_gbps:g} GB/s "
            f"between nodes per rank, {self.latency_us:g} us per collective"
        )


# stated assumptions, to be replaced by measured figures (nccl-tests / hccl_test all_gather)
LINKS = {
    "cuda": Links("H100 SXM: NVLink 4 via NVSwitch, 400 Gb/s NDR per GPU", 360.0, 50.0, 30.0),
    "npu": Links("Ascend 910B (A2): HCCS full mesh, 200 Gb/s RoCE per NPU", 196.0, 25.0, 100.0),
}


@dataclass(frozen=True)
class SyncCost:
    buckets: int  # on the busiest rank's stage
    collectives: int  # on one rank, steady state (headers cached)
    first_sync_extra: int  # the first sync's header broadcasts (pp > 1)
    received_bytes: int  # per rank
    intra_bytes: int
    inter_bytes: int
    seconds: float

    def lines(self, links: Links, bucket_bytes: int) -> list[str]:
        gb = 1e9
        size = f"{bucket_bytes / 2**20:g} MiB buckets" if bucket_bytes > 0 else "per tensor"
        return [
            f"weight sync ({size}): {self.collectives} collectives per rank "
            f"({self.buckets} {'buckets' if bucket_bytes > 0 else 'tensors'} on its stage; "
            f"+{self.first_sync_extra} on the first sync), "
            f"{self.received_bytes / gb:.1f} GB received per rank "
            f"({self.intra_bytes / gb:.1f} GB within the node, {self.inter_bytes / gb:.1f} GB "
            f"between nodes): {self.seconds:.2f} s at {links.line()}",
        ]


def sync_cost(
    spec: Qwen3MoeSpec,
    plan: ParallelPlan,
    bucket_bytes: int,
    links: Links,
    rank: int = 0,
    dtype_bytes: int = 2,
) -> SyncCost:
    """The sync as rank `rank` sees it (default 0; every rank of a plan sees the same up to
    its stage and its groups' node spans); parameters of dtype_bytes (bf16: 2)."""
    layout = RankLayout(plan)
    me = layout.coords(rank)
    totals = dict(collectives=0, extra=0, received=0, intra=0, inter=0, seconds=0.0, buckets=0)
    for stage in range(plan.pp):
        items = stage_items(spec, plan, stage, dtype_bytes)
        buckets = plan_buckets([i.full_bytes for i in items], bucket_bytes)
        for bucket in buckets:
            chunk = [items[i] for i in bucket]
            full = sum(i.full_bytes for i in chunk)
            if stage == me.pp:
                _gathers(totals, chunk, layout, rank, links)
            if plan.pp > 1:  # the bucket over the PP group; the first sync: its tensor list
                src = layout.group(rank, "pp")[stage]
                totals["collectives"] += 1
                totals["extra"] += 1
                if src != rank:
                    _received(totals, full, layout, src, rank, links)
        totals["extra"] += plan.pp > 1  # the first sync's end mark of the stage's lists
        if stage == me.pp:
            totals["buckets"] = len(buckets)
    return SyncCost(
        totals["buckets"], totals["collectives"], totals["extra"], totals["received"],
        totals["intra"], totals["inter"], totals["seconds"],
    )  # fmt: skip


def _gathers(totals: dict, chunk: list[SyncItem], layout: RankLayout, rank: int, links) -> None:
    tp, etp, ep = chunk[0].group_sizes
    sent = {
        "tp": sum(i.local_bytes for i in chunk if i.split == "tp"),
        "etp": sum(i.local_bytes for i in chunk if i.split == "etp"),
        # experts are gathered over EP after their ETP gather: full tensors
        "ep": sum(i.full_bytes // ep for i in chunk if i.expert),
    }
    for group, on in bucket_collectives(chunk).items():
        if not on:
            continue
        totals["collectives"] += 1
        intra, inter = 0, 0
        for member in layout.group(rank, group):
            if member != rank:
                same = layout.node_of(member) == layout.node_of(rank)
                intra, inter = intra + sent[group] * same, inter + sent[group] * (not same)
        _account(totals, intra, inter, links)


def _received(totals, nbytes: int, layout: RankLayout, src: int, rank: int, links) -> None:
    same = layout.node_of(src) == layout.node_of(rank)
    _account(totals, nbytes * same, nbytes * (not same), links)


def _account(totals: dict, intra: int, inter: int, links: Links) -> None:
    totals["received"] += intra + inter
    totals["intra"] += intra
    totals["inter"] += inter
    totals["seconds"] += links.latency_us * 1e-6 + max(
        intra / (links.intra_gbps * 1e9), inter / (links.inter_gbps * 1e9)
    )
