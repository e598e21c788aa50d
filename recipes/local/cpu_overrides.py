"""What the CPU run changes on top of the cluster's overrides: platform, rollout, model, data, plan.

`recipes.dapo.job.overrides.build` makes the same groups for every device; for device cpu it
adds these, which replace the cluster values with the same keys. Everything else (DAPO's
loss, dynamic sampling on `acc`, GRPO, the dapo reward manager, the engine, checkpoints,
resume) is the cluster's.
"""

import os

# vLLM's CPU backend: what it cannot do that the cluster's vLLM does (docs/cpu_run.md)
KV_CACHE_BYTES = 32 << 20  # the KV cache in bytes: a memory fraction here means host RAM
# vLLM engines at most one per actor rank up to this world; a larger world gets two engines of
# TP world / 2 (tp4 x ep8 at world 8: two of TP 4). Memory decides: a TP-1 engine is an API
# server and an engine core (~0.9 + 0.5 GB), and each further TP rank a worker (~0.5 GB), so
# eight TP-1 engines beside eight actor ranks and Ray (~3 GB) pass 24 GiB; two of TP 4 fit.
ENGINE_PER_RANK_UP_TO = 4


# the engine's modules on CPU: ours, as on the cluster (grouped-GEMM experts, SDPA attention on
# packed micro-batches), not the megatron-core reference (SequentialMLP, DotProductAttention on
# padded rows) that BuildOptions' "auto" picks on CPU for the tests to compare against. At mini,
# world 1, a step's update 6.48 -> 3.65 s with recompute off below (docs/timing.md)
CPU_ENGINE = dict(experts="grouped", attention="sdpa", packed=True)


def recompute(world: int) -> str:
    """Activation recompute on CPU: none while memory is plenty; the cluster's "full" beyond
    ENGINE_PER_RANK_UP_TO ranks, where 24 GiB binds (docs/mission_plan.md)."""
    return "none" if world <= ENGINE_PER_RANK_UP_TO else "full"


def engine_threads(world: int, cores: int | None = None) -> int:
    """torch threads per actor rank: its share of the cores. In the sync mode the rollout's
    processes idle while the actor trains, so at world 1 on 2 cores the update takes both."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // world)


def rollout_tp(world: int) -> int:
    """The embedded run's vLLM tensor parallel size (`-- {rollout}.tensor_model_parallel_size=N`
    overrides it)."""
    return 1 if world <= ENGINE_PER_RANK_UP_TO else world // 2


# sized for 2 cores: short prompts and answers keep a step to seconds, most of it verl's
# per-sample rollout path (timings: docs/cpu_run.md, "The toy task")
TOY = dict(
    max_prompt_length=32,
    max_response_length=3,  # an answer digit and <|im_end|> fit in 2: one token of slack
    train_batch_size=8,
    mini_batch_size=2,  # 4 updates a step: more learning per sampled token, the CPU's cost
    n=16,
    lr=2e-3,
    ppo_epochs=1,
    warmup_steps=3,
    overlong_buffer=1,
    inflight_gen_batches=2,
    test_freq=5,
    val_n=8,  # 8 samples of each validation prompt: a steadier yardstick
    score="task",  # recipes/local/task/doubles.py's compute_score (the leading digits)
    batched_tokens=256,  # vLLM's max_num_batched_tokens
    run_name="tiny-qwen3-moe",  # the experiment's name, before its plan
    steps=35,  # the run's default --steps: validation >= 0.9 from about step 25
)
# the mini model's task (recipes.local.task.sums): worked sums of 10-40 tokens; the policy comes
# from the SFT warm-up (recipes.local.warmup), so RL refines it at a lower learning rate
SUMS = dict(
    TOY,
    max_prompt_length=40,  # the ChatML prompt of six operands is 31 tokens
    # the longest worked answer is 40 tokens (sums.MAX_RESPONSE_TOKENS); the overlong buffer
    # penalises what runs past it, up to -1 at the limit: a policy that does not stop
    max_response_length=48,
    overlong_buffer=8,
    lr=2e-4,
    # one train batch of prompts in flight, not two: on 2 cores vLLM generates a group as fast
    # with 8 prompts in flight as with 16 (0.29-0.32 s a group against 0.32), and verl's sync
    # buffer drains and discards what is in flight once a batch is full (surplus 27-46 groups
    # a run against 72; docs/first_run.md)
    inflight_gen_batches=1,
    score="verl",  # verl's math_dapo on "Answer: N", nothing of ours
    batched_tokens=512,
    run_name="qwen3-moe-sums",
    steps=20,  # validation >= 0.9 from about step 5 (docs/mini_task.md)
)
# --task guessing_sums (recipes.local.task.sums.GUESSING_SUMS): the same sums and RL, from a warm-up
# whose teacher works one long sum in five out; the horizon that ranks trainer modes and
# corrections (docs/async_modes.md)
GUESSING_SUMS = dict(SUMS, run_name="qwen3-moe-guessing-sums", steps=40)
TASKS = {"doubles": TOY, "sums": SUMS, "guessing_sums": GUESSING_SUMS}


# run-health alarms (backend.monitor.alarms.AlarmRules; the rest at their defaults), for the
# local tasks, not the models: their answers are arithmetic, so a solved policy is near
# deterministic. The toy's entropy falls from 3.45 to 0.02-0.2 nats in 35 steps, by up to
# 66-74% within 5 steps, the sums' from 0.13 to 0.02-0.04 in 20, which the defaults (floor
# 0.05, -50% in 10 steps) call a collapse. The
# routing rules are the defaults: they are read against the model's E and top-k, the same
# at the tiny model's 8 experts top-2 as at 128 top-8.
TOY_ALARMS = dict(entropy_floor=0.005, entropy_drop=0.9, entropy_window=5)


def cpu_overrides(run) -> dict[str, dict]:
    """{concern: {override: value}} for the embedded run (run: recipes.dapo.job.overrides.JobSpec)."""
    from recipes.dapo import BACKEND
    from recipes.dapo.job.actors import plan_label

    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    world, task = run.plan.world, TASKS[run.task]
    return {
        "data": {
            "data.max_prompt_length": task["max_prompt_length"],
            "data.max_response_length": task["max_response_length"],
            "data.train_batch_size": task["train_batch_size"],
            "data.dataloader_num_workers": 0,
        },
        "algorithm": {
            "algorithm.filter_groups.max_inflight_gen_batches": task["inflight_gen_batches"]
        },
        "policy": {
            f"{a}.ppo_mini_batch_size": task["mini_batch_size"],
            f"{a}.ppo_max_token_len_per_gpu": 4096,
            f"{a}.ppo_epochs": task["ppo_epochs"],
            f"{a}.optim.lr": task["lr"],
            f"{a}.optim.lr_warmup_steps": task["warmup_steps"],
            **_saves(world),
        },
        "engine": _engine(world) if run.engine == BACKEND else {},
        "rollout": {
            f"{r}.tensor_model_parallel_size": rollout_tp(world),
            f"{r}.enforce_eager": True,  # no CUDA graphs, no inductor compile on CPU
            f"+{r}.enable_sleep_mode": False,  # vLLM's sleep mode is CUDA/ROCm/XPU only
            f"{r}.free_cache_engine": False,  # (it would need sleep mode)
            f"+{r}.engine_kwargs.vllm.kv_cache_memory_bytes": KV_CACHE_BYTES,
            f"{r}.n": task["n"],
            f"{r}.max_num_batched_tokens": task["batched_tokens"],
            f"{r}.log_prob_max_token_len_per_gpu": 4096,
            f"{r}.calculate_log_probs": True,  # rollout vs actor log-probs: the sync check
            f"{r}.enable_rollout_routing_replay": True,  # routed_experts in the batch
            # one agent-loop worker and one TransferQueue storage unit: each is a process that
            # imports verl (10-15 s of a core); a second bought no generation speed on 2 cores
            f"{r}.agent.num_workers": 1,
            # the rule-based reward scored in that worker, not in a reward actor of its own
            # (recipes.dapo.engine.in_process_reward; reward.num_workers=0 below)
            f"+{r}.agent.agent_loop_manager_class": IN_PROCESS_REWARD,
            f"{r}.val_kwargs.n": task["val_n"],
            f"{r}.checkpoint_engine.update_weights_bucket_megabytes": 16,
        },
        "reward": {
            "reward.num_workers": 0,  # no reward actor: the agent loop scores (above)
            "+reward.reward_kwargs.max_resp_len": task["max_response_length"],
            "+reward.reward_kwargs.overlong_buffer_cfg.len": task["overlong_buffer"],
            **(_task_score(run) if task["score"] == "task" else {}),
        },
        "trainer": {
            "trainer.save_freq": run.save_freq,
            "trainer.test_freq": task["test_freq"],  # validation reward: the run's yardstick
            "trainer.val_before_train": True,
            "trainer.total_training_steps": run.steps,
            "trainer.logger": ["console", "tensorboard", "file"],
            "trainer.experiment_name": f"{task['run_name']}-cpu-{plan_label(run)}",
            **_polling(run),
        },
        "ray_env": {
            "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
            **({} if run.ray_address else embedded_ray(world)),
        },
    }


# glibc raises its mmap threshold to the largest block freed (up to 32 MiB), after which freed
# tensors stay in fragmented heaps: at world 8 the actor ranks grew ~20 MB a step and 20 steps
# crossed Ray's memory line. Held at glibc's initial 128 KiB, every tensor above it is mapped
# and returned when freed, which costs page faults: an fp32 update ~45% slower (the SFT
# warm-up 321 -> 430 s). So only where memory binds: beyond ENGINE_PER_RANK_UP_TO ranks.
MANY_RANKS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def many_ranks_env(world: int) -> dict[str, str]:
    """The job environment's part for world > ENGINE_PER_RANK_UP_TO (Ray's workers and the
    driver; the warm-up, one rank, keeps glibc's default)."""
    return dict(MANY_RANKS_ENV) if world > ENGINE_PER_RANK_UP_TO else {}


def _engine(world: int) -> dict:
    from recipes.dapo.job.overrides import ENGINE

    return {f"{ENGINE}.{key}": value for key, value in CPU_ENGINE.items()} | {
        f"{ENGINE}.cpu_threads": engine_threads(world)
    }


def _saves(world: int) -> dict:
    """Beyond ENGINE_PER_RANK_UP_TO ranks, saves in the step: a background save's forked
    writers (one a rank) grow by copy-on-write while the next step generates, +2.3 GB at world
    8, which took a 20-step run past Ray's 95% memory line at its step-10 save (Ray killed the
    rollout's workers)."""
    if world <= ENGINE_PER_RANK_UP_TO:
        return {}
    return {"actor_rollout_ref.actor.checkpoint.async_save": False}


# verl's sync trainer looks for finished rollouts every 2 s; a CPU step's generation is ~1 s
# of vLLM's work (recipes.dapo.engine.replay_polling, the figures in docs/timing.md)
POLL_S = 0.2
POLLING_SAMPLER = ("pkg://recipes.dapo.engine.replay_polling", "PollingReplayBuffer")
IN_PROCESS_REWARD = "recipes.dapo.engine.in_process_reward.InProcessRewardManager"


def _polling(run) -> dict:
    if run.trainer_mode != "sync":  # verl's async buffers keep their interval
        return {}
    s = "trainer.v1.sampler"
    return {
        f"{s}.custom_sampler.path": POLLING_SAMPLER[0],
        f"{s}.custom_sampler.name": POLLING_SAMPLER[1],
        f"+{s}.sampler_kwargs.poll_interval_s": POLL_S,
    }


def _task_score(run) -> dict:
    return {
        "reward.custom_reward_function.path": str(run.repo / "recipes/local/task/doubles.py"),
        "reward.custom_reward_function.name": "compute_score",
    }


def embedded_ray(world: int) -> dict:
    """The Ray that verl's ray.init() starts for the embedded run: a new one always (never a
    cluster that `ray start` left on this machine), with what the CPU platform declares. On a
    running cluster the nodes declare it (recipes/dapo/cluster/ray_node.py)."""
    return {
        "+ray_kwargs.ray_init.address": "local",
        "ray_kwargs.ray_init.num_cpus": 32,  # TransferQueue's storage actors each ask for one
        "+ray_kwargs.ray_init.num_gpus": world,  # see recipes.local.cpu.platform
        "+ray_kwargs.ray_init.include_dashboard": False,
    }
