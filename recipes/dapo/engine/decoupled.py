"""Decoupled PPO in verl's separate_async with the mcore_ep engine.

In separate_async verl recomputes the old log-probs of a sync cycle's later mini-batches with
the weights that started the cycle (pi_old): its trainer calls the actor workers'
`save_model_to_cpu(n)` / `restore_model_from_cpu(n)` / `clear_cpu_model(n)`, which verl's
DetachActorWorker implements for its own strategies only (fsdp, fsdp2, veomni, megatron;
anything else raises NotImplementedError at step 1). verl's trainer registry
(`register_trainer`) is the hook: `McoreSeparateAsyncTrainer`, registered as
`mcore_separate_async` (the launcher sets that mode, with its config section an alias of
`trainer.v1.separate_async`), is verl 0.9.1's separate_async trainer whose actor workers are
`McoreDetachActorWorker`: verl's worker, with those three calls answered by `HostSnapshots`
for our engine. verl imports this module in every process of such a run
(VERL_USE_EXTERNAL_MODULES), so the trainer is registered before verl looks it up.

Memory: one host copy of the model at most (recipes.dapo.engine.host_snapshots).

This relies on verl 0.9.1's call order (trainer_separate_async.py, `_compute_old_log_prob`):
save(0) at a cycle's first step; save(k), restore(0), the pass, restore(k), clear(k) at
step k. `check_verl` refuses in one line at import when the version or those sources differ.
"""

import inspect

import verl
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

from recipes.dapo import BACKEND
from recipes.dapo.engine.host_snapshots import HostSnapshots

VERL_VERSION = "0.9.1"
MODE = "mcore_separate_async"

# what the trainer's decoupled pass calls, in this order, in verl 0.9.1
CALL_ORDER = (
    "self.actor_rollout_wg.save_model_to_cpu(self.local_trigger_step)",
    "self.actor_rollout_wg.restore_model_from_cpu(0)",
    "self.actor_rollout_wg.restore_model_from_cpu(self.local_trigger_step)",
    "self.actor_rollout_wg.clear_cpu_model(self.local_trigger_step)",
)


def check_verl() -> None:
    """Refuse in one line unless verl is the release whose trainer this module extends."""
    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(
            f"{MODE} extends verl {VERL_VERSION}'s separate_async trainer; this is verl "
            f"{verl.__version__}: install verl=={VERL_VERSION} or use the bypass mode"
        )
    source = inspect.getsource(PPOTrainerSeparateAsync._compute_old_log_prob)
    positions = [source.find(call) for call in CALL_ORDER]
    if -1 in positions or positions != sorted(positions):
        raise RuntimeError(
            f"{MODE}: verl {verl.__version__}'s _compute_old_log_prob no longer calls "
            "save/restore/clear as HostSnapshots expects: install verl==0.9.1"
        )


def with_our_worker(mapping: dict, theirs: type, ours: type) -> None:
    """Each role verl gave its DetachActorWorker (a Ray actor class) gets ours instead."""
    import ray

    for role, actor_class in list(mapping.items()):
        if getattr(actor_class, "__ray_actor_class__", None) is theirs:
            mapping[role] = ray.remote(ours)


check_verl()  # before verl's classes are extended below


class McoreDetachActorWorker(DetachActorWorker):
    """verl's DetachActorWorker; our engine's weights kept by HostSnapshots."""

    def _snapshot(self, op: str, n: int) -> None:
        """HostSnapshots' `op`, the engine's weights loaded first when it touches them (verl
        calls these while they are offloaded: their buffers freed)."""
        engine = self.actor.engine
        if getattr(self, "_host_snapshots", None) is None:
            self._host_snapshots = HostSnapshots(engine.module)  # views: valid across offload
        snapshots = self._host_snapshots
        if not snapshots.touches_weights(op, n):
            getattr(snapshots, op)(n)
            return
        with engine.weights_loaded():
            getattr(snapshots, op)(n)

    def _ours(self) -> bool:
        return self.config.actor.strategy == BACKEND

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_model_to_cpu(self, n):
        if not self._ours():
            return super().save_model_to_cpu(n)
        self._snapshot("save", n)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def restore_model_from_cpu(self, n):
        if not self._ours():
            return super().restore_model_from_cpu(n)
        self._snapshot("restore", n)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clear_cpu_model(self, n):
        if not self._ours():
            return super().clear_cpu_model(n)
        self._snapshot("clear", n)


@register_trainer(MODE)
class McoreSeparateAsyncTrainer(PPOTrainerSeparateAsync):
    """verl's separate_async trainer with McoreDetachActorWorker as its actor workers."""

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        with_our_worker(self.role_worker_mapping, DetachActorWorker, McoreDetachActorWorker)
