"""Shims for megatron-core modules that build tensors on device 'cuda' by name (optimizer
flags and norms, the schedules' token count): in those modules only, they stay on the cpu."""

import functools
import importlib
import types

import torch

from backend.platform.mcore_shims.shim import Shim

_OPTIMIZER_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


class _TorchWithCpuForCuda(types.ModuleType):
    """`torch` for a megatron module: factories asked for device 'cuda' build on the cpu."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory):
        @functools.wraps(factory)
        def build(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return factory(*args, device=device, **kwargs)

        return build


def _patch_optimizer_cuda_literals() -> None:
    for name in _OPTIMIZER_MODULES:
        module = importlib.import_module(name)
        if module.torch is torch:
            module.torch = _TorchWithCpuForCuda()


class _HostTensor(torch.Tensor):
    """A cpu tensor whose .cuda() stays on the cpu (a plain tensor again)."""

    def cuda(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


class _TorchWithCpuForCudaTensors(_TorchWithCpuForCuda):
    """Also `torch.tensor(...).cuda()` (0.12.1's schedules) stays on the cpu."""

    def __init__(self):
        super().__init__()
        tensor = self.tensor
        self.tensor = lambda *args, **kwargs: tensor(*args, **kwargs).as_subclass(_HostTensor)


def _patch_schedule_cuda_literals() -> None:
    from megatron.core.pipeline_parallel import schedules

    if schedules.torch is torch:
        schedules.torch = _TorchWithCpuForCudaTensors()


OPTIMIZER_CUDA_LITERALS_ARE_CPU = Shim(
    name="optimizer_cuda_literals_are_cpu",
    why="megatron-core's optimizer modules (optimizer, clip_grads, distrib_optimizer) create "
    "their flags and norms with device='cuda' (_dummy_overflow_buf, found_inf, _scale_one, "
    "total-norm and zero-count buffers); in those modules only, torch's factories build "
    "such tensors on the cpu",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_optimizer_cuda_literals,
)
SCHEDULE_CUDA_LITERALS_ARE_CPU = Shim(
    name="schedule_cuda_literals_are_cpu",
    why="megatron-core's pipeline schedules count the step's tokens in a tensor made on "
    "'cuda' (0.16.1: device='cuda'; 0.12.1: torch.tensor(0).cuda()); in that module only, "
    "such tensors stay on the cpu",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_schedule_cuda_literals,
)
