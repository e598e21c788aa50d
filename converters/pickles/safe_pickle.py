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

`check_torch_save(path)` does the same for a whole torch.save file that another program will
`torch.load(weights_only=False)` (verl's dataloader state, `data.pt`): it must be the zip
archive torch.save writes, not TorchScript (which torch.load hands to torch.jit.load), and its
`data.pkl` may build only containers and CPU uint8 tensors (TORCH_SAVE_ALLOWED).
"""

import importlib
import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch

from backend.shared.errors import CheckpointError

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
        # a plan's storage data (a file-name prefix): in `all_local_plans` of saves reusing
        # a cached save plan (TorchDistSaveShardedStrategy(cached_metadata=True), 2nd save on)
        (f"{_DCP}.filesystem", "_StoragePrefix"),
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


# torch's refusal names what it met ("... unsupported GLOBAL posix.system ..."); the rest of its
# message advises `weights_only=False`, the wrong thing to tell about a crafted file
_TORCH_REFUSED = re.compile(r"GLOBAL ([\w.]+)|(Unsupported operand \d+)")


def load_weights_only(data: bytes, what: str):
    """A torch.save'd object through torch's own allow-list (`weights_only=True`)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        met = _TORCH_REFUSED.search(str(err))
        detail = (
            f"references {met[1]}" if met and met[1] else (met[2] if met else "an unknown pickle")
        )
        raise UnsafeCheckpointError(
            f"{what} is not plain tensor data ({detail}): refusing to load it "
            "(nothing in it was run); re-save the checkpoint or restore it "
            "from a trusted copy"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{what} is unreadable ({type(err).__name__}): re-save the checkpoint"
        ) from None


def refusals(ckpt_dir: str | Path) -> Iterator[tuple[Path, UnsafeCheckpointError]]:
    """(file, refusal) for each pickle megatron-core's `dist_checkpointing.load(..., ckpt_dir)`
    would unpickle that is not plain data: `.metadata` (allow-list; a refused one ends the
    list, the rest is found through it), `common.pt` and every byte item of the `.distcp`
    files (torch's weights_only loader). Nothing is run; a file that cannot be read at all
    raises CheckpointError."""
    root = Path(ckpt_dir)
    try:
        meta = load_metadata(root / METADATA)
    except UnsafeCheckpointError as err:
        yield root / METADATA, err
        return
    items = [(root / COMMON, None)] if (root / COMMON).is_file() else []
    byte_keys = {k for k, v in meta.state_dict_metadata.items() if not hasattr(v, "chunks")}
    items += [(i, info) for i, info in meta.storage_data.items() if i.fqn in byte_keys]
    for index, info in items:
        if info is None:
            data, path, what = index.read_bytes(), index, str(index)
        else:
            path = root / info.relative_path
            data, what = _read_range(root, info), f"{path} item {index.fqn}"
        try:
            load_weights_only(data, what)
        except UnsafeCheckpointError as err:
            yield path, err


def check_dist_checkpoint(ckpt_dir: str | Path) -> None:
    """Everything megatron-core's `dist_checkpointing.load(..., ckpt_dir)` would unpickle, read
    first without running code (`refusals`). Raises UnsafeCheckpointError / CheckpointError
    naming the file; returns None when all of it is plain data."""
    for _, err in refusals(ckpt_dir):
        raise err


# ---- a whole torch.save file (verl's data.pt) -------------------------------------------

_ZIP_MAGIC = b"PK\x03\x04"  # the test torch.load makes first (torch.serialization._is_zipfile)
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_BYTES = ("torch", "ByteStorage")
# what torch.save writes for dicts / lists of CPU uint8 tensors: the tensor's rebuild call, its
# storage type (inside the persistent id) and its empty backward-hook dict
TORCH_SAVE_ALLOWED = frozenset({_REBUILD, _BYTES, ("collections", "OrderedDict")})


class _Stored:
    """Stands in for a storage (a `data/<key>` record) and for a tensor built on one."""


def _plain_tensor(storage, offset, size, stride, requires_grad, hooks, *rest):
    """Stands in for `_rebuild_tensor_v2` when checking: what torch.save writes for a plain
    tensor, nothing else (no hooks, no metadata)."""
    ints = (offset, *size, *stride)
    if (
        isinstance(storage, _Stored)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and all(type(i) is int for i in ints)
        and type(requires_grad) is bool
        and isinstance(hooks, OrderedDict)
        and not hooks
        and not rest
    ):
        return _Stored()
    raise _Unplain("holds a tensor rebuilt with arguments other than a plain tensor's")


class _Unplain(Exception):
    pass


class TorchSaveUnpickler(pickle.Unpickler):
    """Walks a torch.save'd `data.pkl` building stand-ins: only TORCH_SAVE_ALLOWED, CPU byte
    storages that are records of the archive, plain tensors; nothing of torch is run."""

    def __init__(self, file, records: set[str]):
        super().__init__(file)
        self.records = records

    def find_class(self, module: str, name: str):
        if (module, name) not in TORCH_SAVE_ALLOWED:
            raise _Unplain(f"references {module}.{name}")
        return {_REBUILD: _plain_tensor, _BYTES: _Stored}.get((module, name), OrderedDict)

    def persistent_load(self, pid):
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and pid[1] is _Stored
            and isinstance(pid[2], str)
            and f"data/{pid[2]}" in self.records
            and pid[3] == "cpu"
            and type(pid[4]) is int
        ):
            return _Stored()
        raise _Unplain(
            f"holds a storage reference other than a CPU byte storage of the archive ({str(pid)[:80]})"
        )


def check_torch_save(path: str | Path, what: str, fix: str, unpickler=None) -> None:
    """Raise UnsafeCheckpointError (or CheckpointError) unless `path` is a torch.save archive
    of plain data (TORCH_SAVE_ALLOWED), read as torch.load reads it: the first bytes, then
    torch's own zip reader. `what` names the file's role, `fix` what the user can do;
    `unpickler`: a TorchSaveUnpickler subclass with another allow-list (raising _Unplain)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                problem = "is not a torch.save zip archive (torch.load would unpickle it whole)"
            else:
                f.seek(0)
                problem = _archive_problem(torch._C.PyTorchFileReader(f), unpickler)
    except OSError as err:
        raise CheckpointError(f"{path} is unreadable ({err.strerror}): {fix}") from None
    except RuntimeError as err:  # torch's zip reader: a damaged or truncated archive
        first = str(err).strip().splitlines()[0] if str(err).strip() else "damaged"
        raise CheckpointError(f"{path} is unreadable ({first}): {fix}") from None
    if problem:
        raise UnsafeCheckpointError(
            f"{path} is not {what}: it {problem}; refusing to load it (nothing in it was run): {fix}"
        )


def _archive_problem(reader, unpickler=None) -> str | None:
    records = set(reader.get_all_records())
    if "constants.pkl" in records:
        return "is a TorchScript archive (torch.load would run it as code)"
    if "data.pkl" not in records:
        return "has no data.pkl"
    try:
        (unpickler or TorchSaveUnpickler)(io.BytesIO(reader.get_record("data.pkl")), records).load()
    except _Unplain as err:
        return str(err)
    except Exception as err:  # any malformed pickle (truncated, wrong opcodes, bad arguments)
        return f"holds a malformed pickle ({type(err).__name__})"
    return None


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
