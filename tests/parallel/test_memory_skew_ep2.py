"""EP skew on the tiny model at ep=2 (2 gloo processes): forcing every token onto EP rank 0's
experts, the saved-tensor bytes of each rank match the skewed estimate, and the SkewGuard
warns; with balanced routing it stays silent."""

import pytest

from backend.qwen3_moe import load_qwen3_moe_spec
from parallel.activations import OURS_ON_CPU_KERNELS, layer_activation_bytes
from parallel.plan import ParallelPlan
from recipes.local.task.hf_checkpoints import tiny_config
from tests.support.multiproc import run_ranks
from tests.support.skew_ranks import TOKENS, skewed_and_balanced

ASSUMED = 1.5


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(skewed_and_balanced, 2, ASSUMED)


def _estimate(load: float) -> float:
    spec = load_qwen3_moe_spec(tiny_config())
    plan = ParallelPlan(ep=2, devices_per_node=2)
    per_layer = layer_activation_bytes(
        spec, plan, TOKENS, b=4, kernels=OURS_ON_CPU_KERNELS, ep_skew=load
    )
    return spec.num_layers * per_layer


@pytest.mark.parametrize("mode, loads", [("skewed", (2.0, 0.0)), ("balanced", (1.0, 1.0))])
def test_saved_bytes_match_the_skewed_estimate(ranks, mode, loads):
    # rank 0 receives every routed token (s = ep = 2), rank 1 none; balanced: both s = 1
    for rank, load in enumerate(loads):
        measured = ranks[rank][mode]["saved_bytes"]
        assert _estimate(load) == pytest.approx(measured, rel=0.05), (rank, mode)
    skewed_0, balanced_0 = ranks[0]["skewed"]["saved_bytes"], ranks[0]["balanced"]["saved_bytes"]
    # what the skew adds is itself as estimated (not hidden inside the 5% of the total)
    assert skewed_0 - balanced_0 == pytest.approx(_estimate(2.0) - _estimate(1.0), rel=0.05)


def test_skew_guard_warns_on_the_skewed_run_only(ranks):
    for result in ranks:
        assert result["skewed"]["ep_skew_max"] == pytest.approx(2.0)
        assert result["balanced"]["ep_skew_max"] == pytest.approx(1.0)
        assert result["balanced"]["warnings"] == []
        (line,) = result["skewed"]["warnings"]
        assert "step 0" in line and "2.00x at layer" in line and f"{ASSUMED:.2f}x" in line
