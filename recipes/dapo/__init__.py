"""DAPO on verl with our megatron-core actor: the cluster path.

- engine.py: the verl engine (backend "mcore_ep", devices cuda / npu / cpu), registered with
  verl's EngineRegistry when imported; verl imports it in every worker through
  `actor_rollout_ref.model.external_lib`.
- config.py: the verl config dataclasses of that engine (`_target_` of the actor section).
- overrides.py + fit.py: the verl overrides for Qwen3-30B-A3B on 4x8 Ascend A2 and 4x8 H100,
  grouped by concern, offload decided by the memory model of `parallel/`.
- launch.py: `python -m recipes.dapo` / scripts/train_mcore.sh: runs the resolved job on the
  running Ray cluster (or the local CPU run); resolution.py: arguments, plan check, environment,
  the resolved config; dry_run.py: what the dry run prints.
See recipes/README.md.
"""

BACKEND = "mcore_ep"  # the EngineRegistry backend name (actor.strategy)


def check_actor_cp(cp: int) -> None:
    """The one plan limit of this actor beyond megatron-core's and the model's: no context
    parallelism (its batches and router instruments do not split sequences)."""
    if cp != 1:
        from parallel.plan import PlanError

        raise PlanError(
            f"cp={cp}: the mcore_ep actor runs cp=1; scale with --tp, --pp and --ep "
            "(python -m parallel --auto)"
        )
