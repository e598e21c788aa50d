"""Where a checkpoint's files lie and when it counts as complete: names and checks only.

verl's layout under `trainer.default_local_dir`:
  latest_checkpointed_iteration.txt  verl's tracker: the newest saved step (for async saves
                    written by the engine once the save is sealed, recipes.dapo.checkpoints.async_save)
  global_step_N/actor/  the engine's checkpoint (save_checkpoint):
    model/dist_ckpt/  megatron-core torch_dist checkpoint of the model (dist_checkpointing.save
                    of the local-spec GPTModel's sharded_state_dict: every rank writes its
                    shards, loadable at any TP/EP plan) + hf_config.json (the model's
                    config.json). `python -m converters mcore-to-hf <that actor dir> OUT
                    --template HF_DIR` exports it to HF safetensors.
    optim/dist_ckpt/  megatron-core's sharded distributed-optimizer checkpoint (master weights,
                    Adam moments and steps; dist_checkpointing, every rank writes its shards)
    optim/schedule.json  the learning-rate schedule's update counter (resume with the same plan).
    meta.json       format, global step, plan (recipes.dapo.engine.weights).
  global_step_N/data.pt  verl's dataloader state (vetted by recipes.dapo.checkpoints.resume).

A torch_dist directory is complete once it carries its manifest.json (written when the save
is sealed). The launcher reads this module before anything heavy is imported: it imports no
megatron-core and none of the engine's modules.
"""

import re
from pathlib import Path

from backend.shared.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"  # verl.utils.checkpoint: the newest saved step
ACTOR = "actor"
MODEL_DIR = "model/dist_ckpt"  # verl's layout, which converters.dist_read finds
OPTIM_DIR = "optim"
OPTIM_STATE = f"{OPTIM_DIR}/dist_ckpt"  # megatron's sharded optimizer state + schedule.json
META = "meta.json"


def is_complete(root: Path) -> bool:
    """A saved actor checkpoint whose every torch_dist directory carries its manifest.json:
    written to the end and sealed (recipes.dapo.checkpoints.async_save). A save cut short has none. verl's
    FSDP engine's (`--engine fsdp`, its fsdp_config.json there): every rank's files."""
    from converters.manifest import NAME

    if is_fsdp(root):
        from converters.pickles.fsdp_state import is_complete as fsdp_complete

        return fsdp_complete(root)
    dirs = [d for d in (root / MODEL_DIR, root / OPTIM_STATE) if d.is_dir()]
    return (root / MODEL_DIR).is_dir() and all((d / NAME).is_file() for d in dirs)


def is_fsdp(root: Path) -> bool:
    """An actor checkpoint of verl's FSDP engine (converters.pickles.fsdp_state), not ours."""
    from converters.pickles.fsdp_state import CONFIG

    return (root / CONFIG).is_file()


def unfinished_error(where: Path) -> CheckpointError:
    return CheckpointError(
        f"{where} was not completely written (no manifest.json: the run stopped while saving "
        "it): resume from a complete checkpoint (trainer.resume_mode=auto picks the newest) "
        "or from an earlier global_step_N (trainer.resume_from_path)"
    )


def check_complete(dirs: list[Path]) -> None:
    from converters.manifest import NAME

    for d in dirs:
        if not (d / NAME).is_file():
            raise unfinished_error(d)


def is_sealed(root: Path) -> bool:
    """Whether every rank finished writing the actor checkpoint `root` (seal wrote its
    manifests: the model's, and the optimizer's where it was saved)."""
    from converters.manifest import NAME

    optim = root / OPTIM_STATE
    return (
        (root / META).is_file()
        and (root / MODEL_DIR / NAME).is_file()
        and (not optim.exists() or (optim / NAME).is_file())
    )


def tracker_of(root: Path) -> Path | None:
    """verl's tracker file for an actor checkpoint in its layout (<dir>/global_step_N/actor)."""
    if root.name != ACTOR or not re.fullmatch(r"global_step_\d+", root.parent.name):
        return None
    return root.parent.parent / TRACKER


def write_tracker(path: Path, step: int) -> None:
    """verl's latest_checkpointed_iteration.txt, replaced atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(str(step))
    tmp.replace(path)
