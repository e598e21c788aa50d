"""SkewGuard: measured EP skew against the plan's assumption, rate-limited, in the report."""

import logging

import pytest
import torch

from backend.instruments.router_tap import RouterCall
from backend.monitor import ExpertLoadMonitor, SkewGuard, load_report
from backend.monitor.render import render

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

LAYERS, EXPERTS, EP = 3, 8, 2


def _skews(*values):
    return {"update": torch.tensor(values, dtype=torch.float64)}


def test_warns_once_per_window_naming_step_layer_and_both_skews():
    guard = SkewGuard(assumed_skew=1.5, every_n_steps=3)
    first = guard.check(10, _skews(1.1, 1.9, 1.2))
    assert first.step == 10 and first.values["layer"] == 1
    assert "1.90x at layer 1 (update) exceeds the 1.50x" in first.line()
    assert first.line().startswith("WARNING [ep_skew] step 10:") and "\n" not in first.line()
    assert guard.check(11, _skews(2.0, 1.0, 1.0)) is None  # within the window: counted only
    assert guard.check(12, _skews(1.0, 1.0, 1.0)) is None  # balanced
    later = guard.check(13, _skews(1.0, 1.0, 1.6))
    assert later.values == {
        "layer": 2,
        "phase": "update",
        "measured": 1.6,
        "assumed": 1.5,
        "unlogged_steps": 1,
    }
    assert guard.exceeded_steps == 3 and guard.worst == 2.0


def test_silent_at_or_below_the_assumption_and_outside_checked_phases():
    guard = SkewGuard(assumed_skew=1.5, every_n_steps=1)
    assert guard.check(0, _skews(1.5, 1.0, float("nan"))) is None
    assert guard.check(1, {"old_log_prob": torch.tensor([4.0])}) is None
    assert guard.exceeded_steps == 0


@pytest.mark.parametrize(
    "kwargs", [dict(assumed_skew=0.5), dict(assumed_skew=2.0, every_n_steps=0)]
)
def test_rejects_meaningless_settings(kwargs):
    with pytest.raises(ValueError):
        SkewGuard(**kwargs)


def _routing_map(tokens: int, experts_of_token) -> torch.Tensor:
    routing_TE = torch.zeros(tokens, EXPERTS, dtype=torch.bool)
    for t in range(tokens):
        routing_TE[t, list(experts_of_token(t))] = True
    return routing_TE


def _step(monitor, step, experts_of_token):
    with monitor.phase("update"):
        for layer in range(LAYERS):
            call = RouterCall(layer, _routing_map(16, experts_of_token), None, False, lambda: None)
            monitor.record(call)
    return monitor.step_end(step)


def test_monitor_logs_one_line_and_keeps_it_in_the_report(tmp_path, caplog):
    monitor = ExpertLoadMonitor(
        LAYERS, EXPERTS, None, top_k=2, skew_guard=SkewGuard(1.5, every_n_steps=10)
    )
    monitor.plan["ep"] = monitor.history.ep = EP  # the world-1 monitor, told of an ep2 layout
    with caplog.at_level(logging.WARNING, logger="backend.monitor.monitor"):
        balanced = _step(monitor, 0, lambda t: (t % 4, 4 + t % 4))
        skewed = [_step(monitor, s, lambda t: (0, 1)) for s in (1, 2)]
    assert balanced["moe/ep_skew_exceeded_steps"] == 0
    assert skewed[-1]["moe/ep_skew_exceeded_steps"] == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "step 1:" in lines[0] and "2.00x at layer 0" in lines[0]
    path = monitor.write_report(tmp_path / "routing_report.json")
    report = load_report(path)
    assert [(w["kind"], w["step"], w["measured"]) for w in report.warnings] == [("ep_skew", 1, 2.0)]
    html = (render(report, tmp_path / "html") / "index.html").read_text()
    assert "exceeds the 1.50x the memory plan assumed" in html
