"""Checkpoint saves off the step's path: megatron-core's async save, then sealing.

A save (`CheckpointWriter`, one per engine) goes through three phases:
1. written: per torch_dist directory, `dist_checkpointing.save(..., async_sharded_save=True)`
   with the cached strategy (recipes.dapo.checkpoints.save_plans) returns an AsyncRequest; the save's
   requests, joined into one (`one_writer`), are scheduled on megatron-core's
   `AsyncCallsQueue` (its default caller: a forked writer process per rank). The step goes
   on meanwhile;
2. finalized: once every rank's writers are done, megatron-core's finalize functions write
   `.metadata` and `metadata.json` (collective);
3. sealed: every rank hashes the data files it wrote (`__<rank>_*.distcp`; rank 0 also the
   small ones) on a thread, and once every rank is done, rank 0 writes each directory's
   manifest.json and then, for async saves, verl's `latest_checkpointed_iteration.txt`
   (verl leaves it to the engine when `checkpoint.async_save` is on). Only then is the
   checkpoint complete: resume never picks one without its manifests.

`poll()` (the engine calls it on every rank at each train_batch) moves a save on without
waiting; `finish()` waits for it to be sealed. A save finishes before the next one starts
and before the run's last step returns (the engine's save_checkpoint).

Why a pending write never reads state a later optimizer step changes: device tensors are
copied to host buffers of their own before the writer starts (megatron-core's preload_fn),
and the writer is a fork, whose view of host memory is a copy-on-write snapshot taken when it
starts. Host-resident state (the optimizer state under offload, everything on CPU) is thus
written as it was at the save, whatever the parent does next (tests/recipes/test_async_save.py).
Device shards are planned as views and copied only when the writer starts (megatron-core
clones CPU views at planning), so the engine offloads (verl's param offload frees that
storage) only after `commit` has started the writer.
A writer sharing the trainer's memory (a thread; megatron-core's PersistentAsyncCaller, whose
torch.multiprocessing queue shares host tensors) would read them live instead: not used.
"""

import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.dapo.checkpoints.files import write_tracker
from recipes.dapo.checkpoints.save_plans import SavePlans

KIND = "mcore-torch_dist"  # the manifests' format name (converters.manifest)
_RANK_FILE = re.compile(r"^__(\d+)_")  # torch DCP's data files: __<rank>_<n>.distcp


@dataclass
class PendingSave:
    root: Path  # verl's global_step_N/actor
    dirs: list[Path]  # the torch_dist directories to seal
    tracker: Path | None  # verl's tracker file, written once sealed (async saves)
    step: int
    hashing: Future | None = None
    on_sealed: list = field(default_factory=list)  # rank 0: called with the root once sealed


def own_files(root: Path, rank: int, world: int) -> list[str]:
    """The files of a written torch_dist directory this rank hashes: the data files it wrote,
    and on rank 0 every other file (common.pt, .metadata, metadata.json, ours)."""
    from converters.manifest import file_names

    def writer(name: str) -> int:
        match = _RANK_FILE.match(name)
        return int(match.group(1)) if match and int(match.group(1)) < world else 0

    return [n for n in file_names(root) if writer(n) == rank]


def hash_own_files(dirs: list[Path], rank: int, world: int) -> list[dict]:
    from converters.manifest import file_entries

    return [file_entries(d, own_files(d, rank, world)) for d in dirs]


class CheckpointWriter:
    """Writes and seals the engine's checkpoints; at most one save in flight."""

    def __init__(self, dp_group, device: torch.device):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.plans = SavePlans(dp_group, device)
        self.device = device
        self._queue = AsyncCallsQueue()  # forked writers (TemporalAsyncCaller): see above
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-sha256")
        self._requests: list = []  # this save's AsyncRequests, one per directory
        self.pending: PendingSave | None = None

    def write(self, kind: str, sharded_state_dict: dict, out: Path, async_save: bool) -> None:
        """One torch_dist directory: written now, or planned for the next commit's writer,
        which starts with a snapshot of the state as it is now (collective)."""
        if self.pending is not None:
            raise RuntimeError("a checkpoint save is still pending: finish() it first")
        out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        request = self.plans.save(kind, sharded_state_dict, out, async_save)
        if request is not None:
            self._requests.append(request)

    def commit(self, pending: PendingSave) -> None:
        """The directories written since the last commit make this save; the small files
        (meta.json, schedule.json, ...) must be in place by now. Starts the writer."""
        if self._requests:
            self._queue.schedule_async_request(one_writer(self._requests))
        self._requests, self.pending = [], pending

    def poll(self) -> bool:
        """Move the pending save on without waiting (collective); True when none is left."""
        return self._advance(blocking=False)

    def finish(self) -> None:
        """Wait until the pending save (if any) is sealed (collective)."""
        self._advance(blocking=True)

    def _advance(self, blocking: bool) -> bool:
        p = self.pending
        if p is None:
            return True
        if p.hashing is None:
            try:
                self._queue.maybe_finalize_async_calls(blocking=blocking)
            except Exception:
                self.pending = None  # a failed write is never sealed: resume skips it
                raise
            if self._queue.get_num_unfinalized_calls():
                return False
            rank, world = dist.get_rank(), dist.get_world_size()
            p.hashing = self._hasher.submit(hash_own_files, p.dirs, rank, world)
        if not self._all_ranks(blocking or p.hashing.done()):
            return False
        self._seal(p, p.hashing.result())
        self.pending = None
        return True

    def _all_ranks(self, done: bool) -> bool:
        flag = torch.tensor([int(done)], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _seal(self, p: PendingSave, entries: list[dict]) -> None:
        """Rank 0: every rank's file entries -> each manifest.json, then the tracker."""
        from converters.manifest import write_files_manifest

        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(entries, gathered, dst=0)  # our own dicts of names and hashes
        if dist.get_rank() != 0:
            return
        for i, d in enumerate(p.dirs):
            files = {name: e for rank_entries in gathered for name, e in rank_entries[i].items()}
            write_files_manifest(d, files, KIND, source=str(p.root))
        if p.tracker is not None:
            write_tracker(p.tracker, p.step)
        for callback in p.on_sealed:
            callback(p.root)

    def close(self) -> None:
        self.finish()
        self._hasher.shutdown()


def one_writer(requests: list):
    """The AsyncRequests of one save's directories as one, written in turn by one forked
    writer. megatron-core's torch_dist writers hand their results back through one queue
    per process (filesystem_async's `_get_write_results_queue`), read by each directory's
    finalize in the order they run; two writers running at once can swap their results (the
    model's .metadata then names the optimizer's files), one writer in order cannot."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    def stage():  # in the trainer, before the fork: device tensors copied to the host
        return [_staged(r) for r in requests if r.async_fn is not None]

    def write_all(_, staged, __):
        for fn, args, kwargs in staged:
            fn(*args, **kwargs)

    finalize = [fn for r in requests for fn in r.finalize_fns]
    return AsyncRequest(write_all, (None, None, None), finalize, preload_fn=stage)


def _staged(request) -> tuple:
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[1] = request.preload_fn()  # megatron's callers put the write buckets there
    return request.async_fn, args, request.async_fn_kwargs
