"""Weights in and out of the sharded actor: HF load, per-tensor HF export, checkpoints.

Checkpoint layout under verl's `.../global_step_N/actor/` (save_checkpoint):
  model/dist_ckpt/  megatron-core torch_dist checkpoint of the model (dist_checkpointing.save of
                    the local-spec GPTModel's sharded_state_dict: every rank writes its shards,
                    loadable at any TP/EP plan) + hf_config.json (the model's config.json).
                    `python -m converters mcore-to-hf <that actor dir> OUT --template HF_DIR`
                    exports it to HF safetensors.
  optim/rank_NNNNN.pt  per-rank optimizer and schedule state (resume with the same plan).
  meta.json         format, global step, plan.
"""

import json
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from backend.distributed import ProcessGroups
from backend.grads import is_expert
from backend.hf_config import Qwen3MoeSpec
from converters.hf_io import CheckpointError, shard_files
from converters.qwen3_moe import ExpertSlice, expand_table, split_row
from converters.sharding import global_name, layer_offsets, unshard

FORMAT = "mcore-moe-dapo/torch_dist/1"
MODEL_DIR = "model/dist_ckpt"  # verl's layout, which converters.dist_read finds
HF_CONFIG = "hf_config.json"  # what converters.convert reads beside the checkpoint
_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


class LazyTensors(Mapping):
    """Tensors of a safetensors checkpoint dir, read one at a time when asked (cast to dtype)."""

    def __init__(self, ckpt_dir: str | Path, dtype: torch.dtype | None = None):
        from safetensors import safe_open

        self.dtype, self._open, self._file = dtype, safe_open, {}
        for path in shard_files(ckpt_dir):
            with safe_open(path, framework="pt") as f:
                self._file.update(dict.fromkeys(f.keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._open(self._file[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def with_global_expert(name: str, experts: ExpertSlice) -> str:
    return _EXPERT.sub(lambda m: f"{m[1]}{experts.global_index(int(m[2]))}{m[3]}", name)


# ---- export: full tensors, gathered over TP/ETP and EP, one at a time ------------------


def full_mcore_tensors(
    module, groups: ProcessGroups, spec: Qwen3MoeSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """(world-size-1 mcore name, full tensor) per tensor; collective: every rank iterates all."""
    offsets, ep = layer_offsets(module), groups.size("ep")
    for name, param in module.named_parameters():
        full = unshard(param.detach(), name, param, groups)
        key = global_name(name, offsets)
        if not is_expert(name):
            yield key, full
            continue
        parts = [full]
        if ep > 1:
            parts = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(parts, full.contiguous(), group=groups.ep)
        for ep_rank, part in enumerate(parts):
            yield with_global_expert(key, ExpertSlice(spec.num_experts, ep, ep_rank)), part


def hf_tensors(
    module, groups: ProcessGroups, spec: Qwen3MoeSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF hub name, full tensor) per tensor, for rollout weight sync (vLLM's names)."""
    rows = {mcore: (row, hf) for row, mcore, hf in expand_table(spec)}
    for key, tensor in full_mcore_tensors(module, groups, spec):
        row, hf_names = rows[key]
        yield from zip(hf_names, split_row(row, tensor, spec), strict=True)


# ---- load: HF or our checkpoint into this rank's shard ----------------------------------


def load_hf(module, hf_dir: str | Path, spec: Qwen3MoeSpec, groups: ProcessGroups) -> None:
    """HF safetensors -> this rank's parameters, reading only the tensors this rank needs."""
    from converters.sharding import load_hf_sharded

    dtype = next(module.parameters()).dtype
    load_hf_sharded(module, LazyTensors(hf_dir, dtype), spec, groups)


# ---- checkpoints -----------------------------------------------------------------------


def save_model(module, out: Path, hf_config: Path, device: str) -> None:
    """megatron-core torch_dist checkpoint of this rank's shards (collective: every rank calls)."""
    from megatron.core import dist_checkpointing

    out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(module.sharded_state_dict(), str(out))
    if dist.get_rank() == 0:
        shutil.copyfile(hf_config, out / HF_CONFIG)


def load_model(module, ckpt: Path) -> None:
    """Our torch_dist checkpoint, resharded to this rank's plan (collective)."""
    from megatron.core import dist_checkpointing

    if not (ckpt / ".metadata").is_file():
        raise CheckpointError(
            f"{ckpt} has no megatron-core checkpoint (.metadata): was the save interrupted?"
        )
    state = dist_checkpointing.load(module.sharded_state_dict(), str(ckpt))
    module.load_state_dict(state)


def save_meta(root: Path, global_step: int, plan: dict[str, int]) -> None:
    (root / "meta.json").write_text(
        json.dumps({"format": FORMAT, "global_step": global_step, "plan": plan}, indent=1)
    )


def read_meta(root: Path) -> dict:
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"{root} has no meta.json: not an mcore_ep checkpoint (trainer.resume_mode)"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{root}: checkpoint format {meta.get('format')!r}, this engine reads {FORMAT!r}"
        )
    return meta


def optim_path(root: Path, rank: int) -> Path:
    return root / "optim" / f"rank_{rank:05d}.pt"


def prune(saved: list[Path], keep: int | None) -> None:
    """Remove the oldest saved actor checkpoints beyond `keep` (rank 0)."""
    while keep and keep > 0 and len(saved) > keep:
        shutil.rmtree(saved.pop(0), ignore_errors=True)
