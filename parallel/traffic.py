"""What a DAPO step moves besides its forward and backward: R2 / R3 routes and checkpoints.

Routes (`routed_experts`): one expert id per token, layer and top-k slot, carried from the
rollout through verl's batch to the micro-batches; one byte per id for up to 256 experts
(backend.model.router_replay.route_dtype; vLLM returns uint8), where verl's own megatron engine
returns int32. A pipeline stage moves only its own layers to its micro-batches.

Checkpoints: the model's weights (bf16 on the accelerators) and the distributed optimizer's
state (fp32 master weights and both Adam moments: 12 bytes a parameter), sharded over all
ranks. The time per save is at a stated aggregate filesystem bandwidth; what the step waits
for with background saves is the copy of its shards to host memory (recipes.dapo.checkpoints.async_save).
"""

from dataclasses import dataclass

from backend.qwen3_moe import Qwen3MoeSpec
from parallel.params import param_counts

GB = 1e9
INT32_BYTES = 4
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weight + Adam exp_avg + exp_avg_sq
FS_GBPS = 10.0  # assumed aggregate write bandwidth of the shared filesystem (GB/s)
D2H_GBPS = 12.0  # assumed device-to-host copy into pageable host memory, per rank (GB/s)


def route_id_bytes(num_experts: int) -> int:
    """Bytes per expert id as the engine moves routes (backend.model.router_replay.route_dtype)."""
    return 1 if num_experts <= 256 else 2 if num_experts <= 2**15 else 4


def route_bytes(spec: Qwen3MoeSpec, samples: int, tokens: float, id_bytes: int) -> float:
    """routed_experts of `samples` sequences of `tokens` tokens each (every layer)."""
    return samples * tokens * spec.num_layers * spec.top_k * id_bytes


def route_lines(
    spec: Qwen3MoeSpec, train_samples: int, gen_samples: int, tokens: float, pp: int
) -> list[str]:
    compact = route_id_bytes(spec.num_experts)
    train, gen = (route_bytes(spec, n, tokens, compact) for n in (train_samples, gen_samples))
    wide = route_bytes(spec, train_samples, tokens, INT32_BYTES)
    name = {1: "uint8", 2: "int16", 4: "int32"}[compact]
    stage = f"; each of the {pp} pipeline stages moves its 1/{pp}" if pp > 1 else ""
    return [
        f"routes (R2 / R3 routed_experts, {spec.num_layers} layers x top-{spec.top_k}, "
        f"{tokens / 1e3:.1f}k tokens a sample assumed): {train / GB:.2f} GB per training batch "
        f"({train_samples} samples) as {name} ({wide / GB:.2f} GB as int32), "
        f"{gen / GB:.2f} GB per generation batch ({gen_samples} samples){stage}"
    ]


@dataclass(frozen=True)
class SaveSize:
    model_bytes: float
    optimizer_bytes: float
    world: int

    @property
    def total(self) -> float:
        return self.model_bytes + self.optimizer_bytes

    @property
    def per_rank(self) -> float:
        """Each rank's share: its optimizer shard, and its part of the model's writes (the
        data-parallel replicas spread them: recipes.dapo.checkpoints.save_plans)."""
        return self.total / self.world

    def lines(self, every: int) -> list[str]:
        write_s = self.total / (FS_GBPS * GB)
        stage_s = self.per_rank / (D2H_GBPS * GB)
        return [
            f"checkpoint save (every {every} steps): {self.total / GB:.0f} GB (model "
            f"{self.model_bytes / GB:.0f} GB bf16, optimizer state {self.optimizer_bytes / GB:.0f}"
            f" GB: fp32 master weights and Adam moments), {self.per_rank / GB:.1f} GB per rank",
            f"  written in the background: {write_s:.0f} s at {FS_GBPS:g} GB/s aggregate to the "
            f"shared filesystem (assumed); the step waits for the host copy of its shards "
            f"({stage_s:.1f} s at {D2H_GBPS:g} GB/s device-to-host, assumed) and for the save "
            "planning, cached or not (scripts/bench/save_planning.py)",
        ]


def save_size(spec: Qwen3MoeSpec, world: int, weight_bytes: int = 2) -> SaveSize:
    params = param_counts(spec).total
    return SaveSize(params * weight_bytes, params * OPTIMIZER_BYTES_PER_PARAM, world)
