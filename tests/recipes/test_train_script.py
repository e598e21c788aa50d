"""The cluster launcher (scripts/train_mcore.sh -> recipes.launcher.launch): dry runs resolve to
exactly the verl overrides we expect on Ascend A2 and H100, verl's own config accepts them,
and misuse stops with one line before anything is started."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parallel.models import QWEN3_30B_A3B
from recipes.dapo.cluster import lost_node, ray_job
from recipes.dapo.job import overrides
from recipes.launcher import launch, resolution, run_spec, stack
from tests.support import model_dirs
from tests.support.model_dirs import header_only
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path):
    """A header-only stand-in of Qwen3-30B-A3B (its 61 GB of shards sparse: the launcher reads
    headers only) and DAPO-schema parquet."""
    model = header_only(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    table = pa.table(
        {
            "data_source": ["math_dapo"],
            "prompt": [[{"content": "1+1?", "role": "user"}]],
            "ability": ["MATH"],
            "reward_model": [{"ground_truth": "2"}],
            "extra_info": [{"index": "0"}],
        }
    )
    for name in ("dapo-math-17k.parquet", "aime-2024.parquet"):
        pq.write_table(table, tmp_path / name)
    return {
        "--model": model,
        "--train-file": tmp_path / "dapo-math-17k.parquet",
        "--val-file": tmp_path / "aime-2024.parquet",
        "--ckpt-dir": tmp_path / "ckpt",
    }


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the launcher starts a process or asks Ray."""
    started = []
    monkeypatch.setattr(ray_job, "run_command", lambda cmd, env, *a: started.append(cmd) or 0)
    monkeypatch.setattr(ray_job, "check_ray", lambda *a: started.append(["ray", "status"]))
    return started


def argv(files, *extra):
    return [x for k, v in files.items() for x in (k, str(v))] + list(extra)


def cluster_dry_run(device: str, *extra: str) -> list[str]:
    """The shipped 4x8 plan's dry run on `device` (npu | cuda)."""
    plan = ["--tp", "4", "--ep", "8", "--nodes", "4", "--devices-per-node", "8"]
    return [*plan, "--device", device, "--dry-run", *extra]


def _source_of_truth(device: str):
    """What the launcher's overrides are made of, taken where it takes them: the DAPO
    settings and token budgets (recipes.dapo.job.overrides), the A2 environment
    (recipes.dapo.cluster.ray_job), the memory model's rollout fit of the shipped plan on the
    embedded Qwen3-30B-A3B (recipes.dapo.job.fit) and the default EP skew (parallel.skew)."""
    from parallel.models import load_spec
    from parallel.plan import plan_for_model
    from parallel.skew import default_skew
    from recipes.dapo.job.fit import fit_rollout

    skew = default_skew().value
    model_fit = plan_for_model(load_spec(), 4, 8, tp=4, ep=8, etp=1, pp=1, cp=1)
    fit = fit_rollout(
        model_fit, device, overrides.MICRO_BATCH_TOKENS, overrides.DAPO["rollout_tp"], skew
    )
    return fit, skew


def expected_overrides(device: str, files: dict) -> dict[str, str]:
    """The full set for --tp 4 --ep 8 on 4 x 8 devices; A2 and H100 differ in offload and env.
    The keys and which setting each carries are written out here; the values come from the
    objects the launcher uses (_source_of_truth), formatted as verl's command line has them."""
    a2 = device == "npu"
    D, fmt = overrides.DAPO, overrides.format_value
    fit, skew = _source_of_truth(device)
    actor, engine, rollout, kw = (
        "actor_rollout_ref.actor",
        "+actor_rollout_ref.actor.mcore_ep",
        "actor_rollout_ref.rollout",
        "+reward.reward_kwargs",
    )
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
        # scripts/test.sh sets it, as train_mcore.sh does: the job passes it on
        **({"PYTHONWARNINGS": w} if (w := os.environ.get("PYTHONWARNINGS")) else {}),
        **(ray_job.A2_ENV if a2 else {}),
        **({"HCCL_SOCKET_IFNAME": "eth0"} if a2 else {"NCCL_SOCKET_IFNAME": "eth0"}),
        "GLOO_SOCKET_IFNAME": "eth0",
        "TQ_NUM_THREADS": ray_job.transferqueue_threads(),  # at most this machine's cores
        "TENSORBOARD_DIR": f"{files['--ckpt-dir']}/tensorboard",
    }
    aux_loss = "{" + ",".join(f"{k}:{fmt(v)}" for k, v in overrides.AUX_LOSS.items()) + "}"
    expected = {
        "data.train_files": str(files["--train-file"]),
        "data.val_files": str(files["--val-file"]),
        "data.prompt_key": "prompt",
        "data.max_prompt_length": D["max_prompt_length"],
        "data.max_response_length": D["max_response_length"],
        "data.train_batch_size": D["train_batch_size"],
        "data.truncation": "left",
        "data.filter_overlong_prompts": True,
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_ctrl.kl_coef": 0.0,
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_inflight_gen_batches": (
            D["gen_batch_size"] // D["train_batch_size"]
        ),
        f"{actor}.clip_ratio_low": D["clip_ratio_low"],
        f"{actor}.clip_ratio_high": D["clip_ratio_high"],
        f"{actor}.clip_ratio_c": D["clip_ratio_c"],
        f"{actor}.loss_agg_mode": "token-mean",
        f"{actor}.use_kl_loss": False,
        f"{actor}.kl_loss_coef": 0.0,
        f"{actor}.entropy_coeff": 0,
        f"{actor}.ppo_mini_batch_size": D["train_batch_size"],  # one update per step
        f"{actor}.ppo_epochs": 1,
        f"{actor}.use_dynamic_bsz": True,
        f"{actor}.ppo_max_token_len_per_gpu": overrides.MICRO_BATCH_TOKENS,
        f"{actor}.optim.lr": D["lr"],
        f"{actor}.optim.lr_warmup_steps": D["warmup_steps"],
        f"{actor}.optim.weight_decay": D["weight_decay"],
        f"{actor}.optim.clip_grad": D["grad_clip"],
        "actor_rollout_ref.model.path": str(files["--model"]),
        "actor_rollout_ref.model.external_lib": "recipes.dapo.engine.verl_engine",
        f"{actor}._target_": "recipes.dapo.engine.config.McoreEpActorConfig",
        f"{actor}.strategy": "mcore_ep",
        f"{engine}._target_": "recipes.dapo.engine.config.McoreEpEngineConfig",
        f"{engine}.tensor_model_parallel_size": 4,
        f"{engine}.expert_model_parallel_size": 8,
        f"{engine}.expert_tensor_parallel_size": 1,
        f"{engine}.pipeline_model_parallel_size": 1,
        f"{engine}.recompute": fit.recompute,  # recipes.dapo.job.fit: the least recompute that fits
        f"{engine}.param_offload": fit.param_offload,
        f"{engine}.optimizer_offload": fit.optimizer_offload,
        f"{engine}.aux_loss": aux_loss,
        f"{engine}.monitor.enable": True,
        f"{engine}.monitor.log_dir": f"{files['--ckpt-dir']}/moe_tensorboard",
        f"{engine}.router_replay": "disabled",
        f"{engine}.packed": False,
        f"{engine}.monitor.assumed_ep_skew": skew,
        f"{engine}.monitor.run_name": f"'qwen3-30b-a3b-{'a2' if a2 else 'h100'}-tp4-ep8'",
        f"{rollout}.name": "vllm",
        f"{rollout}.mode": "async",
        f"{rollout}.tensor_model_parallel_size": D["rollout_tp"],
        f"{rollout}.gpu_memory_utilization": fit.gpu_memory_utilization,
        f"{rollout}.n": D["n"],
        f"{rollout}.temperature": D["temperature"],
        f"{rollout}.top_p": 1.0,
        f"{rollout}.top_k": -1,
        f"{rollout}.max_num_batched_tokens": D["max_prompt_length"] + D["max_response_length"],
        f"{rollout}.enable_chunked_prefill": True,
        f"{rollout}.log_prob_use_dynamic_bsz": True,
        f"{rollout}.log_prob_max_token_len_per_gpu": overrides.LOG_PROB_TOKENS,
        f"{rollout}.val_kwargs.temperature": D["temperature"],
        f"{rollout}.val_kwargs.top_p": D["val_top_p"],
        f"{rollout}.val_kwargs.top_k": -1,
        f"{rollout}.val_kwargs.do_sample": True,
        f"{rollout}.val_kwargs.n": 1,
        # verl's single-turn loop keeping R3's routes uint8 (recipes/dapo/engine/compact_routes.py)
        f"{rollout}.agent.agent_loop_config_path": str(
            Path(__file__).resolve().parents[2] / "recipes" / "dapo" / "engine" / "agent_loops.yaml"
        ),
        f"{rollout}.agent.default_agent_loop": "single_turn_compact_routes",
        "reward.reward_manager.name": "dapo",
        f"{kw}.max_resp_len": D["max_response_length"],
        f"{kw}.overlong_buffer_cfg.enable": True,
        f"{kw}.overlong_buffer_cfg.len": D["overlong_buffer"],
        f"{kw}.overlong_buffer_cfg.penalty_factor": D["overlong_penalty"],
        f"{kw}.overlong_buffer_cfg.log": False,
        "trainer.use_v1": True,
        "trainer.v1.trainer_mode": "sync",
        "trainer.device": device,
        "trainer.nnodes": 4,
        "trainer.n_gpus_per_node": 8,
        "trainer.save_freq": D["save_freq"],
        "trainer.test_freq": D["test_freq"],
        "trainer.resume_mode": "auto",
        "actor_rollout_ref.actor.checkpoint.async_save": True,
        "trainer.val_before_train": True,
        "trainer.default_local_dir": str(files["--ckpt-dir"]),
        "hydra.run.dir": f"{files['--ckpt-dir']}/hydra",
        "trainer.logger": ["console", "tensorboard"],
        "trainer.project_name": "mcore-moe-dapo",
        "trainer.experiment_name": f"qwen3-30b-a3b-{'a2' if a2 else 'h100'}-tp4-ep8",
        # quoted: hydra must hand Ray strings, not HCCL_EXEC_TIMEOUT=3600 as an int
        **{f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}": f"'{v}'" for k, v in env.items()},
    }
    return {k: fmt(v) for k, v in expected.items()}


def resolved(device, files, *extra):
    return resolution.resolve(
        spec_of(
            [*argv(files, "--device", device, "--tp", "4", "--ep", "8", "--ifname", "eth0",
                   "--dry-run"), "--", *extra]
        )
    )  # fmt: skip


def flat(groups: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in overrides.to_cli(groups))


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_dry_run_yields_exactly_the_expected_overrides(device, files, nothing_starts, capsys):
    assert flat(resolved(device, files).groups) == expected_overrides(device, files)
    rc = launch.main(
        argv(files, "--device", device, "--tp", "4", "--ep", "8", "--ifname", "eth0", "--dry-run")
    )
    out = capsys.readouterr().out
    assert rc == 0 and nothing_starts == []
    for item, value in expected_overrides(device, files).items():
        assert f"  {item}={value}\n" in out


def test_pass_through_overrides_replace_ours_or_are_added(files):
    res = resolved("cuda", files, "data.train_batch_size=64", "trainer.total_epochs=2")
    assert res.replaced == ["data.train_batch_size"]
    assert res.groups["data"]["data.train_batch_size"] == "64"
    assert res.groups["extra"] == {"trainer.total_epochs": "2"}


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_verl_composes_and_validates_the_overrides(device, files):
    """verl's hydra config takes every override; its dataclasses build our engine config."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from recipes.dapo.engine.config import McoreEpActorConfig, McoreEpEngineConfig

    run = resolved(device, files)
    cli = overrides.to_cli(run.groups)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=cli)
    validate_config(cfg, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, McoreEpActorConfig) and isinstance(actor.engine, McoreEpEngineConfig)
    # the launcher's plan is the one the engine builds on the job's ranks
    assert actor.engine.plan(run.run.plan.world).record() == run.run.plan.record()
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (actor.optim.lr, actor.optim.lr_warmup_steps, actor.optim.weight_decay) == (
        1e-6,
        10,
        0.1,
    )
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert (algo.filter_groups.enable, algo.filter_groups.metric) == (True, "acc")
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.len == 4096
    assert actor.engine.monitor["run_name"] == cfg.trainer.experiment_name  # the report's title
    assert actor.engine.guards == {}  # the guards are opt-in


def test_the_guards_pass_through_as_the_readme_writes_them(files):
    """docs/run_health.md, "Guards": one pass-through override turns the entropy floor on."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass

    from backend.training.loss_guards import GuardSettings

    guard = "+actor_rollout_ref.actor.mcore_ep.guards={entropy_floor:{enable:true,floor:0.3}}"
    assert guard in (REPO / "docs" / "run_health.md").read_text()
    cli = overrides.to_cli(resolved("cuda", files, guard).groups)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=cli)
    engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine
    settings = GuardSettings.from_dict(engine.guards)
    assert settings.entropy_floor.floor == 0.3 and settings.kl is None


def _fails_with_one_line(capsys, args, *needles):
    rc = launch.main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize(
    "plan, needle",
    [
        (["--tp", "3"], "tp=3 does not divide num_key_value_heads=4"),
        (["--tp", "16", "--nodes", "1"], "tp=16 does not divide num_key_value_heads=4"),
        (
            ["--tp", "2", "--nodes", "1", "--devices-per-node", "3"],
            "tp*cp*pp=2 does not divide world=3",
        ),
        (["--tp", "8"], "tp=8 does not divide num_key_value_heads=4"),
        (["--ep", "64"], "etp*ep*pp=64 does not divide world=32"),
        (["--ep", "12", "--nodes", "3"], "ep=12 does not divide num_experts=128"),
        (["--cp", "2"], "runs cp=1"),
        (["--pp", "5"], "pp=5 does not divide num_hidden_layers=48"),
    ],
)
def test_illegal_plan_fails_before_anything_starts(plan, needle, files, nothing_starts, capsys):
    _fails_with_one_line(capsys, argv(files, "--device", "cuda", *plan), needle)
    assert nothing_starts == []


def test_missing_files_fail_before_anything_starts(files, nothing_starts, capsys):
    files["--train-file"] = files["--train-file"].with_name("nope.parquet")
    _fails_with_one_line(
        capsys, argv(files, "--device", "cuda", "--dry-run"), "nope.parquet", "wget -O"
    )
    files["--model"] = files["--model"].with_name("no-model")
    _fails_with_one_line(capsys, argv(files, "--device", "cuda"), "no config.json")
    _fails_with_one_line(
        capsys, ["--device", "cuda", "--model", "x"], "needs --train-file, --val-file, --ckpt-dir"
    )
    assert nothing_starts == []


def test_data_sources_are_checked_against_the_configured_reward(files, nothing_starts, capsys):
    """verl's default scorer knows math_dapo, not 'my_task'; a custom reward function scores
    every source, so then the function's file must be there instead (all before Ray)."""
    table = pq.read_table(files["--train-file"]).to_pydict()
    pq.write_table(pa.table({**table, "data_source": ["my_task"]}), files["--train-file"])
    dry = argv(files, "--device", "cuda", "--dry-run")
    _fails_with_one_line(capsys, dry, "data_source 'my_task'", "reward.custom_reward_function")
    reward = REPO / "recipes" / "local" / "task" / "doubles.py"
    custom = ["--", f"reward.custom_reward_function.path={reward}",
              "reward.custom_reward_function.name=compute_score"]  # fmt: skip
    assert launch.main(dry + custom) == 0
    capsys.readouterr()
    missing = ["--", "reward.custom_reward_function.path=nope.py"]
    _fails_with_one_line(capsys, dry + missing, "reward.custom_reward_function.path nope.py")
    assert nothing_starts == []


def test_a_broken_model_dir_is_refused_before_anything_starts(files, nothing_starts, capsys):
    """The cluster's --model checked from its headers, in a dry run too: weights gone, a config
    edited after the save (96 experts against 128), a truncated shard; each one line."""
    model = files["--model"]
    dry = argv(files, "--device", "cuda", "--dry-run")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_experts": 96}))
    _fails_with_one_line(
        capsys, dry, "holds model.layers.0.mlp.experts.96.gate_proj.weight (and 4607 more)",
        "num_experts 96", "does config.json match the weights?",
    )  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    shard = model / "model-00007-of-00016.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    _fails_with_one_line(capsys, dry, "model-00007-of-00016.safetensors is unreadable or truncated")
    for path in model.glob("model*.safetensors*"):
        path.unlink()
    _fails_with_one_line(capsys, argv(files, "--device", "cuda"), "has no safetensors weights")
    assert nothing_starts == []


def test_npu_without_torch_npu_fails_before_anything_starts(files, nothing_starts, capsys):
    if importlib.util.find_spec("torch_npu"):
        pytest.skip("torch_npu is installed here")
    _fails_with_one_line(capsys, argv(files, "--device", "npu"), "torch_npu", "install")
    assert nothing_starts == []


def test_launch_checks_ray_then_starts_verl_with_our_engine(files, monkeypatch, tmp_path, capsys):
    """The real launcher end to end but for two stand-ins found where it looks for them: a
    `ray` and a `python` (sys.executable) that log their calls. The real check_ray reads the
    real `ray status` call; the real run_command starts the real command line in the repo with
    the job environment and returns the child's status."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    record = (
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps([os.path.basename(sys.argv[0]), sys.argv[1:], os.getcwd(),"
        " dict(os.environ)]) + '\\n')\n"
    )
    ray, python = bin_dir / "ray", bin_dir / "python"
    python.write_text(record + "sys.exit(3)\n")
    monkeypatch.setattr(sys, "executable", str(python))  # ray_job.ray_executable: its sibling
    monkeypatch.setattr(stack, "problem", lambda target: None)  # the cuda set is installed
    # the node watch reads the cluster's node table from Ray's GCS, which the stand-in lacks
    monkeypatch.setattr(lost_node.NodeWatch, "follow", lambda self, child: None)

    def calls():  # the run's reaper (recipes.dapo.cluster.run_scope) starts from the same python
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return [row for row in rows if not any(a.endswith("reaper.py") for a in row[1])]

    ray.write_text(record + "print(' 0.0/16.0 GPU')\n")
    for exe in (ray, python):
        exe.chmod(0o755)
    assert launch.main(argv(files, "--device", "cuda")) == 2  # 16 GPUs < 32
    assert [(exe, args) for exe, args, _, _ in calls()] == [("ray", ["status"])]  # nothing started
    log.unlink()
    ray.write_text(record + "print(' 0.0/32.0 GPU')\n")
    rc = launch.main(argv(files, "--device", "cuda", "--", "trainer.total_epochs=1"))
    assert rc == 3  # the training child's own status
    (ray_call, verl_call) = calls()  # ray status first, then verl
    assert ray_call[:2] == ["ray", ["status"]]
    exe, args, cwd, env = verl_call
    assert exe == "python" and args[:2] == ["-m", "verl.trainer.main_ppo"] and cwd == str(REPO)
    expected = resolution.resolve(
        spec_of([*argv(files, "--device", "cuda"), "--", "trainer.total_epochs=1"])
    )
    assert args[2:] == overrides.to_cli(expected.groups)
    assert args[-1] == "trainer.total_epochs=1"
    # our engine: loaded by verl's external_lib in the actor's workers, selected by strategy
    assert "actor_rollout_ref.model.external_lib=recipes.dapo.engine.verl_engine" in args
    assert "actor_rollout_ref.actor.strategy=mcore_ep" in args
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)
    assert "VERL_USE_EXTERNAL_MODULES" not in env
    assert env["TQ_NUM_THREADS"] == ray_job.transferqueue_threads()
    # the child's output went through the console: its log in the run, its status on screen
    out = capsys.readouterr().out
    log = files["--ckpt-dir"] / "logs" / "launch_000.log"
    assert f"log: {log}" in out and "the training job exited with status 3" in out
    assert log.read_text().startswith("DAPO, verl 0.9.1 V1 trainer, mcore_ep actor on")


def test_no_accelerator_runs_verls_trainer_on_the_tiny_model(monkeypatch, tmp_path, capsys):
    from recipes.local import run as local_run

    monkeypatch.setattr(run_spec, "pick_device", lambda requested: "cpu")
    started = []
    monkeypatch.setattr(
        ray_job, "run_command", lambda cmd, env, *a: started.append((cmd, env)) or 0
    )
    monkeypatch.setattr(local_run, "finish", lambda *args, **kwargs: 0)
    assert (
        launch.main(["--model", "tiny", "--steps", "3", "--seed", "1", "--ckpt-dir", str(tmp_path)])
        == 0
    )
    ((cmd, env),) = started
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
    for override in ("trainer.device=cpu", "actor_rollout_ref.rollout.name=vllm",
                     "trainer.total_training_steps=3", "trainer.use_v1=true",
                     "algorithm.filter_groups.enable=true",
                     "actor_rollout_ref.actor.strategy=mcore_ep"):  # fmt: skip
        assert override in cmd, override
    assert env["VERL_PLATFORM"] == "cpu"
    assert env["VERL_USE_EXTERNAL_MODULES"] == "recipes.local.cpu.platform"
    assert (tmp_path / "tiny_hf" / "tokenizer.json").is_file()
    assert (tmp_path / "data" / "train.parquet").is_file()
    capsys.readouterr()
    _fails_with_one_line(capsys, ["--train-file", "/x"], "--train-file configure a cluster run")


def test_cpu_on_a_running_cluster_takes_the_cluster_runs_ray_settings(tmp_path, monkeypatch):
    """--device cpu with --ray-address: the tiny job on the cluster's nodes x devices, verl's
    ray.init() attached to that address (the nodes declare the resources); without it the
    embedded run's own Ray, never a running cluster (address=local)."""
    monkeypatch.setattr(run_spec, "pick_device", lambda requested: "cpu")
    base = ["--ep", "2", "--ckpt-dir", str(tmp_path), "--dry-run"]
    on = spec_of(
        ["--ray-address", "10.0.0.1:6380", "--nodes", "2", "--devices-per-node", "1", *base]
    )
    cluster_run = resolution.resolve_local(on)
    embedded = resolution.resolve_local(spec_of(base))
    plans = [(r.run.plan.nodes, r.run.plan.devices_per_node) for r in (cluster_run, embedded)]
    assert plans == [(2, 1), (1, 2)]
    init = "ray_kwargs.ray_init."
    assert {
        k: v for k, v in flat(cluster_run.groups).items() if init in k and "env_vars" not in k
    } == {f"+{init}address": "'10.0.0.1:6380'"}
    assert {k: v for k, v in flat(embedded.groups).items() if init in k and "env_vars" not in k} == {
        f"+{init}address": "local", f"{init}num_cpus": "32", f"+{init}num_gpus": "2",
        f"+{init}include_dashboard": "false",
    }  # fmt: skip
    assert cluster_run.run.env.keys() == embedded.run.env.keys()
    for key, value in {**ray_job.job_env("cpu", None), "VERL_PLATFORM": "cpu"}.items():
        assert cluster_run.run.env[key] == value
    assert "Ray: the running cluster at 10.0.0.1:6380 (--ray-address)" in cluster_run.describe()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"head_dim": 24}, "head_dim 24 is not a head size vLLM's CPU attention supports"),
        ({"hidden_size": 48}, "hidden_size 48 is not a multiple of 32"),
        ({"vocab_size": 40}, "the tokenizer has 32 tokens for vocab_size 40"),
    ],
    ids=["head_dim", "hidden", "tokenizer"],
)
def test_a_model_beyond_the_cpu_rollouts_limits_is_refused_in_one_line(
    monkeypatch, tmp_path, capsys, change, message
):
    """The local run serves its model with vLLM's CPU backend: a model (here through
    actor_rollout_ref.model.path) it cannot serve is refused before Ray, one line, exit 2."""
    import json
    import shutil

    from recipes.local import run as local_run

    monkeypatch.setattr(run_spec, "pick_device", lambda requested: "cpu")
    monkeypatch.setattr(ray_job, "run_command", lambda *a, **k: pytest.fail("started"))
    hf_dir, _ = local_run.prepare(tmp_path / "run")
    capsys.readouterr()
    user = tmp_path / "user_model"  # the built tiny model with the change, weights to match
    base = json.loads((hf_dir / "config.json").read_text())
    model_dirs.built(user, change, base={k: v for k, v in base.items() if k != "dtype"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(hf_dir / name, user / name)
    argv = ["--ckpt-dir", str(tmp_path / "run"), "--", f"actor_rollout_ref.model.path={user}"]
    _fails_with_one_line(capsys, argv, message)


def test_the_cpu_head_sizes_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from recipes.local.cpu.rollout_limits import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_pp_reaches_the_engine_and_the_memory_model(files, monkeypatch, tmp_path, capsys):
    """--pp: the engine's pipeline size, the plan's pp groups, the memory model's stages; the
    local run folds pp into its world and refuses a pp its (mini) model cannot take."""
    run = resolution.resolve(
        spec_of(argv(files, "--device", "cuda", "--tp", "4", "--ep", "4", "--pp", "2", "--dry-run"))
    )
    engine = "+actor_rollout_ref.actor.mcore_ep"
    assert flat(run.groups)[f"{engine}.pipeline_model_parallel_size"] == "2"
    assert (run.run.plan.pp, run.run.plan.dp) == (2, 4)
    peaks = {}
    for pp in ("1", "2"):  # half the layers per device: a lower update peak
        assert launch.main(argv(files, "--device", "cuda", "--tp", "4", "--ep", "4", "--pp", pp,
                                "--dry-run")) == 0  # fmt: skip
        out = capsys.readouterr().out
        peaks[pp] = float(re.search(r"actor update peak ([\d.]+) GiB", out)[1])
    assert peaks["2"] < peaks["1"]
    monkeypatch.setattr(run_spec, "pick_device", lambda requested: "cpu")
    local = spec_of(["--pp", "2", "--ckpt-dir", str(tmp_path), "--dry-run"])
    resolved_local = resolution.resolve_local(local)
    assert (resolved_local.run.plan.pp, resolved_local.run.plan.world) == (2, 2)
    assert flat(resolved_local.groups)[f"{engine}.pipeline_model_parallel_size"] == "2"
    capsys.readouterr()
    _fails_with_one_line(
        capsys,
        ["--pp", "3", "--ckpt-dir", str(tmp_path), "--dry-run"],
        "pp=3 does not divide num_hidden_layers=4: legal pp for this model: 1, 2, 4",
    )


def test_shell_script_forwards_to_the_launcher(files):
    run = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "train_mcore.sh"),
            "--dry-run",
            *argv(files, "--device", "npu", "--tp", "4", "--ep", "8"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "+actor_rollout_ref.actor.mcore_ep.param_offload=true" in run.stdout
    bad = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "train_mcore.sh"),
            *argv(files, "--device", "npu", "--tp", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.startswith(
        "error: tp=3 does not divide num_key_value_heads=4"
    )


@pytest.mark.parametrize("device, label", [("npu", "Ascend A2"), ("cuda", "H100")])
def test_dry_run_without_files_prints_plan_layout_memory_and_warnings(
    device, label, nothing_starts, capsys
):
    rc = launch.main(cluster_dry_run(device))
    out = capsys.readouterr().out
    assert rc == 0
    assert f"mcore_ep actor on {label} x 32" in out
    assert "plan: tp=4 pp=1 cp=1 ep=8 etp=1 dp=8 edp=4 on 4x8=32 devices" in out
    assert "actor update peak" in out and "KV cache" in out
    assert "  ep        8       4  no" in out  # EP stays inside a node
    assert "16 experts per EP rank" in out
    assert "Qwen3-30B-A3B config assumed" in out
    # full recompute leaves one layer's expert activations exposed to routing skew
    assert "2.00x EP skew assumed (default" in out
    assert "fits even with every token on one EP rank (8x)" in out
    assert "recompute: full (the least whose update fits" in out


def test_history_merges_launches_and_skips_a_torn_line(tmp_path):
    from recipes.local.run import next_metrics_file, read_history

    first = next_metrics_file(tmp_path)
    rows = [{"step": s, "data": {"r": float(s)}} for s in (1, 2, 3)]
    first.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "da')
    second = next_metrics_file(tmp_path)  # a resume from step 2 runs step 3 again
    second.write_text(json.dumps({"step": 3, "data": {"r": 30.0}}) + "\n")
    assert [first.name, second.name] == ["launch_000.jsonl", "launch_001.jsonl"]
    history = read_history(tmp_path)
    assert [(h["step"], h["r"]) for h in history] == [(1, 1.0), (2, 2.0), (3, 30.0)]


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_dry_run_names_the_rollout_r3_needs(device, nothing_starts, capsys):
    base = cluster_dry_run(device, "--", "actor_rollout_ref.actor.mcore_ep.router_replay=R3")
    assert launch.main(base) == 0
    out = capsys.readouterr().out
    assert "routing replay: R3" in out and "vLLM >= 0.22" in out
    if device == "npu":  # the A2 set's vllm-ascend predates routed_experts
        assert "vllm-ascend 0.11.0rc1" in out and "use R2 or disabled" in out
    else:
        assert "the cuda set has vllm 0.24.0" in out
    assert "warning: set actor_rollout_ref.rollout.enable_rollout_routing_replay=True" in out
    assert launch.main([*base, "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"]) == 0
    assert "warning: set" not in capsys.readouterr().out
    assert launch.main(base[:-2]) == 0
    assert "routing replay" not in capsys.readouterr().out


def test_last_complete_checkpoint_is_what_resume_loads(tmp_path):
    """verl's tracker names the step; a checkpoint some rank had not finished (no manifest,
    as after a kill during the save) is passed over for the newest sealed one."""
    from converters.manifest import NAME
    from recipes.dapo.checkpoints.files import MODEL_DIR, OPTIM_STATE

    assert lost_node.last_complete_checkpoint(tmp_path) is None  # no tracker: nothing saved
    for step, sealed in ((1, True), (2, False)):
        actor = tmp_path / f"global_step_{step}" / "actor"
        for part in (MODEL_DIR, OPTIM_STATE):
            (actor / part).mkdir(parents=True)
            if sealed:
                (actor / part / NAME).write_text("{}")
        (actor / "meta.json").write_text("{}")
    (tmp_path / lost_node.TRACKER).write_text("2")
    assert lost_node.last_complete_checkpoint(tmp_path) == tmp_path / "global_step_1"


def test_the_warning_filter_reaches_workers_of_raylets_started_elsewhere(monkeypatch):
    """train_mcore.sh's PYTHONWARNINGS goes into the job env (Ray's runtime env): workers of a
    raylet started by ray_start_*.sh do not inherit the launcher's environment (bug: 27 library
    UserWarnings on the 2 x 4 one-box cluster's console, none on the embedded run's)."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::UserWarning")
    assert ray_job.job_env("cpu", None)["PYTHONWARNINGS"] == "ignore::UserWarning"
    assert ray_job.job_env("cuda", None)["PYTHONWARNINGS"] == "ignore::UserWarning"
    monkeypatch.delenv("PYTHONWARNINGS")
    assert "PYTHONWARNINGS" not in ray_job.job_env("cpu", None)
