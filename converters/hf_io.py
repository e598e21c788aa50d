"""Read Hugging Face safetensors checkpoints (single file or sharded with index.json)."""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.shared.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def shard_files(ckpt_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked to exist (index.json order)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory: pass the HF checkpoint directory")
    index = root / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(
                f"{index.name} names missing shard(s) {', '.join(absent)}: re-download them into {root}"
            )
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise CheckpointError(
        f"no {SINGLE} or {INDEX} in {root}: is this an HF safetensors checkpoint?"
    )


def read_state_dict(
    ckpt_dir: str | Path, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, in memory (small models; the converters stream instead)."""
    out: dict[str, torch.Tensor] = {}
    for path in shard_files(ckpt_dir):
        try:
            with safe_open(path, framework="pt") as shard:
                for name in shard.keys():
                    tensor = shard.get_tensor(name)
                    out[name] = tensor if dtype is None else tensor.to(dtype)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{path.name} is unreadable or truncated ({err}): re-download it"
            ) from err
    return out
