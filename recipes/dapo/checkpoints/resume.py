"""A resume directory is data, never code: every pickle verl or the engine will load from it is
checked first, `data.pt` included.

verl 0.9.1 resumes from `global_step_N/` (`_load_checkpoint` in `trainer/ppo/v1/trainer_base.py`
and in `trainer/ppo/ray_trainer.py`): it calls the engine's `load_checkpoint` on `actor/` in
every actor worker and waits for it, and only then unpickles `data.pt`, the StatefulDataLoader
state, in the driver with `torch.load(weights_only=False)`. The check runs in two places:
- the launcher, before Ray starts (`check_resume`): `data.pt` and every pickle of the actor's
  torch_dist checkpoints, so that a crafted file stops the run in one line (exit 2) before a
  minute of start-up;
- the engine's `load_checkpoint` (`weights.check_sealed`, rank 0), which verl runs before its
  torch.load in both trainers: the manifest over every byte (too slow to read twice for a 30B
  checkpoint, so the launcher leaves it to the engine), the allow-lists again and `data.pt`,
  for a trainer started without the launcher or a file changed after the launcher looked.

`data.pt` is the one pickle here that the project does not write. A genuine one (torchdata's
StatefulDataLoader, verl's RandomSampler or SequentialSampler, 0 or more workers; a real run's
and saves made with verl's dataloader directly, tests/recipes/test_resume.py) pickles plain
containers and one uint8 tensor, the sampler's torch.Generator state: exactly
`converters.pickles.safe_pickle.TORCH_SAVE_ALLOWED`.
"""

import re
from pathlib import Path

from backend.shared.errors import CheckpointError
from converters.pickles.fsdp_state import check_fsdp_checkpoint
from converters.pickles.queue_state import check_queue_state
from converters.pickles.safe_pickle import check_dist_checkpoint, check_torch_save
from recipes.dapo.checkpoints.files import (
    ACTOR,
    MODEL_DIR,
    OPTIM_STATE,
    TRACKER,
    check_complete,
    is_complete,
    is_fsdp,
    unfinished_error,
    write_tracker,
)
from recipes.dapo.job import overrides

DATA_STATE = "data.pt"
QUEUE_STATE = "transfer_queue"  # verl's async trainer modes pickle it (pickle.load on resume)
_DATA_WHAT = "verl's dataloader state (plain containers and tensors)"
_DATA_FIX = (
    "restore it from a trusted copy, or delete it to restart the data order from the first "
    "batch (verl then starts its dataloader afresh)"
)


def check_data_state(step_dir: Path) -> None:
    """`data.pt` of a global_step_N directory, if there is one, through the exact allow-list."""
    path = Path(step_dir) / DATA_STATE
    if path.exists():
        check_torch_save(path, _DATA_WHAT, _DATA_FIX)


def check_step_dir(step_dir: Path, trainer_mode: str = "sync") -> None:
    """Everything verl and the engine unpickle when resuming from `step_dir`."""
    step_dir = Path(step_dir)
    check_data_state(step_dir)
    if is_fsdp(step_dir / ACTOR):  # verl's FSDP engine's torch.save files (--engine fsdp)
        check_fsdp_checkpoint(step_dir / ACTOR)
    for sub in (MODEL_DIR, OPTIM_STATE):
        if (step_dir / ACTOR / sub / ".metadata").exists():
            check_dist_checkpoint(step_dir / ACTOR / sub)
    if trainer_mode != "sync":
        check_queue_state_of(step_dir)


def check_queue_state_of(step_dir: Path) -> None:
    """verl's async modes unpickle `transfer_queue/` (plain pickle) after the actor's load:
    every pickle there through its exact allow-list (converters.pickles.queue_state)."""
    if (Path(step_dir) / QUEUE_STATE).is_dir():
        check_queue_state(Path(step_dir) / QUEUE_STATE)


def resume_dir(groups: dict[str, dict], cwd: Path) -> Path | None:
    """The global_step_N directory verl will resume from with these overrides, found as verl
    finds it (`find_latest_ckpt_path` in verl/utils/checkpoint/checkpoint_manager.py, paths
    relative to the trainer's working directory `cwd`), or None: a fresh start."""
    mode = str(overrides.value_of(groups, "trainer.resume_mode") or "auto")
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = overrides.value_of(groups, "trainer.resume_from_path")
        return None if path in (None, "null") else cwd / str(path)
    local_dir = overrides.value_of(groups, "trainer.default_local_dir")
    root = cwd / str(local_dir)
    if local_dir is None or not (root / TRACKER).exists():
        return None
    text = (root / TRACKER).read_text(errors="replace")
    try:
        step = root / f"global_step_{int(text)}"
    except ValueError:
        raise CheckpointError(
            f"{root / TRACKER} holds {text.strip()[:40]!r}, not a step number: write the step "
            "to resume from (N of a global_step_N there), or remove it to start afresh"
        ) from None
    return step if step.exists() else None


def _step(path: Path) -> int:
    return int(path.name.removeprefix("global_step_"))


def _saved_steps(root: Path) -> list[Path]:
    """verl's global_step_N directories with an actor checkpoint, oldest first."""
    found = [p for p in root.glob("global_step_*") if re.fullmatch(r"global_step_\d+", p.name)]
    return sorted((p for p in found if (p / ACTOR).is_dir()), key=_step)


def _unfinished(step_dir: Path) -> bool:
    return not is_complete(step_dir / ACTOR)


_WHY = "was not completely written (the run stopped while saving it; the next save of that step replaces it)"


def settle_unfinished(groups: dict[str, dict], cwd: Path) -> str | None:
    """Before verl resumes: a checkpoint a stopped run left half written is never resumed
    from. resume_mode=auto: the newest complete one is (verl's tracker is pointed at it when
    it named a half-written one; removed when none is complete: a fresh start); returns the
    one line saying which and why, or None when nothing was half written. resume_path naming
    a half-written one: refused in one line."""
    mode = str(overrides.value_of(groups, "trainer.resume_mode") or "auto")
    if mode == "resume_path":
        step_dir = resume_dir(groups, cwd)
        actor = None if step_dir is None else step_dir / ACTOR
        if actor is not None and actor.is_dir() and _unfinished(step_dir):
            if is_fsdp(actor):
                raise unfinished_error(actor)
            subs = [actor / sub for sub in (MODEL_DIR, OPTIM_STATE)]
            check_complete([d for d in subs if d.is_dir()] or subs[:1])
        return None
    local_dir = overrides.value_of(groups, "trainer.default_local_dir")
    if mode != "auto" or local_dir is None:
        return None
    saved = _saved_steps(cwd / str(local_dir))
    unfinished = [d for d in saved if _unfinished(d)]
    if not unfinished:
        return None
    tracked = resume_dir(groups, cwd)
    if tracked is None:
        return f"starting afresh (no checkpoint to resume from): {unfinished[-1]} {_WHY}"
    if not _unfinished(tracked):
        newer = [d for d in unfinished if _step(d) > _step(tracked)]
        return (
            f"resuming from {tracked}, the newest complete checkpoint: {newer[-1]} {_WHY}"
            if newer
            else None
        )
    older = [d for d in saved if _step(d) < _step(tracked) and not _unfinished(d)]
    tracker = tracked.parent / TRACKER
    if not older:
        tracker.unlink()
        return f"starting afresh (no complete checkpoint): {tracked} {_WHY}"
    write_tracker(tracker, _step(older[-1]))
    return f"resuming from {older[-1]}, the newest complete checkpoint: {tracked} {_WHY}"


def resuming_line(step_dir: Path) -> str:
    """The console's line naming the checkpoint a relaunch continues from (after a kill the
    tracker names the newest complete one: recipes.dapo.checkpoints.async_save seals it last)."""
    queue = (Path(step_dir) / QUEUE_STATE).is_dir()
    held = ", with the prompts verl's queue held (transfer_queue/, checked)" if queue else ""
    return f"resuming from {step_dir}{held}"


def check_resume(groups: dict[str, dict], cwd: Path) -> Path | None:
    """Before anything starts: the directory verl will resume from (None: none), checked."""
    step_dir = resume_dir(groups, cwd)
    if step_dir is not None:
        mode = str(overrides.value_of(groups, "trainer.v1.trainer_mode") or "sync")
        check_step_dir(step_dir, mode)
    return step_dir
