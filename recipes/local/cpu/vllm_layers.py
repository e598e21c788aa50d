"""vLLM CPU layers that a rollout with changing weights needs (registered by vllm_plugin).

Each class is an out-of-tree replacement (vLLM's `register_oot`): wherever vLLM builds the
in-tree layer, it builds ours, a subclass that changes only what is named here.

- Linears keep their weight. vLLM's CPU linear packs its weight for oneDNN / sgl-kernel and
  frees the original (`layers/utils.py` dispatch_cpu_unquantized_gemm, remove_weight=True),
  so a second load, verl's weight update, finds a 0-element parameter. vLLM's own per-layer
  switch `_cpu_skip_gemm_dispatch` keeps it and runs F.linear on it.
- The MoE method keeps each layer's experts twice: as loaded (the loader's shape, [E, 2 x I/tp,
  H] and [E, H, I/tp]) and as the CPU kernel reads them (each partition's intermediate size
  zero-padded to the kernel's alignment, then prepacked). vLLM sets the kernel up from the
  loaded tensors on the first load only, and then registers the kernel's under the loader's
  names: a weight update would write the new weights into the padded, packed tensors, which
  fails (or, unpadded, reads the stale packing). So the kernel's parameters load into the kept
  ones, and every `process_weights_after_loading` pads and packs the kernel's again from them.
- The MoE runner reports, per layer, the experts the kernel's own routing function
  (`CPUUnquantizedExperts._select_experts`, on the same inputs) selects, to vLLM's
  routed-experts capturer, which the monolithic CPU kernel cannot feed itself.
"""

import logging

import torch
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.utils import replace_parameter

logger = logging.getLogger(__name__)
KEEP_WEIGHT_LINEARS = (ReplicatedLinear, QKVParallelLinear, MergedColumnParallelLinear,
                       RowParallelLinear)  # fmt: skip


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


class RlCpuFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method whose CPU kernel is rebuilt from the loaded experts after
    every load (the first and each weight update)."""

    def _setup_kernel(self, layer, w13: torch.Tensor, w2: torch.Tensor) -> None:
        if self.unquantized_backend != UnquantizedMoeBackend.CPU:
            return super()._setup_kernel(layer, w13, w2)
        if self.moe_kernel is None:  # the first load: w13, w2 are the loaded parameters
            layer.rl_loaded_experts = dict(zip(EXPERT_WEIGHTS, (w13, w2), strict=True))
            super()._setup_kernel(layer, w13, w2)
        else:  # an update wrote into the kept tensors: pad and pack the kernel's anew
            for name, loaded in layer.rl_loaded_experts.items():
                replace_parameter(layer, name, loaded.data)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
        _load_into_kept(layer)

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None):
        report = getattr(layer, "report_routes", None)
        if report is not None:
            _, topk_ids = self.moe_kernel.impl.fused_experts._select_experts(
                x, router_logits, layer.num_expert_group, layer.topk_group,
                layer.e_score_correction_bias, layer.routed_scaling_factor,
            )  # fmt: skip
            report(topk_ids)
        return super().apply_monolithic(layer, x, router_logits, input_ids)


class RlCpuMoERunner(MoERunner):
    """vLLM's MoE runner as a RoutedExpertsCaptureSource (layer_id, capture_fn): vLLM's
    capturer sets capture_fn; the MoE method hands it the routed experts of each forward."""

    capture_fn = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routed_experts.report_routes = self._report_routes

    def _report_routes(self, topk_ids: torch.Tensor) -> None:
        if self.capture_fn is not None:
            self.capture_fn(topk_ids)


def _load_into_kept(layer) -> None:
    """The kernel's expert parameters hand what the loader gives them to the kept tensors of
    the loader's shape (vLLM's MoE weight loader slices by the target's shape)."""
    for name, loaded in layer.rl_loaded_experts.items():
        getattr(layer, name).weight_loader = _loading_into(loaded)


def _loading_into(loaded: torch.nn.Parameter):
    def weight_loader(param, *args, **kwargs):  # vLLM passes `param` by name or position
        return loaded.weight_loader(loaded, *args, **kwargs)

    return weight_loader


def _keeping_weight(cls: type) -> type:
    return type(f"RlCpu{cls.__name__}", (cls,), {"_cpu_skip_gemm_dispatch": True})


_registered = False


def register() -> None:
    """Once per process (vLLM loads plugins in every process, possibly more than once)."""
    global _registered
    if _registered:
        return
    UnquantizedFusedMoEMethod.register_oot(RlCpuFusedMoEMethod)
    MoERunner.register_oot(RlCpuMoERunner)
    for cls in KEEP_WEIGHT_LINEARS:
        cls.register_oot(_keeping_weight(cls))
    _registered = True
    logger.info("vLLM CPU rollout layers: weights kept, experts repacked, routes reported")
