"""Lazy imports of accelerator-only packages, with one-line errors that say what to install."""

import importlib
from types import ModuleType

A2_SET = (
    "an A2 set (`bash scripts/bootstrap.sh --target npu|npu-cann851|npu-cann91` in its base image)"
)
# module -> what to install; shown when the import fails
INSTALL_HINTS = {
    "torch_npu": "the Ascend stack: CANN plus `pip install torch_npu` matching your torch",
    "mindspeed": f"MindSpeed with {A2_SET}",
    "mindspeed.megatron_adaptor": f"MindSpeed with {A2_SET}",
    "vllm": "vLLM for rollouts (`pip install -e .[cuda]`)",
    "vllm_ascend": f"vllm-ascend for rollouts on Ascend, with {A2_SET}",
    "transformer_engine": "TransformerEngine (`pip install transformer_engine[pytorch]`)",
}


class MissingDependencyError(ImportError):
    """An optional package that the chosen device or feature needs is not installed."""


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` or raise MissingDependencyError naming it, the purpose and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        hint = INSTALL_HINTS.get(module, f"`pip install {module.split('.')[0]}`")
        raise MissingDependencyError(
            f"{purpose} needs `{module}`, which is not importable ({err}); install {hint}"
        ) from err


def available(module: str) -> bool:
    """True when `module` imports; never raises."""
    try:
        importlib.import_module(module)
    except Exception:  # a broken install counts as absent
        return False
    return True
