"""Read an HF safetensors checkpoint one tensor at a time, with plain reads instead of mmap.

safetensors validates each file (header, truncation); data is then read with pread into a
fresh buffer, so resident memory is the tensors in flight, not the mapped shards.
"""

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.shared.errors import CheckpointError
from converters.hf_io import INDEX, shard_files

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in file
    nbytes: int


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _entries(path: Path) -> dict[str, Entry]:
    try:
        with safe_open(path, framework="pt"):  # validates the header against the file length
            pass
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path.name} is unreadable or truncated ({err}): re-download it"
        ) from err
    header, base = _header(path)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(
                f"{path.name}: {name} has dtype {meta['dtype']}, which the converters do not read"
            )
        start, end = meta["data_offsets"]
        out[name] = Entry(
            path, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start, end - start
        )
    return out


class HFSource(Mapping):
    """Tensor names, shapes and dtypes of an HF checkpoint; a read-only mapping that reads
    each tensor when it is asked for (so the name table can consume it like a state dict)."""

    def __init__(self, ckpt_dir: str | Path):
        self.root = Path(ckpt_dir)
        self.files = shard_files(self.root)
        self.entries: dict[str, Entry] = {}
        for path in self.files:
            self.entries.update(_entries(path))
        self._check_index()

    def _check_index(self) -> None:
        index = self.root / INDEX
        if not index.is_file():
            return
        for name, file in json.loads(index.read_text())["weight_map"].items():
            entry = self.entries.get(name)
            if entry is None or entry.file.name != file:
                raise CheckpointError(
                    f"{INDEX} maps {name} to {file}, which does not hold it: re-download the checkpoint"
                )

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def dtype(self) -> torch.dtype:
        """The one floating dtype of the checkpoint (mixed dtypes need an explicit --dtype)."""
        dtypes = {e.dtype for e in self.entries.values()}
        if len(dtypes) != 1:
            names = ", ".join(sorted(str(d) for d in dtypes))
            raise CheckpointError(
                f"checkpoint mixes dtypes ({names}): pass --dtype to convert to one"
            )
        return dtypes.pop()

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        return self.read_into(name, torch.empty(entry.shape, dtype=entry.dtype))

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Read tensor `name` into `out` (contiguous, same shape and dtype) without a copy."""
        entry = self.entries[name]
        if tuple(out.shape) != entry.shape or out.dtype != entry.dtype or not out.is_contiguous():
            raise AssertionError(
                f"{name}: cannot read {entry.shape} {entry.dtype} into {tuple(out.shape)} {out.dtype}"
            )
        with open(entry.file, "rb", buffering=0) as f:
            f.seek(entry.start)
            got = read_exact(f, tensor_memory(out))
        if got != entry.nbytes:
            raise CheckpointError(f"{entry.file.name} ended inside {name}: re-download it")
        return out


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's own bytes, writable (reads land in the tensor)."""
    assert t.is_contiguous()
    return (
        memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if t.numel()
        else memoryview(bytearray())
    )


def read_exact(f, buffer: memoryview) -> int:
    """Fill `buffer` from `f` (a single read stops short past 2 GiB); returns the bytes read."""
    done = 0
    while done < len(buffer) and (n := f.readinto(buffer[done:])):
        done += n
    return done
