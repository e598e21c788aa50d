"""The engine's checkpoint saves and loads (verl's save_checkpoint / load_checkpoint): what is
written where (recipes.dapo.checkpoints.files), in the background or not (recipes.dapo.checkpoints.async_save), what
a load checks before megatron-core reads anything, and the resumed run's log line."""

import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist

from backend.shared.errors import CheckpointError
from converters.convert import HF_CONFIG  # the config.json copy the export reads
from recipes.dapo.checkpoints.async_save import CheckpointWriter, PendingSave
from recipes.dapo.checkpoints.files import (
    MODEL_DIR,
    OPTIM_DIR,
    OPTIM_STATE,
    check_complete,
    tracker_of,
)
from recipes.dapo.engine import weights

logger = logging.getLogger(__name__)


def last_step(global_step: int, total_steps: int, trained: bool) -> bool:
    """The run's last save (verl saves at its last step; nothing polls the writer after
    it): counted in trainer steps (verl's total_training_steps), not optimizer updates,
    which a resumed run's steps without an update (trainer.critic_warmup) leave behind."""
    return not trained or (total_steps > 0 and int(global_step) >= total_steps)


class CheckpointIO:
    """Saves and loads the engine's model and optimizer; `onload`/`offload` are the engine's
    (timed) moves of its state, `param_offload`/`optimizer_offload` its offload settings."""

    def __init__(
        self,
        writer: CheckpointWriter,
        module,
        optim,
        routing,
        plan,
        experts: str,
        model_config,
        onload: Callable[..., None],
        offload: Callable[..., None],
        param_offload: bool,
        optimizer_offload: bool,
    ):
        self.writer, self.module, self.optim, self.routing = writer, module, optim, routing
        self.plan, self.experts, self.model_config = plan, experts, model_config
        self.onload, self.offload = onload, offload
        self.param_offload, self.optimizer_offload = param_offload, optimizer_offload
        self.saved: list[Path] = []  # sealed saves, oldest first (max_ckpt_to_keep)
        self.checked: tuple | None = None  # (root, contents, files' fingerprint) checked early

    def save(
        self,
        root: Path,
        global_step: int,
        keep: int | None,
        contents: set[str],
        async_save: bool,
        total_steps: int,
    ) -> None:
        """The previous save is sealed first; this one is written in the background when
        `async_save` (sealed later, at a train_batch), except at the run's last step, which
        returns sealed. async_save: verl's, which then leaves the tracker to the engine."""
        self.writer.finish()
        rank = dist.get_rank()
        with_optim = self.optim is not None and "optimizer" in contents
        in_background = async_save and not last_step(
            global_step, total_steps, self.optim is not None
        )
        weights.clear_for_save(root)
        self.onload(model=self.param_offload, optimizer=False, grad=False)
        model_dir = root / MODEL_DIR
        self.writer.write("model", self.module.sharded_state_dict(), model_dir, in_background)
        if rank == 0:
            config_json = Path(self.model_config.local_hf_config_path) / "config.json"
            shutil.copyfile(config_json, model_dir / HF_CONFIG)
            weights.save_meta(root, global_step, self.plan.record(), self.experts)
            self.routing.write_report(root / "moe_report.json", model=str(self.model_config.path))
        if with_optim:
            # params stay loaded: the sharded optimizer state refers to the model's shards
            self.onload(model=False, optimizer=self.optimizer_offload, grad=False)
            state_dir = root / OPTIM_STATE
            self.writer.write("optim", self.optim.sharded_for_save(), state_dir, in_background)
            if rank == 0:
                self.optim.write_schedule(root / OPTIM_DIR)
        dirs = [model_dir] + ([root / OPTIM_STATE] if with_optim else [])
        tracker = tracker_of(root) if async_save else None
        sealed = partial(self._sealed, keep=keep)
        self.writer.commit(PendingSave(root, dirs, tracker, global_step, on_sealed=[sealed]))
        # offloaded only once the writer has its copy: until then the plan's write items are
        # views of the device shards (copied to the host when the writer starts), whose
        # storage a param offload frees
        optimizer = with_optim and self.optimizer_offload
        self.offload(model=self.param_offload, optimizer=optimizer)
        if not in_background:
            self.writer.finish()

    def _sealed(self, root: Path, keep: int | None) -> None:
        self.saved.append(root)
        weights.prune(self.saved, keep)

    def check_early(self, root: Path, contents: set[str]) -> None:
        """The checks of `load`, when the engine starts (the launcher names the checkpoint
        verl will resume from): a damaged one ends the run before the rollout starts. The
        load then skips the byte check (a full read of every file) if no file changed since.
        Collective."""
        self._check(root, contents)
        if dist.get_rank() == 0:  # rank 0 checks the bytes, so its files decide (load)
            self.checked = (root.resolve(), frozenset(contents), _fingerprint(root))

    def _check(self, root: Path, contents: set[str], sealed: bool = True) -> tuple[dict, bool]:
        """(meta.json, whether the optimizer state loads) after the checks: complete, the
        same plan and experts for optimizer state, and (sealed) every file against its
        manifest and every pickle against the allow-list."""
        meta = weights.read_meta(root)
        with_optim = self.optim is not None and "optimizer" in contents
        saved = (meta["plan"], meta.get("experts", "sequential"))
        if with_optim and saved != (self.plan.record(), self.experts):
            raise CheckpointError(
                f"{root} holds optimizer state for plan {saved[0]} with {saved[1]} experts, this "
                f"run is {self.plan.record()} with {self.experts} experts: resume with the same plan and "
                "experts setting, or export its weights (python -m converters mcore-to-hf) and "
                "start from them"
            )
        dirs = [root / MODEL_DIR] + ([root / OPTIM_STATE] if with_optim else [])
        if with_optim:
            weights.check_optim_dir(root)
        check_complete(dirs)
        if sealed:
            # verl's global_step_N/actor: data.pt beside it is verl's, unpickled after the load
            weights.check_sealed(dirs, step_dir=root.parent)
        return meta, with_optim

    def load(self, root: Path, contents: set[str]) -> None:
        """A save into the engine, checked first (`_check`; the byte check skipped when
        `check_early` did it and no file changed since); the loaded state goes back to the
        host as it was."""
        self.writer.finish()
        unchanged = [
            dist.get_rank() == 0
            and self.checked == (root.resolve(), frozenset(contents), _fingerprint(root))
        ]
        dist.broadcast_object_list(unchanged, src=0)  # rank 0's files decide, as they check
        meta, with_optim = self._check(root, contents, sealed=not unchanged[0])
        self.onload(
            model=self.param_offload,
            optimizer=with_optim and self.optimizer_offload,
            grad=False,
        )
        weights.load_model(self.module, root / MODEL_DIR)
        self.routing.trainer_steps = int(meta.get("global_step", 0))  # the report's step axis
        if self.optim:
            self.optim.reload_model_params()
        if with_optim:
            self.optim.load(root / OPTIM_DIR)
        self._log_loaded(root, meta)
        # as verl's megatron engine: the loaded state goes back to the host until it is used
        self.offload(
            model=self.param_offload,
            optimizer=self.optim is not None and self.optimizer_offload,
        )

    def _log_loaded(self, root: Path, meta: dict) -> None:
        """One line on rank 0 of what the load left in the engine: the checkpoint's global step
        (meta.json), the optimizer's update count and its weights' norm (rank 0's shards), so
        a resumed run shows it starts from the checkpoint, not from the HF weights."""
        if dist.get_rank() != 0:
            return
        norm = weights.weights_norm(self.module)
        update = self.optim.updates if self.optim else None
        logger.warning(
            "mcore_ep: resumed from %s: global step %s, optimizer update %s, weights norm "
            "%.9e (rank 0's parameters)", root, meta.get("global_step"), update, norm,
        )  # fmt: skip


def _fingerprint(root: Path) -> tuple:
    """(path, size, mtime) of every file of a step's checkpoint (global_step_N: the actor's
    files and verl's data.pt): what a change after `check_early` would change."""
    files = sorted(p for p in root.parent.rglob("*") if p.is_file())
    return tuple((str(p), st.st_size, st.st_mtime_ns) for p in files if (st := p.stat()))
