"""Bytes each rank moves, counted in the collectives themselves and split by process group.

torch's flight recorder keeps every collective a process group runs (gloo included): its
group, op and buffer sizes. It is on when `TORCH_FR_BUFFER_SIZE` (entries, a ring) is set in
a process before its first collective; `MCORE_DAPO_COMM_BYTES=<dir>` turns this counter on in
the engine, which then writes one JSON line per phase to `<dir>/rank<k>.jsonl`
(scripts/bench/launches/scale_table.py sets both). The profiler records the same ops without
their group, so it cannot split TP from EP from DP.

A collective's bytes are its larger buffer on this rank, as nccl-tests count a message: the
input of an all-reduce, reduce-scatter or all-to-all, the output of an all-gather. Gloo has
no reduce-scatter of one tensor: megatron-core's falls back to an all-reduce of the whole
input there, which is what the recorder sees and what is counted.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

ENV = "MCORE_DAPO_COMM_BYTES"
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
# entries of the recorder's ring (each keeps its Python stack: ~2 KB, so ~40 MiB a process);
# a phase of the mini model's world-8 run makes ~2k collectives a rank
FR_BUFFER = 20_000
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4,
               "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1}  # fmt: skip
# megatron-core's group_desc -> the dimension it belongs to; the rest by our ProcessGroups
DESC_KIND = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "EXPERT_TENSOR_PARALLEL_GROUP": "tp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "ep",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "EXPERT_DATA_PARALLEL_GROUP": "dp",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
}
KINDS = ("tp", "ep", "dp", "pp", "other")


def buffer_bytes(entry: dict, group_size: int) -> int:
    """The larger of one recorded collective's input and output buffers on this rank, in
    bytes; 0 in a group of one (nothing moves). An all-gather's output is its input times the
    group: the recorder gives a list-of-tensors gather's output as one [1, n] tensor."""
    if group_size == 1:
        return 0

    def size(shapes, dtypes) -> int:
        total = 0
        for shape, dtype in zip(shapes, dtypes, strict=True):
            n = 1
            for d in shape:
                n *= d
            total += n * DTYPE_BYTES.get(dtype, 4)
        return total

    sent = size(entry["input_sizes"], entry["input_dtypes"])
    if entry["profiling_name"].endswith("all_gather"):
        return sent * group_size
    return max(sent, size(entry["output_sizes"], entry["output_dtypes"]))


def group_sizes() -> dict[str, int]:
    """Process-group name -> size, for every group this process has made. torch keeps the
    registry in a private attribute: the counter refuses in one line when it is not there."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if names is None:
        raise RuntimeError(
            f"{ENV}: torch {torch.__version__} has no distributed_c10d._world.pg_names "
            "(the process-group registry the counter reads): unset it"
        )
    return {name: pg.size() for pg, name in names.items()}


def group_kinds(groups) -> dict[str, str]:
    """Process-group name -> 'tp' / 'ep' / 'dp' / 'pp' for the groups of a ProcessGroups whose
    size is over 1 (megatron-core's descriptions cover the ones it makes beside them)."""
    out = {}
    for kind in ("pp", "dp", "edp", "ep", "etp", "tp"):  # later wins: tp over etp when equal
        pg = getattr(groups, kind)
        if dist.get_world_size(pg) > 1:
            out[pg.group_name] = {"edp": "dp", "etp": "tp"}.get(kind, kind)
    return out


def kind_of(process_group: tuple[str, str], by_name: dict[str, str]) -> str:
    name, desc = process_group
    return by_name.get(name) or DESC_KIND.get(desc, "other")


@dataclass
class CommBytes:
    """Reads the flight recorder's new entries at each phase's end: bytes and calls by kind."""

    out: Path
    by_name: dict[str, str]
    rank: int
    sizes: dict[str, int] = field(default_factory=dict)  # group name -> ranks
    seen: int = -1  # the newest record_id counted

    @classmethod
    def from_env(cls, groups) -> "CommBytes | None":
        where = os.environ.get(ENV)
        if not where:
            return None
        if not os.environ.get(FR_BUFFER_ENV):
            raise RuntimeError(f"{ENV} needs {FR_BUFFER_ENV} set before the process groups start")
        out = Path(where)
        out.mkdir(parents=True, exist_ok=True)
        counter = cls(out, group_kinds(groups), dist.get_rank(), group_sizes())
        counter.new_entries()  # what ran before the engine (verl's, ours at build) is not a phase
        return counter

    def new_entries(self) -> list[dict]:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        dump = json.loads(_dump_fr_trace_json(True, False))
        fresh = [e for e in dump.get("entries", []) if e["record_id"] > self.seen]
        if fresh and self.seen >= 0 and min(e["record_id"] for e in fresh) > self.seen + 1:
            raise RuntimeError(
                f"{ENV}: the recorder's ring dropped collectives within one phase: "
                f"raise {FR_BUFFER_ENV} above {len(fresh)}"
            )
        if fresh:
            self.seen = max(e["record_id"] for e in fresh)
        return fresh

    def _size(self, name: str) -> int:
        if name not in self.sizes:  # a group made after the counter (verl's weight channel)
            self.sizes = group_sizes()
        return self.sizes.get(name, 2)

    def take(self, phase: str, tokens: int = 0) -> dict:
        """Bytes and calls by kind since the last take, written as `phase`'s line with the
        tokens its passes ran on this rank (padded)."""
        row = {"phase": phase, "tokens": tokens, "bytes": dict.fromkeys(KINDS, 0),
               "calls": dict.fromkeys(KINDS, 0)}  # fmt: skip
        ops: dict[str, int] = {}
        for e in self.new_entries():
            if e.get("is_p2p"):
                kind = "pp"
            else:
                kind = kind_of(tuple(e["process_group"]), self.by_name)
            nbytes = buffer_bytes(e, self._size(e["process_group"][0]))
            row["bytes"][kind] += nbytes
            row["calls"][kind] += 1
            op = f"{kind}:{e['profiling_name'].split(':')[-1]}"
            ops[op] = ops.get(op, 0) + nbytes
        row["ops"] = ops
        if not ops and phase == "other":
            return row
        with open(self.out / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row
