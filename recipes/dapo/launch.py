"""Resolve and launch the DAPO run (scripts/train_mcore.sh runs `python -m recipes.dapo.launch`).

Cluster run (--device npu|cuda, or the accelerator this machine has): check the plan against
the model (parallel/), the model and data files, the device stack; decide offload with the
memory model; print the resolved config; check `ray status`; start verl's own entry point
(`python -m verl.trainer.main_ppo` + our overrides) on the running Ray cluster.
Local run (no accelerator, or --device cpu): the embedded CPU recipe.
Everything after `--` passes through as verl overrides (or local-run flags).
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from recipes.dapo import cluster, data, overrides, stack
from recipes.dapo.cluster import LaunchError

DEVICE_LABELS = {"npu": "Ascend A2", "cuda": "H100"}
CLUSTER_PLAN = {"tp": 4, "ep": 8, "etp": 1, "pp": 1, "cp": 1}
CLUSTER_ONLY = ("model", "train_file", "val_file", "ifname", "etp", "pp", "cp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/train_mcore.sh",
        description=__doc__.splitlines()[0],
        epilog="verl overrides go after `--`, e.g. -- trainer.total_epochs=2",
    )
    plan = p.add_argument_group("parallel plan (cluster default: tp 4, ep 8, etp 1, pp 1, cp 1)")
    for dim in CLUSTER_PLAN:
        plan.add_argument(f"--{dim}", type=int, default=None)
    plan.add_argument("--nodes", type=int, default=4)
    plan.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument(
        "--device",
        choices=("npu", "cuda", "cpu"),
        default=None,
        help="default: this machine's accelerator, else cpu (the local run)",
    )
    p.add_argument("--model", help="HF checkpoint dir of Qwen3-30B-A3B (config.json + safetensors)")
    p.add_argument(
        "--train-file", help=f"{data.TRAIN.filename} (scripts/prepare_data.py checks it)"
    )
    p.add_argument("--val-file", help=f"{data.VAL.filename}")
    p.add_argument(
        "--ckpt-dir", help="checkpoints and logs (shared filesystem); local run: its --out"
    )
    p.add_argument("--ifname", help="network interface for HCCL/NCCL and gloo (e.g. eth0)")
    p.add_argument("--dry-run", action="store_true", help="resolve and print, start nothing")
    local = p.add_argument_group("local run")
    local.add_argument("--steps", type=int, default=None)
    local.add_argument("--seed", type=int, default=None)
    local.add_argument("--resume", action="store_true")
    return p


@dataclass(frozen=True)
class Resolved:
    run: overrides.RunSpec
    model_fit: object  # parallel.plan.ModelFit
    groups: dict[str, dict]
    replaced: list[str]

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides.to_cli(self.groups)]

    def describe(self) -> str:
        run = self.run
        lines = [
            f"DAPO, verl 0.9.1 V1 trainer, mcore_ep actor on {DEVICE_LABELS[run.device]} "
            f"x {run.plan.world}",
            f"plan: {run.plan.describe()}",
            "memory (parallel/ model):",
        ]
        lines += [f"  {line}" for line in run.fit.lines()]
        lines += self._layout_and_warnings()
        lines += ["environment (this process and every Ray worker):"]
        lines += [f"  {k}={v}" for k, v in run.env.items()]
        if self.replaced:
            lines.append(f"replaced by pass-through overrides: {', '.join(self.replaced)}")
        for group, values in self.groups.items():
            lines.append(f"[{group}]")
            lines += [f"  {item}" for item in overrides.to_cli({group: values})]
        lines.append("command: " + " ".join(self.command[:3]) + " <the overrides above>")
        return "\n".join(lines)


    def _layout_and_warnings(self) -> list[str]:
        from parallel.advice import cross_node_warnings, expert_notes
        from parallel.layout import RankLayout
        from parallel.report import layout_summary

        layout = RankLayout(self.run.plan)
        notes = cross_node_warnings(layout) + expert_notes(self.model_fit, overrides.MICRO_BATCH_TOKENS)
        return [layout_summary(layout), "warnings:", *[f"  - {n}" for n in notes]]


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def pick_device(requested: str | None) -> str:
    from backend.device import resolve_device

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


def check_data(train: str, val: str, counts: bool = False) -> None:
    for path, dataset in ((train, data.TRAIN), (val, data.VAL)):
        report = data.check_file(Path(path).expanduser(), dataset, counts=counts)
        if not report.ok:
            raise LaunchError(f"{dataset.name} {report.path}: " + "; ".join(report.problems))


def resolve(args, device: str, extra: list[str]) -> Resolved:
    """Everything checked and decided; nothing started. Raises with one line on misuse."""
    from parallel.models import load_spec
    from parallel.plan import ParallelPlan, PlanError, check_against_model
    from recipes.dapo.fit import fit_rollout

    # a dry run needs no files: the embedded Qwen3-30B-A3B config stands in for --model
    if not args.dry_run:
        _require(args, "model", "train_file", "val_file", "ckpt_dir")
    dims = {d: v if getattr(args, d) is None else getattr(args, d) for d, v in CLUSTER_PLAN.items()}
    if dims["pp"] != 1 or dims["cp"] != 1:
        raise PlanError(
            f"pp={dims['pp']} cp={dims['cp']}: the mcore_ep actor runs pp=1 and cp=1; "
            "scale with --tp and --ep (python -m parallel --auto)"
        )
    plan = ParallelPlan(nodes=args.nodes, devices_per_node=args.devices_per_node, **dims)
    rollout_tp = overrides.DAPO["rollout_tp"]
    if plan.world % rollout_tp:
        raise PlanError(f"{plan.world} devices do not split into vLLM engines of TP {rollout_tp}")
    model = check_model(args.model) if args.model else None
    model_fit = check_against_model(plan, load_spec(str(model) if model else None))
    fit = fit_rollout(model_fit, device, overrides.MICRO_BATCH_TOKENS, rollout_tp)
    if args.train_file and args.val_file:
        check_data(args.train_file, args.val_file)
    if not args.dry_run:  # what only a real launch needs
        from backend.optional import require
        from converters.hf_io import shard_files

        shard_files(model)  # raises CheckpointError naming what is missing
        if device == "npu":
            require("torch_npu", "--device npu")
    ckpt_dir = Path(args.ckpt_dir or "<ckpt-dir>").expanduser()
    env = {**cluster.job_env(device, args.ifname), "TENSORBOARD_DIR": str(ckpt_dir / "tensorboard")}
    run = overrides.RunSpec(
        device,
        plan,
        fit,
        str(model or "<model: not given, Qwen3-30B-A3B config assumed>"),
        str(Path(args.train_file or "<train-file>").expanduser()),
        str(Path(args.val_file or "<val-file>").expanduser()),
        str(ckpt_dir),
        env,
    )
    groups, replaced = overrides.merge(overrides.build(run), extra)
    return Resolved(run, model_fit, groups, replaced)


def local_command(args, extra: list[str]) -> list[str]:
    """The embedded CPU run: recipes.local.dapo with the flags it shares with the cluster run."""
    given = [n for n in CLUSTER_ONLY if getattr(args, n)]
    if given:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise LaunchError(
            f"{flags} configure a cluster run: add --device npu or cuda "
            "(this machine has no accelerator; the local run uses the tiny model)"
        )
    module = "recipes.local.dapo"
    flags = {"--tp": args.tp, "--ep": args.ep, "--steps": args.steps, "--seed": args.seed,
             "--out": args.ckpt_dir}
    switches = ["--resume"] if args.resume else []
    cmd = [sys.executable, "-m", module]
    for flag, value in flags.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + switches + extra


def main(argv: list[str] | None = None) -> int:
    from backend.device import DeviceError
    from backend.optional import MissingDependencyError

    own, extra = split_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        args = build_parser().parse_args(own)
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return int(exit_.code or 0)
    try:
        device = pick_device(args.device)
        if device == "cpu":
            cmd = local_command(args, extra)
            print("local run (no accelerator): " + " ".join(cmd))
            return 0 if args.dry_run else cluster.run_command(cmd, {})
        resolved = resolve(args, device, extra)
        print(resolved.describe())
        if args.dry_run:
            return 0
        stack.check_installed(device)  # the target's package set, before Ray or any model work
        if device == "npu":
            cluster.raise_open_files()
        cluster.check_ray(device, resolved.run.plan.world)
        return cluster.run_command(resolved.command, resolved.run.env)
    except (ValueError, LaunchError, MissingDependencyError, DeviceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
