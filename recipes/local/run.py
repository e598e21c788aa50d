"""The embedded run: verl's own DAPO trainer on a tiny Qwen3-MoE, on this machine's CPUs.

`bash scripts/train_mcore.sh` without an accelerator lands here (recipes.dapo.launch):
1. prepare <out>/: the tiny model with its character tokenizer (tiny_hf/) and the task's
   parquet files (data/), once;
2. run `python -m verl.trainer.main_ppo` with the cluster's overrides plus the CPU ones
   (recipes.local.overrides): Ray, the V1 trainer, our mcore_ep engine, the CPU rollout,
   verl's weight sync, checkpoints under <out>/checkpoints (resume_mode=auto);
3. finish: export the last checkpoint to HF (converters), check that transformers reloads it
   with the same logits as megatron-core, render the routing report, plot the reward curve,
   write summary.json.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from recipes.local.summary import STEP_TIME_KEYS, print_summary, write_summary

METRICS = "metrics"  # verl's file logger, one jsonl per launch
TINY_VOCAB = 32  # the task tokenizer's 26 tokens, rounded up


def prepare(out: Path, seed: int = 0) -> tuple[Path, dict]:
    """<out>/tiny_hf (model + tokenizer) and <out>/data (train/val parquet), made once."""
    from recipes.local.task import write_data, write_tokenizer
    from recipes.local.tiny_model import make_tiny_checkpoint

    hf_dir, data_dir = out / "tiny_hf", out / "data"
    if not (hf_dir / "tokenizer.json").is_file():
        tmp = out / ".tiny_hf.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_checkpoint(tmp, seed=seed, vocab_size=TINY_VOCAB, eos_token_id=2, pad_token_id=0)
        write_tokenizer(tmp)
        shutil.rmtree(hf_dir, ignore_errors=True)
        os.replace(tmp, hf_dir)
    files = {"train": data_dir / "train.parquet", "val": data_dir / "val.parquet"}
    if not all(p.is_file() for p in files.values()):
        files = write_data(data_dir)
    return hf_dir, files


def job_env(out: Path) -> dict[str, str]:
    """The environment of the driver and (through ray_env) every Ray worker: the cluster
    run's for device cpu (recipes.dapo.cluster.job_env) and this run's outputs."""
    from recipes.dapo.cluster import job_env as cluster_env

    return {
        **cluster_env("cpu", None),
        "TENSORBOARD_DIR": str(out / "tensorboard"),
        # verl's file logger truncates its file: each launch (a resume too) gets its own
        "VERL_FILE_LOGGER_PATH": str(next_metrics_file(out / METRICS)),
    }


def finish(out: Path, hf_dir: Path, wall_s: float, verl_s: float, target: float = 0.9) -> int:
    """Export, reload check, routing report, reward curve, summary (after verl returns)."""
    from recipes.local.export import check_export, latest_actor_checkpoint

    history = read_history(out / METRICS)
    actor = latest_actor_checkpoint(out / "checkpoints")
    paths: dict = {"tensorboard": out / "tensorboard", "checkpoint": actor}
    diff = None
    if actor is not None:
        export_dir, diff = check_export(actor, hf_dir, out / "export_hf")
        paths["export"] = export_dir
        paths.update(render_routing_report(actor / "moe_report.json", out))
    stepping = sum(row.get(k, 0.0) for row in history for k in STEP_TIME_KEYS)
    summary = write_summary(out, history, target, paths, wall_s, startup_s=verl_s - stepping,
                            export_max_logits_diff=diff)  # fmt: skip
    print_summary(summary)
    if diff is not None:
        print(f"export reloads in transformers: max |logits diff| = {diff:.2e}")
    return 0 if diff is not None and diff < 1e-4 else 1


def next_metrics_file(folder: Path) -> Path:
    """<out>/metrics/launch_NNN.jsonl, one past the newest."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"launch_{len(list(folder.glob('launch_*.jsonl'))):03d}.jsonl"


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


def render_routing_report(report: Path, out: Path) -> dict:
    if not report.is_file():
        return {}
    from backend.monitor.render import render
    from backend.monitor.report import load_report

    shutil.copyfile(report, out / "routing_report.json")
    html = render(load_report(out / "routing_report.json"), out / "routing_report") / "index.html"
    return {"routing_report": out / "routing_report.json", "routing_html": html}


def run(resolved, out: Path, hf_dir: Path, t0: float, watch=None) -> int:
    """verl's trainer, then the finish. watch: a recipes.dapo.lost_node.NodeWatch on a cluster."""
    from recipes.dapo.cluster import run_command
    from recipes.dapo.lost_node import failure_line

    code = run_command(resolved.command, resolved.run.env, watch)
    verl_s = time.perf_counter() - t0
    if code != 0:
        lost = failure_line(watch, resolved.run.ckpt_dir, resume="relaunch with --resume")
        print(lost or f"error: verl's trainer exited with status {code}", file=sys.stderr)
        return code
    return finish(out, hf_dir, time.perf_counter() - t0, verl_s)
