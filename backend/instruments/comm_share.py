"""The communication share of a step, from StepTimer's timing/* seconds, and its warning.

comm_share / add_steps compute it; CommLayout / comm_layout say where the job's ranks are
(what the advice depends on); comm_share_warning raises the RunWarning above COMM_SHARE_WARN;
max_over_ranks gives every rank the slowest rank's values.
"""

from dataclasses import dataclass

import torch

PREFIX = "timing"  # the metrics' namespace: StepTimer writes timing/<section>_s
COMM_SECTIONS = ("moe_dispatch", "moe_combine", "grad_reduce", "weight_sync")
COMM_SHARE_WARN = 0.30  # above it, communication is the first thing to fix


def comm_share(metrics: dict[str, float]) -> float:
    """(moe_dispatch + moe_combine + grad_reduce + weight_sync) / step_s, from timing/* seconds.

    What counts (COMM_SECTIONS), as the mcore_ep engine times them:
    - grad_reduce: megatron-core's finalize_model_grads (DDP's DP / expert-DP reduce-scatter,
      the TP all-reduce of layer-norm and q/k-norm grads);
    - moe_dispatch / moe_combine: only with the dispatch instrument on (`timing_dispatch`);
      on megatron-core 0.12.1 they include the local token permutation;
    - weight_sync: producing every HF tensor for the rollout, whole: the TP / EP gathers are
      interleaved with the local renaming and splitting per tensor (at world size 1 it is all
      local work).
    What does not: the distributed optimizer's parameter all-gather and grad-norm all-reduce
    (inside `optimizer`), the tensor-parallel all-reduces inside forward / backward, the DP
    token count of the loss (inside `forward_backward` / `old_log_prob`), offload / onload
    (host <-> device copies)."""
    step = metrics.get(f"{PREFIX}/step_s", 0.0)
    comm = sum(metrics.get(f"{PREFIX}/{name}_s", 0.0) for name in COMM_SECTIONS)
    return comm / step if step > 0 else 0.0


def add_steps(total: dict[str, float], step: dict[str, float]) -> dict[str, float]:
    """Two spans' timing/* as one: seconds (and unclosed sections) summed, the share anew."""
    share = f"{PREFIX}/comm_share"
    out = {k: total.get(k, 0.0) + step.get(k, 0.0) for k in {*total, *step} if k != share}
    return {**out, share: comm_share(out)}


@dataclass(frozen=True)
class CommLayout:
    """Where the job's ranks are: what the communication advice depends on.

    spanning: the parallel groups (e.g. "tp", "ep") whose ranks are on more than one node;
    device: "cpu" for gloo between processes of one box, whose share is its own."""

    world: int
    nodes: int = 1
    spanning: tuple[str, ...] = ()
    device: str = ""

    def cause(self) -> str | None:
        """What makes the share high when it is the layout itself, not the job: gloo on one
        box (device cpu, several ranks); None otherwise."""
        if self.device == "cpu" and self.world > 1 and self.nodes == 1:
            return ("the cause on one box is gloo on CPU (collectives through host memory and "
                    "sockets); it does not predict a cluster's NCCL/HCCL share")  # fmt: skip
        return None

    def advice(self) -> str:
        if self.spanning:
            return (f"{'/'.join(self.spanning)} groups span nodes: keep EP and TP inside a "
                    "node, overlap grad reduction")  # fmt: skip
        if self.world == 1:
            return ("one rank, no collective: weight_sync is the local gather and renaming of "
                    "the weights for the rollout; sync fewer, larger buckets")  # fmt: skip
        where = "one node" if self.nodes == 1 else f"{self.nodes} nodes, every TP/EP group in one"
        return (f"{where}: overlap grad reduction with backward, fewer and larger weight-sync "
                "buckets, longer micro-batches")  # fmt: skip


def comm_layout(groups) -> CommLayout:
    """This job's CommLayout from its ranks' host names (collective over the world: every rank
    calls it; backend.training.distributed.ProcessGroups)."""
    import socket

    import torch.distributed as dist

    world = dist.get_world_size(groups.world)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=groups.world)
    spanning = tuple(
        name for name in ("tp", "ep", "etp")
        if len({hosts[r] for r in dist.get_process_group_ranks(getattr(groups, name))}) > 1
    )  # fmt: skip
    device = "cpu" if dist.get_backend(groups.world) == "gloo" else ""
    return CommLayout(world, len(set(hosts)), spanning, device)


def comm_share_warning(step: int, metrics: dict[str, float], threshold: float = COMM_SHARE_WARN,
                       layout: CommLayout | None = None):  # fmt: skip
    """A RunWarning when timing/comm_share is above `threshold`, else None; its advice follows
    `layout` (nodes spanned or not; gloo on one box names itself as the cause), or is the general
    one without it.

    For the run summary pass `timer.run_metrics()`; for the routing report hand the result
    to `ExpertLoadMonitor.add_warning`."""
    from backend.monitor.run_warnings import RunWarning

    share = metrics.get(f"{PREFIX}/comm_share", comm_share(metrics))
    if share <= threshold:
        return None
    parts = ", ".join(
        f"{name} {metrics.get(f'{PREFIX}/{name}_s', 0.0):.3g}s" for name in COMM_SECTIONS
    )
    advice = layout.advice() if layout else "keep EP and TP inside a node, overlap grad reduction"
    cause = layout.cause() if layout else None
    text = (
        f"communication takes {share:.0%} of the step (over {threshold:.0%}): {parts} of "
        f"{metrics.get(f'{PREFIX}/step_s', 0.0):.3g}s; "
        + (cause if cause else f"fix communication first ({advice})")
    )
    return RunWarning("comm_share", step, text, {"comm_share": share, "threshold": threshold})


def max_over_ranks(metrics: dict[str, float], device, group=None) -> dict[str, float]:
    """Every value's maximum over the ranks of `group` (the slowest rank's seconds, the highest
    share; float32 on the wire, as every backend reduces it). Collective: every rank calls it
    with the same keys."""
    import torch.distributed as dist

    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, values.tolist(), strict=True))
