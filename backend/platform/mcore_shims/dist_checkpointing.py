"""Shims for megatron-core 0.12.1's dist_checkpointing under newer torch and numpy 2."""

import importlib
import types

from backend.platform.mcore_shims.shim import Shim


def _patch_write_item_format() -> None:
    from functools import partial

    from torch.distributed.checkpoint import filesystem

    from backend.platform.compat import mcore_version

    if mcore_version().release >= (0, 13) or not hasattr(filesystem, "SerializationFormat"):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._write_item, partial):
        filesystem_async._write_item = partial(
            filesystem._write_item, serialization_format=filesystem.SerializationFormat.TORCH_SAVE
        )


def _patch_numpy_product() -> None:
    import numpy as np

    from backend.platform.compat import mcore_version

    if mcore_version().release >= (0, 13) or hasattr(np, "product"):
        return
    alias = types.ModuleType("numpy")
    alias.__getattr__ = lambda name: getattr(np, name)
    alias.product = np.prod
    for name in ("mapping", "validation", "exchange_utils"):
        module = importlib.import_module(f"megatron.core.dist_checkpointing.{name}")
        if getattr(module, "np", None) is np:
            module.np = alias


DIST_CKPT_WRITE_ITEM_FORMAT = Shim(
    name="dist_ckpt_write_item_format",
    why="megatron-core 0.12.1's torch_dist writer calls torch's filesystem _write_item "
    "without the serialization_format argument newer torch requires; bind it to "
    "TORCH_SAVE, the format it always wrote (no-op on megatron-core >= 0.13)",
    devices=("cpu", "cuda", "npu"),
    releases=("0.12.1",),
    patch=_patch_write_item_format,
)
DIST_CKPT_NUMPY_PRODUCT = Shim(
    name="dist_ckpt_numpy_product",
    why="megatron-core 0.12.1's dist_checkpointing (mapping, validation, exchange_utils) "
    "calls np.product, removed in numpy 2; those modules get np.prod under that name "
    "(no-op with numpy < 2 or megatron-core >= 0.13)",
    devices=("cpu", "cuda", "npu"),
    releases=("0.12.1",),
    patch=_patch_numpy_product,
)
