"""verl overrides for DAPO on Qwen3-30B-A3B with the mcore_ep actor, grouped by concern.

Everything is on top of verl 0.9.1's `ppo_trainer` config and its V1 trainer (trainer.use_v1,
sync mode), which carries DAPO's dynamic sampling (algorithm.filter_groups); the DAPO reward
manager and math_dapo scoring are verl's too. A leading `+` adds a key verl's yaml lacks.
The reference runs' settings are in DAPO below; what depends on the cluster (plan, offload,
paths, environment) comes from a JobSpec.
"""

from dataclasses import dataclass
from pathlib import Path

from backend.shared.names import DEVICE_TAGS
from parallel.plan import ParallelPlan
from recipes.dapo import BACKEND
from recipes.dapo.job.actors import plan_label
from recipes.dapo.job.fit import Fit

# verl's agent loop with R3's routes kept uint8 on their way to the engine
# (recipes.dapo.engine.compact_routes; verl reads the loop from this config file)
AGENT_LOOPS = Path(__file__).parents[1] / "engine" / "agent_loops.yaml"
AGENT_LOOP = "single_turn_compact_routes"

DAPO = dict(
    max_prompt_length=2048,
    max_response_length=6144,
    train_batch_size=32,
    gen_batch_size=96,
    n=16,
    lr=1e-6,
    warmup_steps=10,
    weight_decay=0.1,
    grad_clip=1.0,
    temperature=1.0,
    val_top_p=0.7,
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=10.0,
    overlong_buffer=4096,
    overlong_penalty=1.0,
    save_freq=50,
    test_freq=200,
    rollout_tp=2,
)
# mean tokens (prompt + response) of a sample in the seed's DAPO runs on Qwen3-30B-A3B: the
# route and step sizes the dry run prints assume it
MEAN_SAMPLE_TOKENS = 4900
# padded tokens per micro-batch per DP rank: two full-length sequences (2048 + 6144)
MICRO_BATCH_TOKENS = 2 * (DAPO["max_prompt_length"] + DAPO["max_response_length"])
LOG_PROB_TOKENS = 2 * MICRO_BATCH_TOKENS  # no backward: twice the tokens
# Qwen3's own balancing (global batch), applied with an explicit coefficient, never inherited
# from the HF config; f counted in the old-log-prob pass that runs anyway (exact with one
# update per step, see below), not in an extra forward (a whole no-grad forward per update;
# figures in docs/aux_loss.md). "observe" logs it without a gradient
AUX_LOSS = {"mode": "on", "type": "global_batch", "coeff": 0.001, "global_counts": "old_log_prob"}
ENGINE_MODULE = "recipes.dapo.engine.verl_engine"
ACTOR = "actor_rollout_ref.actor"
ENGINE = f"+{ACTOR}.{BACKEND}"


@dataclass(frozen=True)
class JobSpec:
    device: str  # npu (Ascend A2) | cuda (H100) | cpu (the embedded run)
    plan: ParallelPlan
    fit: Fit
    model: str
    train_file: str
    val_file: str
    ckpt_dir: str
    env: dict[str, str]
    steps: int | None = None  # trainer.total_training_steps (None: the epochs decide)
    save_freq: int = DAPO["save_freq"]
    # the running cluster verl's ray.init() attaches to (None: the one Ray finds from this
    # node; the embedded CPU run starts its own)
    ray_address: str | None = None
    task: str = "doubles"  # the embedded run's task (recipes.local.cpu_overrides.TASKS)
    trainer_mode: str = "sync"  # verl's V1 trainer mode (recipes.dapo.job.trainer_modes)
    rollout_nodes: int = 0  # separate_async: the rollout's own nodes (trainer_modes.split)
    engine: str = BACKEND  # the actor: ours, or verl's FSDP2 engine (recipes.dapo.job.actors)
    repo: Path = Path(__file__).resolve().parents[3]


def data(run: JobSpec) -> dict:
    return {
        "data.train_files": run.train_file,
        "data.val_files": run.val_file,
        "data.prompt_key": "prompt",
        "data.max_prompt_length": DAPO["max_prompt_length"],
        "data.max_response_length": DAPO["max_response_length"],
        "data.train_batch_size": DAPO["train_batch_size"],
        "data.truncation": "left",
        "data.filter_overlong_prompts": True,
    }


def algorithm(run: JobSpec) -> dict:
    """GRPO advantages, no KL, DAPO dynamic sampling on accuracy."""
    inflight = DAPO["gen_batch_size"] // DAPO["train_batch_size"]  # 96 prompts in flight
    return {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_ctrl.kl_coef": 0.0,
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_inflight_gen_batches": inflight,
    }


def policy(run: JobSpec) -> dict:
    """DAPO's loss (clip-higher, dual clip, token-mean, no KL/entropy) and optimizer."""
    return {
        f"{ACTOR}.clip_ratio_low": DAPO["clip_ratio_low"],
        f"{ACTOR}.clip_ratio_high": DAPO["clip_ratio_high"],
        f"{ACTOR}.clip_ratio_c": DAPO["clip_ratio_c"],
        f"{ACTOR}.loss_agg_mode": "token-mean",
        f"{ACTOR}.use_kl_loss": False,
        f"{ACTOR}.kl_loss_coef": 0.0,
        f"{ACTOR}.entropy_coeff": 0,
        f"{ACTOR}.ppo_mini_batch_size": DAPO["train_batch_size"],  # one update per step
        f"{ACTOR}.ppo_epochs": 1,
        f"{ACTOR}.use_dynamic_bsz": True,
        f"{ACTOR}.ppo_max_token_len_per_gpu": MICRO_BATCH_TOKENS,
        f"{ACTOR}.optim.lr": DAPO["lr"],
        f"{ACTOR}.optim.lr_warmup_steps": DAPO["warmup_steps"],
        f"{ACTOR}.optim.weight_decay": DAPO["weight_decay"],
        f"{ACTOR}.optim.clip_grad": DAPO["grad_clip"],
    }


def engine(run: JobSpec) -> dict:
    """Our backend in place of FSDP: registered by ENGINE_MODULE, configured by config.py;
    with --engine fsdp verl's own FSDP2 engine instead (recipes.dapo.job.actors)."""
    if run.engine != BACKEND:
        from recipes.dapo.job.actors import fsdp_overrides

        return {"actor_rollout_ref.model.path": run.model, **fsdp_overrides(run)}
    return {
        "actor_rollout_ref.model.path": run.model,
        "actor_rollout_ref.model.external_lib": ENGINE_MODULE,
        f"{ACTOR}._target_": "recipes.dapo.engine.config.McoreEpActorConfig",
        f"{ACTOR}.strategy": BACKEND,
        f"{ENGINE}._target_": "recipes.dapo.engine.config.McoreEpEngineConfig",
        f"{ENGINE}.tensor_model_parallel_size": run.plan.tp,
        f"{ENGINE}.expert_model_parallel_size": run.plan.ep,
        f"{ENGINE}.expert_tensor_parallel_size": run.plan.etp,
        f"{ENGINE}.pipeline_model_parallel_size": run.plan.pp,
        f"{ENGINE}.recompute": run.fit.recompute,  # recipes.dapo.job.fit: the least that fits
        f"{ENGINE}.param_offload": run.fit.param_offload,
        f"{ENGINE}.optimizer_offload": run.fit.optimizer_offload,
        f"{ENGINE}.aux_loss": _hydra_dict(AUX_LOSS),
        f"{ENGINE}.monitor.enable": True,
        f"{ENGINE}.monitor.log_dir": f"{run.ckpt_dir}/moe_tensorboard",
        f"{ENGINE}.router_replay": "disabled",  # R2 | R3: docs/routing_replay.md
        f"{ENGINE}.packed": False,  # THD micro-batches: docs/packed_sequences.md
        # checkpoints written in the background (recipes.dapo.checkpoints.async_save); verl then leaves the
        # tracker (latest_checkpointed_iteration.txt) to the engine, which writes it once sealed
        f"{ACTOR}.checkpoint.async_save": True,
    }


def rollout(run: JobSpec) -> dict:
    r = "actor_rollout_ref.rollout"
    return {
        f"{r}.name": "vllm",
        f"{r}.mode": "async",
        f"{r}.tensor_model_parallel_size": DAPO["rollout_tp"],
        f"{r}.gpu_memory_utilization": run.fit.gpu_memory_utilization,
        f"{r}.n": DAPO["n"],
        f"{r}.temperature": DAPO["temperature"],
        f"{r}.top_p": 1.0,
        f"{r}.top_k": -1,
        f"{r}.max_num_batched_tokens": DAPO["max_prompt_length"] + DAPO["max_response_length"],
        f"{r}.enable_chunked_prefill": True,
        f"{r}.log_prob_use_dynamic_bsz": True,
        f"{r}.log_prob_max_token_len_per_gpu": LOG_PROB_TOKENS,
        f"{r}.val_kwargs.temperature": DAPO["temperature"],
        f"{r}.val_kwargs.top_p": DAPO["val_top_p"],
        f"{r}.val_kwargs.top_k": -1,
        f"{r}.val_kwargs.do_sample": True,
        f"{r}.val_kwargs.n": 1,
        f"{r}.agent.agent_loop_config_path": str(AGENT_LOOPS),
        f"{r}.agent.default_agent_loop": AGENT_LOOP,
    }


def reward(run: JobSpec) -> dict:
    """verl's DAPO reward manager (math_dapo score, `acc` in its extra info) + overlong buffer."""
    kw = "+reward.reward_kwargs"
    return {
        "reward.reward_manager.name": "dapo",
        f"{kw}.max_resp_len": DAPO["max_response_length"],
        f"{kw}.overlong_buffer_cfg.enable": True,
        f"{kw}.overlong_buffer_cfg.len": DAPO["overlong_buffer"],
        f"{kw}.overlong_buffer_cfg.penalty_factor": DAPO["overlong_penalty"],
        f"{kw}.overlong_buffer_cfg.log": False,
    }


def trainer(run: JobSpec) -> dict:
    label = DEVICE_TAGS[run.device]
    return {
        "trainer.use_v1": True,
        "trainer.v1.trainer_mode": run.trainer_mode,
        "trainer.device": run.device,
        "trainer.nnodes": run.plan.nodes,
        "trainer.n_gpus_per_node": run.plan.devices_per_node,
        "trainer.save_freq": DAPO["save_freq"],
        "trainer.test_freq": DAPO["test_freq"],
        "trainer.resume_mode": "auto",
        "trainer.val_before_train": True,
        "trainer.default_local_dir": run.ckpt_dir,
        "hydra.run.dir": f"{run.ckpt_dir}/hydra",  # not ./outputs in the working directory
        "trainer.logger": ["console", "tensorboard"],
        "trainer.project_name": "mcore-moe-dapo",
        "trainer.experiment_name": f"qwen3-30b-a3b-{label}-{plan_label(run)}",
    }


def ray_env(run: JobSpec) -> dict:
    """Environment of every Ray worker of the job (verl's ray_init.runtime_env), and the
    cluster its ray.init() attaches to."""
    # Ray wants str values: hydra would make HCCL_EXEC_TIMEOUT=3600 an int
    env = {f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}": quoted(v) for k, v in run.env.items()}
    if run.ray_address:
        env["+ray_kwargs.ray_init.address"] = quoted(run.ray_address)
    return env


GROUPS = {
    "data": data,
    "algorithm": algorithm,
    "policy": policy,
    "engine": engine,
    "rollout": rollout,
    "reward": reward,
    "trainer": trainer,
    "ray_env": ray_env,
}


def build(run: JobSpec, on_top: dict[str, dict] | None = None) -> dict[str, dict]:
    """{concern: {override key: value}}; `on_top` replaces values by concern before the
    trainer mode reads the batch sizes (the CPU run's few differences:
    recipes.local.cpu_overrides, which the launcher passes on cpu)."""
    groups = {name: make(run) for name, make in GROUPS.items()}
    for group, values in (on_top or {}).items():
        groups[group].update(values)
    return with_trainer_mode(run, groups)


def with_trainer_mode(run: JobSpec, groups: dict[str, dict]) -> dict[str, dict]:
    """verl's trainer mode and what it needs (recipes.dapo.job.trainer_modes), from the batch
    sizes the groups above set."""
    from recipes.dapo.job import trainer_modes

    sp = trainer_modes.run_split(run)
    batch = int(value_of(groups, "data.train_batch_size"))
    mini = int(value_of(groups, f"{ACTOR}.ppo_mini_batch_size"))
    mode = trainer_modes.overrides(run.trainer_mode, run.device, sp, batch, mini, run.engine)
    if mode:
        groups["trainer_mode"] = mode
    if trainer_modes.decoupled(run.trainer_mode, run.engine):
        groups["trainer"]["trainer.v1.trainer_mode"] = trainer_modes.DECOUPLED_MODE
        env = f"+ray_kwargs.ray_init.runtime_env.env_vars.{trainer_modes.MODULES_ENV}"
        existing = run.env.get(trainer_modes.MODULES_ENV)
        groups["ray_env"][env] = quoted(trainer_modes.external_modules(existing))
    # the old-log-prob pass is skipped (bypass) or runs on the cycle's first weights
    # (decoupled): the aux loss counts f in a pass of its own
    if run.trainer_mode == "separate_async":
        groups["engine"][f"{ENGINE}.aux_loss"] = _hydra_dict(
            {**AUX_LOSS, "global_counts": "counting_pass"}
        )
        # verl's own key, so that a pass-through override of it reaches the engine too
        groups["engine"][f"{ENGINE}.updates_per_step"] = (
            "${trainer.v1.separate_async.parameter_sync_step}"
        )
        gpus = "+ray_kwargs.ray_init.num_gpus"
        if gpus in groups["ray_env"]:  # the embedded Ray declares the rollout's device too
            groups["ray_env"][gpus] = run.plan.world + sp.rollout_devices
    return groups


def name_the_run(groups: dict[str, dict]) -> dict[str, dict]:
    """The routing report's run name: the experiment name the run ends up with (after
    pass-through overrides, which may replace it)."""
    name = next((v for kv in groups.values() for k, v in kv.items()
                 if key_of(k) == "trainer.experiment_name"), None)  # fmt: skip
    if name is not None and runs_ours(groups):
        groups["engine"][f"{ENGINE}.monitor.run_name"] = quoted(str(name))
    return groups


def runs_ours(groups: dict[str, dict]) -> bool:
    """Whether the actor is our engine (not verl's FSDP one: recipes.dapo.job.actors)."""
    return value_of(groups, f"{ACTOR}.strategy") == BACKEND


def key_of(override: str) -> str:
    """The config path an override sets (without +, ++ or ~)."""
    return override.split("=", 1)[0].lstrip("+~")


def value_of(groups: dict[str, dict], key: str):
    """The value an override sets for config path `key` (None when none does)."""
    return next((v for kv in groups.values() for k, v in kv.items() if key_of(k) == key), None)


def merge(groups: dict[str, dict], extra: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Pass-through overrides replace ours with the same key; others go to an 'extra' group.
    `~key` (Hydra's deletion, with or without =value) drops ours, and deletes verl's own key
    unless ours was a `+` addition."""
    replaced, groups = [], {g: dict(kv) for g, kv in groups.items()}
    remaining = {}
    for item in extra:
        deletion = item.startswith("~")
        if "=" not in item and not deletion:
            raise ValueError(
                f"pass-through override {item!r} is not key=value: "
                "write e.g. trainer.total_epochs=2"
            )
        key, value = item.split("=", 1) if "=" in item else (item, None)
        hit = next(
            ((g, k) for g, kv in groups.items() for k in kv if key_of(k) == key_of(key)), None
        )
        if hit:
            replaced.append(key_of(key))
        if hit and deletion:
            del groups[hit[0]][hit[1]]
            if hit[1].startswith("+"):  # only ours added it: dropping ours deletes it
                continue
        elif hit:
            groups[hit[0]][hit[1]] = value
            continue
        remaining[key] = value
    if remaining:
        groups["extra"] = remaining
    return groups, replaced


def format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, str) and "," in value and value[:1] not in "{['":
        return quoted(value)  # hydra would read a bare a,b as a list
    return str(value)


def quoted(value: str) -> str:
    """A hydra string literal: keeps "1800" a string and "a,b" one value."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _hydra_dict(d: dict) -> str:
    return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in d.items()) + "}"


def to_cli(groups: dict[str, dict]) -> list[str]:
    """verl's command line; a deletion without a value (`~key`) stays as written."""
    return [
        k if v is None and k.startswith("~") else f"{k}={format_value(v)}"
        for kv in groups.values()
        for k, v in kv.items()
    ]
