"""Shims for megatron-core's DistributedOptimizer with cpu fp32 params and torch's Adam."""

import torch

from backend.platform.mcore_shims.shim import Shim


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


DIST_OPTIM_FP32_CPU_PARAMS = Shim(
    name="dist_optim_fp32_cpu_params",
    why="DistributedOptimizer._build_model_and_main_param_groups accepts only "
    "param.type() == 'torch.cuda.FloatTensor' for fp32 params (its fp32 branch only slices "
    "views); during that one call the model's cpu fp32 params answer that type",
    devices=("cpu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_dist_optim_fp32_params,
)
DIST_OPTIM_LOAD_ADAM_STEP = Shim(
    name="dist_optim_load_adam_step",
    why="with torch's Adam (no Apex/TE FusedAdam) every param state holds a 'step'; "
    "megatron-core 0.12.1's loads (dp_zero_gather_scatter, which backend.training.optim saves there, "
    "and fully_sharded_model_space) pass no 'step' (it is restored from param_groups) and "
    "then copy every state key, so KeyError; a missing 'step' is copied from the state "
    "itself (no-op with FusedAdam, and with 0.16.1's dp_reshardable, which saves 'step')",
    devices=("cpu", "cuda", "npu"),
    releases=("0.12.1",),
    patch=_patch_dist_optim_load_adam_step,
)
