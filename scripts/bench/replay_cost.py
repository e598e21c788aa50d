"""Cost of routing replay on the actor's update step: R3 (or R2) vs disabled, one process.

Two mcore_ep engines on the same tiny checkpoint (world size 1, CPU unless --device), the
same verl batch carrying `routed_experts`; train_batch steps (forward, backward, optimizer)
alternate between the engines, and the ratio of the medians is printed.

    python -m scripts.bench.replay_cost                  # tiny model, R3, 15 steps each
    python -m scripts.bench.replay_cost --mode R2 --steps 25 --seqs 3
"""

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path


def sum_loss(model_output, data, dp_group=None):
    return model_output["log_probs"].values().mean(), {}


def build(hf_dir: Path, mode: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    import recipes.dapo.engine.verl_engine  # noqa: F401  (registers the backend)
    from recipes.dapo.engine.config import McoreEpEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mcore_ep",
        model_config=HFModelConfig(path=str(hf_dir), load_tokenizer=False),
        engine_config=McoreEpEngineConfig(router_replay=mode),
        optimizer_config=FSDPOptimizerConfig(lr=1e-5),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def batch(seqs: int, prompt: int, response: int, engine):
    """Random sequences with the router's own routes (an R2 recording) as `routed_experts`."""
    from scripts.bench.engine_batches import random_batch

    data = random_batch(seqs, prompt, response, max_tokens=seqs * (prompt + response))
    with engine.eval_mode():
        data["routed_experts"] = engine.infer_batch(data)["model_output"]["routed_experts"]
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="R3", choices=("R2", "R3"))
    parser.add_argument("--steps", type=int, default=15, help="timed steps per engine")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", args.device)
    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    init_parallel(prepare_device(args.device), seed=0)
    hf_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    engines = {mode: build(hf_dir, mode) for mode in ("disabled", args.mode)}
    data = batch(args.seqs, args.prompt, args.response, build(hf_dir, "R2"))
    times = {mode: [] for mode in engines}
    for step in range(args.steps + 2):  # two warm-up rounds
        for mode, engine in engines.items():
            with engine.train_mode():
                start = time.perf_counter()
                engine.train_batch(data, loss_function=partial(sum_loss))
                elapsed = time.perf_counter() - start
            if step >= 2:
                times[mode].append(elapsed)
    med = {mode: statistics.median(t) for mode, t in times.items()}
    tokens = args.seqs * (args.prompt + args.response)
    for mode, value in med.items():
        print(f"{mode:>9}: median update step {value * 1e3:.1f} ms ({tokens} tokens)")
    print(f"ratio {args.mode}/disabled: {med[args.mode] / med['disabled']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
