"""Where every world-size-1 mcore parameter lives in a megatron-core dist checkpoint.

The source of truth is the model itself: the GPTModel (local spec) is built on the meta
device at world size 1 and asked for its `sharded_state_dict()`, so the checkpoint keys,
global shapes and chunk offsets are exactly what the installed megatron-core loads and
reshards to any TP/EP/PP/ETP plan. Nothing is allocated: Qwen3-30B-A3B's layout (18,771
chunks) takes ~1.2 s (megatron imported) and ~0.15 GB.

A `Piece` is one ShardedTensor: a region of a global checkpoint tensor (`key`, `offset`,
`shape`) and the part of its parameter it holds (as_strided view: the GLU fc1 factory
stores gate and up rows as two pieces).
"""

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from converters.errors import ConversionError


@dataclass(frozen=True)
class Piece:
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # chunk shape, with the prepended (layer, expert) axes
    global_shape: tuple[int, ...]
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset in the param

    def of(self, param: torch.Tensor) -> torch.Tensor:
        return param.as_strided(*self.view)


@dataclass
class Layout:
    sharded_state_dict: dict  # world-1 model's, factories applied (meta data)
    shapes: dict[str, tuple[int, ...]]  # parameter name -> full shape, in model order
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16

    def nbytes(self, name: str) -> int:
        return torch.Size(self.shapes[name]).numel() * self.dtype.itemsize


def world1_groups():
    """megatron-core parallel state at world size 1: the layout must be the unsharded one."""
    from backend.platform.device import prepare_device

    prepare_device("cpu")  # before megatron is imported
    from megatron.core import parallel_state as ps

    from backend.training.distributed import current_groups, init_parallel

    if not ps.model_parallel_is_initialized():
        return init_parallel("cpu")
    groups = current_groups()
    if groups.size("world") != 1:
        raise ConversionError(
            "the converters run in a single process: call them outside a parallel job"
        )
    return groups


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Importing megatron and building the layout make hundreds of thousands of objects that
    all live on; the cyclic collector would rescan them again and again meanwhile. Paused,
    they are scanned a couple of times once it resumes (figures: converters/README.md,
    "Start-up")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_layout(spec, dtype: torch.dtype) -> Layout:
    with _collector_paused():
        return _build_layout(spec, dtype)


def _build_layout(spec, dtype: torch.dtype) -> Layout:
    groups = world1_groups()
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from backend.model.build import BuildOptions, build_model

    with torch.device("meta"):
        opts = BuildOptions(dtype=dtype, spec="local", init_weights=False)
        model = build_model(spec, groups, opts)
        # torch norms stay fp32 whatever params_dtype; training casts the whole model
        # (Float16Module), so its checkpoints hold one dtype: so do ours
        model = model.to(dtype)
    shapes = {
        name: tuple(p.shape)
        for name, p in model.state_dict(keep_vars=True).items()
        if isinstance(p, torch.Tensor) and not name.endswith("_extra_state")
    }
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    layout = Layout(sharded, shapes, dtype=dtype)
    for name, value in sharded.items():
        for sh in nested_values(value) if isinstance(value, (dict, list)) else [value]:
            if isinstance(sh, ShardedTensor):
                chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                view = (tuple(sh.data.shape), tuple(sh.data.stride()), sh.data.storage_offset())
                piece = Piece(sh.key, tuple(sh.global_offset), chunk, tuple(sh.global_shape), view)
                layout.pieces.setdefault(name, []).append(piece)
    missing = set(shapes) - set(layout.pieces)
    assert not missing, f"parameters without a ShardedTensor: {sorted(missing)[:3]}"
    return layout
