"""Per-rank state (optimizer, scheduler, RNG, counters) saved as data only: its tensors in a
safetensors file and everything else in a JSON skeleton that points at them. Loading runs no
code from the files (no pickle at all), and the round trip is exact: dict key types (int or
str), tuples versus lists, ints, floats (inf and nan included), bools, None, strings, and
every tensor's dtype, shape and bytes.

    save_state(state, "ckpt/optim/rank_00003")   # rank_00003.safetensors + rank_00003.json
    state = load_state("ckpt/optim/rank_00003")
"""

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from converters.hf_io import CheckpointError

TENSORS, SKELETON = ".safetensors", ".json"
VERSION = 1
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


class StateError(CheckpointError):
    """Per-rank state that cannot be saved as data, or a saved state that is damaged."""


def _flatten(value, tensors: dict[str, torch.Tensor], where: str):
    """JSON for value; its tensors go into `tensors` under generated names."""
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = _own_bytes(value)
        return {_TENSOR: name}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        items = [_flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str | int) or isinstance(k, bool)]
        if bad:
            raise StateError(
                f"{where} has a key {bad[0]!r} of type {type(bad[0]).__name__}: only str and int keys are saved"
            )
        return {_DICT: [[k, _flatten(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise StateError(
        f"{where} is a {type(value).__name__}: only tensors, numbers, strings, None and "
        "lists/tuples/dicts of them are saved; convert it first"
    )


def _own_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with a storage of exactly its bytes (safetensors refuses shared storage)."""
    t = t.detach().cpu()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _unflatten(node, tensors: dict[str, torch.Tensor]):
    if isinstance(node, list):
        return [_unflatten(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        return tensors[node[_TENSOR]]
    if _TUPLE in node:
        return tuple(_unflatten(v, tensors) for v in node[_TUPLE])
    return {k: _unflatten(v, tensors) for k, v in node[_DICT]}


def save_state(state, path: str | Path) -> tuple[Path, Path]:
    """Write `path`.safetensors and `path`.json (each atomically, the JSON last)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {"version": VERSION, "state": _flatten(state, tensors, "state")}
    files = path.with_name(path.name + TENSORS), path.with_name(path.name + SKELETON)
    tmp = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in files]
    try:
        save_file(tensors, tmp[0])
        tmp[1].write_text(json.dumps(skeleton))
        for t, p in zip(tmp, files, strict=True):
            _fsync(t)
            t.replace(p)
    finally:
        for t in tmp:
            t.unlink(missing_ok=True)
    return files


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_state(path: str | Path):
    """The state saved at `path` (no code runs); StateError naming the file when damaged."""
    path = Path(path)
    tensor_file, skeleton_file = (
        path.with_name(path.name + TENSORS),
        path.with_name(path.name + SKELETON),
    )
    try:
        skeleton = json.loads(skeleton_file.read_text())
        tensors = load_file(tensor_file)
        return _unflatten(skeleton["state"], tensors)
    except FileNotFoundError as err:
        raise StateError(
            f"{err.filename} is missing: the save did not finish; resume from an earlier checkpoint"
        ) from None
    except (SafetensorError, OSError) as err:
        raise StateError(
            f"{tensor_file} is unreadable ({err}): resume from an earlier checkpoint"
        ) from None
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise StateError(
            f"{skeleton_file} is damaged ({type(err).__name__}: {err}): "
            "resume from an earlier checkpoint"
        ) from None
