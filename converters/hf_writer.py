"""Write an HF safetensors checkpoint one tensor at a time: bounded shards + index.json.

The tensor list (names, shapes, dtypes) is known before any data, so each shard's header
is written first and the tensors follow as they are produced; nothing is held but the
tensor being written.
"""

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from converters.hf_io import INDEX, SINGLE
from converters.hf_source import DTYPE_NAMES
from converters.manifest import NAME as MANIFEST
from converters.manifest import HashingStream, tensor_bytes
from converters.output import open_output

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = (INDEX, "pytorch_model.bin.index.json", MANIFEST)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def plan_shards(tensors: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_header(shard: list[TensorSpec]) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in shard:
        entries[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_index(out_dir: Path, files: list[str], shards: list[list[TensorSpec]]) -> None:
    """index.json of a checkpoint of several shards (a single file needs none)."""
    if len(files) > 1:
        weight_map = {t.name: f for f, shard in zip(files, shards, strict=True) for t in shard}
        total = sum(t.nbytes for shard in shards for t in shard)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (Path(out_dir) / INDEX).write_text(json.dumps(index, indent=2) + "\n")


class ShardedWriter:
    """Takes the planned tensors in order via `write`; `close` writes the index."""

    def __init__(self, out_dir: Path, tensors: list[TensorSpec], max_shard_bytes: int):
        self.out = Path(out_dir)
        self.shards = plan_shards(tensors, max_shard_bytes)
        n = len(self.shards)
        self.files = (
            [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._queue = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._next, self._stream, self._shard = 0, None, -1
        self.hashed: dict[str, dict] = {}  # manifest entries of the finished shards

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, spec = self._queue[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise AssertionError(
                f"writer expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if shard != self._shard:
            self._open(shard)
        self._stream.write(tensor_bytes(tensor))
        self._next += 1

    def _open(self, shard: int) -> None:
        self._finish_file()
        self._shard = shard
        self._stream = HashingStream(open_output(self.out / self.files[shard]))
        self._stream.write(shard_header(self.shards[shard]))

    def _finish_file(self) -> None:
        if self._stream is not None:
            self._stream.stream.sync()
            self.hashed[self.files[self._shard]] = self._stream.file_entry()
            self._stream.stream.close()
            self._stream = None

    def close(self) -> None:
        if self._next != len(self._queue):
            raise AssertionError(f"writer got {self._next} of {len(self._queue)} tensors")
        self._finish_file()
        write_index(self.out, self.files, self.shards)

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.stream.close()


def copy_template(template: Path, out_dir: Path) -> list[str]:
    """Config, generation config, tokenizer and other non-weight files of an HF dir."""
    copied = []
    for path in sorted(Path(template).iterdir()):
        if (
            path.is_file()
            and not path.name.endswith(WEIGHT_SUFFIXES)
            and path.name not in WEIGHT_INDEXES
        ):
            shutil.copy2(path, out_dir / path.name)
            copied.append(path.name)
    return copied
