"""Shims for megatron-core's gradient norm and clipping, which assume CUDA grads."""

import torch

from backend.platform.mcore_shims.shim import Shim


def _patch_clip_grads_cpu() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(optimizer.clip_grad_by_total_norm_fp32, "_cpu", False):
        return

    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in params if getattr(p, attr, None) is not None]
        if any(g.device.type != "cpu" or g.dtype != torch.float32 for g in grads):
            return original(params, max_norm, total_norm, use_decoupled_grad)
        coeff = max_norm / (total_norm + 1.0e-6)  # megatron's formula and in-place scale
        if coeff < 1.0:
            for grad in grads:
                grad.copy_(grad * coeff)

    clip._cpu = True
    optimizer.clip_grad_by_total_norm_fp32 = clip


def _patch_local_l2_norm_cpu() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return  # Apex / TE kernels: not our case

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [[torch.norm(t) for t in tensors] for tensors in tensor_lists]
        return torch.tensor([float(torch.norm(torch.tensor(norms)))], dtype=torch.float), None

    clip_grads.l2_norm_impl = l2_norm


CLIP_GRADS_CPU = Shim(
    name="clip_grads_cpu",
    why="clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'; for "
    "cpu fp32 grads the optimizer uses the same clip coefficient and scale without the assert",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_clip_grads_cpu,
)
LOCAL_L2_NORM_ON_CPU = Shim(
    name="local_l2_norm_on_cpu",
    why="without Apex/TE, clip_grads uses utils.local_multi_tensor_l2_norm, which returns "
    "the norm on device='cuda'; the same norm, returned on the cpu",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_local_l2_norm_cpu,
)
