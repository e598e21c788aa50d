"""The rollout fit counts what shares each chip with the actor: vLLM's own device context and
the collective buffers of every communicator, in the update peak and in vLLM's share."""

import math

import pytest

from parallel.memory import HEADROOM
from parallel.models import load_spec
from parallel.plan import ParallelPlan, PlanError, check_against_model
from recipes.dapo.job import fit as fit_mod
from recipes.dapo.job.fit import COMM_BUFFER_GIB, SECOND_CONTEXT_GIB, communicators, fit_rollout
from recipes.dapo.job.overrides import MICRO_BATCH_TOKENS


def _fit(device="npu", tp=4, ep=8, rollout_tp=4):
    plan = ParallelPlan(tp=tp, ep=ep, nodes=4, devices_per_node=8)
    return fit_rollout(
        check_against_model(plan, load_spec(None)), device, MICRO_BATCH_TOKENS, rollout_tp
    )


def test_communicators_of_a_chip():
    plan = ParallelPlan(tp=4, ep=8, nodes=4, devices_per_node=8)  # dp 8, edp 4
    assert communicators(plan, rollout_tp=4) == 5 + 2  # tp dp ep edp world + vLLM tp, world
    assert communicators(ParallelPlan(nodes=1, devices_per_node=1), rollout_tp=1) == 0


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_vllm_share_leaves_room_for_contexts_and_buffers(device):
    fit = _fit(device)
    assert fit.context_gib == SECOND_CONTEXT_GIB[device]
    assert fit.comm_gib == pytest.approx(7 * COMM_BUFFER_GIB[device])
    left = HEADROOM * fit.device_gib - fit.actor_idle_gib - fit.context_gib - fit.comm_gib
    assert fit.gpu_memory_utilization == math.floor(left / fit.device_gib * 100) / 100
    # HCCL: 2 x 200 MB per communicator (CANN's HCCL_BUFFSIZE default)
    assert COMM_BUFFER_GIB["npu"] == pytest.approx(400 / 1024)
    assert any("second device context" in line for line in fit.lines())


def test_a2_share_is_below_the_share_without_them():
    fit = _fit("npu")
    without = math.floor((HEADROOM * fit.device_gib - fit.actor_idle_gib) / fit.device_gib * 100)
    assert fit.gpu_memory_utilization * 100 <= without - 5  # 3.7 GiB of 64 GiB


def test_update_peak_includes_them(monkeypatch):
    monkeypatch.setitem(fit_mod.SECOND_CONTEXT_GIB, "npu", 40.0)  # nothing fits beside it
    with pytest.raises(PlanError, match="vLLM context and collective buffers"):
        _fit("npu")
