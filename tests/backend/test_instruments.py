"""The router instruments' aux-loss gradient scale, derived from the optimizer's declared DP
reduction (backend.instruments.router_instruments.aux_grad_scale)."""

import pytest

from backend.instruments.router_instruments import DP_REDUCTIONS, aux_grad_scale
from backend.training import optim


def test_scale_undoes_a_mean_and_leaves_a_sum():
    assert aux_grad_scale("mean", 4) == 4.0
    assert aux_grad_scale("sum", 4) == 1.0
    assert aux_grad_scale("mean", 1) == aux_grad_scale("sum", 1) == 1.0


def test_the_optimizer_declares_a_known_reduction():
    assert optim.DP_REDUCTION in DP_REDUCTIONS
    assert optim.DP_REDUCTION == "mean"  # megatron-core DDP's default: the engine's aux scale = dp


def test_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="dp_reduction='avg'"):
        aux_grad_scale("avg", 2)
