"""The local run's decisions before anything is written or started (recipes.launcher.resolution).

`model_fit`: the plan (tp, ep, etp, pp, cp) checked against the model the run will train
(recipes.launcher.local_model: --model tiny / mini, from its config in memory until it is
written, or the user's directory) with parallel.plan's checks, the cluster run's: each
refusal names the legal values.
`check_rollout_model`: vLLM's CPU backend limits (recipes.local.cpu.rollout_limits) on that model.
`check_resume`: --resume with no checkpoint to continue is refused, naming the directory.
`earlier_run` / `set_aside`: a new run in a directory an earlier run wrote into moves that
run's outputs to `<dir>.<UTC timestamp>` (never deletes them) and says where; the dry run
says it would. The run starts in an empty directory: nothing of the old one is resumed or
mixed into the new one's metrics.
"""

import os
import time
from pathlib import Path

from recipes.dapo.checkpoints import resume
from recipes.dapo.cluster import ray_job
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import overrides
from recipes.local.task.built_models import BUILT

# what a local run writes into its directory: the built models and data (recipes.local.run's
# prepare), verl's outputs, the console's logs, finish's report, export and summary
# and the mini model's warm-up (recipes.local.warmup: its work and its export)
BUILT_FILES = (*(f"{n}_hf" for n in BUILT), *(f".{n}_hf.partial" for n in BUILT), "data",
               "warmup", "sft_hf")  # fmt: skip
# of those, what a run leaves (the models and data are remade the same way)
RUN_OUTPUTS = ("checkpoints", "metrics", "tensorboard", "logs", "alarms.jsonl",
               "routing_report.json", "routing_report", "export_hf", "reward_curve.png",
               "summary.json")  # fmt: skip
RUN_FILES = (*BUILT_FILES, *RUN_OUTPUTS)


def model_fit(config: dict, nodes: int, per_node: int, **dims: int):
    """parallel.plan's checks of the plan on nodes x per_node ranks against the model (the
    actor's own cp limit: recipes.launcher.run_spec, before)."""
    from backend.qwen3_moe import load_qwen3_moe_spec
    from parallel.plan import plan_for_model

    return plan_for_model(load_qwen3_moe_spec(config), nodes, per_node, **dims)


def check_rollout_model(model, rollout_tp: int) -> None:
    """The model the local run serves with vLLM's CPU backend (a local_model.LocalModel) at
    the run's rollout TP: its limits, one line each; a tokenizer that does not load is one
    line too."""
    from recipes.local.cpu.rollout_limits import problems

    tokens = model.tokens if model.built else None  # a built one's tokenizer: the task's
    try:
        found = problems(model.path, rollout_tp, config=model.config, tokens=tokens)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LaunchError(
            f"{model.path}: its tokenizer does not load ({first}): save a tokenizer "
            "transformers loads (AutoTokenizer.from_pretrained) with the model"
        ) from None
    if found:
        raise LaunchError(found[0])


def check_resume(groups: dict[str, dict], out: Path) -> None:
    """--resume: verl's resume_mode=auto must find a checkpoint in the run's directory."""
    if str(overrides.value_of(groups, "trainer.resume_mode") or "auto") != "auto":
        return  # resume_path / disable: the overrides name what to do
    root = ray_job.REPO / str(overrides.value_of(groups, "trainer.default_local_dir"))
    if resume.resume_dir(groups, ray_job.REPO) is None and not list(root.glob("global_step_*")):
        raise LaunchError(
            f"--resume: {root} holds no checkpoint to continue: drop --resume to start a new "
            f"run in {out}, or pass the --ckpt-dir of the run to continue"
        )


def check_task(out: Path, task: str, resume: bool) -> None:
    """--resume continues a run on the task its data was made for (recipes.local.run.data_task)."""
    from recipes.local.run import data_task

    made = data_task(out)
    if resume and made not in (None, task):
        raise LaunchError(
            f"--resume: the run in {out} trained on the {made} task, this launch's is {task}: "
            "continue it with its own --model and --task, or drop --resume to start a new run"
        )


def earlier_run(out: Path) -> bool:
    """Whether a run wrote its outputs into `out` (a dry run, which writes nothing, did not)."""
    return any(_holds(out / name) for name in RUN_OUTPUTS)


def _holds(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def would_set_aside(out: Path) -> str:
    """The dry run's line for a directory an earlier run wrote into."""
    return (
        f"a launch without --resume moves the last run in {out} to {out}.<UTC timestamp> "
        "and starts afresh (--resume continues it instead)"
    )


def set_aside(out: Path) -> Path:
    """Move what the earlier run in `out` wrote to `<out>.<UTC timestamp>` (same filesystem:
    renames, nothing copied or deleted); returns that directory."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = out.with_name(f"{out.name}.{stamp}"), 1
    while dest.exists():
        dest, n = out.with_name(f"{out.name}.{stamp}-{n}"), n + 1
    dest.mkdir()
    for name in RUN_FILES:
        if (out / name).exists():
            os.rename(out / name, dest / name)
    return dest


def set_aside_line(out: Path, dest: Path) -> str:
    return (
        f"moved the last run in {out} to {dest} (--resume would have continued it; "
        f"--ckpt-dir {dest} --resume still can); starting afresh"
    )
