"""DAPO on verl with our megatron-core actor: the cluster path, by concern.

- job/: the verl overrides for Qwen3-30B-A3B on 4x8 Ascend A2 and 4x8 H100 grouped by concern
  (a JobSpec makes them), offload decided by parallel/'s memory model, the trainer modes, which
  actor trains (ours or verl's FSDP2).
- checkpoints/: where a checkpoint's files lie, background saves and their sealing, resume as
  data.
- engine/: what runs inside verl's workers: the `mcore_ep` engine (verl_engine.py, registered
  with verl's EngineRegistry when verl imports it through `actor_rollout_ref.model.external_lib`),
  its config dataclasses, passes, batches, log-probs, routes, guards, metrics, weights.
- cluster/: the job's processes and environment, Ray, a lost node, the run's scope.
- console/: what a person sees of a run.
The launcher over this and the embedded CPU run is recipes.launcher. See recipes/README.md.
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
