"""Overhead of the engine's step timing (mcore_ep.timing) on a whole trainer step, as a ratio.

Two engines on the same tiny model and batch, timing off and on, taking turns within each
round (world 1, CPU). A round is what the actor does in a trainer step: the old-log-prob
pass, the offload verl asks for after it, one train_batch (which onloads) and the weight stream to the rollout. Timed in process
CPU time (the timer's cost is CPU work; wall time on a shared machine swings by more).

    python -m scripts.bench.engine_timing_overhead --rounds 30
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def sum_loss(model_output, data, dp_group=None):
    return model_output["log_probs"].values().mean(), {}


def trainer_step(engine, data) -> float:
    start = time.process_time()
    with engine.eval_mode():
        engine.infer_batch(data)
    engine.to("cpu")
    with engine.train_mode():
        engine.train_batch(data, loss_function=sum_loss)
    stream, _ = engine.get_per_tensor_param()
    for _ in stream:
        pass
    return time.process_time() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON with the figures")
    args = parser.parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint
    from scripts.bench.engine_batches import build_engine, random_batch

    init_parallel(prepare_device("cpu"), seed=0)
    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers)  # fmt: skip
    hf_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0, **shape)
    offload = dict(param_offload=True, optimizer_offload=True)  # as the CPU run (A2-like)
    engines = {"off": build_engine(hf_dir, timing=False, **offload),
               "on": build_engine(hf_dir, timing=True, **offload)}  # fmt: skip
    tokens = args.seqs * (args.prompt + args.response)
    data = random_batch(args.seqs, args.prompt, args.response, max_tokens=tokens)
    times = {name: [] for name in engines}
    for r in range(args.rounds + 2):  # two warm-up rounds
        order = list(engines) if r % 2 else list(engines)[::-1]
        for name in order:
            seconds = trainer_step(engines[name], data)
            if r >= 2:
                times[name].append(seconds)
    med = {name: statistics.median(t) for name, t in times.items()}
    paired = statistics.median(on / off for on, off in zip(times["on"], times["off"], strict=True))
    figures = {"tokens": tokens, "rounds": args.rounds, "median_s": med,
               "ratio_of_medians": med["on"] / med["off"], "median_paired_ratio": paired}  # fmt: skip
    print(f"{tokens} tokens, {args.layers} layers, hidden {args.hidden}, {args.rounds} rounds: "
          f"trainer step {med['off'] * 1e3:.1f} ms off, {med['on'] * 1e3:.1f} ms on; "
          f"on/off {figures['ratio_of_medians']:.3f} (median paired {paired:.3f})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
