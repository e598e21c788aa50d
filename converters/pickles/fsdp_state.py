"""verl's FSDP checkpoint files are data, never code: an exact allow-list before verl unpickles
them.

verl's FSDP engine (`--engine fsdp`) saves `global_step_N/actor/{model,optim,extra_state}_
world_size_W_rank_R.pt` with torch.save and resumes with `torch.load(weights_only=False)`
(verl/utils/checkpoint/fsdp_checkpoint_manager.py). `check_fsdp_checkpoint(actor)` reads every
such file first with an unpickler that builds stand-ins only, for exactly the globals those
saves hold (read from FSDP2 saves on CPU at world 1 and 2): DTensor shards (their spec, device
mesh, placements), plain tensors and storages, the scheduler's containers, and the RNG states
(numpy's arrays, torch's byte states). Nothing named in a file is imported or called, so a
crafted file is refused before verl touches it; a truncated one is unreadable in one line
(converters.pickles.safe_pickle.check_torch_save, with this allow-list).
`is_complete(actor)`: every rank's files are there (verl writes the tracker after the save).
"""

import json
import re
from collections import OrderedDict
from pathlib import Path

from converters.pickles.safe_pickle import TorchSaveUnpickler, _Unplain, check_torch_save

CONFIG = "fsdp_config.json"  # {"FSDP_version": 2, "world_size": W}, written with the save
KINDS = ("model", "optim", "extra_state")
_DT = "torch.distributed"
_STORAGES = ("Float", "BFloat16", "Half", "Double", "Long", "Int", "Short", "Char", "Byte", "Bool")
_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8",
           "uint8", "bool")  # fmt: skip
FSDP_ALLOWED = frozenset(
    {
        ("collections", "OrderedDict"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_wrapper_subclass"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.serialization", "_get_layout"),
        ("torch", "device"),
        ("torch", "Size"),
        (f"{_DT}.tensor", "DTensor"),
        (f"{_DT}.tensor._dtensor_spec", "DTensorSpec"),
        (f"{_DT}.tensor._dtensor_spec", "TensorMeta"),
        (f"{_DT}.tensor._dtensor_spec", "ShardOrderEntry"),
        (f"{_DT}.tensor.placement_types", "Shard"),
        (f"{_DT}.tensor.placement_types", "Replicate"),
        (f"{_DT}.device_mesh", "DeviceMesh"),
        (f"{_DT}._mesh_layout", "_MeshLayout"),
        (f"{_DT}._mesh_layout", "_FlatLayout"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
        *(("torch", f"{s}Storage") for s in _STORAGES),
        *(("torch", d) for d in _DTYPES),
    }
)
_FIX = (
    "restore the checkpoint from a trusted copy, or resume from an earlier global_step_N "
    "(trainer.resume_from_path)"
)


class _StandIn:
    """What every allowed global becomes while checking: built, called, set, never run."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _StandIn()

    def __setstate__(self, state):
        pass


class FsdpUnpickler(TorchSaveUnpickler):
    """Stand-ins for FSDP_ALLOWED only; storages (of any dtype) must be records of the
    archive."""

    def find_class(self, module: str, name: str):
        if (module, name) not in FSDP_ALLOWED:
            raise _Unplain(f"references {module}.{name}")
        return OrderedDict if name == "OrderedDict" else _StandIn

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[2], str) and f"data/{pid[2]}" in self.records
                and isinstance(pid[3], str) and type(pid[4]) is int):  # fmt: skip
            return _StandIn()
        raise _Unplain(f"holds a storage reference other than the archive's ({str(pid)[:80]})")


def rank_files(actor: Path) -> list[Path]:
    """The actor's `<kind>_world_size_W_rank_R.pt` files."""
    pattern = re.compile(rf"({'|'.join(KINDS)})_world_size_\d+_rank_\d+\.pt")
    return sorted(p for p in Path(actor).iterdir() if pattern.fullmatch(p.name))


def world_size(actor: Path) -> int | None:
    try:
        return int(json.loads((Path(actor) / CONFIG).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_complete(actor: Path) -> bool:
    """Every rank's model file (and optim / extra_state where any rank saved one) is there."""
    world = world_size(actor)
    if world is None:
        return False
    names = {p.name for p in rank_files(actor)}
    kinds = [k for k in KINDS if any(n.startswith(f"{k}_") for n in names)]
    return "model" in kinds and all(
        f"{k}_world_size_{world}_rank_{r}.pt" in names for k in kinds for r in range(world)
    )


def check_fsdp_checkpoint(actor: Path) -> None:
    """Raise UnsafeCheckpointError (or CheckpointError) unless every rank file of `actor` is a
    torch.save archive of FSDP checkpoint data (FSDP_ALLOWED)."""
    for path in rank_files(actor):
        check_torch_save(path, "verl's FSDP checkpoint data", _FIX, unpickler=FsdpUnpickler)
