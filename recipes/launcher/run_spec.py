"""The launcher's arguments validated once, into one frozen RunSpec that everything after reads.

`from_args` takes argparse's namespace and the pass-through overrides and checks, in this
order, what the flags say alone and against the model: the device (the flag, else this
machine's accelerator, else cpu: the local run), the flags that belong to the other kind of
run, a cluster run's files, the plan's defaults (cluster tp 4 / ep 8, verl's FSDP actor tp 1;
local 1 each) against the engine and the trainer mode, the actor's cp limit, the model (a
cluster's checkpoint dir, or the local run's tiny / mini / directory), the trainer mode's
split of the nodes and the plan against that model (parallel.plan's checks). Each refusal is
one line (LaunchError, PlanError). Nothing is written or started.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from parallel.plan import ModelFit, ParallelPlan, PlanError
from recipes.dapo import check_actor_cp
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import actors, overrides, trainer_modes
from recipes.dapo.job.trainer_modes import Split
from recipes.launcher import local_model
from recipes.launcher.arguments import (
    CLUSTER_DEVICES_PER_NODE,
    CLUSTER_NODES,
    CLUSTER_ONLY,
    CLUSTER_PLAN,
    LOCAL_ONLY,
    LOCAL_OUT,
)
from recipes.launcher.local_model import LocalModel


@dataclass(frozen=True)
class RunSpec:
    """What the launcher was asked for, checked: the plan, the model, the mode, the engine."""

    device: str  # npu | cuda | cpu (the local run)
    engine: str  # the actor: mcore_ep or verl's FSDP2 (recipes.dapo.job.actors)
    trainer_mode: str  # verl's V1 trainer mode (recipes.dapo.job.trainer_modes)
    split: Split  # the trainer's and a separate rollout's nodes
    model_fit: ModelFit  # the plan checked against the model (parallel.plan)
    model_dir: Path | None  # a cluster run's --model (None: a dry run without one)
    local: LocalModel | None  # the local run's model: tiny / mini (built) or a directory
    out: Path | None  # the local run's directory (--ckpt-dir or runs/local_dapo)
    ckpt_dir: Path | None  # a cluster run's --ckpt-dir
    train_file: Path | None
    val_file: Path | None
    ifname: str | None
    ray_address: str | None
    skew_from: str | None
    steps: int | None
    seed: int | None
    warmup_steps: int | None
    resume: bool
    dry_run: bool
    verbose: bool
    debug: bool
    extra: tuple[str, ...]  # verl overrides after `--`

    @property
    def plan(self) -> ParallelPlan:
        return self.model_fit.plan

    @property
    def is_local(self) -> bool:
        """The local run (device cpu): the embedded one, or on a running cluster."""
        return self.device == "cpu"


def from_args(args, extra: list[str]) -> RunSpec:
    """argparse's namespace (recipes.launcher.arguments) and the overrides after `--`, checked."""
    device = pick_device(args.device)
    if device == "cpu":
        return _local(args, extra)
    return _cluster(args, device, extra)


def pick_device(requested: str | None) -> str:
    from backend.platform.device import resolve_device

    return resolve_device(requested or "auto")


def _cluster(args, device: str, extra: list[str]) -> RunSpec:
    from parallel.models import load_spec
    from parallel.plan import plan_for_model

    given = [
        f"--{n.replace('_', '-')}" for n in LOCAL_ONLY if getattr(args, n) not in (None, False)
    ]
    if given:
        raise LaunchError(
            f"{', '.join(given)} configure the local CPU run, not a {device} cluster run: "
            "drop them (pass verl overrides after --, e.g. -- trainer.total_training_steps=N)"
        )
    if not args.dry_run:  # a dry run needs no files: Qwen3-30B-A3B's config stands in
        _require(args, "model", "train_file", "val_file", "ckpt_dir")
    defaults = CLUSTER_PLAN if args.engine == actors.BACKEND else {**CLUSTER_PLAN, "tp": 1}
    dims = {d: v if getattr(args, d) is None else getattr(args, d) for d, v in defaults.items()}
    _check_engine(args, dims)
    model = _model_dir(args.model) if args.model else None
    spec = load_spec(str(model) if model else None)
    nodes, per_node = _cluster_layout(args)
    split = trainer_modes.split(args.trainer_mode, nodes, per_node)
    fit = plan_for_model(spec, split.trainer_nodes, per_node, **dims)
    rollout_tp = overrides.DAPO["rollout_tp"]
    if fit.plan.world % rollout_tp:
        raise PlanError(
            f"{fit.plan.world} devices do not split into vLLM engines of TP {rollout_tp}"
        )
    return _spec(args, extra, device, split, fit, model_dir=model, local=None, out=None)


def _local(args, extra: list[str]) -> RunSpec:
    from recipes.launcher.local_checks import check_task, model_fit

    given = [n for n in CLUSTER_ONLY if getattr(args, n)]
    if given:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise LaunchError(
            f"{flags} configure a cluster run: add --device npu or cuda "
            "(this machine has no accelerator; the local run trains on the toy task)"
        )
    dims = {d: getattr(args, d) or 1 for d in CLUSTER_PLAN}
    _check_engine(args, dims)
    out = Path(args.ckpt_dir or LOCAL_OUT).expanduser().absolute()
    model = local_model.choose(args.model, extra, out, args.task)
    check_task(out, model.task, args.resume)
    if args.warmup_steps is not None and not model.warmed:
        raise LaunchError(
            f"--warmup-steps applies to --model mini (its SFT warm-up), not to {model.name}: "
            "drop it, or add --model mini"
        )
    embedded = not args.ray_address  # the local run's own Ray, or a running cluster
    if embedded and (args.nodes or args.devices_per_node):
        raise LaunchError(
            "--nodes and --devices-per-node describe a running Ray cluster, which the embedded "
            "run does not use (its ranks are this machine's processes, as many as --tp, --ep "
            "and --pp need): drop them, or add --ray-address HEAD_IP:PORT"
        )
    nodes, per_node = _cluster_layout(args) if not embedded else (1, 1)
    split = trainer_modes.split(args.trainer_mode, nodes, per_node, embedded)
    layout = (nodes, per_node) if not embedded else _embedded_layout(dims)
    fit = model_fit(model.config, *layout, **dims)
    return _spec(args, extra, "cpu", split, fit, model_dir=None, local=model, out=out)


def _spec(args, extra, device, split, fit, **where) -> RunSpec:
    ckpt = Path(args.ckpt_dir).expanduser() if args.ckpt_dir and device != "cpu" else None
    path = lambda value: Path(value).expanduser() if value else None  # noqa: E731
    return RunSpec(
        device=device, engine=args.engine, trainer_mode=args.trainer_mode, split=split,
        model_fit=fit, ckpt_dir=ckpt, train_file=path(args.train_file),
        val_file=path(args.val_file), ifname=args.ifname, ray_address=args.ray_address,
        skew_from=args.skew_from, steps=args.steps, seed=args.seed,
        warmup_steps=args.warmup_steps, resume=args.resume, dry_run=args.dry_run,
        verbose=args.verbose, debug=args.debug,
        extra=tuple(extra), **where,
    )  # fmt: skip


def _check_engine(args, dims: dict) -> None:
    """The actor against the plan and mode (recipes.dapo.job.actors), then its cp limit."""
    actors.check_engine_plan(args.engine, dims, args.trainer_mode)
    check_actor_cp(dims["cp"])


def _require(args, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if not getattr(args, n)]
    if missing:
        raise LaunchError(
            f"a cluster run needs {', '.join(missing)}: pass the model dir, data files "
            "and a checkpoint dir on the shared filesystem"
        )


def _model_dir(path: str) -> Path:
    """--model of a cluster run: its config.json, weights and tokenizer agree, from the files'
    headers (converters.hf_check: seconds, also at 61 GB), before Ray or a queue slot."""
    from backend.shared.errors import CheckpointError
    from converters.hf_check import check_hf_dir

    model = Path(path).expanduser()
    if not (model / "config.json").is_file():
        raise LaunchError(
            f"--model {model} has no config.json: pass the HF checkpoint dir of Qwen3-30B-A3B"
        )
    try:
        check_hf_dir(model, f"--model {model}")
    except CheckpointError as e:
        raise LaunchError(str(e)) from None
    return model


def _cluster_layout(args) -> tuple[int, int]:
    """(nodes, devices per node) of a running cluster: the flags, else 4 x 8."""
    return args.nodes or CLUSTER_NODES, args.devices_per_node or CLUSTER_DEVICES_PER_NODE


def _embedded_layout(dims: dict) -> tuple[int, int]:
    """The embedded run's one node: the smallest dp that lets the experts fold over its
    ranks."""
    return 1, math.lcm(dims["tp"] * dims["cp"], dims["etp"] * dims["ep"]) * dims["pp"]
