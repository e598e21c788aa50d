"""megatron-core's save strategy per checkpoint directory, kept across saves while the sharded
structure is unchanged: the save plan is built once, not at every save.

What a torch_dist save plans before any byte is written, and what is cached:
- the sharding check (`validate_sharding_integrity`: every rank's shard metadata gathered,
  rank 0 checks that the main replicas tile every tensor exactly once): on a new strategy's
  first save only (`validate_access_integrity`, or the wrapper's own check);
- the distribution of the writes over the data-parallel replicas:
  `FullyParallelSaveStrategyWrapper` computes it on its first save and keeps it
  (`do_cache_distribution`);
- torch DCP's local and global plan and the checkpoint's global metadata:
  `TorchDistSaveShardedStrategy(cached_metadata=True)` gathers them on the first save,
  checks that the second one agrees, and skips the gather from the third on.
Both caches assume the same structure, so a strategy is reused only while every rank's
`structure_fingerprint` is the one it was built for (one int all-reduced per save); when any
rank's differs (another plan, a parameter added), all ranks start a new strategy, which
checks the sharding again. Both megatron-core releases (0.12.1, 0.16.1) have these classes
with these arguments.
"""

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from backend.platform.compat import async_save_kwargs


def structure_fingerprint(sharded_state_dict: dict) -> str:
    """sha256 of what a save plan depends on: every sharded entry's key, kind, global shape,
    offset, fragmentation, replica id, dtype and flattened range, and the common keys."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    digest = hashlib.sha256()
    for value in nested_values(sharded_state_dict):
        digest.update(repr(_structure(value)).encode())
    return digest.hexdigest()


def _structure(value) -> tuple:
    if not hasattr(value, "key"):  # a common (non-sharded) entry: only its type
        return (type(value).__name__,)
    data = getattr(value, "data", None)
    parts = [type(value).__name__, value.key, getattr(value, "replica_id", None)]
    for name in ("global_shape", "global_offset", "axis_fragmentations", "flattened_range"):
        parts.append(getattr(value, name, None))
    parts.append(getattr(value, "dtype", None) or getattr(data, "dtype", None))
    if isinstance(data, torch.Tensor):
        parts.append(tuple(data.shape))
    return tuple(map(str, parts))


@dataclass
class SavePlans:
    """One cached strategy per directory kind ("model", "optim"); `save` times each call."""

    dp_group: object  # the data-parallel group the writes of replicated shards spread over
    device: torch.device  # where this rank's collectives run
    _strategies: dict = field(default_factory=dict)
    _fingerprints: dict = field(default_factory=dict)
    plan_s: dict = field(default_factory=dict)  # per kind, the last save() until it returned

    def save(self, kind: str, sharded_state_dict: dict, out: Path, async_save: bool):
        """dist_checkpointing.save with this kind's strategy: an AsyncRequest to schedule
        (async_save) or None (written). Collective."""
        from megatron.core import dist_checkpointing

        start = time.perf_counter()
        fresh = self._renew(kind, structure_fingerprint(sharded_state_dict))
        strategy = self._strategies[kind]
        request = dist_checkpointing.save(
            sharded_state_dict,
            str(out),
            sharded_strategy=strategy,
            # a new strategy's first save checks the sharding; the DP wrapper does it itself
            validate_access_integrity=fresh and not _spreads(strategy),
            async_sharded_save=async_save,
            **async_save_kwargs(),
        )
        self.plan_s[kind] = time.perf_counter() - start
        return request

    def cached(self, kind: str) -> bool:
        return kind in self._strategies

    def _renew(self, kind: str, fingerprint: str) -> bool:
        """A new strategy for `kind` unless every rank's structure is the cached one's."""
        same = torch.tensor([int(self._fingerprints.get(kind) == fingerprint)], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if same.item():
            return False
        self._strategies[kind] = new_strategy(self.dp_group)
        self._fingerprints[kind] = fingerprint
        return True


def new_strategy(dp_group):
    """megatron-core's torch_dist save strategy with both caches on; with DP replicas, their
    writes spread over them (the wrapper checks the sharding on its first save, and, with
    one replica, on every save: so it is left out there)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    if dist.get_world_size(dp_group) == 1:
        return base
    return FullyParallelSaveStrategyWrapper(base, dp_group, do_cache_distribution=True)


def _spreads(strategy) -> bool:
    return hasattr(strategy, "base_strategy")
