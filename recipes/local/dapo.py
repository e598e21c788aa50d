"""DAPO end to end on a tiny Qwen3-MoE on CPU: the megatron-core actor learns arithmetic.

python -m recipes.local.dapo [--tp 2 --ep 2] [--steps N] [--out runs/local_dapo] [--resume]

Parallel plans: world = tp * dp ranks and the experts fold over them (ep must divide the
world, etp = 1); dp defaults to the smallest that fits, so --tp 2 --ep 2 runs 2 processes
(tp=2, dp=1, ep=2) and --tp 1 --ep 2 runs 2 (dp=2); --dp 2 with --tp 2 --ep 2 runs 4. With
more than one rank the module relaunches itself under torchrun (gloo on CPU).
Outputs under --out: checkpoints/, tensorboard/, metrics.jsonl, routing_report.json and
routing_report/index.html, export_hf/ (transformers-loadable), reward_curve.png, summary.json.
"""

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# settings a resumed run must share with the checkpoint it loads
RESUME_KEYS = (
    "tp", "ep", "dp", "seed", "ops", "max_operand", "n", "max_response_length",
    "overlong_buffer", "overlong_penalty", "train_prompts", "gen_prompts", "max_num_gen_batches",
    "filter_metric", "mini_prompts", "micro_size", "lr", "warmup", "aux_loss", "aux_coeff",
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m recipes.local.dapo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="default: the smallest dp with ep | tp*dp")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", type=Path, default=Path("runs/local_dapo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --out"
    )
    p.add_argument(
        "--save-freq", type=int, default=50, help="checkpoint every N steps (and the last)"
    )
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    task = p.add_argument_group("task and rollout")
    task.add_argument("--ops", default="+-")
    task.add_argument("--max-operand", type=int, default=4)
    task.add_argument("--n", type=int, default=16, help="responses per prompt")
    task.add_argument("--max-response-length", type=int, default=4)
    task.add_argument("--overlong-buffer", type=int, default=2)
    task.add_argument("--overlong-penalty", type=float, default=1.0)
    dapo = p.add_argument_group("DAPO")
    dapo.add_argument("--train-prompts", type=int, default=16)
    dapo.add_argument("--gen-prompts", type=int, default=32)
    dapo.add_argument("--max-num-gen-batches", type=int, default=4)
    dapo.add_argument(
        "--filter-metric",
        choices=("acc", "score", "seq_reward", "seq_final_reward"),
        default="acc",
        help="dynamic sampling drops groups where it does not vary",
    )
    dapo.add_argument("--mini-prompts", type=int, default=8)
    dapo.add_argument("--micro-size", type=int, default=64)
    dapo.add_argument("--lr", type=float, default=5e-4)
    dapo.add_argument("--warmup", type=int, default=5)
    dapo.add_argument("--aux-loss", choices=("off", "observe", "on"), default="on")
    dapo.add_argument("--aux-coeff", type=float, default=1e-3)
    p.add_argument("--target-reward", type=float, default=0.9)
    # one thread: on a shared CPU, intra-op threads wait on each other when one is descheduled
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (0: torch's default)"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: run at least one step")
    return args


def plan_world(tp: int, ep: int, dp: int | None) -> tuple[int, int]:
    """(world, dp): world = tp * dp, the experts folded over it (ep | world)."""
    if tp < 1 or ep < 1:
        raise ValueError(f"--tp {tp} --ep {ep}: both must be >= 1")
    dp = dp or math.lcm(tp, ep) // tp
    if (tp * dp) % ep:
        raise ValueError(f"--ep {ep} must divide tp*dp = {tp * dp}: raise --dp or lower --ep")
    return tp * dp, dp


def relaunch(argv: list[str], world: int) -> int:
    """Rerun this module on `world` local ranks under torchrun; its exit status."""
    # "--": torchrun's parser would otherwise read our flags as abbreviations of its own (--n)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "recipes.local.dapo",
        "--",
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = argv[1:] if argv[:1] == ["--"] else argv  # as relaunch() passes them
    args = parse_args(argv)
    world, args.dp = plan_world(args.tp, args.ep, args.dp)
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and "RANK" not in os.environ:
        return relaunch(argv, world)
    if launched != world:
        raise SystemExit(
            f"running on {launched} ranks but --tp {args.tp} --ep {args.ep} --dp {args.dp} "
            f"needs {world}: launch without torchrun and the module relaunches itself"
        )
    from recipes.local.run import run

    return run(args, {k: getattr(args, k) for k in RESUME_KEYS}, time.perf_counter())


if __name__ == "__main__":
    raise SystemExit(main())
