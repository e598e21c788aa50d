"""Measure what decoder layers save for backward, to check the activation formula.

Counts distinct tensor storages handed to autograd (saved_tensors_hooks) while a decoder
layer runs forward, leaving out parameters and the cached causal mask (both live whether or
not backward keeps them), at their size once the forward is over: a storage freed after it
was saved (megatron-core's CheckpointWithoutOutput discards its output and recomputes it in
backward) counts 0. That is the memory backward keeps alive, which peak RSS or tracemalloc
cannot isolate on CPU.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch


class _SavedStorages:
    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.depth = 0  # > 0 while inside a measured module

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        from backend.model.forward import is_causal_mask

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self.depth and key not in self.excluded and not is_causal_mask(tensor):
            self.storages[key] = storage
        return tensor

    @property
    def total(self) -> int:
        """Bytes of the saved storages now (a storage resized to 0 since counts 0)."""
        return sum(storage.nbytes() for storage in self.storages.values())


@contextmanager
def saved_bytes_inside(model: torch.nn.Module, modules: list[torch.nn.Module]):
    """Yield a counter of bytes saved for backward while any of `modules` runs forward."""
    counter = _SavedStorages({p.untyped_storage().data_ptr() for p in model.parameters()})

    def enter(*_):
        counter.depth += 1

    def leave(*_):
        counter.depth -= 1

    handles = [
        h
        for m in modules
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            yield counter
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class ActivationCheck:
    tokens: int
    measured_bytes: int
    estimated_bytes: float


def check_tiny_activations(
    groups, tokens: int, seed: int = 0, ours: bool = False, recompute: str = "none"
) -> ActivationCheck:
    """Tiny model on one CPU rank (fp32, local spec): measured vs estimated decoder bytes.

    ours: our GroupedExperts + SDPAttention instead of megatron-core's local modules.
    recompute: "none" or "selective" (what a layer keeps under each, parallel.activations).
    `groups` comes from backend.training.distributed.init_parallel on a world of one.
    """
    from transformers import Qwen3MoeConfig

    from backend.model.build import BuildOptions, build_model
    from backend.model.forward import forward_logits
    from backend.qwen3_moe import load_qwen3_moe_spec
    from parallel.activations import LOCAL_SPEC_KERNELS, OURS_ON_CPU_KERNELS, layer_activation_bytes
    from parallel.models import TINY_QWEN3_MOE
    from parallel.plan import ParallelPlan

    spec = load_qwen3_moe_spec(Qwen3MoeConfig(**TINY_QWEN3_MOE))
    torch.manual_seed(seed)
    modules = (
        dict(experts="grouped", attention="sdpa")
        if ours
        else dict(experts="sequential", attention="local")
    )
    options = BuildOptions(
        device="cpu", dtype=torch.float32, spec="local", recompute=recompute, **modules
    )
    model = build_model(spec, groups, options)
    input_ids = torch.randint(0, spec.vocab_size, (1, tokens))
    with saved_bytes_inside(model, list(model.decoder.layers)) as counter:
        forward_logits(model, input_ids)
    per_layer = layer_activation_bytes(
        spec,
        ParallelPlan(devices_per_node=1),
        tokens,
        b=4,
        kernels=OURS_ON_CPU_KERNELS if ours else LOCAL_SPEC_KERNELS,
        selective=recompute == "selective",
    )
    return ActivationCheck(tokens, counter.total, spec.num_layers * per_layer)
