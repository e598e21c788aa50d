"""The few patches megatron-core needs where its code assumes CUDA or TransformerEngine.

Every shim is named, says why it exists, lists the devices it is for, and is
idempotent. `apply_shims(device)` runs the ones for that device; the device
layer calls it before any model code imports megatron. Official flags are used
instead of shims wherever megatron-core has one (see backend.model):

- RNG: model_parallel_cuda_manual_seed(..., inference_rng_tracker=True) (no CUDA RNG state),
- dispatcher: moe_token_dispatcher_type="allgather" on CPU (alltoall creates CUDA streams),
- use_cpu_initialization=True on CPU.

Measured on megatron-core 0.12.1 and 0.16.1 with torch 2.13 (CPU).
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    devices: tuple[str, ...]
    patch: Callable[[], None]


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_cuda_current_device() -> None:
    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_current_device


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_allows_sequence_parallel", False):
        return

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        # torch's norms are token-wise, so a sequence shard is fine; build with the check
        # off, then tag the weights so grad finalisation sums them over TP as mcore expects
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._allows_sequence_parallel = True
    WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random

    if not torch.cuda.is_available():
        random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        random._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_cuda_synchronize() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None


def _patch_write_item_format() -> None:
    from functools import partial

    from torch.distributed.checkpoint import filesystem

    from backend.compat import mcore_version

    if mcore_version().release >= (0, 13) or not hasattr(filesystem, "SerializationFormat"):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._write_item, partial):
        filesystem_async._write_item = partial(
            filesystem._write_item, serialization_format=filesystem.SerializationFormat.TORCH_SAVE
        )


def _noop_decorator(func):
    return func


def _compile_wrapped(value):
    """The function torch.compile wrapped, if `value` is such a wrapper (else None)."""
    if inspect.isfunction(value):
        return vars(value).get("_torchdynamo_orig_callable")
    return None


def _patch_jit_fuser_off() -> None:
    import sys

    from megatron.core import jit

    # modules imported from now on decorate with a no-op (0.16 has disable_jit_fuser for this)
    jit.jit_fuser = _noop_decorator
    # ones already imported (MindSpeed's adaptor imports megatron first) hold torch.compile
    # wrappers, compiled lazily on the first call: put the original functions back
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core.") or module is None:
            continue
        owners = [module] + [
            v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name
        ]  # module functions and methods (e.g. the router's and experts' fused helpers)
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                original = _compile_wrapped(value)
                if original is not None:
                    setattr(owner, attr, original)


def compiled_functions() -> list[str]:
    """megatron-core functions currently wrapped by torch.compile (what the shim above undoes)."""
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core.") and module is not None:
            for owner in [module] + [
                v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name
            ]:
                found += [
                    f"{name}.{attr}"
                    for attr, value in vars(owner).items()
                    if _compile_wrapped(value) is not None
                ]
    return found


SHIMS: tuple[Shim, ...] = (
    Shim(
        name="cuda_current_device_is_cpu",
        why="megatron-core passes device=torch.cuda.current_device() when it creates tensors "
        "(rotary embedding, router, experts, TP mappings); with no CUDA that call raises, "
        "so on CPU it answers the cpu device",
        devices=("cpu",),
        patch=_patch_cuda_current_device,
    ),
    Shim(
        name="te_general_gemm_placeholder",
        why="megatron-core 0.16 moe_utils reads te_general_gemm, bound only when "
        "TransformerEngine imports; without TE the router forward raises NameError. "
        "None selects its plain torch.mm path",
        devices=("cpu", "cuda", "npu"),
        patch=_patch_te_general_gemm,
    ),
    Shim(
        name="torch_norm_sequence_parallel",
        why="without Apex or TE, mcore's local norm is torch's RMSNorm wrapper, which refuses "
        "sequence parallelism (an assert), and mcore requires sequence parallelism for MoE "
        "with TP > 1; the norm is token-wise, so it is built with the check off and its "
        "weights tagged sequence_parallel",
        devices=("cpu", "cuda"),
        patch=_patch_torch_norm_sequence_parallel,
    ),
    Shim(
        name="cuda_rng_state_is_empty",
        why="activation recompute (CheckpointFunction) saves and restores the CUDA RNG state "
        "around each replay; with no CUDA there is none, so it is an empty tensor and "
        "restoring it does nothing (CPU RNG state is still saved and restored by mcore)",
        devices=("cpu",),
        patch=_patch_cuda_rng_state,
    ),
    Shim(
        name="cuda_synchronize_is_noop",
        why="dist_checkpointing's writer calls torch.cuda.synchronize() after its "
        "device-to-host copies; with no CUDA there is nothing to wait for",
        devices=("cpu",),
        patch=_patch_cuda_synchronize,
    ),
    Shim(
        name="jit_fuser_without_inductor",
        why="megatron-core sets jit_fuser = torch.compile at import and decorates its fused "
        "kernels with it (fusions/fused_bias_swiglu.py: weighted_swiglu, bias_swiglu, ...), so "
        "the MoE experts' weighted SwiGLU would be compiled by inductor, which torch_npu does "
        "not target; megatron-core has no flag for it (0.16's disable_jit_fuser only affects "
        "modules imported later), so npu runs the same functions eagerly",
        devices=("npu",),
        patch=_patch_jit_fuser_off,
    ),
    Shim(
        name="dist_ckpt_write_item_format",
        why="megatron-core 0.12.1's torch_dist writer calls torch's filesystem _write_item "
        "without the serialization_format argument newer torch requires; bind it to "
        "TORCH_SAVE, the format it always wrote (no-op on megatron-core >= 0.13)",
        devices=("cpu", "cuda", "npu"),
        patch=_patch_write_item_format,
    ),
)

_applied: set[str] = set()


def apply_shims(device: str) -> list[str]:
    """Apply the shims meant for `device` (in order); return the names now active."""
    for shim in SHIMS:
        if device in shim.devices and shim.name not in _applied:
            shim.patch()
            _applied.add(shim.name)
    return sorted(_applied)
