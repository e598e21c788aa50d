"""Selective recompute in the memory model: what it drops, exactly, and none > selective > full;
on the tiny model, what the decoder layers keep for backward, measured, against the formula."""

import pytest

from parallel.activations import (
    ACCELERATOR_KERNELS,
    LOCAL_SPEC_KERNELS,
    OURS_ON_CPU_KERNELS,
    TE_KERNELS,
    attention_side_bytes_per_token,
    checkpoint_bytes,
    expert_side_bytes_per_routed_token,
    layer_activation_bytes,
    layers_in_flight,
    routed_tokens,
    stage_activation_bytes,
)
from parallel.cli import main
from parallel.memory import MemoryOptions, estimate_memory, least_recompute
from parallel.models import load_spec
from parallel.plan import ParallelPlan, check_against_model
from tests.support.torch_features import needs_cpu_flash_gqa

QWEN = load_spec()
TOKENS = 8192
FIT = check_against_model(ParallelPlan(tp=4, ep=8, nodes=4), QWEN)
Q, KV = QWEN.num_heads * QWEN.head_dim, QWEN.num_kv_heads * QWEN.head_dim


@pytest.mark.parametrize(
    "kernels, dropped",
    [
        (ACCELERATOR_KERNELS, QWEN.num_heads * 4),  # flash: the fp32 log-sum-exp
        (TE_KERNELS, QWEN.num_heads * 4),
        # unfused: repeated K/V and the softmax probabilities, bf16
        (LOCAL_SPEC_KERNELS, ((2 * Q - KV) + QWEN.num_heads * 512) * 2),
    ],
)
def test_core_attention_recompute_drops_its_internals(kernels, dropped):
    none, selective = (
        attention_side_bytes_per_token(QWEN, 2, kernels, 512, sel) for sel in (False, True)
    )
    assert none - selective == dropped


@pytest.mark.parametrize("etp", [1, 2])
@pytest.mark.parametrize(
    "kernels, kept_inside",
    [(ACCELERATOR_KERNELS, 0), (OURS_ON_CPU_KERNELS, 2), (LOCAL_SPEC_KERNELS, None)],
)
def test_moe_act_recompute_drops_the_swiglu_output(etp, kernels, kept_inside):
    f = QWEN.moe_ffn_hidden_size / etp
    none, selective = (
        expert_side_bytes_per_routed_token(QWEN, etp, 2, kernels, sel) for sel in (False, True)
    )
    if kept_inside is None:  # megatron's SequentialMLP does not recompute its activation
        assert selective == none
    else:  # the fc2 input f and what an unfused SwiGLU keeps inside
        assert none - selective == (1 + kept_inside) * f * 2
        index = 8 if kernels.dispatcher == "allgather" else 0  # its permutation index
        assert selective == (QWEN.hidden_size + 2 * f) * 2 + 4 + index  # fc1 in, out; prob


@pytest.mark.parametrize("skew", [1.0, 2.0, 8.0])
def test_selective_stage_formula_and_order(skew):
    local = TOKENS / (FIT.plan.tp * FIT.plan.cp)
    routed = routed_tokens(QWEN, FIT.plan, TOKENS, skew)
    a = local * attention_side_bytes_per_token(QWEN, 2, ACCELERATOR_KERNELS, TOKENS, True)
    x = routed * expert_side_bytes_per_routed_token(QWEN, 1, 2, ACCELERATOR_KERNELS, True)
    layers = layers_in_flight(FIT.plan, FIT.stage_layers, 0)
    none, selective, full = (
        stage_activation_bytes(FIT, 0, TOKENS, mode, ep_skew=skew)
        for mode in ("none", "selective", "full")
    )
    assert selective == pytest.approx(layers * (a + x), rel=1e-12)  # layers * (A' + s X')
    assert (
        selective
        == layer_activation_bytes(QWEN, FIT.plan, TOKENS, ep_skew=skew, selective=True) * layers
    )
    assert none > selective > full
    # the bools are the old spellings of none / full
    assert stage_activation_bytes(FIT, 0, TOKENS, False, ep_skew=skew) == none
    assert stage_activation_bytes(FIT, 0, TOKENS, True, ep_skew=skew) == full
    assert full == pytest.approx(
        layers * checkpoint_bytes(QWEN, FIT.plan, TOKENS)
        + layer_activation_bytes(QWEN, FIT.plan, TOKENS, ep_skew=skew)
    )


def test_selective_expert_side_scales_with_skew_on_every_layer():
    layers = layers_in_flight(FIT.plan, FIT.stage_layers, 0)
    per_s = routed_tokens(QWEN, FIT.plan, TOKENS, 1.0) * expert_side_bytes_per_routed_token(
        QWEN, 1, 2, ACCELERATOR_KERNELS, True
    )
    at_1, at_3 = (stage_activation_bytes(FIT, 0, TOKENS, "selective", ep_skew=s) for s in (1, 3))
    assert at_3 - at_1 == pytest.approx(2 * layers * per_s, rel=1e-12)


def test_memory_options_take_the_choice():
    rows = {
        mode: estimate_memory(FIT, MemoryOptions(None, TOKENS, recompute=mode))
        for mode in ("none", "selective", "full")
    }
    assert rows["none"].update_bytes > rows["selective"].update_bytes > rows["full"].update_bytes
    assert MemoryOptions(None, recompute=True).recompute == "full"
    with pytest.raises(ValueError):
        MemoryOptions(None, recompute="some")


@pytest.mark.parametrize(
    "tokens, mode, tried",
    [(8192, "none", ["none"]), (9216, "selective", ["none", "selective"]), (16384, "full", None)],
)
def test_least_recompute_that_fits(tokens, mode, tried):
    options = MemoryOptions(64.0, tokens, ep_skew=2.0)  # A2, the shipped plan's default skew
    choice = least_recompute(FIT, options)
    assert choice.mode == mode and choice.estimate.fits
    assert [m for m, _ in choice.tried] == (tried or ["none", "selective", "full"])
    assert all(use > 0.9 for _, use in choice.tried[:-1])  # every lighter one was over
    assert (
        choice.estimate.update_bytes
        == estimate_memory(
            FIT, MemoryOptions(64.0, tokens, recompute=mode, ep_skew=2.0)
        ).update_bytes
    )
    assert choice.line().startswith(f"recompute: {mode} (auto, the least that fits 90%")


def test_nothing_fits_gives_full():
    choice = least_recompute(FIT, MemoryOptions(64.0, 65536 * 4, ep_skew=2.0))
    assert choice.mode == "full" and not choice.estimate.fits
    assert "nothing fits" in choice.line()


@pytest.mark.parametrize(
    "argv, line",
    [
        ([], "recompute: none (auto, the least that fits 90%: none 87%; margin 2.0 GiB)"),
        (["--micro-batch-tokens", "9216"], "recompute: selective (auto, the least that fits"),
        (["--micro-batch-tokens", "16384"], "recompute: full (auto, the least that fits 90%"),
        (["--recompute"], "recompute: full (--recompute full)"),
        (["--recompute", "selective"], "recompute: selective (--recompute selective)"),
    ],
)
def test_dry_run_prints_the_choice(argv, line, capsys):
    assert main(["--tp", "4", "--ep", "8", "--nodes", "4", "--device", "npu", *argv]) == 0
    out = capsys.readouterr().out
    assert any(printed.startswith(line) for printed in out.splitlines()), out


@pytest.mark.slow
@pytest.mark.parametrize(
    "ours",
    [False, pytest.param(True, marks=needs_cpu_flash_gqa)],
    ids=["mcore-local", "grouped-sdpa"],
)
@pytest.mark.parametrize("tokens", [64, 256])
def test_selective_recompute_keeps_what_the_formula_says_measured(world1, tokens, ours):
    """The tiny model's decoder layers under selective recompute keep, for backward, the bytes
    parallel.activations estimates (measured by parallel.measure), and drop against none what
    it says they drop; the comparisons above restate the formula, this one measures. Catches
    a layer keeping more than the formula knows (backend/model/experts.py handing fc2 a copy of the
    SwiGLU output, `act_TF.clone()`: the checkpoint frees the original, fc2 keeps the copy;
    numerics and replays unchanged)."""
    from tests.parallel.test_memory_model import older_local_modules_bytes
    from tests.support.activation_measure import check_tiny_activations

    none = check_tiny_activations(world1, tokens, ours=ours)
    selective = check_tiny_activations(world1, tokens, ours=ours, recompute="selective")
    kept = selective.measured_bytes + older_local_modules_bytes(tokens, ours)
    assert abs(selective.estimated_bytes - kept) < 0.005 * kept, selective
    dropped = none.measured_bytes - selective.measured_bytes
    assert dropped == pytest.approx(none.estimated_bytes - selective.estimated_bytes, rel=0.005)
