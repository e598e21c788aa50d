"""ExpertLoadMonitor on synthetic router calls: exact counts, masks, recompute, phases, history."""

import pytest
import torch

from backend.instruments.router_tap import RouterCall
from backend.monitor import ExpertLoadMonitor
from tests.support.oracles import local_counts

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def _call(layer, routing_TE, valid_T=None, recompute=False):
    routing_TE = torch.as_tensor(routing_TE, dtype=torch.bool)
    return RouterCall(layer, routing_TE, valid_T, recompute, lambda: torch.zeros(routing_TE.shape))


# 4 tokens, 4 experts, top-2
ROUTING_TE = [[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1]]


def _monitor(**kw):
    return ExpertLoadMonitor(num_layers=2, num_experts=4, groups=None, top_k=2, **kw)


def test_counts_exact_padding_excluded_recompute_ignored():
    mon = _monitor()
    valid_T = torch.tensor([True, True, False, True])  # token 2 is padding
    with mon.phase("update"):
        mon.record(_call(0, ROUTING_TE, valid_T))
        mon.record(_call(0, ROUTING_TE, valid_T, recompute=True))  # replay in backward
        mon.record(_call(1, ROUTING_TE))
    with mon.phase("ref"):
        mon.record(_call(1, ROUTING_TE, torch.tensor([False, False, False, True])))
    counts_PLE = local_counts(mon)
    assert counts_PLE[0].tolist() == [[3, 1, 1, 1], [3, 2, 2, 1]]
    assert counts_PLE[1].sum() == 0  # old_log_prob never ran
    assert counts_PLE[2].tolist() == [[0, 0, 0, 0], [1, 0, 0, 1]]


def test_calls_outside_a_phase_are_not_counted_but_reported():
    mon = _monitor()
    mon.record(_call(0, ROUTING_TE))
    assert local_counts(mon).sum() == 0
    with mon.phase("update"):
        mon.record(_call(0, ROUTING_TE))
    metrics = mon.step_end(0)
    assert metrics["moe/unlabelled_router_calls"] == 1.0


def test_step_end_metrics_cumulative_and_windows():
    mon = _monitor(window_steps=2)
    for step in range(3):
        with mon.phase("update"):
            mon.record(_call(0, ROUTING_TE))
            mon.record(_call(1, [[1, 1, 0, 0]] * 4))  # layer 1 collapsed onto experts 0, 1
        metrics = mon.step_end(step, aux_losses={"moe/aux_loss": torch.tensor(0.25)})
    assert local_counts(mon).sum() == 0  # zeroed for the next step
    assert metrics["moe/update/layer_0/max_over_mean"] == 1.5  # 3 2 2 1 over mean 2
    assert metrics["moe/update/layer_1/dead"] == 2.0
    assert metrics["moe/update/tokens"] == 4.0
    # the shape the run-health alarms read the per-layer metrics by (backend.monitor.alarms)
    assert metrics["moe/num_experts"] == 4.0 and metrics["moe/top_k"] == 2.0
    assert metrics["moe/update/cumulative/assignments"] == 3 * 16
    assert metrics["moe/aux_loss"] == 0.25
    assert not any(k.startswith("moe/ref/") for k in metrics)  # no ref pass, no ref metrics
    windows = mon.history.all_windows()
    assert [(w.start_step, w.end_step, w.complete) for w in windows] == [
        (0, 1, True),
        (2, 2, False),
    ]
    assert windows[0].counts_PLE[0, 0].tolist() == [6, 4, 4, 2]
    assert mon.history.cumulative_PLE[0, 1].tolist() == [12, 12, 0, 0]


def test_phase_misuse_raises():
    mon = _monitor()
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        with mon.phase("rollout"):
            pass
    with pytest.raises(RuntimeError, match="still open"):
        with mon.phase("update"), mon.phase("ref"):
            pass
    with pytest.raises(ValueError, match="must start with 'moe/aux_loss'"):
        mon.step_end(0, aux_losses={"aux": 1.0})


def test_wrong_shape_call_raises():
    mon = _monitor()
    with pytest.raises(ValueError, match="outside the monitor's 2 x 4"), mon.phase("update"):
        mon.record(_call(2, ROUTING_TE))
