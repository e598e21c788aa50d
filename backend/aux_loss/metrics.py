"""The flat `moe/aux_loss/...` metrics the hook reports each step (read by backend.monitor)."""

import torch

from backend.aux_loss.config import AuxLossConfig
from backend.shared.names import AUX_LOSS_PREFIX

PREFIX = AUX_LOSS_PREFIX


def metric_dict(
    config: AuxLossConfig, balance_L: torch.Tensor, z_L: torch.Tensor, grad_scale: float = 0.0
) -> dict[str, float]:
    """Flat metrics: per-layer values, layer means, the weighted total and whether it was applied.

    load_balancing/*: L (1.0 = perfectly balanced); z_loss/*: Z; total: coeff * sum_l L_l +
    z_coeff * sum_l Z_l, the term added to the objective (with mode observe: that would be).
    grad_scale (mode on): the gradient scale the step's backward passes carried to the aux
    terms, per router call of the step: the hook's grad_scale (the DP size under
    megatron-core's DDP) when every call's aux gradient reached backward, less when some
    never did, 0 when none did.
    """
    width = len(str(len(z_L) - 1))
    out: dict[str, float] = {}
    names = [("z_loss", z_L)]
    if config.type != "none":
        names.insert(0, ("load_balancing", balance_L))
    for name, values_L in names:
        values_L = values_L.double().cpu()
        out.update(
            {f"{PREFIX}/{name}/layer_{i:0{width}d}": float(v) for i, v in enumerate(values_L)}
        )
        out[f"{PREFIX}/{name}/mean"] = float(values_L.mean())
    total = config.z_coeff * float(z_L.double().sum())
    if config.type != "none":
        total += config.coeff * float(balance_L.double().sum())
    out[f"{PREFIX}/total"] = total
    out[f"{PREFIX}/applied"] = 1.0 if config.adds_gradient else 0.0
    if config.adds_gradient:
        out[f"{PREFIX}/grad_scale"] = grad_scale
    return out
