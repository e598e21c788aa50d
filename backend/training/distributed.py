"""torch.distributed + megatron-core parallel state, handed out as one explicit object.

megatron-core keeps its groups in module globals (parallel_state); our code does not
read them: `init_parallel` builds them once and returns a `ProcessGroups` that the
rest of the backend receives as an argument.
"""

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from backend.platform.device import dist_backend


@dataclass(frozen=True)
class ProcessGroups:
    """The groups one rank belongs to (megatron-core's order: tp-cp-ep-dp-pp)."""

    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup  # attention data parallel (with cp folded out)
    ep: dist.ProcessGroup
    etp: dist.ProcessGroup
    edp: dist.ProcessGroup

    def size(self, name: str) -> int:
        return dist.get_world_size(getattr(self, name))

    def rank(self, name: str) -> int:
        return dist.get_rank(getattr(self, name))


# megatron-core's model-parallel sizes, each a group init_parallel sets up
_DIMS = ("tp", "pp", "cp", "ep", "etp")


class ParallelSizes(Protocol):
    """What init_parallel reads of a plan: its sizes, its world and a line naming it
    (parallel.plan.ParallelPlan is one; the planner stays above the backend)."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int

    @property
    def world(self) -> int: ...

    def describe(self) -> str: ...


def current_groups() -> ProcessGroups:
    """The groups megatron-core's parallel state holds now (after init_parallel)."""
    from megatron.core import parallel_state as ps

    return ProcessGroups(
        world=dist.group.WORLD,
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp=ps.get_data_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group(),
        edp=ps.get_expert_data_parallel_group(),
    )


def job_world() -> int:
    """This job's ranks: the process group's, or (before it exists) torchrun's / Ray's env."""
    return dist.get_world_size() if dist.is_initialized() else int(os.getenv("WORLD_SIZE", "1"))


def init_parallel(
    device: str, plan: ParallelSizes | None = None, seed: int = 1234, init_method: str | None = None
) -> ProcessGroups:
    """Join the process group (env:// under torchrun, a single rank otherwise) and set up
    megatron-core's groups for `plan` (its sizes over exactly this job's ranks, e.g. a
    parallel.plan.ParallelPlan; None: every size 1). Call `prepare_device` first.

    When megatron-core is already set up (a second engine in the same process, e.g. actor and
    reference), its groups must be the plan's."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        _join(device, init_method)
    world = dist.get_world_size()
    if plan is not None and plan.world != world:
        raise ValueError(f"plan {plan.describe()} is for {plan.world} ranks, this job has {world}")
    wanted = {d: getattr(plan, d) if plan is not None else 1 for d in _DIMS}
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=wanted["tp"],
            pipeline_model_parallel_size=wanted["pp"],
            context_parallel_size=wanted["cp"],
            expert_model_parallel_size=wanted["ep"],
            expert_tensor_parallel_size=wanted["etp"],
        )
    groups = current_groups()
    sizes = {d: groups.size(d) for d in _DIMS}
    if sizes != wanted:
        named = plan.describe() if plan is not None else " ".join(f"{d}=1" for d in _DIMS)
        raise ValueError(
            f"megatron-core is already set up with {sizes}, not plan {named}: "
            "every engine of a process (actor, reference) must use the same plan"
        )
    # No CUDA RNG on CPU: the inference tracker keeps plain torch RNG (dropout is 0 here).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=(device == "cpu"))
    torch.manual_seed(seed)
    return groups


def _join(device: str, init_method: str | None) -> None:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if init_method is None and "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is unset: launch with torchrun")
        # a lone rank needs no rendezvous: an in-process store, no port
        dist.init_process_group(dist_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(
            dist_backend(device), init_method=init_method, rank=rank, world_size=world
        )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def destroy_parallel() -> None:
    """Tear down mcore's groups and the process group (tests reuse the process)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
