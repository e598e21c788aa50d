"""What the launcher resolves before it starts anything: its arguments, the run they make.

`build_parser` and `split_argv`: the launcher's own flags, and the verl overrides after `--`.
`resolve`: a cluster run (npu / cuda), checked against the model (parallel/), the model and
data files, the reward its overrides configure; offload decided by the memory model.
`resolve_local`: the embedded CPU run on the model --model chose (recipes.launcher.local_model:
tiny, mini or the user's directory), or with --ray-address the same job on that running
cluster, checked as recipes.launcher.local_checks says. Either way a `Resolved` (overrides by group, verl's command line), the pass-through
overrides checked against verl's config (recipes.launcher.verl_schema), nothing started or
written; misuse raises LaunchError with one line.
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from backend.shared.cli_contract import OneLineParser
from recipes.dapo import check_actor_cp
from recipes.dapo.cluster import ray_job
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import actors, overrides, trainer_modes
from recipes.launcher import a2_replay, datasets, dry_run, local_model
from recipes.launcher.verl_schema import check_overrides
from recipes.local.cpu_overrides import TASKS, cpu_overrides
from recipes.local.warmup import WARMUP

# the launcher's --help headline (recipes/launcher/launch.py is the entry point)
DESCRIPTION = "Resolve and launch the DAPO run (scripts/train_mcore.sh runs `python -m recipes.launcher.launch`)."
CLUSTER_PLAN = {"tp": 4, "ep": 8, "etp": 1, "pp": 1, "cp": 1}
CLUSTER_ONLY = ("train_file", "val_file", "ifname", "skew_from")
LOCAL_ONLY = ("steps", "seed", "resume", "warmup_steps")
LOCAL_OUT, LOCAL_SAVE_FREQ = "runs/local_dapo", 10


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
    plan.add_argument("--nodes", type=positive_int, default=4, help="nodes in the Ray cluster")
    plan.add_argument(
        "--devices-per-node", type=positive_int, default=8, help="accelerators per node"
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
        "--warmup-steps",
        type=positive_int,
        default=None,
        help="SFT steps of the mini model's warm-up before RL, made once per --ckpt-dir "
        f"(default {WARMUP['steps']}; docs/mini_task.md)",
    )
    local.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint in --ckpt-dir (without it a new run starts, "
        "and an earlier run there is moved to <dir>.<UTC timestamp>, never deleted)",
    )
    return p


@dataclass(frozen=True)
class Resolved:
    run: overrides.RunSpec
    model_fit: object  # parallel.plan.ModelFit
    groups: dict[str, dict]
    replaced: list[str]
    skew_lines: tuple[str, ...] = ()  # parallel.skew: verdict at the assumed EP skew, margin
    model_line: str = ""  # the local run: which model it trains (local_model.LocalModel)

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides.to_cli(self.groups)]

    def describe(self) -> str:
        """What the dry run prints, and every launch's log begins with (recipes.launcher.dry_run)."""
        return dry_run.describe(self)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def pick_device(requested: str | None) -> str:
    from backend.platform.device import resolve_device

    return resolve_device(requested or "auto")


def _require(args, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if not getattr(args, n)]
    if missing:
        raise LaunchError(
            f"a cluster run needs {', '.join(missing)}: pass the model dir, data files "
            "and a checkpoint dir on the shared filesystem"
        )


def check_model(path: str) -> Path:
    model = Path(path).expanduser()
    if not (model / "config.json").is_file():
        raise LaunchError(
            f"--model {model} has no config.json: pass the HF checkpoint dir of Qwen3-30B-A3B"
        )
    return model


def check_data(train: str | None, val: str | None, groups: dict, counts: bool = False) -> None:
    """Each data file given (a dry run may give either or none), its data_source values
    against the reward these overrides configure."""
    given = [(p, d) for p, d in ((train, datasets.TRAIN), (val, datasets.VAL)) if p is not None]
    scorer = reward_scorer(groups) if given else None
    for path, dataset in given:
        report = datasets.check_file(Path(path).expanduser(), dataset, counts=counts, scorer=scorer)
        if not report.ok:
            raise LaunchError(f"{dataset.name} {report.path}: " + "; ".join(report.problems))


def reward_scorer(groups: dict):
    """The scoring function verl's reward manager will use (datasets.check_file's `scorer`): None
    for a custom_reward_function (it scores every data_source), else verl's default one."""
    custom = overrides.value_of(groups, "reward.custom_reward_function.path")
    if custom not in (None, "", "null"):
        if not (ray_job.REPO / Path(str(custom)).expanduser()).is_file():
            raise LaunchError(
                f"reward.custom_reward_function.path {custom} does not exist: pass the file "
                "that defines the reward function (relative paths start at the repository)"
            )
        return None
    manager = overrides.value_of(groups, "reward.reward_manager.name") or datasets.DAPO_MANAGER
    return datasets.default_scorer(str(manager))


def resolve(args, device: str, extra: list[str]) -> Resolved:
    """Everything checked and decided; nothing started. Raises with one line on misuse."""
    from parallel.models import load_spec
    from parallel.plan import PlanError, plan_for_model
    from recipes.dapo.job.fit import fit_rollout

    local = [f"--{n}" for n in LOCAL_ONLY if getattr(args, n) not in (None, False)]
    if local:
        raise LaunchError(
            f"{', '.join(local)} configure the local CPU run, not a {device} cluster run: "
            "drop them (pass verl overrides after --, e.g. -- trainer.total_training_steps=N)"
        )
    # a dry run needs no files: the embedded Qwen3-30B-A3B config stands in for --model
    if not args.dry_run:
        _require(args, "model", "train_file", "val_file", "ckpt_dir")
    defaults = CLUSTER_PLAN if args.engine == actors.BACKEND else {**CLUSTER_PLAN, "tp": 1}
    dims = {d: v if getattr(args, d) is None else getattr(args, d) for d, v in defaults.items()}
    actors.check_engine_plan(args.engine, dims, args.trainer_mode)
    check_actor_cp(dims["cp"])
    model = check_model(args.model) if args.model else None
    spec = load_spec(str(model) if model else None)
    sp = trainer_modes.split(args.trainer_mode, args.nodes, args.devices_per_node)
    model_fit = plan_for_model(
        spec, sp.trainer_nodes, args.devices_per_node, **dims
    )  # model reasons first
    plan = model_fit.plan
    rollout_tp = overrides.DAPO["rollout_tp"]
    if plan.world % rollout_tp:
        raise PlanError(f"{plan.world} devices do not split into vLLM engines of TP {rollout_tp}")
    skew = _assumed_skew(args.skew_from, plan.ep)
    fit = fit_rollout(model_fit, device, overrides.MICRO_BATCH_TOKENS, rollout_tp, skew.value)
    if not args.dry_run:  # what only a real launch needs
        from backend.platform.optional import require
        from converters.hf_io import shard_files

        shard_files(model)  # raises CheckpointError naming what is missing
        if device == "npu":
            require("torch_npu", "--device npu")
    ckpt_dir = Path(args.ckpt_dir or "<ckpt-dir>").expanduser()
    env = {**ray_job.job_env(device, args.ifname), "TENSORBOARD_DIR": str(ckpt_dir / "tensorboard")}
    run = overrides.RunSpec(
        device,
        plan,
        fit,
        str(model or "<model: not given, Qwen3-30B-A3B config assumed>"),
        str(Path(args.train_file or "<train-file>").expanduser()),
        str(Path(args.val_file or "<val-file>").expanduser()),
        str(ckpt_dir),
        env,
        ray_address=args.ray_address,
        trainer_mode=args.trainer_mode,
        rollout_nodes=sp.rollout_nodes,
        engine=args.engine,
    )
    built = overrides.build(run)
    if args.engine == actors.BACKEND:
        # the engine's SkewGuard warns when measured routing exceeds what the verdict assumed
        built["engine"][f"{overrides.ENGINE}.monitor.assumed_ep_skew"] = skew.value
    groups, replaced = overrides.merge(built, extra)
    check_overrides(overrides.to_cli(groups), overrides.to_cli(built), extra)
    check_mode(args.trainer_mode, groups)
    a2_replay.check_r3_rollout(device, groups)  # R3 on A2: rollouts vllm-ascend 0.23 cannot record
    check_data(args.train_file, args.val_file, groups)  # before Ray: verl scores at step 1
    groups = overrides.name_the_run(groups)
    return Resolved(
        run, model_fit, groups, replaced, dry_run.assumed_skew_lines(model_fit, fit, skew)
    )


def check_mode(mode: str, groups: dict[str, dict]) -> None:
    """The trainer mode against the values the run ends up with (pass-through overrides
    included): trainer_modes.check_values's one line."""
    of = lambda key: overrides.value_of(groups, key)  # noqa: E731
    trainer_modes.check_values(mode, {
        "router_replay": of(f"{overrides.ACTOR}.{overrides.BACKEND}.router_replay"),
        "train_batch": of("datasets.train_batch_size"),
        "mini_batch": of(f"{overrides.ACTOR}.ppo_mini_batch_size"),
        "sync_step": of(trainer_modes.SYNC_STEP),
    })  # fmt: skip


def _assumed_skew(report: str | None, ep: int):
    from parallel.skew import default_skew, skew_from_report

    return skew_from_report(report, ep=ep) if report else default_skew()


def resolve_local(args, extra: list[str]) -> tuple[Resolved, Path, local_model.LocalModel]:
    """The embedded run: the same overrides on the chosen model and the toy task
    (recipes.local); with --ray-address on that cluster's --nodes x --devices-per-node ranks.
    Checks only: nothing is written (recipes.launcher.local_checks; the launch prepares the
    directory after them)."""
    from recipes.dapo.job.fit import Fit
    from recipes.launcher import local_checks as checks
    from recipes.local import run as local

    given = [n for n in CLUSTER_ONLY if getattr(args, n)]
    if given:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise LaunchError(
            f"{flags} configure a cluster run: add --device npu or cuda "
            "(this machine has no accelerator; the local run trains on the toy task)"
        )
    dims = {d: getattr(args, d) or 1 for d in CLUSTER_PLAN}
    actors.check_engine_plan(args.engine, dims, args.trainer_mode)
    out = Path(args.ckpt_dir or LOCAL_OUT).expanduser().absolute()
    data_dir = out / "data"
    model = local_model.choose(args.model, extra, out)
    if args.warmup_steps is not None and not model.warmed:
        raise LaunchError(
            f"--warmup-steps applies to --model mini (its SFT warm-up), not to {model.name}: "
            "drop it, or add --model mini"
        )
    sp = trainer_modes.split(
        args.trainer_mode, args.nodes, args.devices_per_node, not args.ray_address
    )
    plan = checks.model_fit(
        model.config, *_local_layout(args, sp.trainer_nodes, **dims), **dims
    ).plan
    fresh = not args.resume and checks.earlier_run(out)  # the launch moves that run aside
    # memory figures nominal (the CPU rollout reads no memory fraction); offload as on an A2,
    # so verl's offload/onload calls run between rollout and update here too
    fit = Fit(1.0, 0.0, 0.0, 0.0, 0.0, param_offload=True, optimizer_offload=True)
    run = overrides.RunSpec(
        "cpu", plan, fit, str(model.path), str(data_dir / "train.parquet"),
        str(data_dir / "val.parquet"), str(out / "checkpoints"), local.job_env(out, fresh),
        steps=args.steps or TASKS[model.task]["steps"], save_freq=LOCAL_SAVE_FREQ, ray_address=args.ray_address,
        task=model.task, trainer_mode=args.trainer_mode,
        rollout_nodes=sp.rollout_nodes, engine=args.engine,
    )  # fmt: skip
    built = overrides.build(run, on_top=cpu_overrides(run))
    groups, replaced = overrides.merge(built, extra)
    check_overrides(overrides.to_cli(groups), overrides.to_cli(built), extra)
    check_mode(args.trainer_mode, groups)
    groups = overrides.name_the_run(groups)
    checks.check_rollout_model(model)
    if args.resume:
        checks.check_resume(groups, out)
    resolved = Resolved(run, None, groups, replaced, model_line=model.describe())
    return resolved, out, model


def _local_layout(
    args, nodes: int, tp: int, ep: int, pp: int, etp: int, cp: int
) -> tuple[int, int]:
    """(nodes, ranks per node): the cluster's trainer nodes with --ray-address; else one node
    of the smallest dp that lets the experts fold over the ranks."""
    import math

    if args.ray_address:
        return nodes, args.devices_per_node
    return 1, math.lcm(tp * cp, etp * ep) * pp
