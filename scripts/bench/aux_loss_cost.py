"""Cost of the router aux loss on the actor: update step and trainer step, vs aux off.

One process, world size 1, CPU unless --device: one mcore_ep engine per aux-loss setting on
the same tiny checkpoint and the same verl batch. Each round runs, per engine, the
old-log-prob pass (infer_batch, as verl's trainer does before the updates) and one
train_batch (forward, backward, optimizer: one update per trainer step, as the cluster
recipe's ppo_mini_batch_size = train_batch_size); engines alternate within a round so that
load drift hits all alike. Prints the medians and their ratios to "off":

    update = train_batch;  step = old-log-prob pass + train_batch

and, for the settings that compute it, the load-balancing loss of the last step (the
"observe" engine is the no-gradient baseline of the "on" ones).

    python -m scripts.bench.aux_loss_cost                          # tiny model, 15 rounds
    python -m scripts.bench.aux_loss_cost --hidden 256 --layers 4  # FLOPs weigh more
    python -m scripts.bench.aux_loss_cost --settings off observe global_batch_olp \
        --lr 1e-3 --steps 60                                      # the balancing it buys
"""

import argparse
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from backend.shared.names import AUX_LOSS_PREFIX

QWEN3 = {"type": "global_batch", "coeff": 0.001}
SETTINGS = {
    "off": {"mode": "off"},
    "observe": {"mode": "observe", **QWEN3},
    "micro_batch": {"mode": "on", "type": "micro_batch", "coeff": 0.001},
    "global_batch": {"mode": "on", **QWEN3},  # + the counting pass
    "global_batch_olp": {"mode": "on", **QWEN3, "global_counts": "old_log_prob"},
}
BALANCE = f"{AUX_LOSS_PREFIX}/load_balancing/mean"


def setting(name: str, coeff: float) -> dict:
    aux = dict(SETTINGS[name])
    return {**aux, "coeff": coeff} if "coeff" in aux else aux


def sum_loss(model_output, data, dp_group=None):
    return model_output["log_probs"].values().mean(), {}


def build(hf_dir: Path, aux_loss: dict, lr: float):
    from scripts.bench.engine_batches import build_engine

    return build_engine(hf_dir, lr, aux_loss=aux_loss)


def batch(seqs: int, prompt: int, response: int, max_tokens: int):
    from scripts.bench.engine_batches import random_batch

    return random_batch(seqs, prompt, response, max_tokens)


def round_times(engine, data) -> tuple[float, float, dict]:
    """(old-log-prob pass s, update s, update metrics) of one trainer step."""
    start = time.perf_counter()
    with engine.eval_mode():
        engine.infer_batch(data)
    olp = time.perf_counter() - start
    with engine.train_mode():
        start = time.perf_counter()
        out = engine.train_batch(data, loss_function=partial(sum_loss))
        update = time.perf_counter() - start
    return olp, update, out["metrics"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=15, help="timed rounds")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per micro-batch")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--coeff", type=float, default=0.001, help="balancing coefficient")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", args.device)
    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    init_parallel(prepare_device(args.device), seed=0)
    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers)  # fmt: skip
    hf_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", seed=0, **shape)
    engines = {name: build(hf_dir, setting(name, args.coeff), args.lr) for name in args.settings}
    data = batch(args.seqs, args.prompt, args.response, args.max_tokens)
    olp, update, last = ({n: [] for n in engines} for _ in range(3))
    for step in range(args.steps + 2):  # two warm-up rounds
        for name, engine in engines.items():
            o, u, last[name] = round_times(engine, data)
            if step >= 2:
                olp[name].append(o)
                update[name].append(u)
    report(args, engines, olp, update, last)
    return 0


def report(args, engines, olp, update, last) -> None:
    med = {n: (statistics.median(olp[n]), statistics.median(update[n])) for n in engines}
    tokens = args.seqs * (args.prompt + args.response)
    print(f"{tokens} tokens/step, hidden {args.hidden}, {args.layers} layers, "
          f"{args.steps} rounds, medians; ratios to off")  # fmt: skip
    base_update, base_step = med["off"][1], sum(med["off"])
    for name, (o, u) in med.items():
        balance = last[name].get(BALANCE, [float("nan")])[0]
        print(f"{name:>16}: old_log_prob {o * 1e3:7.1f} ms  update {u * 1e3:7.1f} ms "
              f"({u / base_update:.3f})  step {(o + u) * 1e3:7.1f} ms ({(o + u) / base_step:.3f})"
              f"  load_balancing {balance:.5f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
