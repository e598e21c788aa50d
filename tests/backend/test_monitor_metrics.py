"""Load metrics on hand-built counts, checked against values worked out by hand."""

import math

import pytest
import torch

from backend.monitor import metrics as m
from backend.monitor.compare import jensen_shannon_L

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

# layer 0: 4 experts, loads 4 2 0 2 (N=8, mean 2); layer 1: perfectly balanced
COUNTS_LE = torch.tensor([[4, 2, 0, 2], [1, 1, 1, 1]])


def test_layer_metrics_by_hand():
    per_layer = m.layer_metrics(COUNTS_LE, ep=2)
    assert per_layer["max_over_mean"].tolist() == [2.0, 1.0]
    # deviations 2, 0, -2, 0: population variance 2, std sqrt(2), mean 2
    assert per_layer["cv"].tolist() == pytest.approx([math.sqrt(2) / 2, 0.0])
    # p = .5 .25 0 .25: H = .5 ln 2 + 2 * .25 ln 4 = 1.5 ln 2; / ln 4 = 0.75
    assert per_layer["entropy"].tolist() == pytest.approx([0.75, 1.0])
    assert per_layer["dead"].tolist() == [1.0, 0.0]
    # ceil(4 / 10) = 1 expert: the busiest
    assert per_layer["top10_share"].tolist() == [0.5, 0.25]
    # EP rank 0 holds experts 0-1, rank 1 experts 2-3: loads 6 | 2 and 2 | 2
    assert m.ep_rank_load_LR(COUNTS_LE, 2).tolist() == [[6.0, 2.0], [2.0, 2.0]]
    assert per_layer["ep_max_over_mean"].tolist() == [1.5, 1.0]


def test_overall_metrics_by_hand():
    overall = m.overall_metrics(COUNTS_LE, ep=2)
    assert overall["assignments"] == 12
    assert overall["dead_total"] == 1
    assert overall["max_over_mean_max"] == 2.0
    assert overall["max_over_mean_mean"] == 1.5
    assert overall["entropy_min"] == pytest.approx(0.75)
    # (max rank load summed over layers) / (mean rank load summed) = (6 + 2) / (4 + 2)
    assert overall["ep_straggler"] == pytest.approx(8 / 6)
    assert (overall["ep_rank_0_share"], overall["ep_rank_1_share"]) == (8 / 12, 4 / 12)
    assert "ep_rank_0_share" not in m.overall_metrics(COUNTS_LE, ep=1)


def test_flat_keys_and_empty_layers_left_out():
    counts = torch.tensor([[4, 2, 0, 2], [0, 0, 0, 0]])
    flat = m.flat_metrics(counts, ep=1, prefix="moe/update")
    assert flat["moe/update/layer_0/max_over_mean"] == 2.0
    assert flat["moe/update/layer_0/ep_max_over_mean"] == 1.0  # one EP rank is always balanced
    assert "moe/update/layer_1/cv" not in flat  # NaN: no tokens, no imbalance
    assert flat["moe/update/layer_1/dead"] == 4.0


def test_top10_count_uses_integer_ceiling():
    assert [m.top10_count(e) for e in (4, 8, 10, 11, 30, 128)] == [1, 1, 1, 2, 3, 13]


def test_collapse_extremes():
    collapsed = torch.tensor([[0, 0, 16, 0]])
    assert m.max_over_mean_L(collapsed).item() == 4.0
    assert m.entropy_L(collapsed).item() == 0.0
    assert m.top10_share_L(collapsed).item() == 1.0


def test_bad_inputs_raise_one_line():
    with pytest.raises(ValueError, match="does not divide"):
        m.ep_rank_load_LR(COUNTS_LE, 3)
    with pytest.raises(ValueError, match=r"\[layers, experts\]"):
        m.layer_metrics(torch.ones(4))


def test_jensen_shannon_by_hand():
    # disjoint supports: 1 bit; identical: 0
    a = torch.tensor([[2, 0], [1, 3]])
    b = torch.tensor([[0, 5], [2, 6]])
    assert jensen_shannon_L(a, b).tolist() == pytest.approx([1.0, 0.0])
    # p = (1, 0), q = (.5, .5), m = (.75, .25)
    kl_pm = math.log2(1 / 0.75)
    kl_qm = 0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)
    half = jensen_shannon_L(torch.tensor([[4, 0]]), torch.tensor([[3, 3]]))
    assert half.item() == pytest.approx((kl_pm + kl_qm) / 2)


@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (128, 8)])
def test_shape_free_forms_span_even_to_collapsed_at_any_shape(num_experts, top_k):
    """0 .. 1 from an even load to all of it on top_k experts, at the tiny model's shape and
    Qwen3-30B-A3B's: a form normalised by E alone would leave a collapse at log K / log E."""
    even = torch.ones(1, num_experts)
    on_k = torch.zeros(1, num_experts)
    on_k[0, :top_k] = 1.0
    for counts, expected in ((even, 0.0), (on_k, 1.0)):
        entropy = m.entropy_L(counts).item()
        assert m.concentration(entropy, num_experts, top_k) == pytest.approx(expected, abs=1e-12)
        hot = m.hot_share(m.max_over_mean_L(counts).item(), num_experts, top_k)
        assert hot == pytest.approx(top_k / num_experts if expected == 0 else 1.0)
    assert m.experts_in_use(0.5, num_experts, top_k) == pytest.approx(
        math.sqrt(num_experts * top_k)
    )
