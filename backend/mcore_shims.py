"""The few patches megatron-core needs where its code assumes CUDA or TransformerEngine.

Every shim is named, says why it exists, lists the devices it is for, and is
idempotent. `apply_shims(device)` runs the ones for that device; the device
layer calls it before any model code imports megatron. Official flags are used
instead of shims wherever megatron-core has one (see backend.model):

- RNG: model_parallel_cuda_manual_seed(..., inference_rng_tracker=True) (no CUDA RNG state),
- dispatcher: moe_token_dispatcher_type="allgather" on CPU (alltoall creates CUDA streams),
- use_cpu_initialization=True on CPU.

The distributed optimizer (DistributedDataParallel + get_megatron_optimizer) runs on CPU in
fp32 with the `dist_optim_*` / `optimizer_*` shims below; bf16 stays on accelerators.

Measured on megatron-core 0.12.1 and 0.16.1 with torch 2.13 (CPU).
"""

import functools
import importlib
import inspect
import types
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


def _patch_dist_optim_fp32_params() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._build_model_and_main_param_groups.__func__
    if getattr(original, "_cpu_fp32", False):
        return

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        cpu_fp32 = [
            p for p in param_gbuf_map if p.device.type == "cpu" and p.dtype == torch.float32
        ]
        for param in cpu_fp32:  # only these params, only during this call
            param.type = _cuda_float_type
        try:
            return original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        finally:
            for param in cpu_fp32:
                del param.type

    build._cpu_fp32 = True
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)


def _cuda_float_type(*args, **kwargs) -> str:
    if args or kwargs:
        raise TypeError("dist_optim_fp32_cpu_params: only type() without arguments is shimmed")
    return "torch.cuda.FloatTensor"


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


def _patch_fp8_quantize_without_te() -> None:
    from megatron.core import fp8_utils

    try:
        fp8_utils._quantize_param_shard_impl([], [], [], None)
        return  # >= 0.13: no fp8 params is a no-op already
    except RuntimeError:
        pass
    original = fp8_utils._quantize_param_shard_impl

    def quantize(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    fp8_utils._quantize_param_shard_impl = quantize


def _patch_numpy_product() -> None:
    import numpy as np

    if hasattr(np, "product"):
        return
    alias = types.ModuleType("numpy")
    alias.__getattr__ = lambda name: getattr(np, name)
    alias.product = np.prod
    for name in ("mapping", "validation", "exchange_utils"):
        module = importlib.import_module(f"megatron.core.dist_checkpointing.{name}")
        if getattr(module, "np", None) is np:
            module.np = alias


def _patch_dist_optim_load_adam_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:  # torch Adam keeps a per-param step; megatron restores it itself
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states._keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


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
    Shim(
        name="optimizer_cuda_literals_are_cpu",
        why="megatron-core's optimizer modules (optimizer, clip_grads, distrib_optimizer) create "
        "their flags and norms with device='cuda' (_dummy_overflow_buf, found_inf, _scale_one, "
        "total-norm and zero-count buffers); in those modules only, torch's factories build "
        "such tensors on the cpu",
        devices=("cpu",),
        patch=_patch_optimizer_cuda_literals,
    ),
    Shim(
        name="schedule_cuda_literals_are_cpu",
        why="megatron-core's pipeline schedules count the step's tokens in a tensor made on "
        "'cuda' (0.16.1: device='cuda'; 0.12.1: torch.tensor(0).cuda()); in that module only, "
        "such tensors stay on the cpu",
        devices=("cpu",),
        patch=_patch_schedule_cuda_literals,
    ),
    Shim(
        name="dist_optim_fp32_cpu_params",
        why="DistributedOptimizer._build_model_and_main_param_groups accepts only "
        "param.type() == 'torch.cuda.FloatTensor' for fp32 params (its fp32 branch only slices "
        "views); during that one call the model's cpu fp32 params answer that type",
        devices=("cpu",),
        patch=_patch_dist_optim_fp32_params,
    ),
    Shim(
        name="clip_grads_cpu",
        why="clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'; for "
        "cpu fp32 grads the optimizer uses the same clip coefficient and scale without the assert",
        devices=("cpu",),
        patch=_patch_clip_grads_cpu,
    ),
    Shim(
        name="local_l2_norm_on_cpu",
        why="without Apex/TE, clip_grads uses utils.local_multi_tensor_l2_norm, which returns "
        "the norm on device='cuda'; the same norm, returned on the cpu",
        devices=("cpu",),
        patch=_patch_local_l2_norm_cpu,
    ),
    Shim(
        name="fp8_quantize_without_te",
        why="megatron-core 0.12.1 without TransformerEngine raises in quantize_param_shard even "
        "with no fp8 params, which every distributed-optimizer step calls; an empty list is a "
        "no-op, as in 0.13+ (no-op on megatron-core >= 0.13)",
        devices=("cpu", "cuda", "npu"),
        patch=_patch_fp8_quantize_without_te,
    ),
    Shim(
        name="dist_ckpt_numpy_product",
        why="megatron-core 0.12.1's dist_checkpointing (mapping, validation, exchange_utils) "
        "calls np.product, removed in numpy 2; those modules get np.prod under that name "
        "(no-op with numpy < 2 or megatron-core >= 0.13)",
        devices=("cpu", "cuda", "npu"),
        patch=_patch_numpy_product,
    ),
    Shim(
        name="dist_optim_load_adam_step",
        why="with torch's Adam (no Apex/TE FusedAdam) every param state holds a 'step'; "
        "megatron-core 0.12.1's fully_sharded_model_space load drops 'step' from what it read "
        "(it restores it from param_groups) and then copies every state key, so KeyError; "
        "a missing 'step' is copied from the state itself (no-op with FusedAdam)",
        devices=("cpu", "cuda", "npu"),
        patch=_patch_dist_optim_load_adam_step,
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
