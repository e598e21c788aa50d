"""Router aux losses (load balancing, z-loss) for the actor, explicit and visible.

Our model builder sets megatron-core's own balancing to "none" with coefficient 0, and
verl's engine forces "none" as well; balancing is added here, from `AuxLossConfig`, and
logged every step under `moe/aux_loss/...`. Formulas: losses.py. Lifecycle: hook.py.
Why it is scaled, counted and carried as it is (and what of megatron-core's machinery is
used and not): backend/aux_loss/README.md.
"""

from backend.aux_loss.adapters import hf_aux_loss, mcore_aux_loss
from backend.aux_loss.config import AuxLossConfig, AuxLossConfigError
from backend.aux_loss.hf_tap import HFRouterTap
from backend.aux_loss.hook import AuxLossHook
from backend.aux_loss.metrics import metric_dict

__all__ = [
    "AuxLossConfig",
    "AuxLossConfigError",
    "AuxLossHook",
    "HFRouterTap",
    "hf_aux_loss",
    "mcore_aux_loss",
    "metric_dict",
]
