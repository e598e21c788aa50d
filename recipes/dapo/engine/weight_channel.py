"""A weight channel over gloo for verl's separate rollout: `checkpoint_engine.backend=gloo`.

verl's separate_async trainer moves the actor's weights to rollout replicas on other devices
through a registered checkpoint engine (verl/checkpoint_engine/base.py); its own are nccl,
hccl and RDMA ones, none of which runs without an accelerator. This one is registered in
`CheckpointEngineRegistry` when verl imports `rollout.checkpoint_engine.custom_backend_module`
(the launcher names this module), in the driver, the actor ranks and the rollout workers.

The wire: actor rank 0 broadcasts over a gloo group of its own (a TCPStore it hosts, not the
job's default group) to every rollout worker. The other actor ranks sit out (rank -1) but
still run the weight generator to its end, since gathering the full tensors is collective over
the actor's TP/EP groups. A bucket is a header (names, shapes, dtypes: JSON), then the tensors
packed back to back (converters.buckets.pack); an empty header ends the update. Each bucket is
a new buffer, so the tensors yielded from it stay valid while the rollout consumes them.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from converters.buckets import layout, pack, unpack

NAME = "gloo"
METRICS = "weight_sync/gloo"  # what send_weights returns, logged by verl with the step
SITS_OUT = -1  # the rank build_topology gives actor ranks other than 0


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


def _host() -> str:
    import ray

    return ray.util.get_node_ip_address()


@CheckpointEngineRegistry.register(NAME)
class GlooCheckpointEngine(CheckpointEngine):
    """verl's CheckpointEngine over a gloo broadcast from actor rank 0 (see the module doc)."""

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0):
        self.bucket_size, self.is_master = bucket_size, is_master
        self.timeout = timedelta(seconds=timeout_s)
        self.store = self.group = None
        self.rank = SITS_OUT

    def prepare(self) -> dict:
        """The sender hosts the rendezvous on a port the OS picks (no race for a free one)."""
        if not self.is_master:
            return {"endpoint": None}
        host = _host()
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout
        )
        return {"endpoint": Endpoint(host, self.store.port)}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ):
        endpoint = metadata[0]["endpoint"]
        if endpoint is None:
            raise RuntimeError("gloo weight channel: actor rank 0 did not host the rendezvous")
        world = rollout_world_size + 1
        actor = {
            "rank": [0] + [SITS_OUT] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "endpoint": [endpoint] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "endpoint": [endpoint] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, endpoint: Endpoint):
        self.rank = rank
        if rank == SITS_OUT:
            return
        if self.store is None:  # a receiver: join the sender's store
            self.store = dist.TCPStore(
                endpoint.host, endpoint.port, is_master=False, timeout=self.timeout
            )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"w{world_size}", self.store), rank, world_size, self.timeout
        )

    def finalize(self):
        self.group = self.store = None
        self.rank = SITS_OUT

    @torch.no_grad()
    async def send_weights(self, weights: Iterable, global_steps: int | None = None) -> dict:
        """Broadcast every (name, tensor) in buckets; verl logs what this returns with the
        step (METRICS: tensors, MiB and seconds of this update, on the sender)."""
        start, pending, nbytes, sent = time.perf_counter(), [], 0, [0, 0]
        async for name, tensor in ensure_async_iterator(weights):
            if self.rank == SITS_OUT:
                continue  # the gather is collective: iterate, send nothing
            pending.append((name, tensor.detach().to("cpu")))
            nbytes += tensor.numel() * tensor.element_size()
            if nbytes >= self.bucket_size:
                await self._send_bucket(pending, sent)
                pending, nbytes = [], 0
        if self.rank == SITS_OUT:
            return {}
        if pending:
            await self._send_bucket(pending, sent)
        await self._broadcast_header([])  # the end
        return {f"{METRICS}/tensors": sent[0], f"{METRICS}/mib": sent[1] / 2**20,
                f"{METRICS}/seconds": time.perf_counter() - start}  # fmt: skip

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator:
        while True:
            entries = await self._broadcast_header(None)
            if not entries:
                return
            total, places = layout([(shape, _dtype(dtype)) for _, shape, dtype in entries])
            buffer = torch.empty(total, dtype=torch.uint8)
            await self._broadcast(buffer)
            for (name, _, _), place in zip(entries, places, strict=True):
                yield name, unpack(buffer, place)

    async def _send_bucket(self, named: list[tuple[str, torch.Tensor]], sent: list[int]) -> None:
        buffer, _ = pack([t for _, t in named])
        sent[0] += len(named)
        sent[1] += sum(t.numel() * t.element_size() for _, t in named)
        await self._broadcast_header([(n, list(t.shape), str(t.dtype)) for n, t in named])
        await self._broadcast(buffer)

    async def _broadcast_header(self, entries: list | None) -> list:
        """The sender's entries (None on a receiver), as every rank of the group reads them."""
        size = torch.zeros(1, dtype=torch.int64)
        raw = json.dumps(entries).encode() if entries is not None else b""
        size[0] = len(raw)
        await self._broadcast(size)
        data = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(int(size), dtype=torch.uint8)
        )
        await self._broadcast(data)
        return json.loads(bytes(data.numpy()).decode())

    async def _broadcast(self, tensor: torch.Tensor) -> None:
        work = self.group.broadcast(tensor, 0)
        await asyncio.to_thread(work.wait)


def _dtype(name: str) -> torch.dtype:
    """'torch.bfloat16' -> torch.bfloat16 (only torch dtypes, never an arbitrary attribute)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gloo weight channel: {name!r} is not a torch dtype")
    return dtype
