"""The embedded run: verl's own DAPO trainer on a small Qwen3-MoE, on this machine's CPUs.

`bash scripts/train_mcore.sh` without an accelerator lands here (recipes.launcher.launch):
1. prepare <out>/: the model --model builds (tiny or mini, recipes.local.task.built_models: <name>_hf/,
   with the task's character tokenizer; a user's directory is used in place) and the task's
   parquet files (data/), once;
2. run `python -m verl.trainer.main_ppo` with the cluster's overrides plus the CPU ones
   (recipes.local.cpu_overrides): Ray, the V1 trainer, our mcore_ep engine, the CPU rollout,
   verl's weight sync, checkpoints under <out>/checkpoints (resume_mode=auto);
3. finish: export the last checkpoint to HF (converters) against the model it trained
   (`trained_model`), check that transformers reloads it with the same logits as megatron-core
   (made while verl's processes end: recipes.local.export_ahead), render the routing report,
   plot the reward curve, write summary.json (its wall time: the launch to the summary).
"""

import json
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from recipes.local.summary import STEP_TIME_KEYS, print_summary, write_summary

METRICS = "metrics"  # verl's file logger, one jsonl per launch
MODEL_KEY = "actor_rollout_ref.model.path"
EARLY_EXPORT = "export: made while verl's processes ended"  # the run's log says which finish ran


def prepare(out: Path, seed: int = 0, model: str = "tiny", warmup_steps: int | None = None,
            task: str | None = None) -> tuple[Path | None, dict]:  # fmt: skip
    """<out>/<model>_hf (a built model + tokenizer; none for a user's directory), <out>/data
    (train/val parquet; sft too for a sums task), the mini model's warm-up (<out>/sft_hf)
    and <out>/metrics, made once (the launcher calls it once its checks pass); data made for
    another task (task.json) is made again, with the warm-up it taught. Returns the
    directory RL reads for a built model (None for a directory) and the data files."""
    from transformers.utils.logging import disable_progress_bar

    from recipes.local.task import sums
    from recipes.local.task.built_models import BUILT, TASK_OF, make_built, warmed_dir
    from recipes.local.task.doubles import write_data
    from recipes.local.warmup import WARMUP, warm_up

    disable_progress_bar()  # the launcher's console shows no library progress bars
    hf_dir = make_built(out, model, seed) if model in BUILT else None
    task = task or TASK_OF.get(model, "doubles")
    data_dir = out / "data"
    splits = ("train", "val", "sft") if task in sums.TASKS else ("train", "val")
    files = {s: data_dir / f"{s}.parquet" for s in splits}
    if data_task(out) not in (None, task):  # the warm-up learnt the other task's corpus
        shutil.rmtree(data_dir)
        shutil.rmtree(warmed_dir(out), ignore_errors=True)
    if not all(p.is_file() for p in files.values()):
        if task in sums.TASKS:
            files = sums.write_sums_data(data_dir, seed=seed, task=sums.TASKS[task])
        else:
            files = write_data(data_dir)
    if task in sums.TASKS:
        hf_dir = warm_up(out, hf_dir, files["sft"], warmup_steps or WARMUP["steps"])
    (out / METRICS).mkdir(exist_ok=True)
    return hf_dir, files


def data_task(out: Path) -> str | None:
    """The task of the data a launch made in `out` (its task.json; the toy's names none), or
    None where none was made."""
    try:
        made = json.loads((out / "data" / "task.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return made.get("task", "doubles")


def trained_model(groups: dict[str, dict]) -> Path:
    """The model verl's trainer was given (actor_rollout_ref.model.path after the
    pass-through overrides): the export's template and the reload check's tokenizer."""
    from recipes.dapo.job.overrides import value_of

    return Path(str(value_of(groups, MODEL_KEY))).expanduser()


def job_env(out: Path, fresh: bool = False, world: int = 1) -> dict[str, str]:
    """The environment of the driver and (through ray_env) every Ray worker: the cluster
    run's for device cpu (recipes.dapo.cluster.ray_job.job_env), the allocator's beyond world 4
    (recipes.local.cpu_overrides.many_ranks_env) and this run's outputs (fresh: in a
    directory emptied first, recipes.launcher.local_checks.set_aside)."""
    from recipes.dapo.cluster.ray_job import job_env as cluster_env
    from recipes.local.cpu_overrides import many_ranks_env

    return {
        **cluster_env("cpu", None),
        **many_ranks_env(world),
        "TENSORBOARD_DIR": str(out / "tensorboard"),
        # verl's file logger truncates its file: each launch (a resume too) gets its own
        "VERL_FILE_LOGGER_PATH": str(next_metrics_file(out / METRICS, fresh)),
    }


def finish(out: Path, model: Path, started: float, verl_s: float, target: float = 0.9,
           console=None, world: int = 1, parts: dict | None = None,
           engine: str = "mcore_ep", ahead=None) -> int:  # fmt: skip
    """Export against `model` (the trained one: its config and tokenizer), reload check,
    routing report, reward curve, summary (after verl returns); with
    a console (recipes.dapo.console.screen) what that work prints goes to the run's log, and the
    summary is the last thing on screen. started: the launch (time.perf_counter's clock): the
    summary's wall time runs from it to the summary; ahead: a recipes.local.export_ahead.
    ExportAhead whose export the finish takes when it is of the checkpoint it would export."""
    with console.capture() if console else nullcontext():
        summary = _finish_files(out, model, started, verl_s, target, world, parts, engine, ahead)
    if console:
        console.close()
    print_summary(summary)
    diff = summary.get("export_max_logits_diff")
    return 0 if diff is not None and diff < 1e-4 else 1


def _finish_files(out: Path, model: Path, started: float, verl_s: float, target: float,
                  world: int, parts: dict | None = None, engine: str = "mcore_ep",
                  ahead=None) -> dict:  # fmt: skip
    from recipes.dapo.console.health_report import (
        latest_actor_checkpoint,
        latest_fsdp_checkpoint,
        routing_report,
    )
    from recipes.local.export import check_export, check_fsdp_export

    history = read_history(out / METRICS)
    ours = engine == "mcore_ep"
    root = out / "checkpoints"
    actor = latest_actor_checkpoint(root) if ours else latest_fsdp_checkpoint(root)
    paths: dict = {"model": model, "tensorboard": out / "tensorboard", "checkpoint": actor}
    diff = None
    if actor is not None and ours:
        if ahead is not None:
            ahead.last_look()  # its export runs beside the routing report
        paths.update(routing_report(actor / "moe_report.json", out))
        early = ahead.take(actor) if ahead is not None else None
        if early is not None:  # exported while verl shut down; its output to the log now
            print(f"{EARLY_EXPORT} ({early.actor})\n{early.output}", file=sys.stderr)
            export_dir, diff = early.export, early.diff
        else:
            export_dir, diff = check_export(actor, model, out / "export_hf")
        paths["export"] = export_dir
    elif actor is not None:  # verl's FSDP engine: no routing monitor of ours in it
        paths["export"], diff = check_fsdp_export(actor, out / "export_hf")
    stepping = sum(row.get(k, 0.0) for row in history for k in STEP_TIME_KEYS)
    wall_s = time.perf_counter() - started  # to the summary, the finish's work included
    return write_summary(out, history, target, paths, wall_s, startup_s=verl_s - stepping,
                         world=world, export_max_logits_diff=diff,
                         startup_parts_s=parts or {})  # fmt: skip


def startup_parts(out: Path, prepared_s: float, validation_at: float | None) -> dict:
    """The start-up's parts known before the steps (seconds): the bootstrap (train_mcore.sh's
    MCORE_DAPO_BOOTSTRAP_S), the model, data and warm-up (`warmup`: made, reused from the
    cache, or none), and when the first validation began (from the launch); write_summary
    splits verl's start-up from the validation with it."""
    import os

    from recipes.local.task.built_models import warmed_dir
    from recipes.local.warmup import WORK_DIR

    parts = {"bootstrap": float(os.environ.get("MCORE_DAPO_BOOTSTRAP_S") or 0.0),
             "prepared": prepared_s}  # fmt: skip
    if validation_at is not None:
        parts["validation_at"] = validation_at
    made = (out / WORK_DIR / "log.txt").is_file()
    warmup = "made" if made else "reused" if warmed_dir(out).is_dir() else None
    return {**{k: round(v, 1) for k, v in parts.items()}, "warmup": warmup}


def next_metrics_file(folder: Path, fresh: bool = False) -> Path:
    """<out>/metrics/launch_NNN.jsonl, one past the newest (the first when fresh); nothing
    is created."""
    done = 0 if fresh else len(list(folder.glob("launch_*.jsonl")))
    return folder / f"launch_{done:03d}.jsonl"


def read_history(folder: Path) -> list[dict]:
    """verl's file-logger rows {step, data} of every launch -> [{step, **metrics}].

    A later launch (a resume) replaces the steps it ran again; a torn last line of a killed
    launch is skipped."""
    rows: dict[int, dict] = {}
    for path in sorted(folder.glob("launch_*.jsonl")):
        launch: dict[int, dict] = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            launch[row["step"]] = {**launch.get(row["step"], {}), **row["data"]}
        rows.update(launch)
    return [{"step": step, **data} for step, data in sorted(rows.items())]


def run(resolved, out: Path, t0: float, verbose: bool = False, debug: bool = False,
        watch=None, prepared_s: float = 0.0) -> int:  # fmt: skip
    """verl's trainer through the launcher's console (recipes.dapo.console.screen), then finish on
    the model it trained (`trained_model`: the built one, or the user's directory). A
    checkpoint the engine refused raises its CheckpointError (recipes.dapo.cluster.ray_job), a Ray
    that failed to start every attempt RayStartError (recipes.dapo.cluster.ray_start); the run's
    processes and leftovers end with it (recipes.dapo.cluster.run_scope). watch: a
    recipes.dapo.cluster.lost_node.NodeWatch on a running cluster (--ray-address). t0: the launcher's
    start (recipes.launcher.launch.launched_at, time.perf_counter's clock): the wall time and the
    console's start-up lines count from it; prepared_s: of that, making the model, the data
    and the warm-up (recipes.launcher.launch.prepare_local)."""
    from backend.monitor.alarms import AlarmRules
    from recipes.dapo.cluster.lost_node import failure_line
    from recipes.dapo.cluster.ray_job import interrupted_line, run_command
    from recipes.dapo.cluster.ray_start import run_retrying
    from recipes.dapo.cluster.run_scope import RunScope
    from recipes.dapo.console.screen import open_console
    from recipes.local.cpu_overrides import TOY_ALARMS

    env = resolved.run.env
    index = int(Path(env["VERL_FILE_LOGGER_PATH"]).stem.removeprefix("launch_"))
    console = open_console(out, index, verbose, resolved.run.steps, env["TENSORBOARD_DIR"],
                           AlarmRules(**TOY_ALARMS), debug=debug, device="cpu",
                           started=t0)  # fmt: skip
    ahead = _export_ahead(resolved, out)
    try:
        console.header(resolved.describe())
        with RunScope(out / "logs") as scope:  # its processes and leftovers end with it
            console.log.write(f"run id: {scope.id} (temp dir {scope.tmp}; {scope.log})\n")
            job = {**env, **scope.env}
            if watch is None:  # the embedded Ray: its start is retried when it fails
                code = run_retrying(resolved.command, job, console, scope.reap)
            else:
                code = run_command(resolved.command, job, console, watch)
        verl_s = time.perf_counter() - t0
        if code != 0:
            resume, ckpt_dir = "relaunch with --resume", resolved.run.ckpt_dir
            lost = (
                console.oom.failure_line(ckpt_dir, resume)
                or interrupted_line(code, ckpt_dir)
                or failure_line(watch, ckpt_dir, resume=resume)
            )
            print(lost or console.failure_line(code), file=sys.stderr)
            return code  # (the export ahead, if any, is cancelled below)
        from recipes.dapo.console.filters import FIRST_VALIDATION

        validation_at = console.startup.began.get(FIRST_VALIDATION)
        parts = startup_parts(out, prepared_s,
                              None if validation_at is None else validation_at - t0)  # fmt: skip
        return finish(out, trained_model(resolved.groups), t0, verl_s, console=console,
                      world=resolved.run.plan.world, parts=parts, engine=resolved.run.engine,
                      ahead=ahead)  # fmt: skip
    finally:
        if ahead is not None:
            ahead.cancel()  # nothing left to end once the finish took it
        console.close()


def _export_ahead(resolved, out: Path):
    """ExportAhead of the run's final checkpoint (ours; verl's FSDP checkpoints are copied)."""
    from recipes.dapo import BACKEND
    from recipes.local.cpu_overrides import ENGINE_PER_RANK_UP_TO
    from recipes.local.export_ahead import ExportAhead

    if resolved.run.engine != BACKEND or not resolved.run.steps:
        return None
    metrics = Path(resolved.run.env["VERL_FILE_LOGGER_PATH"])
    return ExportAhead(out / "checkpoints", metrics, resolved.run.steps,
                       trained_model(resolved.groups), out / "export_hf",
                       preload=resolved.run.plan.world <= ENGINE_PER_RANK_UP_TO).start()  # fmt: skip
