"""The trainer's blocked time per checkpoint save: written in the background vs in place (CPU).

One mcore_ep engine (world size 1) on the tiny model widened (--hidden, --layers, --experts),
with its distributed optimizer; saves of the model and optimizer state alternate between
verl's `checkpoint.async_save` on and off (recipes.dapo.checkpoints.async_save), after warm-up saves of
each (the save plan is cached in both):
- in place: save_checkpoint returns once the files are written, hashed and sealed;
- background: save_checkpoint returns once the writer has started, and the step then polls
  the writer (as each train_batch does) until the save is sealed; the blocked time is the
  call plus those polls. Between polls the bench sleeps --step-s (the step's own work, 1 s:
  far shorter than a real step, so a save here takes more polls than on the cluster).
Prints one JSON document: per mode the median blocked seconds, the checkpoint's bytes, the
ratio background / in place (target <= 0.2), and the planning time (dist_checkpointing.save
until its request is returned, model and optimizer state) of the first save (a new plan)
and of the timed background saves (cached).

    python -m scripts.bench.save_blocking                       # hidden 1024, 4 layers, 5 each
    python -m scripts.bench.save_blocking --hidden 256 --saves 3 --out save.json
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build(hf_dir: Path):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    import recipes.dapo.engine.verl_engine  # noqa: F401  (registers the backend)
    from recipes.dapo.engine.config import McoreEpEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mcore_ep",
        model_config=HFModelConfig(path=str(hf_dir), load_tokenizer=False),
        engine_config=McoreEpEngineConfig(optimizer_offload=True),
        optimizer_config=FSDPOptimizerConfig(lr=1e-5),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def timed_save(engine, root: Path, step: int, background: bool, step_s: float) -> dict:
    """One save; its blocked seconds (the call, and the polls until sealed)."""
    from verl.trainer.config import CheckpointConfig

    from recipes.dapo.checkpoints.files import is_complete

    engine.checkpoint_config = CheckpointConfig(async_save=background)
    start = time.perf_counter()
    engine.save_checkpoint(str(root / f"global_step_{step}" / "actor"), global_step=step)
    call_s, polls, poll_s = time.perf_counter() - start, 0, 0.0
    plan_s = sum(engine.writer.plans.plan_s.values())  # model + optimizer state
    while engine.writer.pending is not None:
        time.sleep(step_s)
        start = time.perf_counter()
        engine.writer.poll()
        polls, poll_s = polls + 1, poll_s + time.perf_counter() - start
    actor = root / f"global_step_{step}" / "actor"
    assert is_complete(actor), actor
    size = sum(p.stat().st_size for p in actor.rglob("*") if p.is_file())
    return {"blocked_s": call_s + poll_s, "call_s": call_s, "polls": polls, "poll_s": poll_s,
            "plan_s": plan_s, "bytes": size}  # fmt: skip


def run(args) -> dict:
    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel

    init_parallel(prepare_device("cpu"), seed=0)
    with tempfile.TemporaryDirectory(prefix="save_bench_") as work:
        return _run(args, Path(work))


def _run(args, work: Path) -> dict:
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
                 num_experts=args.experts)  # fmt: skip
    engine = build(make_tiny_checkpoint(work / "hf", seed=0, **shape))
    saves = {"background": [], "in_place": []}  # the first save, with a new plan: background
    first, step = None, 0
    for i in range(args.warmup + args.saves):
        for mode in saves:
            step += 1
            result = timed_save(engine, work / "ckpt", step, mode == "background", args.step_s)
            first = first or result
            if i >= args.warmup:
                saves[mode].append(result)
    median = {m: statistics.median(r["blocked_s"] for r in rs) for m, rs in saves.items()}
    # a background save's plan_s is its planning alone (in place, it includes the writing)
    cached_plan = statistics.median(r["plan_s"] for r in saves["background"])
    doc = {
        "settings": vars(args) | {"params": sum(p.numel() for p in engine.module.parameters())},
        "checkpoint_bytes": saves["in_place"][-1]["bytes"],
        "saves": saves,
        "median_blocked_s": median,
        "ratio": median["background"] / median["in_place"],
        "plan_s": {"first": first["plan_s"], "cached": cached_plan},
    }
    engine.writer.close()
    return doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--saves", type=int, default=5, help="timed saves per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed saves per mode first")
    parser.add_argument("--step-s", type=float, default=1.0,
                        help="the step's own work between two polls (the engine polls once per "
                        "train_batch; a DAPO step at the shipped size takes minutes)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    doc = run(args)
    doc["settings"]["out"] = str(args.out) if args.out else None
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
