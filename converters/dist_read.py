"""Read regions of a megatron-core torch_dist checkpoint, whatever plan wrote it.

`.metadata` (torch DCP) lists each global tensor's stored chunks and their byte ranges; a
region is assembled from the chunks it overlaps, each read with pread and
torch.load(weights_only=True). `.metadata` itself is a pickle: it is read with an exact
allow-list of DCP's metadata classes and torch dtypes/sizes (converters.pickles.safe_pickle).
"""

import io
import json
import os
import struct
import sys
import zipfile
from pathlib import Path

import torch

from converters.errors import ConversionError
from converters.hf_source import read_exact, tensor_memory
from converters.manifest import ChunkHashes, ManifestError, load_files_manifest
from converters.pickles.safe_pickle import load_metadata

METADATA = ".metadata"
CONFIG = "metadata.json"
COMMON = "common.pt"
# verl 0.9 (global_step_N/actor/...) and older layouts, tried in order below the given path
SUBDIRS = ("", "model/dist_ckpt", "actor/model/dist_ckpt", "dist_ckpt", "actor/dist_ckpt")


def find_dist_dir(path: str | Path) -> Path:
    """The torch_dist directory at `path` or in verl's checkpoint layout below it."""
    root = Path(path)
    latest = root / "latest_checkpointed_iteration.txt"
    if latest.is_file():  # verl's trainer dir: follow to the newest step
        root = root / f"global_step_{latest.read_text().strip()}"
    for sub in SUBDIRS:
        if (root / sub / METADATA).is_file():
            return root / sub
    raise ConversionError(
        f"no megatron-core dist checkpoint ({METADATA}) at {path} or its {', '.join(SUBDIRS[1:])}: "
        "pass the dist_ckpt directory or verl's global_step_N/actor"
    )


def is_dist_dir(path: str | Path) -> bool:
    try:
        find_dist_dir(path)
        return True
    except ConversionError:
        return False


class DistReader:
    """Global tensors of one torch_dist checkpoint: shapes, dtypes and any region of them."""

    def __init__(self, path: str | Path, check_manifest: bool = False):
        """check_manifest: every file and chunk read is checked against the checkpoint's
        manifest.json as it is read (ManifestError, one line, on any difference)."""
        self.root = find_dist_dir(path)
        self.hashes = (
            ChunkHashes(self.root, load_files_manifest(self.root)) if check_manifest else None
        )
        self._check_backend()
        meta = load_metadata(self.root / METADATA, self._small_file(METADATA))
        self.tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.storage = {(i.fqn, tuple(i.offset or ())): s for i, s in meta.storage_data.items()}
        self._buckets = {key: _bucket_chunks(md.chunks) for key, md in self.tensors.items()}
        self._native: dict[Path, bool] = {}  # data file -> written in this machine's byte order
        if (
            self.hashes is not None
        ):  # megatron's non-sharded part: not read here, but exported with it
            self._small_file(COMMON)

    def check_unread(self) -> None:
        """With check_manifest: the byte ranges not read so far, against the manifest."""
        if self.hashes is not None:
            self.hashes.check_unread()

    def _small_file(self, name: str) -> bytes | None:
        """A small file's bytes, checked against the manifest when there is one to check."""
        path = self.root / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if name == COMMON and self.hashes is not None and name not in self.hashes.files:
                return None
            raise ConversionError(
                f"{path} is missing: the checkpoint is incomplete; re-save or re-copy it"
            ) from None
        if self.hashes is not None:
            self.hashes.check_file(name, data)
        return data

    def _check_backend(self) -> None:
        config = self.root / CONFIG
        try:
            backend = (
                json.loads(self._small_file(CONFIG)).get("sharded_backend")
                if config.is_file()
                else None
            )
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise ConversionError(
                f"{config} is not valid JSON: the save did not finish; re-save the checkpoint"
            ) from None
        if backend != "torch_dist":
            raise ConversionError(
                f"{self.root} has sharded_backend {backend!r} in {CONFIG}: only torch_dist is read; "
                "re-save with megatron-core's default (torch_dist) strategy"
            )

    def global_shape(self, key: str) -> tuple[int, ...]:
        if key not in self.tensors:
            raise ConversionError(
                f"dist checkpoint {self.root} lacks {key}: was it saved from this model and config?"
            )
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def region(
        self,
        key: str,
        offset: tuple[int, ...],
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The [offset, offset + shape) box of global tensor `key`, from every chunk it overlaps
        (into `out` when given: same dtype, shape `shape`)."""
        self.global_shape(key)
        lead, buckets = self._buckets[key]
        chunks = (
            buckets.get(offset[:lead], [])
            if shape[:lead] == (1,) * lead
            else self.tensors[key].chunks
        )
        for chunk in chunks:  # stored as asked: no assembly
            if tuple(chunk.offsets) == offset and tuple(chunk.sizes) == shape:
                return self._read_chunk(key, offset, out).reshape(shape)
        out = torch.empty(shape, dtype=self.dtype(key)) if out is None else out
        covered = 0
        for chunk in chunks:
            lo = [max(o, c) for o, c in zip(offset, chunk.offsets, strict=True)]
            hi = [
                min(o + s, c + n)
                for o, s, c, n in zip(offset, shape, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._read_chunk(key, tuple(chunk.offsets))
            src = data[
                tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))
            ]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))] = src
            covered += src.numel()
        if covered != out.numel():
            raise ConversionError(
                f"dist checkpoint {self.root} does not cover all of {key} at {offset}: the save was incomplete"
            )
        return out

    def _read_chunk(
        self, key: str, offset: tuple[int, ...], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A stored chunk; into `out` (contiguous, the chunk's dtype and size) when given."""
        info = self.storage[(key, offset)]
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(
                f"{key} is stored with transforms {info.transform_descriptors}: not supported"
            )
        path = self._data_path(info.relative_path)
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size < info.offset + info.length:
                    raise ConversionError(f"{path} is truncated: re-save or re-copy the checkpoint")
                chunk = _Slice(f, info.offset, info.length)
                if path not in self._native:  # one file, one writer: checked on its first chunk
                    self._native[path] = native_byte_order(chunk)
                if self.hashes is None:
                    return read_slice(chunk, out, self._native[path])
                return self._read_checked(chunk, info, out, self._native[path])
        except (ConversionError, ManifestError):
            raise
        except FileNotFoundError:
            raise ConversionError(
                f"{path} is missing: the checkpoint is incomplete; re-save or re-copy it"
            ) from None
        except Exception as err:  # a damaged zip record or pickle inside the chunk
            raise ConversionError(
                f"{path} holds a damaged chunk of {key} at byte {info.offset} "
                f"({type(err).__name__}): re-save or re-copy the checkpoint"
            ) from None

    def _data_path(self, relative: str) -> Path:
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ConversionError(
                f"{self.root / METADATA} points outside the checkpoint ({relative}): "
                "re-save the checkpoint or restore it from a trusted copy"
            )
        return self.root / relative

    def _read_checked(
        self, chunk: "_Slice", info, out: torch.Tensor | None, native: bool
    ) -> torch.Tensor:
        """As read_slice, and the chunk's bytes hashed as they are read: the data where it lands
        (straight in `out`), the small zip/pickle records around it read apart."""
        if native and out is not None and out.is_contiguous():
            start = _load_into(chunk, out)
            if start is not None:
                end = start + out.nbytes
                parts = [
                    _pread(chunk, 0, start),
                    tensor_memory(out),
                    _pread(chunk, end, info.length - end),
                ]
                self.hashes.check_chunk(info.relative_path, info.offset, info.length, parts)
                return out
        raw = _pread(chunk, 0, info.length)
        self.hashes.check_chunk(info.relative_path, info.offset, info.length, [raw])
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        return data if out is None else out.copy_(data.reshape(out.shape))


def _pread(chunk: "_Slice", start: int, length: int) -> bytes:
    chunk.seek(start)
    buffer = bytearray(length)
    return bytes(buffer[: read_exact(chunk, memoryview(buffer))])


def read_slice(chunk: "_Slice", out: torch.Tensor | None, native: bool) -> torch.Tensor:
    """A torch.save'd tensor; into `out` (contiguous, its dtype and size) when given. Its
    bytes go straight into `out` when they are in this machine's byte order (`native`);
    otherwise torch.load reads it (and swaps them)."""
    chunk.seek(0)
    if native and out is not None and out.is_contiguous() and _load_into(chunk, out) is not None:
        return out
    chunk.seek(0)
    data = torch.load(chunk, map_location="cpu", weights_only=True)
    return data if out is None else out.copy_(data.reshape(out.shape))


def native_byte_order(chunk: "_Slice") -> bool:
    """Whether a torch.save'd chunk holds its data in this machine's byte order (its
    `byteorder` record; torch.load takes a file without one as little-endian)."""
    with zipfile.ZipFile(chunk) as z:
        record = next(
            (i for i in z.infolist() if i.filename.rsplit("/", 1)[-1] == "byteorder"), None
        )
    order = "little" if record is None else _stored_record(chunk, record).decode()
    chunk.seek(0)
    return order == sys.byteorder


def _stored_record(f, info: zipfile.ZipInfo) -> bytes:
    """An uncompressed zip record's bytes, read past its local header (zipfile's own read
    would check a CRC-32 that torch.save may leave out)."""
    f.seek(info.header_offset)
    name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    f.seek(info.header_offset + 30 + name_len + extra_len)
    return f.read(info.file_size)


def _load_into(chunk: "_Slice", out: torch.Tensor) -> int | None:
    """Read a torch.save'd tensor's data straight into `out` (contiguous, same dtype and size):
    no buffer of torch.load's own and no copy out of it. Returns where the data starts in the
    chunk; None where the chunk is not plainly that (a view of a bigger storage, or a torch
    whose meta loads give no record offsets)."""
    meta = torch.load(chunk, map_location="meta", weights_only=True)  # the pickle only, no data
    start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if (
        start is None
        or not meta.is_contiguous()
        or meta.storage_offset() != 0
        or meta.dtype != out.dtype
        or meta.numel() != out.numel()
    ):
        return None
    chunk.seek(start)
    if read_exact(chunk, tensor_memory(out)) != out.nbytes:
        raise ConversionError(
            f"{chunk.f.name} ends inside a chunk at {chunk.start}: re-save the checkpoint"
        )
    return start


class _Slice(io.RawIOBase):
    """A byte range of a file as its own file: torch.load reads records straight into
    tensor storage (readinto), without a bytes copy of the chunk first."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[: self.length - self.pos]
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(view)
        self.pos += n
        return n


def _bucket_chunks(chunks) -> tuple[int, dict]:
    """Chunks grouped by their leading unit axes (layer, expert): a region looks in one group.

    `lead` is how many leading axes every chunk has size 1 on (megatron's prepended axes).
    """
    lead = 0
    while all(len(c.sizes) > lead and c.sizes[lead] == 1 for c in chunks):
        lead += 1
    buckets: dict[tuple[int, ...], list] = {}
    for c in chunks:
        buckets.setdefault(tuple(c.offsets[:lead]), []).append(c)
    return lead, buckets
