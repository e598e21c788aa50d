"""Device layer: choose cuda / npu / cpu and prepare megatron-core for it.

`prepare_device(kind)` must run before model code imports megatron:
- npu: imports torch_npu and MindSpeed's megatron adaptor (it patches megatron on import),
- cuda: checks a GPU is visible,
- cpu: nothing to import; the CPU shims make megatron's CUDA-only calls answer the cpu device.
"""

import torch

from backend.platform.mcore_shims import apply_shims
from backend.platform.optional import available, require

DEVICES = ("cuda", "npu", "cpu")
DIST_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


class DeviceError(RuntimeError):
    """The requested device cannot be used on this machine."""


def resolve_device(kind: str | None = "auto") -> str:
    """'auto' picks cuda if a GPU is visible, else npu if torch_npu imports, else cpu."""
    if kind in (None, "auto"):
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if available("torch_npu") else "cpu"
    if kind not in DEVICES:
        raise DeviceError(f"unknown device {kind!r}: choose one of {', '.join(DEVICES)} or auto")
    return kind


def prepare_device(kind: str | None = "auto") -> str:
    """Resolve the device, import its stack, apply its shims; return the device name."""
    device = resolve_device(kind)
    if device == "npu":
        require("torch_npu", "device npu")
        require("mindspeed.megatron_adaptor", "device npu (megatron-core on Ascend)")
    elif device == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "device cuda was requested but torch sees no GPU: use --device cpu or check CUDA_VISIBLE_DEVICES"
        )
    apply_shims(device)
    return device


def torch_device(device: str, local_rank: int = 0) -> torch.device:
    """The torch.device that holds this rank's model."""
    return torch.device("cpu") if device == "cpu" else torch.device(device, local_rank)


def dist_backend(device: str) -> str:
    """torch.distributed backend for the device (gloo on CPU)."""
    return DIST_BACKENDS[device]


def has_transformer_engine() -> bool:
    """TransformerEngine importable (selects the TE layer spec)."""
    return available("transformer_engine.pytorch")
