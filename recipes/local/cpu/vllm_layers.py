"""vLLM CPU layers that a rollout with changing weights needs (registered by vllm_plugin).

Each class is an out-of-tree replacement (vLLM's `register_oot`): wherever vLLM builds the
in-tree layer, it builds ours, a subclass that changes only what is named here.

- Linears keep their weight. vLLM's CPU linear packs its weight for oneDNN / sgl-kernel and
  frees the original (`layers/utils.py` dispatch_cpu_unquantized_gemm, remove_weight=True),
  so a second load, verl's weight update, finds a 0-element parameter. vLLM's own per-layer
  switch `_cpu_skip_gemm_dispatch` keeps it and runs F.linear on it.
- The MoE method prepacks the experts again after every update (vLLM sets the CPU kernel up
  on the first load only; later loads copy the new weights in unpacked).
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

logger = logging.getLogger(__name__)
KEEP_WEIGHT_LINEARS = (ReplicatedLinear, QKVParallelLinear, MergedColumnParallelLinear,
                       RowParallelLinear)  # fmt: skip


class RlCpuFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, with the CPU experts prepacked after every load."""

    def _setup_kernel(self, layer, w13: torch.Tensor, w2: torch.Tensor) -> None:
        is_update = self.moe_kernel is not None
        super()._setup_kernel(layer, w13, w2)
        if is_update and self.unquantized_backend == UnquantizedMoeBackend.CPU:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

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
