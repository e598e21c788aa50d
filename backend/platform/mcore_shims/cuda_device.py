"""Shims for megatron-core's direct torch.cuda calls (current device and stream, RNG state,
synchronize) on a machine without CUDA."""

import torch

from backend.platform.mcore_shims.shim import Shim


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_cuda_current_device() -> None:
    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_current_device


def _patch_cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random

    if not torch.cuda.is_available():
        random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        random._set_cuda_rng_state = lambda *args, **kwargs: None


class _NoStream:
    """What torch.cuda.current_stream() answers on CPU: nothing to wait for."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None


def _patch_cuda_current_stream() -> None:
    if not torch.cuda.is_available():
        torch.cuda.current_stream = lambda device=None: _NoStream()


def _patch_cuda_synchronize() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None


CUDA_CURRENT_DEVICE_IS_CPU = Shim(
    name="cuda_current_device_is_cpu",
    why="megatron-core passes device=torch.cuda.current_device() when it creates tensors "
    "(rotary embedding, router, experts, TP mappings); with no CUDA that call raises, "
    "so on CPU it answers the cpu device",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_cuda_current_device,
)
CUDA_RNG_STATE_IS_EMPTY = Shim(
    name="cuda_rng_state_is_empty",
    why="activation recompute (CheckpointFunction) saves and restores the CUDA RNG state "
    "around each replay; with no CUDA there is none, so it is an empty tensor and "
    "restoring it does nothing (CPU RNG state is still saved and restored by mcore)",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_cuda_rng_state,
)
CUDA_SYNCHRONIZE_IS_NOOP = Shim(
    name="cuda_synchronize_is_noop",
    why="dist_checkpointing's writer calls torch.cuda.synchronize() after its "
    "device-to-host copies; with no CUDA there is nothing to wait for",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_cuda_synchronize,
)
CUDA_CURRENT_STREAM_IS_NONE = Shim(
    name="cuda_current_stream_is_none",
    why="megatron-core 0.19's grad-bucket start_grad_sync takes torch.cuda.current_stream() "
    "to wait on CUDA-graph replay events (none outside CUDA graphs); with no CUDA that call "
    "raises, so on CPU it answers a stream with nothing to wait for",
    devices=("cpu",),
    releases=("0.19.2",),
    patch=_patch_cuda_current_stream,
)
