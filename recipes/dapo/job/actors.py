"""The actor a run trains with: ours (`mcore_ep`, the default) or verl's own FSDP2 engine on the
same job (`--engine fsdp`), for the side by side of docs/ab_engines.md.

Only the actor changes: model, data, rollout, DAPO's loss, batch sizes, seed and Ray are the
run's either way, and so is the offload and recompute the memory model picks for ours. The fsdp
actor is verl's FSDP2 engine with verl's FSDPActorConfig (`actor.strategy=fsdp2`), its
parameters sharded over every rank of the run. It has no tensor, pipeline or context
parallelism, so --tp, --pp and --cp above 1 are refused; --ep only counts ranks, which makes
`--engine fsdp --ep 2` the FSDP side of `--ep 2` on the same two ranks. Its checkpoints are
written in the step (verl writes the tracker: it leaves it to the engine only for async saves,
which verl's FSDP engine does not seal), with the HF model on the CPU run (its finish exports
that, recipes.local.export).

On cpu: verl registers that engine for cuda and npu only; recipes.local.cpu.fsdp_engine registers the
same class for the CPU platform (named in `model.external_lib`, which verl imports in every
worker). Attention is transformers' SDPA (verl's default asks for FlashAttention 2) and the
parameters train in fp32, as ours do on CPU.
"""

from parallel.plan import PlanError
from recipes.dapo import BACKEND

FSDP = "fsdp"
ENGINES = (BACKEND, FSDP)
STRATEGY = "fsdp2"  # verl's FSDP2 (fully_shard); "fsdp" would be the FSDP1 wrapper
CPU_REGISTRATION = "recipes.local.cpu.fsdp_engine"
ACTOR = "actor_rollout_ref.actor"
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
SAVE_WITH_HF = ["model", "optimizer", "extra", "hf_model"]
HF_DIR = "huggingface"  # verl's FSDP checkpoint: config, tokenizer (and the hf_model) there


def fsdp_overrides(run) -> dict:
    """verl's FSDP2 actor for `run` (recipes.dapo.job.overrides.JobSpec)."""
    f = f"{ACTOR}.fsdp_config"
    values = {
        f"{ACTOR}.strategy": STRATEGY,
        f"{f}.param_offload": run.fit.param_offload,
        f"{f}.optimizer_offload": run.fit.optimizer_offload,
        "actor_rollout_ref.model.enable_gradient_checkpointing": run.fit.recompute != "none",
    }
    if run.device == "cpu":
        values |= {
            "actor_rollout_ref.model.external_lib": CPU_REGISTRATION,
            "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
            f"+{f}.mixed_precision": FP32,
            f"{ACTOR}.checkpoint.save_contents": SAVE_WITH_HF,
        }
    return values


def plan_label(run) -> str:
    """The experiment name's plan part: tpT-epE (-ppP), or fsdpW for verl's FSDP engine."""
    if run.engine != BACKEND:
        return f"fsdp{run.plan.world}"
    return f"tp{run.plan.tp}-ep{run.plan.ep}" + (f"-pp{run.plan.pp}" if run.plan.pp > 1 else "")


def check_engine_plan(engine: str, dims: dict, trainer_mode: str) -> None:
    """--engine fsdp against the plan and the trainer mode: PlanError with one line."""
    if engine == BACKEND:
        return
    split = [f"--{d} {dims[d]}" for d in ("tp", "pp", "cp") if dims.get(d, 1) > 1]
    if split:
        raise PlanError(
            f"--engine fsdp shards parameters over every rank and splits no layer: drop "
            f"{', '.join(split)} (--ep N only counts the ranks, as ours would take them)"
        )
    if trainer_mode != "sync":
        raise PlanError(
            f"--engine fsdp runs --trainer-mode sync (the side by side's mode), not "
            f"{trainer_mode}: drop --trainer-mode"
        )
