"""EP routing skew in the memory model: what scales, by how much, and the skew margin."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from backend.monitor.history import LoadHistory
from backend.monitor.report import ReportError, build_report, save_report
from backend.shared.names import DEFAULT_EP_SKEW
from parallel.activations import (
    ACCELERATOR_KERNELS,
    attention_side_bytes_per_token,
    checkpoint_bytes,
    dispatch_buffer_bytes,
    expert_side_bytes_per_routed_token,
    layer_activation_bytes,
    stage_activation_bytes,
)
from parallel.cli import main
from parallel.memory import GIB, HEADROOM, MemoryOptions, estimate_memory
from parallel.models import load_spec
from parallel.plan import ParallelPlan, check_against_model
from parallel.skew import skew_from_report, skew_margin

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

QWEN = load_spec()
TOKENS = 8192
PLAN = ParallelPlan(tp=4, ep=8, nodes=4)
FIT = check_against_model(PLAN, QWEN)


def _expert_bytes(plan=PLAN, tokens=TOKENS, b=2):
    """X: one layer's balanced expert-side bytes, T * k * etp / (tp*cp) routed tokens."""
    routed = tokens / (plan.tp * plan.cp) * QWEN.top_k * plan.etp
    return routed * expert_side_bytes_per_routed_token(QWEN, plan.etp, b, ACCELERATOR_KERNELS)


@pytest.mark.parametrize("skew", [0.0, 1.0, 1.5, 2.4, 8.0])
def test_only_the_expert_side_of_a_layer_scales(skew):
    attention = (
        TOKENS / PLAN.tp * attention_side_bytes_per_token(QWEN, 2, ACCELERATOR_KERNELS, TOKENS)
    )
    layer = layer_activation_bytes(QWEN, PLAN, TOKENS, ep_skew=skew)
    assert layer == pytest.approx(attention + skew * _expert_bytes(), rel=1e-12)
    buffers = dispatch_buffer_bytes(QWEN, PLAN, TOKENS, ep_skew=skew)
    assert buffers == pytest.approx(skew * TOKENS / PLAN.tp * QWEN.top_k * 2 * QWEN.hidden_size * 2)


def test_recompute_exposes_one_layer_to_skew():
    layers, extra = QWEN.num_layers, 1.7
    for recompute, exposed in ((False, layers), (True, 1)):
        at_1 = stage_activation_bytes(FIT, 0, TOKENS, recompute, ep_skew=1.0)
        at_s = stage_activation_bytes(FIT, 0, TOKENS, recompute, ep_skew=1.0 + extra)
        assert at_s - at_1 == pytest.approx(exposed * extra * _expert_bytes())
    # what recompute keeps of the other layers (their inputs) does not move with skew
    kept = stage_activation_bytes(FIT, 0, TOKENS, True, ep_skew=3.0)
    assert kept == pytest.approx(
        layers * checkpoint_bytes(QWEN, PLAN, TOKENS)
        + layer_activation_bytes(QWEN, PLAN, TOKENS, ep_skew=3.0)
    )


def test_estimate_adds_exactly_the_scaled_terms_and_caps_at_ep():
    base = estimate_memory(FIT, MemoryOptions(64.0, TOKENS))
    skewed = estimate_memory(FIT, MemoryOptions(64.0, TOKENS, ep_skew=2.5))
    per_s = QWEN.num_layers * _expert_bytes() + dispatch_buffer_bytes(QWEN, PLAN, TOKENS)
    assert skewed.update_bytes - base.update_bytes == pytest.approx(1.5 * per_s)
    assert skewed.idle_bytes == base.idle_bytes  # activations are gone between updates
    capped = estimate_memory(FIT, MemoryOptions(64.0, TOKENS, ep_skew=100.0))
    at_ep = estimate_memory(FIT, MemoryOptions(64.0, TOKENS, ep_skew=8.0))
    assert capped.update_bytes == at_ep.update_bytes  # max over mean of 8 ranks is at most 8
    with pytest.raises(ValueError, match="ep_skew"):
        MemoryOptions(64.0, ep_skew=0.9)


def test_margin_is_where_the_verdict_flips():
    # a memory size that fits balanced routing but not every token on one rank
    at = {
        s: estimate_memory(FIT, MemoryOptions(None, TOKENS, recompute=True, ep_skew=s))
        for s in (1.0, 2.0)
    }
    slope = at[2.0].update_bytes - at[1.0].update_bytes
    device_gib = (at[1.0].update_bytes + 1.4 * slope) / HEADROOM / GIB
    options = MemoryOptions(device_gib, TOKENS, recompute=True)
    margin = skew_margin(FIT, options)
    assert margin == pytest.approx(2.4, abs=2e-3)  # affine in s: 1 + 1.4 slopes of headroom
    assert estimate_memory(FIT, replace(options, ep_skew=margin)).fits
    assert not estimate_memory(FIT, replace(options, ep_skew=margin + 0.01)).fits
    assert skew_margin(FIT, replace(options, device_memory_gib=1000.0)) == 8.0
    assert skew_margin(FIT, replace(options, device_memory_gib=10.0)) is None


def _report(path, curves_SL, ep=2):
    """A report whose update-phase steps carry the given per-layer ep_max_over_mean curves."""
    layers = len(curves_SL[0])
    history = LoadHistory(("update",), layers, 4, ep, 2)
    for step, curve in enumerate(curves_SL):
        counts = torch.ones(1, layers, 4, dtype=torch.int64)
        history.add(step, counts, {})
        history.steps[-1]["phases"]["update"]["layers"]["ep_max_over_mean"] = list(curve)
    plan = {"tp": 1, "ep": ep, "pp": 1, "cp": 1, "dp": ep, "etp": 1, "edp": 1, "world": ep}
    return save_report(build_report(history, plan), path)


def test_skew_from_report_is_the_p95_of_layer_steps(tmp_path):
    rng = np.random.default_rng(0)
    curves = 1 + rng.random((30, 4))
    skew = skew_from_report(_report(tmp_path / "r.json", curves.tolist()))
    assert skew.value == pytest.approx(np.percentile(curves, 95))
    assert "p95" in skew.origin and "30 steps x 4 layers" in skew.origin
    with pytest.raises(ReportError, match="ep=1"):
        skew_from_report(_report(tmp_path / "ep1.json", curves.tolist(), ep=1))


def _counts_report(path, counts_LE, ep):
    """A report of 4 update steps that each routed `counts_LE`, measured at `ep`."""
    layers, experts = len(counts_LE), len(counts_LE[0])
    history = LoadHistory(("update",), layers, experts, ep, 2)
    for step in range(4):
        history.add(step, torch.tensor([counts_LE], dtype=torch.int64), {})
    plan = {"tp": 1, "ep": ep, "pp": 1, "cp": 1, "dp": ep, "etp": 1, "edp": 1, "world": ep}
    return save_report(build_report(history, plan), path)


def test_the_plans_ep_splits_the_reports_counts_where_skew_grows_with_ep(tmp_path):
    """Experts 0 and 2 take 4x the tokens of 1 and 3: two EP ranks hold one hot expert each
    (balanced, 1.0), four ranks one expert each (the busiest 4 over a mean of 2.5: 1.6).
    Catches an ep 2 run's skew applied to an ep 4 plan unchanged, and an ep 1 run's report
    refused where its counts say what any ep would see."""
    counts = [[4, 1, 4, 1], [4, 1, 4, 1]]
    at_ep2 = _counts_report(tmp_path / "ep2.json", counts, ep=2)
    assert skew_from_report(at_ep2).value == pytest.approx(1.0)
    assert skew_from_report(at_ep2, ep=2).value == pytest.approx(1.0)
    split = skew_from_report(at_ep2, ep=4)
    assert split.value == pytest.approx(1.6)
    assert "(1.00) and its counts split into this plan's ep=4 ranks" in split.origin
    at_ep1 = _counts_report(tmp_path / "ep1.json", counts, ep=1)
    assert skew_from_report(at_ep1, ep=4).value == pytest.approx(1.6)
    with pytest.raises(ReportError, match="or give the plan's ep"):
        skew_from_report(at_ep1)


def test_cli_prints_the_verdict_at_the_skew_and_the_margin(tmp_path, capsys):
    # 42 GiB: fits at the default 2x, not at 8x (lean log-prob heads: the update peak is ~38 GiB)
    argv = ["--nodes", "4", "--tp", "4", "--ep", "8", "--recompute", "--device-memory-gb", "42"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"{DEFAULT_EP_SKEW:.2f}x EP skew assumed (default" in out
    assert "fits up to" in out and "x EP skew" in out
    report = _report(tmp_path / "r.json", [[1.2, 1.3]] * 4)
    assert main([*argv, "--skew-from", str(report)]) == 0
    assert "1.30x EP skew assumed (p95 of ep_max_over_mean" in capsys.readouterr().out
    assert main([*argv, "--skew-from", str(tmp_path / "missing.json")]) == 2
    assert "no such report file" in capsys.readouterr().err
