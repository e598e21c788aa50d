"""The launcher's command line: its flags (`build_parser`) and the verl overrides after `--`
(`split_argv`). Parsing only: recipes.launcher.run_spec validates what they say, once."""

import argparse

from backend.shared.cli_contract import OneLineParser
from recipes.dapo.job import actors, trainer_modes
from recipes.launcher import datasets, local_model
from recipes.local.cpu_overrides import TASKS
from recipes.local.warmup import WARMUP

# the launcher's --help headline (recipes/launcher/launch.py is the entry point)
DESCRIPTION = (
    "Resolve and launch the DAPO run (scripts/train_mcore.sh runs `python -m recipes.launcher`)."
)
CLUSTER_PLAN = {"tp": 4, "ep": 8, "etp": 1, "pp": 1, "cp": 1}
CLUSTER_NODES, CLUSTER_DEVICES_PER_NODE = 4, 8  # --nodes, --devices-per-node
CLUSTER_ONLY = ("train_file", "val_file", "ifname", "skew_from")
LOCAL_ONLY = ("steps", "seed", "resume", "warmup_steps", "task")
LOCAL_OUT = "runs/local_dapo"  # the local run's directory without --ckpt-dir


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="scripts/train_mcore.sh",
        description=DESCRIPTION,
        epilog="verl overrides go after `--`, e.g. -- trainer.total_epochs=2 (checked against "
        "verl's config before anything starts; +key=value adds a key, ~key deletes one)",
    )
    plan = p.add_argument_group(
        "parallel plan (cluster: tp 4, ep 8, etp 1, pp 1, cp 1; local: 1 each), checked against "
        "the model"
    )
    for dim in CLUSTER_PLAN:
        plan.add_argument(f"--{dim}", type=positive_int, default=None, help=f"{dim} size")
    plan.add_argument(
        "--nodes", type=positive_int, default=None, help="nodes in the Ray cluster (default 4)"
    )
    plan.add_argument(
        "--devices-per-node",
        type=positive_int,
        default=None,
        help="accelerators per node (default 8); the local run takes both only with --ray-address",
    )
    p.add_argument(
        "--device",
        choices=("npu", "cuda", "cpu"),
        default=None,
        help="default: this machine's accelerator, else cpu (the local run)",
    )
    p.add_argument("--model", metavar="tiny|mini|DIR", help=local_model.FLAG_HELP)
    p.add_argument(
        "--train-file", help=f"{datasets.TRAIN.filename} (scripts/prepare_data.py checks it)"
    )
    p.add_argument("--val-file", help=f"{datasets.VAL.filename}")
    p.add_argument(
        "--ckpt-dir",
        help=f"checkpoints and logs (shared filesystem); local run: its directory (default "
        f"{LOCAL_OUT})",
    )
    p.add_argument("--ifname", help="network interface for HCCL/NCCL and gloo (e.g. eth0)")
    p.add_argument(
        "--ray-address",
        metavar="HEAD_IP:PORT",
        help="the running Ray cluster (ray_start_head.sh prints it); default: the one Ray finds "
        "from this node. --device cpu: run the tiny job on it instead of the embedded run",
    )
    p.add_argument(
        "--trainer-mode",
        choices=trainer_modes.MODES,
        default="sync",
        help="verl's V1 trainer mode: sync (the default), colocate_async (partial rollouts "
        "across weight updates), separate_async (the rollout on nodes of its own: half the "
        "--nodes; on cpu one more vLLM engine) (docs/async_modes.md)",
    )
    p.add_argument(
        "--engine",
        choices=actors.ENGINES,
        default=actors.BACKEND,
        help="the actor: mcore_ep (ours, the default) or fsdp (verl's own FSDP2 engine on the "
        "same job, over the ranks the plan takes: the side by side, docs/ab_engines.md)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="check, resolve and print; start and write nothing"
    )
    p.add_argument(
        "--skew-from",
        metavar="REPORT",
        help="routing report of an earlier run: the EP skew the memory check assumes",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="tracebacks on the console: the launcher's, and the trainer's for a refused checkpoint",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every line of verl, Ray and the workers (they always go to the run's log)",
    )
    local = p.add_argument_group(
        "local run (CPU only; --model picks its model; a cluster run takes verl overrides after --)"
    )
    local.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"training steps (default {TASKS['sums']['steps']} on mini, {TASKS['doubles']['steps']} "
        "on tiny or a directory)",
    )
    local.add_argument(
        "--seed", type=int, default=None, help="random seed of a built model (tiny, mini)"
    )
    local.add_argument(
        "--task",
        choices=("sums", "guessing_sums"),
        default=None,
        help="the mini model's task: sums (the default) or guessing_sums (its warm-up mostly "
        f"guesses: still learning at step 30, default {TASKS['guessing_sums']['steps']} steps; "
        "docs/mini_task.md)",
    )
    local.add_argument(
        "--warmup-steps",
        type=positive_int,
        default=None,
        help="SFT steps of the mini model's warm-up before RL, made once and kept in a cache "
        f"beside the run directories (default {WARMUP['steps']}; docs/mini_task.md)",
    )
    local.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in --ckpt-dir (without it a new run starts, "
        "and an earlier run there is moved to <dir>.<UTC timestamp>, never deleted)",
    )
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []
