"""Write a megatron-core torch_dist checkpoint one parameter at a time.

`dist_checkpointing.save` runs as usual (factories, sharding validation, common.pt,
metadata.json) with a save strategy of our own for the sharded part. megatron's
TorchDistSaveShardedStrategy does not fit a single-process conversion: it resolves every
tensor before writing (the whole model in memory), and torch's ShardedTensor and DCP
global-plan checks compare every chunk with every other (~10^8 pairs for Qwen3-30B-A3B's
18,771 chunks at world size 1: minutes of CPU before the first byte). This strategy writes
the same format linearly: each parameter is materialised (`materialize(name)`) when the
writer reaches it, its chunks are serialised as DCP does (torch.save per chunk, in one
`__0_0.distcp`), and the DCP `.metadata` is built from the layout and the write offsets.
"""

import io
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from converters.dist_layout import Layout
from converters.manifest import HashingStream
from converters.output import open_output

DATA_FILE = f"__0_0{DEFAULT_SUFFIX}"
METADATA = ".metadata"


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """t with a storage of exactly its bytes: torch.save writes a view's whole storage.

    A contiguous view (a GLU gate/up half) is re-wrapped in place with frombuffer; only a
    strided one is copied.
    """
    if t.untyped_storage().nbytes() == t.nbytes:
        return t
    if not t.is_contiguous():
        return t.clone()
    start = t.storage_offset() * t.element_size()
    raw = memoryview(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy())
    return torch.frombuffer(raw[start : start + t.nbytes], dtype=t.dtype).reshape(t.shape)


@contextmanager
def no_zip_crc32() -> Iterator[None]:
    """torch.save's zip CRC32 costs more than the disk write; torch.load never checks it.

    Integrity is the manifest's job (sha256 per parameter and per DCP item).
    """
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def write_sharded(
    root: Path,
    layout: Layout,
    objects: dict[str, io.BytesIO],
    materialize: Callable[[str], torch.Tensor],
    progress: Callable[[int], None],
) -> dict:
    """Objects, then every parameter's chunks in model order; then `.metadata`. Returns the
    data file's manifest entry (each item's sha256, hashed as it is written)."""
    state: dict = {key: BytesStorageMetadata() for key in objects}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    chunks = []
    with no_zip_crc32(), open_output(root / DATA_FILE) as out:
        stream = HashingStream(out)

        def record(index: MetadataIndex, write: Callable[[], object]) -> None:
            stream.begin()
            write()
            chunks.append(stream.end())
            storage[index] = _StorageInfo(DATA_FILE, chunks[-1][0], chunks[-1][1])

        for key, data in objects.items():
            record(MetadataIndex(key), lambda data=data: stream.write(data.getbuffer()))
        for name, pieces in layout.pieces.items():
            param = materialize(name)
            for p in pieces:
                data = own_storage(p.of(param).reshape(p.shape))
                record(
                    MetadataIndex(p.key, torch.Size(p.offset)),
                    lambda data=data: torch.save(data, stream),
                )
                entry = state.setdefault(
                    p.key,
                    TensorStorageMetadata(
                        TensorProperties(dtype=layout.dtype), torch.Size(p.global_shape), []
                    ),
                )
                entry.chunks.append(ChunkStorageMetadata(torch.Size(p.offset), torch.Size(p.shape)))
                progress(data.nbytes)
            del param  # one parameter in memory at a time
        out.sync()
        entry = {"size": out.tell(), "chunks": chunks}
    _write_metadata(root, Metadata(state, planner_data={}, storage_data=storage))
    return entry


def _write_metadata(root: Path, metadata: Metadata) -> None:
    """As torch's FileSystemWriter.finish does: version, storage meta, pickle, rename."""
    # torch 2.7 (the npu set's) has no DCP format version yet: its .metadata carries none
    if hasattr(filesystem, "CURRENT_DCP_VERSION"):
        metadata.version = filesystem.CURRENT_DCP_VERSION
    metadata.storage_meta = StorageMeta(checkpoint_id=root, save_id=uuid.uuid4().hex)
    # megatron-core 0.12 stores per-tensor extras here (used only for optimizer states)
    metadata.mcore_data = {
        k: {} for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")
    }
    tmp = root / f"{METADATA}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(root / METADATA)


def _strategy(layout: Layout, materialize: Callable, progress: Callable, hashed: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    # a torch_dist strategy whose save() is ours: megatron-core 0.19's save() replaces any
    # strategy that is not one (its SaveShardedStrategy base is gone)
    class StreamingTorchDist(TorchDistSaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            chunks = {
                (s.key, tuple(s.global_offset))
                for v in flat.values()
                for s in v
                if isinstance(s, ShardedTensor)
            }
            planned = {(p.key, p.offset) for ps in layout.pieces.values() for p in ps}
            assert chunks == planned, "the layout and megatron's sharded state dict disagree"
            objects = {k: v for k, v in flat.items() if isinstance(v[0], ShardedObject)}
            # megatron's own encoding of sharded objects (torch.save of their list)
            hashed[DATA_FILE] = write_sharded(
                Path(checkpoint_dir),
                layout,
                mcore_to_pyt_state_dict(objects, False),
                materialize,
                progress,
            )

    return StreamingTorchDist("torch_dist", 1)


def save_streaming(
    layout: Layout,
    materialize: Callable[[str], torch.Tensor],
    out_dir: Path,
    progress: Callable[[int], None] = lambda n: None,
) -> dict[str, dict]:
    """Write `layout`'s checkpoint to out_dir, each parameter from `materialize(name)`.
    Returns the manifest entries of the files hashed while written (the data file)."""
    from megatron.core import dist_checkpointing

    hashed: dict[str, dict] = {}
    strategy = _strategy(layout, materialize, progress, hashed)
    dist_checkpointing.save(layout.sharded_state_dict, str(out_dir), sharded_strategy=strategy)
    return hashed
