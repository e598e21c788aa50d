"""Aux-loss formulas: hand-computed values, analytic gradients, megatron-core and HF references."""

import inspect
import math

import pytest
import torch

from backend.aux_loss import losses
from backend.aux_loss.config import AuxLossConfig, AuxLossConfigError
from backend.aux_loss.metrics import metric_dict
from tests.support import oracles

pytestmark = pytest.mark.mcore_compat

# 3 valid tokens and one padding token (last), E = 4, k = 2; logits = log(p) so softmax = p
PROBS_TE = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.1, 0.6, 0.2, 0.1], [0.97, 0.01, 0.01, 0.01]],
    dtype=torch.float64,
)
LOGITS_TE = PROBS_TE.log().float()
MAP_TE = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
VALID_T = torch.tensor([True, True, True, False])


def test_switch_loss_hand_example():
    # C = [1, 2, 2, 1], f = C / (2 * 3); P = [0.2, 11/30, 7/30, 0.2]; L = 4 * sum f P = 16/15
    loss = oracles.switch_loss(LOGITS_TE, MAP_TE, top_k=2, valid_T=VALID_T)
    assert loss.item() == pytest.approx(16 / 15, rel=1e-6)
    alone = oracles.switch_loss(LOGITS_TE[:3], MAP_TE[:3], top_k=2)  # padding row changes nothing
    assert alone.item() == pytest.approx(16 / 15, rel=1e-6)
    with_pad = oracles.switch_loss(LOGITS_TE, MAP_TE, top_k=2)
    assert with_pad.item() != pytest.approx(16 / 15, rel=1e-3)


def test_uniform_routing_gives_one_for_any_k():
    for top_k in (1, 2, 4):
        logits_TE = torch.zeros(8, 8)
        map_TE = torch.zeros(8, 8, dtype=torch.bool)
        for t in range(8):
            map_TE[t, [(t * top_k + j) % 8 for j in range(top_k)]] = True
        assert oracles.switch_loss(logits_TE, map_TE, top_k).item() == pytest.approx(1.0, abs=1e-6)


def test_z_loss_hand_example():
    logits_TE = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3), math.log(4)], [9.0, 9, 9, 9]]
    )
    valid_T = torch.tensor([True, True, False])
    expected = (math.log(4) ** 2 + math.log(10) ** 2) / 2
    assert oracles.z_loss(logits_TE, valid_T).item() == pytest.approx(expected, rel=1e-6)


def test_switch_gradient_matches_analytic():
    # dL/dz_tj = E / (k N^2) * p_tj * (C_j - sum_i C_i p_ti) on valid tokens, 0 on padding
    logits_TE = LOGITS_TE.clone().requires_grad_()
    oracles.switch_loss(logits_TE, MAP_TE, top_k=2, valid_T=VALID_T).backward()
    p_TE = PROBS_TE.float()
    counts_E = (MAP_TE & VALID_T[:, None]).sum(0).float()
    expected = 4 / (2 * 3**2) * p_TE * (counts_E[None, :] - (p_TE @ counts_E)[:, None])
    expected[~VALID_T] = 0
    torch.testing.assert_close(logits_TE.grad, expected, rtol=1e-5, atol=1e-7)


def test_z_gradient_matches_analytic():
    # d/dz_tj mean(lse^2) = 2 lse_t p_tj / N
    logits_TE = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()
    oracles.z_loss(logits_TE).backward()
    lse_T = torch.logsumexp(logits_TE.detach(), -1)
    expected = 2 * lse_T[:, None] * torch.softmax(logits_TE.detach(), -1) / 5
    torch.testing.assert_close(logits_TE.grad, expected)


def _random_call(num_tokens=24, num_experts=8, top_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, num_experts, generator=gen) * 2
    map_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
    map_TE.scatter_(1, logits_TE.topk(top_k, dim=-1).indices, True)
    valid_T = torch.rand(num_tokens, generator=gen) > 0.25
    return logits_TE, map_TE, valid_T


def test_global_shares_over_a_partition_sum_to_the_loss_and_its_gradient():
    logits_TE, map_TE, valid_T = _random_call()
    whole = logits_TE.clone().requires_grad_()
    oracles.switch_loss(whole, map_TE, 2, valid_T).backward()
    parts = logits_TE.clone().requires_grad_()
    n = int(valid_T.sum())
    f_E = losses.expert_fractions_E(losses.routed_counts_E(map_TE, valid_T), n, 2)
    total = sum(
        losses.balance_share(chunk, f_E, n, v)
        for chunk, v in zip(parts.split([5, 11, 8]), valid_T.split([5, 11, 8]), strict=True)
    )
    total.backward()
    torch.testing.assert_close(parts.grad, whole.grad)
    torch.testing.assert_close(total, oracles.switch_loss(logits_TE, map_TE, 2, valid_T))


def test_sequence_loss_is_the_mean_of_per_sequence_losses():
    logits_TE, map_TE, valid_T = _random_call(num_tokens=24)
    seq_T = torch.arange(24) % 4  # sequence-first order, B = 4
    valid_T[seq_T == 2] = False  # a sequence with no valid token is left out of the mean
    per_seq = [
        oracles.switch_loss(logits_TE[seq_T == b], map_TE[seq_T == b], 2, valid_T[seq_T == b])
        for b in (0, 1, 3)
    ]
    got = oracles.sequence_loss(logits_TE, map_TE, seq_T, 4, 2, valid_T)
    torch.testing.assert_close(got, torch.stack(per_seq).mean())


def test_matches_megatron_core_switch_and_z_loss():
    from megatron.core.transformer.moe import moe_utils

    logits_TE, map_TE, _ = _random_call()
    probs_TE, counts_E = torch.softmax(logits_TE, -1), map_TE.sum(0)
    func = moe_utils.switch_load_balancing_loss_func
    if "total_num_tokens" in inspect.signature(func).parameters:  # 0.13+
        ref = func(
            probs_TE, counts_E, total_num_tokens=24, topk=2, num_experts=8, moe_aux_loss_coeff=1.0
        )
    else:
        ref = func(probs_TE, counts_E, topk=2, moe_aux_loss_coeff=1.0)
    torch.testing.assert_close(oracles.switch_loss(logits_TE, map_TE, 2), ref)
    torch.testing.assert_close(oracles.z_loss(logits_TE), moe_utils.z_loss_func(logits_TE, 1.0))


def test_matches_transformers_balancing_loss_times_k():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits_TE, map_TE, _ = _random_call(num_tokens=24)
    attention_BS = torch.ones(3, 8, dtype=torch.long)
    attention_BS[1, 5:] = 0
    valid_T = attention_BS.reshape(-1).bool()  # transformers flattens batch-major
    ref = load_balancing_loss_func(
        (logits_TE,), num_experts=8, top_k=2, attention_mask=attention_BS
    )
    torch.testing.assert_close(2 * oracles.switch_loss(logits_TE, map_TE, 2, valid_T), ref)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="sometimes"), "mode='sometimes' is unknown"),
        (dict(mode="on", type="token", coeff=1e-3), "type='token' is unknown"),
        (
            dict(mode="on", type="global_batch", coeff=1e-3, scope="prompt"),
            "scope='prompt' is unknown",
        ),
        (dict(mode="on", type="global_batch", coeff=-1.0), "coeff=-1.0 is negative"),
        (dict(mode="on", coeff=1e-3), "no effect with type='none'"),
        (dict(mode="on", type="sequence"), "needs coeff > 0"),
        (dict(mode="on"), "nothing to compute"),
        (dict(mode="observe"), "nothing to compute"),
        (dict(mode="off", coeff=1e-3), "mode='off' ignores"),
        (dict(mode="off", z_coeff=1e-3), "mode='off' ignores"),
        (
            dict(mode="on", type="global_batch", coeff=1e-3, global_counts="rollout"),
            "global_counts='rollout' is unknown",
        ),
        (
            dict(mode="observe", type="global_batch", coeff=1e-3, global_counts="old_log_prob"),
            "no effect with mode='observe'",
        ),
        (
            dict(mode="on", type="micro_batch", coeff=1e-3, global_counts="old_log_prob"),
            "no effect with mode='on', type='micro_batch'",
        ),
    ],
)
def test_config_rejects_settings_without_effect(kwargs, message):
    with pytest.raises(AuxLossConfigError, match=message) as err:
        AuxLossConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_config_accepts_and_describes():
    assert AuxLossConfig().describe() == "router aux loss: off"
    on = AuxLossConfig(mode="on", type="global_batch", coeff=1e-3, scope="response")
    assert on.needs_counting_pass and on.adds_gradient
    assert on.describe() == "router aux loss: on, balance global_batch coeff=0.001, tokens=response"
    olp = AuxLossConfig(mode="on", type="global_batch", coeff=1e-3, global_counts="old_log_prob")
    assert not olp.needs_counting_pass and olp.adds_gradient
    assert "f from the old-log-prob pass" in olp.describe()
    observe = AuxLossConfig(mode="observe", type="global_batch", coeff=1e-3)
    assert not observe.needs_counting_pass and not observe.adds_gradient
    assert (
        AuxLossConfig(mode="on", z_coeff=1e-3).describe().endswith("z-loss coeff=0.001, tokens=all")
    )


def test_metric_dict_keys_and_total():
    config = AuxLossConfig(mode="on", type="sequence", coeff=0.5, z_coeff=0.1)
    out = metric_dict(
        config, torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([2.0, 4.0]), 2.0
    )
    assert out == {
        "moe/aux_loss/load_balancing/layer_0": 1.0,
        "moe/aux_loss/load_balancing/layer_1": 3.0,
        "moe/aux_loss/load_balancing/mean": 2.0,
        "moe/aux_loss/z_loss/layer_0": 2.0,
        "moe/aux_loss/z_loss/layer_1": 4.0,
        "moe/aux_loss/z_loss/mean": 3.0,
        "moe/aux_loss/total": pytest.approx(0.5 * 4.0 + 0.1 * 6.0),
        "moe/aux_loss/applied": 1.0,
        "moe/aux_loss/grad_scale": 2.0,
    }
