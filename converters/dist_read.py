"""Read regions of a megatron-core torch_dist checkpoint, whatever plan wrote it.

`.metadata` (torch DCP) lists each global tensor's stored chunks and their byte ranges; a
region is assembled from the chunks it overlaps, each read with pread and
torch.load(weights_only=True). `.metadata` itself is a pickle: it is read with an
unpickler that admits only DCP's metadata classes and torch dtypes/sizes.
"""

import io
import json
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch

from converters.errors import ConversionError
from converters.hf_source import read_exact, tensor_memory

METADATA = ".metadata"
CONFIG = "metadata.json"
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


class _Placeholder:
    """Stands in for megatron's empty marker classes some versions pickle into .metadata."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_PLAIN = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("builtins", "set"),
          ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES or (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith("megatron.core.dist_checkpointing."):
            return _Placeholder
        raise ConversionError(f"{METADATA} references {module}.{name}, which a torch_dist checkpoint never holds: refusing to load it")


class DistReader:
    """Global tensors of one torch_dist checkpoint: shapes, dtypes and any region of them."""

    def __init__(self, path: str | Path):
        self.root = find_dist_dir(path)
        self._check_backend()
        try:
            with open(self.root / METADATA, "rb") as f:
                meta = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as err:
            raise ConversionError(f"{self.root / METADATA} is unreadable ({err}): the save did not finish; re-save it") from err
        self.tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
        self.storage = {(i.fqn, tuple(i.offset or ())): s for i, s in meta.storage_data.items()}
        self._buckets = {key: _bucket_chunks(md.chunks) for key, md in self.tensors.items()}
        self._native: dict[Path, bool] = {}  # data file -> written in this machine's byte order

    def _check_backend(self) -> None:
        config = self.root / CONFIG
        backend = json.loads(config.read_text()).get("sharded_backend") if config.is_file() else None
        if backend != "torch_dist":
            raise ConversionError(
                f"{self.root} has sharded_backend {backend!r} in {CONFIG}: only torch_dist is read; "
                "re-save with megatron-core's default (torch_dist) strategy"
            )

    def global_shape(self, key: str) -> tuple[int, ...]:
        if key not in self.tensors:
            raise ConversionError(f"dist checkpoint {self.root} lacks {key}: was it saved from this model and config?")
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def region(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The [offset, offset + shape) box of global tensor `key`, from every chunk it overlaps
        (into `out` when given: same dtype, shape `shape`)."""
        self.global_shape(key)
        lead, buckets = self._buckets[key]
        chunks = buckets.get(offset[:lead], []) if shape[:lead] == (1,) * lead else self.tensors[key].chunks
        for chunk in chunks:  # stored as asked: no assembly
            if tuple(chunk.offsets) == offset and tuple(chunk.sizes) == shape:
                return self._read_chunk(key, offset, out).reshape(shape)
        out = torch.empty(shape, dtype=self.dtype(key)) if out is None else out
        covered = 0
        for chunk in chunks:
            lo = [max(o, c) for o, c in zip(offset, chunk.offsets, strict=True)]
            hi = [min(o + s, c + n) for o, s, c, n in zip(offset, shape, chunk.offsets, chunk.sizes, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            data = self._read_chunk(key, tuple(chunk.offsets))
            src = data[tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, chunk.offsets, strict=True))]
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))] = src
            covered += src.numel()
        if covered != out.numel():
            raise ConversionError(f"dist checkpoint {self.root} does not cover all of {key} at {offset}: the save was incomplete")
        return out

    def _read_chunk(self, key: str, offset: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """A stored chunk; into `out` (contiguous, the chunk's dtype and size) when given."""
        info = self.storage[(key, offset)]
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{key} is stored with transforms {info.transform_descriptors}: not supported")
        path = self.root / info.relative_path
        if path.stat().st_size < info.offset + info.length:
            raise ConversionError(f"{info.relative_path} in {self.root} is truncated: re-save the checkpoint")
        with open(path, "rb", buffering=0) as f:
            chunk = _Slice(f, info.offset, info.length)
            if path not in self._native:  # one file, one writer: checked on its first chunk
                self._native[path] = native_byte_order(chunk)
            return read_slice(chunk, out, self._native[path])


def read_slice(chunk: "_Slice", out: torch.Tensor | None, native: bool) -> torch.Tensor:
    """A torch.save'd tensor; into `out` (contiguous, its dtype and size) when given. Its
    bytes go straight into `out` when they are in this machine's byte order (`native`);
    otherwise torch.load reads it (and swaps them)."""
    chunk.seek(0)
    if native and out is not None and out.is_contiguous() and _load_into(chunk, out):
        return out
    chunk.seek(0)
    data = torch.load(chunk, map_location="cpu", weights_only=True)
    return data if out is None else out.copy_(data.reshape(out.shape))


def native_byte_order(chunk: "_Slice") -> bool:
    """Whether a torch.save'd chunk holds its data in this machine's byte order (its
    `byteorder` record; torch.load takes a file without one as little-endian)."""
    with zipfile.ZipFile(chunk) as z:
        record = next((i for i in z.infolist() if i.filename.rsplit("/", 1)[-1] == "byteorder"), None)
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


def _load_into(chunk: "_Slice", out: torch.Tensor) -> bool:
    """Read a torch.save'd tensor's data straight into `out` (contiguous, same dtype and size):
    no buffer of torch.load's own and no copy out of it. False where the chunk is not plainly
    that (a view of a bigger storage, or a torch whose meta loads give no record offsets)."""
    meta = torch.load(chunk, map_location="meta", weights_only=True)  # the pickle only, no data
    start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if (start is None or not meta.is_contiguous() or meta.storage_offset() != 0
            or meta.dtype != out.dtype or meta.numel() != out.numel()):
        return False
    chunk.seek(start)
    if read_exact(chunk, tensor_memory(out)) != out.nbytes:
        raise ConversionError(f"{chunk.f.name} ends inside a chunk at {chunk.start}: re-save the checkpoint")
    return True


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
