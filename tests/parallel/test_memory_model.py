"""Parameter counts against transformers, and the memory model's structure."""

from dataclasses import replace

import pytest
import torch

from backend.qwen3_moe import load_qwen3_moe_spec
from parallel.activations import layer_activation_bytes, stage_activation_bytes
from parallel.memory import DEVICE_MEMORY_GIB, MemoryOptions, estimate_memory
from parallel.models import QWEN3_30B_A3B, load_spec
from parallel.params import device_params, hf_param_counts, param_counts
from parallel.plan import ParallelPlan, check_against_model
from tests.support.torch_features import needs_cpu_flash_gqa

QWEN = load_spec()


def _fit(**plan):
    return check_against_model(ParallelPlan(**plan), QWEN)


def _rows(estimate) -> dict:
    return {r.name.split(" (")[0]: r for r in estimate.rows}


def test_qwen3_30b_a3b_matches_the_published_sizes():
    counts = param_counts(QWEN)
    assert counts.total == pytest.approx(30.5e9, rel=0.01)
    assert counts.non_embedding == pytest.approx(29.9e9, rel=0.01)
    # the model card's "3.3B activated" is 3.35B cut to one decimal, hence 2%
    assert counts.active == pytest.approx(3.3e9, rel=0.02)


def test_qwen3_30b_a3b_matches_transformers_exactly():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "architectures"})
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    counts = param_counts(QWEN)
    assert hf_param_counts(model) == (counts.total, counts.active)


def test_tiny_model_count_equals_transformers(tiny_config_factory):
    from transformers import Qwen3MoeForCausalLM

    config = tiny_config_factory()
    model = Qwen3MoeForCausalLM(config)
    counts = param_counts(load_qwen3_moe_spec(config))
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert hf_param_counts(model) == (counts.total, counts.active)


def test_device_params_cover_the_model_once():
    whole = param_counts(QWEN, vocab=QWEN.vocab_size)
    single = device_params(_fit(nodes=1, devices_per_node=1), 0)
    assert single.total == whole.total
    sharded = device_params(_fit(tp=4, ep=8, nodes=4), 0)
    assert sharded.expert * 8 == whole.num_layers * whole.num_experts * whole.expert
    staged = [device_params(_fit(pp=4, nodes=4, devices_per_node=1), s) for s in range(4)]
    assert sum(p.total for p in staged) == whole.total


def test_optimizer_is_sharded_over_dp_and_edp():
    small = _rows(estimate_memory(_fit(tp=4, ep=8, nodes=1), MemoryOptions(64.0)))
    wide = _rows(estimate_memory(_fit(tp=4, ep=8, nodes=4), MemoryOptions(64.0)))
    assert wide["params"].update == small["params"].update
    assert wide["optimizer"].update == pytest.approx(small["optimizer"].update / 4)


def test_offload_moves_terms_off_the_device_between_updates():
    fit = _fit(tp=4, ep=8, nodes=4)
    base = estimate_memory(fit, MemoryOptions(64.0))
    off = estimate_memory(fit, MemoryOptions(64.0, offload_params=True, offload_optimizer=True))
    assert off.update_bytes == base.update_bytes  # verl loads everything back for the update
    rows = _rows(off)
    for name in ("params", "grads", "optimizer"):
        assert rows[name].idle == 0
    assert off.host_bytes == rows["params"].update + rows["optimizer"].update
    assert off.idle_bytes < 0.1 * base.idle_bytes


def test_activations_scale_with_tokens_tp_cp_and_top_k():
    def per_layer(spec=QWEN, tokens=8192, **plan):
        return layer_activation_bytes(spec, ParallelPlan(**plan), tokens)

    assert per_layer(tokens=16384) == pytest.approx(2 * per_layer())
    assert per_layer(tp=4, ep=8) == pytest.approx(per_layer(tp=2, ep=8) / 2)
    assert per_layer(cp=2, ep=8) == pytest.approx(per_layer(ep=8) / 2)
    assert per_layer(ep=8) == pytest.approx(per_layer(ep=1))  # balanced routing
    assert per_layer(replace(QWEN, top_k=16)) > 1.45 * per_layer()  # experts dominate (~2/3 at k=8)


def test_pipeline_first_stage_holds_a_full_model_of_activations():
    flat = stage_activation_bytes(_fit(), 0, 8192, recompute=False)
    piped = stage_activation_bytes(_fit(pp=4, nodes=4, devices_per_node=1), 0, 8192, False)
    assert piped == pytest.approx(flat)
    interleaved = stage_activation_bytes(
        _fit(pp=4, vpp=2, nodes=4, devices_per_node=1), 0, 8192, False
    )
    assert interleaved == pytest.approx(flat * (1 + 3 / 8))  # 1 + (pp-1)/(pp*vpp)


def test_recompute_keeps_only_layer_inputs():
    fit = _fit(tp=4, ep=8, nodes=4)
    full = stage_activation_bytes(fit, 0, 8192, recompute=False)
    kept = stage_activation_bytes(fit, 0, 8192, recompute=True)
    assert kept < full / 10


def test_devices_differ_only_in_capacity():
    fit = _fit(tp=4, ep=8, nodes=4)
    a2 = estimate_memory(fit, MemoryOptions(DEVICE_MEMORY_GIB["npu"]))
    h100 = estimate_memory(fit, MemoryOptions(DEVICE_MEMORY_GIB["cuda"]))
    assert a2.update_bytes == h100.update_bytes
    assert a2.utilization == pytest.approx(h100.utilization * 80 / 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ours",
    [False, pytest.param(True, marks=needs_cpu_flash_gqa)],
    ids=["mcore-local", "grouped-sdpa"],
)
@pytest.mark.parametrize("tokens", [64, 256])
def test_activation_estimate_matches_saved_tensors_of_tiny_model(world1, tokens, ours):
    from tests.support.activation_measure import check_tiny_activations

    check = check_tiny_activations(world1, tokens, ours=ours)
    kept = check.measured_bytes + older_local_modules_bytes(tokens, ours)
    assert abs(check.estimated_bytes - kept) < 0.005 * kept, check  # both module sets, exactly


def older_local_modules_bytes(tokens: int, ours: bool) -> int:
    """What megatron-core 0.12.1's local modules keep less than the formula (0.16.1's): one
    [T, H] fp32 tensor per layer, measured (2 x T x 64 x 4 bytes at 64 and 256 tokens, with and
    without selective recompute); 0 for ours and on 0.16.1."""
    from packaging.version import Version

    from backend.platform.compat import mcore_version
    from parallel.models import TINY_QWEN3_MOE

    if ours or mcore_version() >= Version("0.13"):
        return 0
    return TINY_QWEN3_MOE["num_hidden_layers"] * tokens * TINY_QWEN3_MOE["hidden_size"] * 4
