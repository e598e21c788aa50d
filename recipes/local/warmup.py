"""The SFT warm-up: verl's own SFT trainer (verl/trainer/sft_trainer.py) on our mcore_ep engine.

RL from random weights cannot earn a binary reward on the sums task (recipes.local.task.sums),
so the local run starts from a policy that speaks its format: a short SFT on the task's
worked answers, made once for its content (recipes.local.warmup_cache: a new run directory
reuses an identical one, checked byte for byte). verl's SFT trainer builds its engine through
TrainingWorker -> EngineRegistry, the registry that finds `mcore_ep` for RL: this module only
composes its config (verl's sft_trainer_engine.yaml with our engine section in place of the
FSDP one) and runs it on torchrun's ranks; the checkpoint it saves is our engine's, which
converters export to the HF folder RL starts from.

    python -m torch.distributed.run --standalone --nproc-per-node W -m recipes.local.warmup \
        --model DIR --data sft.parquet --out DIR [--steps N] [--tp T --ep E]

(the local run's warm_up starts its ranks itself, without torchrun's agent: two data-parallel
ranks of one thread where there are two cores, `warmup_ranks`).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from recipes.local.cpu_overrides import CPU_ENGINE
from recipes.local.task.built_models import warmed_dir

WORK_DIR = "warmup"  # under the run directory: the warm-up's work (its export: SFT_DIR)
PROGRESS_EVERY_S = 15.0
ENGINE_TARGET = "recipes.dapo.engine.config.McoreEpEngineConfig"
ENGINE_MODULE = "recipes.dapo.engine.verl_engine"
# 260 steps: at a constant lr the share of sums the policy guesses swings from step to step
# (two ranks: 0.32, 0.64, 0.89, 0.49, 0.49, 0.45, 0.43 at steps 140-260 by 20); at 260 it starts
# RL as one rank's 200 steps did (accuracy 0.70, 43% guessed; docs/mini_task.md)
WARMUP = dict(steps=260, batch=32, lr=3e-3, warmup_steps=5, max_length=96)


def sft_config(
    model: Path, data: Path, out: Path, steps: int, plan: dict, world: int, save_freq: int = -1
):
    """verl's SFT config (Hydra-composed from its package) for our engine on this run."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    overrides = [
        f"model.path={model}",
        f"data.train_files={data}",
        "data.val_files=null",
        f"data.train_batch_size={WARMUP['batch']}",
        f"data.micro_batch_size_per_gpu={WARMUP['batch'] // max(1, world // plan['tp'])}",
        f"data.max_length={WARMUP['max_length']}",
        "data.use_dynamic_bsz=False",
        "data.pad_mode=no_padding",
        "data.num_workers=0",
        f"optim.lr={WARMUP['lr']}",
        f"optim.lr_warmup_steps={WARMUP['warmup_steps']}",
        "optim.lr_scheduler_type=constant",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        f"trainer.default_local_dir={out}",
        "trainer.logger=[console,file]",
        f"trainer.save_freq={save_freq}",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={world}",
        "checkpoint.save_contents=[model]",
    ]
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("sft_trainer_engine", overrides=overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.model.external_lib = ENGINE_MODULE
    cfg.engine = OmegaConf.create(
        {
            "_target_": ENGINE_TARGET,
            "strategy": "mcore_ep",
            "tensor_model_parallel_size": plan["tp"],
            "expert_model_parallel_size": plan["ep"],
            **CPU_ENGINE,  # the RL run's modules (ours), so the warm-up trains what RL runs
            "monitor": {"enable": False, "log_dir": None},
            # verl's SFT step offloads after every step, where the default trim returns the free
            # heap to the OS for the next step to fault back in: 697-703 -> 583 ms a step. One
            # short process on the whole machine: nothing to give memory back to
            "cpu_trim_heap": "off",
        }
    )
    return cfg


class WarmupError(RuntimeError):
    """The warm-up's trainer or export failed: the message names its log."""


def warm_up(out: Path, base: Path, sft_data: Path, steps: int = WARMUP["steps"],
            say=print) -> Path:  # fmt: skip
    """<out>/sft_hf: `base` after `steps` SFT steps on `sft_data`, made once (converters write
    it whole or not at all: a killed warm-up is never taken for a model), or the identical one
    from the cache (recipes.local.warmup_cache), which keeps each one made. verl's SFT trainer
    runs on `warmup_ranks()` ranks of our engine; their whole output goes to
    <out>/warmup/log.txt and `say` gets a progress line every PROGRESS_EVERY_S seconds."""
    from recipes.local import warmup_cache

    final = warmed_dir(out)
    if (final / "tokenizer.json").is_file():
        return final
    root = warmup_cache.cache_root(out)
    ready = base.is_dir() and sft_data.is_file()  # else the trainer says what is missing
    ranks = warmup_ranks()
    key = warmup_cache.warmup_key(base, sft_data, steps, warmup_settings()) if ready else None
    cached = warmup_cache.lookup(root, key, say) if key else None
    if cached is not None:
        say(f"warm-up: reused {cached} (the same model, corpus, steps and code; "
            f"rm -r {root} clears the cache)")  # fmt: skip
        return warmup_cache.copy_out(cached, final)
    work = out / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log, metrics = work / "log.txt", work / "metrics.jsonl"
    cmd = [sys.executable, "-m", "recipes.local.warmup", "--model", str(base), "--data",
           str(sft_data), "--out", str(work / "checkpoints"), "--steps", str(steps)]  # fmt: skip
    t0 = time.perf_counter()
    say(f"warm-up: {steps} SFT steps (verl's SFT trainer on the mcore_ep engine, {ranks} "
        f"rank{'s' if ranks > 1 else ''}), log {log}")  # fmt: skip
    with open(log, "w") as sink:
        code = _run_ranks(cmd, ranks, metrics, sink, lambda: say(
            _progress(metrics, steps, time.perf_counter() - t0)))  # fmt: skip
    if code != 0:
        raise WarmupError(f"the SFT warm-up failed (exit {code}): see {log}")
    from recipes.local.export import export_hf

    # converters write the folder whole or not at all: a killed export is never a model
    with open(log, "a") as sink, redirect_stdout(sink), redirect_stderr(sink):
        try:
            export_hf(work / "checkpoints" / f"global_step_{steps}", base, final)
        except RuntimeError as e:
            raise WarmupError(f"{e}: see {log}") from None
    say(_progress(metrics, steps, time.perf_counter() - t0, done=True))
    say(f"warm-up: kept in {warmup_cache.keep(root, key, final)} for the next run")
    return final


def warmup_ranks() -> int:
    """The warm-up's data-parallel ranks: 2 where there are 2 cores or more. One rank with 2
    threads keeps 1.28 of 2 cores busy (verl's SFT loop and the step's small ops run on
    one); two ranks of 1 thread each: 0.494 -> 0.328 s a step, loss equal to 6 digits."""
    return min(2, os.cpu_count() or 1)


def warmup_settings() -> dict:
    """What the warm-up's result depends on besides its inputs: WARMUP and the ranks (data
    parallel: the order of the gradient's sum)."""
    return {**WARMUP, "ranks": warmup_ranks()}


def _run_ranks(cmd: list[str], ranks: int, metrics: Path, sink, progress) -> int:
    """`cmd` on `ranks` ranks (torchrun's variables, without its agent process), their output
    to `sink`, `progress()` every PROGRESS_EVERY_S; returns the exit code of the rank that
    failed first (the others are ended then: they would wait on its collectives) or 0."""
    port, t0, next_line_s = _free_port(), time.perf_counter(), PROGRESS_EVERY_S
    children = [subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                 env=_env(metrics, rank, ranks, port))
                for rank in range(ranks)]  # fmt: skip
    while (codes := [c.poll() for c in children]).count(None):
        if failed := next((c for c in codes if c), 0):  # end the others: they would wait
            for child in children:
                if child.poll() is None:
                    child.terminate()
            for child in children:
                child.wait()
            return failed
        time.sleep(0.5)
        if time.perf_counter() - t0 >= next_line_s:
            progress()
            next_line_s += PROGRESS_EVERY_S
    return next((c for c in codes if c), 0)


def _env(metrics: Path, rank: int = 0, ranks: int = 1, port: int = 0) -> dict[str, str]:
    """Rank `rank` of `ranks` (torchrun's variables, without its agent process), the cores
    shared out between them."""
    from recipes.dapo.cluster.ray_job import CPU_ENV

    env = {**os.environ, **CPU_ENV, "VERL_FILE_LOGGER_PATH": str(metrics)}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
               LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port or _free_port()))  # fmt: skip
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_metrics(metrics: Path) -> dict:
    """verl's file logger's last complete row {step, data} ({} before the first step)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def _progress(metrics: Path, steps: int, elapsed_s: float, done: bool = False) -> str:
    row = last_metrics(metrics)
    loss = row.get("data", {}).get("train/loss")
    at = f"step {row.get('step', 0)}/{steps}" + (f", loss {loss:.3f}" if loss is not None else "")
    return f"warm-up: {'done, ' if done else ''}{at} ({elapsed_s:.0f}s)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.local.warmup")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=WARMUP["steps"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--save-freq", type=int, default=-1)
    args = p.parse_args(argv)
    import torch.distributed as dist
    from verl.trainer.sft_trainer import SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = sft_config(args.model, args.data, args.out, args.steps,
                     {"tp": args.tp, "ep": args.ep}, world, args.save_freq)  # fmt: skip
    # verl's run_sft asks for "cpu:gloo,cpu:gloo" on a CPU host, which torch refuses: the
    # group is ours to make (gloo), the trainer is verl's
    dist.init_process_group("gloo")
    try:
        SFTTrainer(config=cfg).fit()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
