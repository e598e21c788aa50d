"""Run checkpoints: one directory per step, written atomically, resumed bit-exactly.

Layout: <out>/checkpoints/step_000010/{meta.json, rank_00.pt, ...} and <out>/checkpoints/latest
(the name of the newest complete step directory). Each rank saves its actor shard (model,
AdamW, LR schedule), the monitor's history and the RNG states (torch, python, numpy, the
rollout generator); rank 0 adds meta.json (step, data cursor, run settings, clocks); the
metrics of earlier steps are in <out>/metrics.jsonl, cut back on resume. A step directory is
filled under a temporary name and renamed when every rank has written, so a run killed
mid-save leaves the previous checkpoint as the latest.
"""

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or from a run with other settings."""


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def barrier(world) -> None:
    if dist.is_initialized() and dist.get_world_size(world) > 1:
        dist.barrier(group=world)


def rng_state(sampler: torch.Generator) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "sampler": sampler.get_state(),
    }


def set_rng_state(state: dict, sampler: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    sampler.set_state(state["sampler"])


def save(root: Path, step: int, rank: int, world, shard: dict, meta: dict, keep: int = 2) -> Path:
    """Collective: every rank writes its shard, rank 0 the meta, then the directory appears."""
    root.mkdir(parents=True, exist_ok=True)
    final, partial = root / _step_name(step), root / f".{_step_name(step)}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    barrier(world)
    torch.save(shard, partial / f"rank_{rank:02d}.pt")
    barrier(world)
    if rank == 0:
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _write_text_atomic(root / LATEST, final.name)
        _prune(root, keep)
    barrier(world)
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint directory, None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"{pointer} names {path.name}, which is incomplete: delete {pointer} to start over"
        )
    return path


def read_meta(path: Path, settings: dict) -> dict:
    """meta.json of a checkpoint, checked to come from a run with the same `settings`."""
    meta = json.loads((path / "meta.json").read_text())
    differ = {
        k: (meta["settings"].get(k), v) for k, v in settings.items() if meta["settings"].get(k) != v
    }
    if differ:
        shown = ", ".join(f"{k}={old} (now {new})" for k, (old, new) in differ.items())
        raise CheckpointError(
            f"{path} was written with {shown}: rerun with those settings or a new --out"
        )
    return meta


def load(path: Path, rank: int, settings: dict) -> tuple[dict, dict]:
    """(this rank's shard, meta) of a checkpoint written with the same `settings`."""
    meta = read_meta(path, settings)
    shard_path = path / f"rank_{rank:02d}.pt"
    if not shard_path.is_file():
        raise CheckpointError(f"{shard_path} is missing: resume with the world size that wrote it")
    return torch.load(shard_path, weights_only=False), meta
