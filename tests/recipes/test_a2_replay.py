"""R3 on Ascend A2 through the launcher (recipes.launcher.a2_replay): the rollout settings under
which vllm-ascend 0.23 records no routes, or one TP rank's share, are refused in one line
naming the upstream source and the fix, exit 2, at resolution (before Ray or any model work);
the default A2 rollout passes."""

import pytest

from recipes.dapo.cluster import ray_job
from recipes.launcher import a2_replay, launch

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

PLAN = ["--tp", "4", "--ep", "8", "--nodes", "4", "--devices-per-node", "8"]
R = "actor_rollout_ref.rollout"
KW = f"+{R}.engine_kwargs.vllm"
R3 = [
    "+actor_rollout_ref.actor.mcore_ep.router_replay=R3",
    f"{R}.enable_rollout_routing_replay=True",
]


@pytest.fixture
def nothing_starts(monkeypatch):
    started = []
    monkeypatch.setattr(ray_job, "check_ray", lambda *a: started.append("ray"))
    monkeypatch.setattr(ray_job, "run_command", lambda *a: started.append("verl") or 0)
    return started


def _dry_run(capsys, *extra: str, device: str = "npu") -> tuple[int, str, str]:
    code = launch.main([*PLAN, "--device", device, "--dry-run", "--", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_default_a2_rollout_takes_r3(capsys, nothing_starts):
    """TP 2, DP 1, no expert parallelism, bf16: vllm-ascend's all-gather MoE path records
    every token; the dry run goes through and sizes the routes as uint8 for Qwen3-30B-A3B."""
    code, out, err = _dry_run(capsys, *R3)
    assert code == 0, err
    routes = next(line for line in out.splitlines() if "routes (R2 / R3 routed_experts" in line)
    assert (
        "48 layers x top-8" in routes
        and "0.96 GB per training batch (512 samples) as uint8" in routes
    )
    assert f"{R}.tensor_model_parallel_size=2" in out and "expert_parallel_size" not in out
    assert nothing_starts == []


REFUSED = [
    # quantized MoE: vllm-ascend's quantized methods never call the capturer
    (
        [f"{R}.quantization=ascend"],
        ["quantized MoE", f"{R}.quantization=ascend", "fused_moe.py:204"],
    ),
    ([f"{KW}.quantization=ascend"], ["quantized MoE", "engine_kwargs.vllm.quantization"]),
    ([f"++{R}.qat.enable=true"], ["quantized MoE", f"{R}.qat.enable"]),
    # EPLB: vLLM's switch, vllm-ascend's eplb_config by key or as a whole dict
    ([f"{KW}.enable_eplb=True"], ["EPLB on", "enable_eplb=True", "vllm-ascend#13882"]),
    ([f"{KW}.additional_config.eplb_config.dynamic_eplb=true"], ["EPLB on", "dynamic_eplb"]),
    ([f"{KW}.additional_config.eplb_config.num_redundant_experts=16"], ["EPLB on"]),
    (
        [f"{KW}.additional_config={{eplb_config:{{expert_map_path:/srv/map.json}}}}"],
        ["EPLB on", "expert_map_path"],
    ),
    # expert parallelism at DP 1 with TP > 1: one TP rank's share recorded
    (
        [f"{R}.expert_parallel_size=2"],
        ["DP 1 and TP 2", "vllm-ascend#15451", "expert_parallel_size=1"],
    ),
    (
        [f"{R}.tensor_model_parallel_size=8", f"{KW}.enable_expert_parallel=True"],
        ["DP 1 and TP 8", "vllm-ascend#15451"],
    ),
]


@pytest.mark.parametrize(
    "extra, words",
    REFUSED,
    ids=["quantization", "vllm-quantization", "qat", "enable-eplb", "dynamic-eplb",
         "redundant-experts", "eplb-dict", "ep-dp1-tp2", "ep-dp1-tp8"],
)  # fmt: skip
def test_r3_with_what_vllm_ascend_0_23_cannot_record_is_refused(
    capsys, nothing_starts, extra, words
):
    """Catches R3 replaying expert 0 for every route vllm-ascend left unrecorded."""
    code, out, err = _dry_run(capsys, *R3, *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: router_replay=R3 on npu"), err
    for word in words:
        assert word in err, err
    assert "router_replay=R2" in err  # the other fix, always open
    assert nothing_starts == []


def test_a_quantized_model_directory_is_refused(tmp_path, capsys):
    """vllm-ascend picks a ModelSlim model's quantized methods from the directory alone."""
    (tmp_path / "quant_model_description.json").write_text("{}")
    found = a2_replay.refusal({"model": {"actor_rollout_ref.model.path": str(tmp_path)}})
    assert found and "quant_model_description.json" in found and "quantized MoE" in found


@pytest.mark.parametrize(
    "extra",
    [
        [f"{R}.quantization=ascend"],  # not R3: routes are not replayed
        [f"{R}.expert_parallel_size=4", f"{R}.data_parallel_size=2"],  # DP 2: EP = TP x DP
        [f"{KW}.enable_eplb=False", f"{KW}.additional_config.eplb_config.dynamic_eplb=false"],
        [f"{KW}.additional_config.eplb_config.expert_map_path=null"],
    ],
    ids=["quantized-without-r3", "ep-at-dp2", "eplb-off", "no-expert-map"],
)
def test_what_vllm_ascend_can_record_is_not_refused(capsys, extra):
    """A refusal only where the routes would be missing: R3 off, DP > 1, EPLB set off."""
    replay = [] if extra[0].endswith("=ascend") else R3
    code, _, err = _dry_run(capsys, *replay, *extra)
    assert code == 0, err


def test_only_npu_runs_are_checked(capsys):
    """vLLM on cuda records in its own router (BaseRouter, before EPLB's map): not refused."""
    code, _, err = _dry_run(capsys, *R3, f"{R}.expert_parallel_size=2", device="cuda")
    assert code == 0, err
