"""verl's async trainer state (its TransferQueue checkpoint) checked before verl unpickles it.

In verl's colocate_async and separate_async modes a save writes `global_step_N/transfer_queue/`:
the controller's state (`controller_state.pkl`) and each storage unit's samples
(`simple_storage/*.pkl`), written with plain `pickle.dump` and read back with `pickle.load`
(transfer_queue/controller.py, storage/simple_storage.py): loading a crafted file would run
its code. What a genuine one references, read from real saves of both modes:

- containers, numbers, strings, bytes (no class needed);
- transfer_queue's own dataclasses `DataPartitionStatus` and `FieldMeta`, built field by field;
- torch dtypes (`torch.int64`, ...), `collections.OrderedDict`;
- tensors as pickle writes them: `torch._utils._rebuild_tensor_v2` on a storage that
  `torch.storage._load_from_bytes` rebuilds from bytes, themselves a legacy torch.save stream
  of one CPU storage (magic number, protocol 1001, system info, a pickle naming only the
  storage's type, the storage keys, then each storage's element count and raw bytes).

`check_queue_state` walks every pickle with stand-ins for exactly those (QUEUE_ALLOWED) and
the nested streams with their own exact list (STORAGE_TYPES); nothing of torch or
transfer_queue is run, and anything else is refused in one line naming it.
"""

import io
import pickle
import struct
from collections import OrderedDict
from pathlib import Path

from backend.shared.errors import CheckpointError
from converters.pickles.safe_pickle import UnsafeCheckpointError

# torch.serialization's legacy stream (torch.save(..., _use_new_zipfile_serialization=False))
LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001
# storage type -> bytes per element
STORAGE_TYPES = {"ByteStorage": 1, "CharStorage": 1, "BoolStorage": 1, "ShortStorage": 2,
                 "IntStorage": 4, "LongStorage": 8, "HalfStorage": 2, "BFloat16Storage": 2,
                 "FloatStorage": 4, "DoubleStorage": 8}  # fmt: skip
DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
_QUEUE_CLASSES = {
    ("transfer_queue.controller", "DataPartitionStatus"),
    ("transfer_queue.controller", "FieldMeta"),
}
_REBUILD, _FROM_BYTES = (
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
)
QUEUE_ALLOWED = frozenset(
    {_REBUILD, _FROM_BYTES, ("collections", "OrderedDict"), *_QUEUE_CLASSES}
    | {("torch", d) for d in DTYPES}
)
WHAT = "verl's async trainer state (TransferQueue: containers, tensors and its own dataclasses)"
FIX = (
    "restore the checkpoint from a trusted copy, or resume from an earlier global_step_N "
    "(delete the later ones)"
)


class _Refused(Exception):
    pass


class _Record:
    """Stands in for a dataclass of transfer_queue's, a storage, a tensor or a dtype."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise _Refused("sets a non-dict state on a transfer_queue record")


class _Storage(_Record):
    pass


def _storage_from_bytes(raw) -> _Storage:
    if not isinstance(raw, bytes):
        raise _Refused("rebuilds a storage from something other than bytes")
    check_legacy_storage(raw)
    return _Storage()


def _tensor(storage, offset, size, stride, requires_grad, hooks, *rest) -> _Record:
    ints = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else ()
    if not (isinstance(storage, _Storage) and ints and all(type(i) is int for i in ints)
            and type(requires_grad) is bool and isinstance(hooks, OrderedDict) and not hooks and not rest):  # fmt: skip
        raise _Refused("rebuilds a tensor with arguments other than a plain tensor's")
    return _Record()


class _QueueUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in QUEUE_ALLOWED:
            raise _Refused(f"references {module}.{name}")
        if (module, name) == _REBUILD:
            return _tensor
        if (module, name) == _FROM_BYTES:
            return _storage_from_bytes
        if (module, name) in _QUEUE_CLASSES:
            return type(name, (_Record,), {})
        return OrderedDict if name == "OrderedDict" else _Record  # a dtype: a stand-in

    def persistent_load(self, pid):
        raise _Refused("holds a persistent reference (plain pickle never writes one)")


class _StorageUnpickler(pickle.Unpickler):
    """The legacy stream's object pickle: one storage's persistent id, nothing else."""

    def __init__(self, file):
        super().__init__(file)
        self.storages: dict[str, tuple[str, int]] = {}

    def find_class(self, module: str, name: str):
        if module != "torch" or name not in STORAGE_TYPES:
            raise _Refused(f"holds a storage stream naming {module}.{name}")
        return name

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"
                and pid[1] in STORAGE_TYPES and isinstance(pid[2], str) and pid[3] == "cpu"
                and type(pid[4]) is int and pid[5] is None):  # fmt: skip
            raise _Refused(
                f"holds a storage reference other than a CPU storage's ({str(pid)[:80]})"
            )
        self.storages[pid[2]] = (pid[1], pid[4])
        return _Storage()


def _plain(f) -> object:
    """A pickle of plain values only (the stream's header records)."""
    return _QueueUnpickler(f).load()


def check_legacy_storage(raw: bytes) -> None:
    """`raw` is torch.save's legacy stream of one CPU storage, exactly (see the module doc)."""
    f = io.BytesIO(raw)
    try:
        if _plain(f) != LEGACY_MAGIC or _plain(f) != LEGACY_PROTOCOL:
            raise _Refused("holds a storage stream with a wrong magic number or protocol")
        if not isinstance(_plain(f), dict):
            raise _Refused("holds a storage stream without its system info")
        body = _StorageUnpickler(f)
        if not isinstance(body.load(), _Storage) or len(body.storages) != 1:
            raise _Refused("holds a storage stream of something other than one storage")
        if _plain(f) != list(body.storages):
            raise _Refused("holds a storage stream whose keys do not match its storages")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise _Refused(f"holds a damaged storage stream ({type(err).__name__})") from None
    ((kind, numel),) = body.storages.values()
    head = f.read(8)
    if len(head) != 8 or struct.unpack("<q", head)[0] != numel:
        raise _Refused("holds a storage stream whose element count does not match")
    if len(f.read()) != numel * STORAGE_TYPES[kind]:
        raise _Refused("holds a storage stream whose bytes do not match its size")


def check_queue_file(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            _QueueUnpickler(f).load()
            if f.read(1):
                raise _Refused("has bytes after its pickle")
    except OSError as err:
        raise CheckpointError(f"{path} is unreadable ({err.strerror}): {FIX}") from None
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"{path} is not {WHAT}: it {err}; refusing to load it (nothing in it was run): {FIX}"
        ) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
    ) as err:
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}: {err}): {FIX}") from None


def check_queue_state(queue_dir: Path) -> int:
    """Every pickle under `queue_dir` (verl's transfer_queue/); returns how many."""
    files = sorted(Path(queue_dir).rglob("*.pkl"))
    for path in files:
        check_queue_file(path)
    return len(files)
