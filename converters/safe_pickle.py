"""Checkpoint pickles are data, never code: an exact allow-list for `.metadata`, and a check of
everything megatron-core's `dist_checkpointing.load` would unpickle.

megatron-core hands a torch_dist checkpoint's `.metadata` to plain `pickle.load`, and torch
DCP loads its byte items (megatron's sharded objects: optimizer param groups, `_extra_state`)
with `torch.load(weights_only=False)`. `check_dist_checkpoint(dir)` reads all of them first
with unpicklers that build only known data classes, so a crafted file is refused before
megatron touches it.

`.metadata` admits exactly the (module, name) pairs in `ALLOWED`, resolved here by a single
attribute lookup: no module-wide admission, and no dotted names (pickle protocol 4 would
resolve `("torch.distributed.checkpoint.filesystem", "os.mkdir")` to `os.mkdir`). Every
callable an unpickler can call (REDUCE, NEWOBJ, BUILD) comes from `find_class`, so the list
bounds what runs: dataclass constructors, `set`, `OrderedDict`, a layout lookup.
"""

import importlib
import io
import pickle
from pathlib import Path

import torch

from converters.hf_io import CheckpointError

METADATA = ".metadata"
COMMON = "common.pt"
_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"

# what torch 2.13's DCP and megatron-core 0.12 / 0.16 write into .metadata (tests read real saves)
ALLOWED = frozenset(
    [
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        (f"{_DCP}.planner", n)
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    ]
    + [
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    ]
    + [
        ("torch", str(d).removeprefix("torch."))
        for d in vars(torch).values()
        if isinstance(d, torch.dtype)
    ]
)
# megatron's empty marker classes (MCoreSavePlan: 0.12 saves; MCoreMetadata: 0.15 optimizer
# saves): built as a placeholder, so megatron need not be imported to read a checkpoint
PLACEHOLDERS = frozenset({(_MCORE, "MCoreSavePlan"), (_MCORE, "MCoreMetadata")})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something other than checkpoint data; nothing of it was run."""


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})


class MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes in ALLOWED (and PLACEHOLDERS); anything else is refused."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in PLACEHOLDERS:
            return _Placeholder
        if (module, name) not in ALLOWED:
            raise UnsafeCheckpointError(
                f"{self.source} references {module}.{name}, which a torch_dist checkpoint never "
                "holds: refusing to load it (nothing in it was run); re-save the checkpoint or "
                "restore it from a trusted copy"
            )
        return getattr(importlib.import_module(module), name)  # one attribute, never a dotted path

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(
            f"{self.source} holds a persistent reference, which .metadata never does: "
            "re-save the checkpoint or restore it from a trusted copy"
        )


def load_metadata(path: str | Path, raw: bytes | None = None):
    """The DCP `Metadata` in `path` (`raw`: its bytes, when the caller has read them)."""
    path = Path(path)
    try:
        data = path.read_bytes() if raw is None else raw
        return MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} does not exist: pass a megatron-core torch_dist checkpoint directory"
        ) from None
    except Exception as err:  # any malformed pickle (truncated, wrong opcodes, bad arguments)
        raise CheckpointError(
            f"{path} is unreadable ({type(err).__name__}: {err}): "
            "the save did not finish; re-save the checkpoint"
        ) from None


def check_metadata(path: str | Path) -> None:
    """Raise UnsafeCheckpointError (or CheckpointError) unless `path` is a plain DCP `.metadata`."""
    load_metadata(path)


def load_weights_only(data: bytes, what: str):
    """A torch.save'd object through torch's own allow-list (`weights_only=True`)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"{what} is not plain tensor data ({first}): refusing to load it "
            "(nothing in it was run); re-save the checkpoint or restore it "
            "from a trusted copy"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{what} is unreadable ({type(err).__name__}): re-save the checkpoint"
        ) from None


def check_dist_checkpoint(ckpt_dir: str | Path) -> None:
    """Everything megatron-core's `dist_checkpointing.load(..., ckpt_dir)` would unpickle, read
    first without running code: `.metadata` (allow-list), `common.pt` and every byte item in
    the `.distcp` files (torch's weights_only loader). Raises UnsafeCheckpointError /
    CheckpointError naming the file; returns None when all of it is plain data."""
    root = Path(ckpt_dir)
    meta = load_metadata(root / METADATA)
    if (root / COMMON).is_file():
        load_weights_only((root / COMMON).read_bytes(), str(root / COMMON))
    byte_keys = {k for k, v in meta.state_dict_metadata.items() if not hasattr(v, "chunks")}
    for index, info in meta.storage_data.items():
        if index.fqn in byte_keys:
            load_weights_only(
                _read_range(root, info), f"{root / info.relative_path} item {index.fqn}"
            )


def _read_range(root: Path, info) -> bytes:
    path = root / info.relative_path
    if Path(info.relative_path).is_absolute() or ".." in Path(info.relative_path).parts:
        raise UnsafeCheckpointError(
            f"{root / METADATA} points outside the checkpoint ({info.relative_path}): "
            "re-save the checkpoint or restore it from a trusted copy"
        )
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as err:
        raise CheckpointError(
            f"{path} is unreadable ({err.strerror}): re-save or re-copy the checkpoint"
        ) from None
    if len(data) != info.length:
        raise CheckpointError(f"{path} is truncated: re-save or re-copy the checkpoint")
    return data
