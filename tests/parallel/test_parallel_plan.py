"""Plan legality messages, derived sizes, warnings, --auto and the CLI."""

import json

import pytest

from parallel.advice import expert_notes, plan_warnings
from parallel.auto import rank_plans
from parallel.cli import main
from parallel.memory import DEVICE_MEMORY_GIB, MemoryOptions, estimate_memory
from parallel.models import TINY_QWEN3_MOE, load_spec
from parallel.plan import ParallelPlan, PlanError, check_against_model
from parallel.rank_layout import RankLayout

QWEN = load_spec()


def _model_error(**plan) -> str:
    with pytest.raises(PlanError) as err:
        check_against_model(ParallelPlan(**plan), QWEN)
    return str(err.value)


def _plan_error(**plan) -> str:
    with pytest.raises(PlanError) as err:
        ParallelPlan(**plan)
    return str(err.value)


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=4, ep=8, nodes=4),
        dict(tp=2, pp=2, cp=2, ep=4, nodes=4),
        dict(tp=2, ep=2, etp=2, nodes=2),
        dict(pp=4, ep=16, nodes=8),
        dict(cp=2, tp=2, ep=2, nodes=1),
    ],
)
def test_dp_and_edp_fold_the_world_twice(kw):
    p = ParallelPlan(**kw)
    assert p.tp * p.cp * p.dp * p.pp == p.world
    assert p.etp * p.ep * p.edp * p.pp == p.world


def test_derived_sizes_of_the_recipe_plan():
    p = ParallelPlan(tp=4, ep=8, nodes=4, devices_per_node=8)
    assert (p.world, p.dp, p.edp) == (32, 8, 4)
    q = ParallelPlan(tp=2, cp=2, pp=2, ep=2, etp=2, nodes=2)
    assert (q.dp, q.edp) == (2, 2)


@pytest.mark.parametrize(
    "name,value", [("tp", 0), ("ep", -2), ("nodes", 0), ("vpp", 0), ("cp", 1.5)]
)
def test_sizes_must_be_positive_integers(name, value):
    assert _plan_error(**{name: value}) == f"{name}={value!r} must be a positive integer"


def test_attention_folding_names_the_legal_products():
    msg = _plan_error(tp=3, nodes=1)
    assert "tp*cp*pp=3 does not divide world=8" in msg
    assert "legal tp*cp*pp: 1, 2, 4, 8" in msg


def test_expert_folding_names_the_legal_products():
    msg = _plan_error(ep=16, nodes=1)
    assert "etp*ep*pp=16 does not divide world=8" in msg and "legal etp*ep*pp: 1, 2, 4, 8" in msg


def test_vpp_needs_a_pipeline():
    assert "vpp=2 needs pp > 1" in _plan_error(vpp=2)


def test_tp_beyond_kv_heads():
    assert _model_error(tp=8) == (
        "tp=8 does not divide num_key_value_heads=4: legal tp for this model: 1, 2, 4"
    )


def test_ep_must_divide_experts():
    msg = _model_error(ep=3, nodes=3)
    assert msg.startswith("ep=3 does not divide num_experts=128")
    assert msg.endswith("legal ep for this model: 1, 2, 4, 8, 16, 32, 64, 128")


def test_etp_must_divide_the_expert_ffn():
    msg = _model_error(etp=5, nodes=5)
    assert msg.startswith("etp=5 does not divide moe_intermediate_size=768")
    assert "legal etp for this model: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32" in msg


def test_pp_must_divide_layers():
    assert _model_error(pp=5, nodes=5) == (
        "pp=5 does not divide num_hidden_layers=48: legal pp for this model: "
        "1, 2, 3, 4, 6, 8, 12, 16, 24, 48 (or set first/last stage layers)"
    )


def test_pp_times_vpp_must_divide_layers():
    assert _model_error(pp=4, vpp=5, nodes=4).startswith(
        "pp*vpp=20 does not divide num_hidden_layers=48"
    )


def test_uneven_stages_split_the_rest_evenly():
    fit = check_against_model(
        ParallelPlan(pp=4, first_stage_layers=11, last_stage_layers=11, nodes=4), QWEN
    )
    assert fit.stage_layers == (11, 13, 13, 11) and sum(fit.stage_layers) == QWEN.num_layers
    assert "must split it evenly" in _model_error(
        pp=4, first_stage_layers=10, last_stage_layers=11, nodes=4
    )


def test_sequence_parallel_follows_tp():
    assert not check_against_model(ParallelPlan(ep=8), QWEN).sequence_parallel
    assert check_against_model(ParallelPlan(tp=2, ep=8), QWEN).sequence_parallel


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocab(tp):
    padded = check_against_model(ParallelPlan(tp=tp), QWEN).padded_vocab
    assert padded % (128 * tp) == 0 and 0 <= padded - QWEN.vocab_size < 128 * tp
    if tp == 1:
        assert padded == QWEN.vocab_size  # 151936 is already a multiple of 128


def _warnings(plan: ParallelPlan, tokens: int = 8192, device: str = "npu") -> list[str]:
    fit = check_against_model(plan, QWEN)
    memory = estimate_memory(fit, MemoryOptions(DEVICE_MEMORY_GIB[device], tokens))
    return plan_warnings(fit, RankLayout(plan), memory, tokens)


def test_cross_node_ep_is_flagged():
    warns = _warnings(ParallelPlan(tp=2, ep=16, nodes=4))
    assert any(w.startswith("ep groups span 2 nodes") for w in warns)
    assert not any("tp groups span" in w for w in warns)


def test_cross_node_tp_is_flagged():
    warns = _warnings(ParallelPlan(tp=4, ep=8, nodes=8, devices_per_node=2))
    assert any(w.startswith("tp groups span 2 nodes") for w in warns)


def test_intra_node_plan_has_no_cross_node_warning():
    assert not any("span" in w for w in _warnings(ParallelPlan(tp=4, ep=8, nodes=4)))


def test_expert_load_lines_are_notes_not_warnings():
    plan = ParallelPlan(tp=4, ep=8, nodes=4)
    notes = expert_notes(check_against_model(plan, QWEN), 4096)
    assert notes[0] == "16 experts per EP rank (128 experts / ep=8)"
    assert notes[1].startswith("expected tokens per expert: 256 per micro-batch of 4096")
    assert _warnings(plan, tokens=4096) == []
    assert _warnings(plan, tokens=256)[0].startswith("only ~32 tokens per expert GEMM")


def test_memory_pressure_is_flagged():
    fat = _warnings(ParallelPlan(ep=8, nodes=4), tokens=16384)  # tp=1: nothing sharded by tp
    assert any("above 90%" in w for w in fat)
    assert not any("above 90%" in w for w in _warnings(ParallelPlan(tp=4, ep=8, nodes=4), 2048))


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_auto_picks_a_plan_that_fits_on_4x8(device):
    options = MemoryOptions(DEVICE_MEMORY_GIB[device], micro_batch_tokens=8192)
    ranked = rank_plans(QWEN, 4, 8, options)
    best = ranked[0]
    assert best.memory.fits
    assert best.cross_node[:2] == (1, 1)  # TP and EP inside a node
    assert all(best.rank_key() <= c.rank_key() for c in ranked)
    assert any(not c.memory.fits for c in ranked)  # the search did rule plans out


def test_auto_respects_pinned_dimensions():
    options = MemoryOptions(DEVICE_MEMORY_GIB["cuda"], micro_batch_tokens=8192)
    ranked = rank_plans(QWEN, 4, 8, options, fixed={"tp": 4, "pp": 2})
    assert {(c.fit.plan.tp, c.fit.plan.pp) for c in ranked} == {(4, 2)}


def test_cli_prints_plan_layout_memory_and_warnings(capsys):
    assert main(["--nodes", "4", "--tp", "4", "--ep", "8", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "plan: tp=4 pp=1 cp=1 ep=8",
        "sequence_parallel=True",
        "layout (",
        "optimizer (fp32 master",
        "of 80 GiB",
        "warnings:",
    ):
        assert expected in out


def test_cli_illegal_plan_exits_2_with_one_line(capsys):
    assert main(["--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: tp=8 does not divide num_key_value_heads=4: legal tp for this model: 1, 2, 4\n"
    )


def test_cli_auto_and_custom_model(tmp_path, capsys):
    config = {"model_type": "qwen3_moe", **TINY_QWEN3_MOE}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (
        main(
            [
                "--model",
                str(tmp_path),
                "--auto",
                "--nodes",
                "1",
                "--devices-per-node",
                "4",
                "--device",
                "cpu",
                "--device-memory-gb",
                "16",
            ]
        )
        == 0
    )
    assert "auto:" in capsys.readouterr().out
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
