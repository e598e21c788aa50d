"""Resolve and launch the DAPO run (scripts/train_mcore.sh runs `python -m recipes.dapo.launch`).

Cluster run (--device npu|cuda, or the accelerator this machine has): check the plan against
the model (parallel/), the model and data files, the device stack; decide offload with the
memory model; print the resolved config; check `ray status`; start verl's own entry point
(`python -m verl.trainer.main_ppo` + our overrides) on the running Ray cluster, watching its
nodes (recipes.dapo.lost_node).
Local run (no accelerator, or --device cpu): the embedded CPU recipe, whose verl starts its
own Ray; with --ray-address, the same tiny job on that running cluster, through the cluster
run's steps (`ray status` check, job environment, node watch): the one-box rehearsal.
Everything after `--` passes through as verl overrides.
Console (recipes.dapo.console): the child's whole output goes to <run>/logs/launch_NNN.log;
the screen shows a line per trainer step, each distinct warning once, the run-health
alarms and the summary (`--verbose`: every line, as verl prints them).

Exit codes (backend.cli_contract): 0 done (a dry run: resolved), 2 misuse, a missing file or
a checkpoint refused on resume (one line naming it and the fix; the launcher's own checks run
before anything starts, the engine's refusal comes back from the training child with its
traceback in the launch's log; --debug shows the tracebacks on the console: the launcher's and
that one), the training child's own status otherwise (SIGINT / SIGTERM are passed on to it
and it is waited for: 130 / 143 when it ends by them).
"""

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from backend.cli_contract import OneLineParser, parse_or_exit_code, run_cli
from backend.common import DEVICE_LABELS
from recipes.dapo import (
    BACKEND,
    check_actor_cp,
    cluster,
    data,
    lost_node,
    overrides,
    resume,
    stack,
)
from recipes.dapo.cluster import LaunchError

RUN_LABELS = {**DEVICE_LABELS, "cpu": f"{DEVICE_LABELS['cpu']} (tiny Qwen3-MoE)"}
CLUSTER_PLAN = {"tp": 4, "ep": 8, "etp": 1, "pp": 1, "cp": 1}
CLUSTER_ONLY = ("model", "train_file", "val_file", "ifname", "etp", "cp", "skew_from")
LOCAL_ONLY = ("steps", "seed", "resume")
LOCAL_OUT, LOCAL_STEPS, LOCAL_SAVE_FREQ = "runs/local_dapo", 35, 10


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="scripts/train_mcore.sh",
        description=__doc__.splitlines()[0],
        epilog="verl overrides go after `--`, e.g. -- trainer.total_epochs=2",
    )
    plan = p.add_argument_group("parallel plan (cluster default: tp 4, ep 8, etp 1, pp 1, cp 1)")
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
    p.add_argument("--model", help="HF checkpoint dir of Qwen3-30B-A3B (config.json + safetensors)")
    p.add_argument(
        "--train-file", help=f"{data.TRAIN.filename} (scripts/prepare_data.py checks it)"
    )
    p.add_argument("--val-file", help=f"{data.VAL.filename}")
    p.add_argument(
        "--ckpt-dir", help="checkpoints and logs (shared filesystem); local run: its --out"
    )
    p.add_argument("--ifname", help="network interface for HCCL/NCCL and gloo (e.g. eth0)")
    p.add_argument(
        "--ray-address",
        metavar="HEAD_IP:PORT",
        help="the running Ray cluster (ray_start_head.sh prints it); default: the one Ray finds "
        "from this node. --device cpu: run the tiny job on it instead of the embedded run",
    )
    p.add_argument("--dry-run", action="store_true", help="resolve and print, start nothing")
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
        "local run (CPU only; a cluster run takes verl overrides after --)"
    )
    local.add_argument("--steps", type=int, default=None, help="training steps")
    local.add_argument("--seed", type=int, default=None, help="random seed")
    local.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --ckpt-dir"
    )
    return p


@dataclass(frozen=True)
class Resolved:
    run: overrides.RunSpec
    model_fit: object  # parallel.plan.ModelFit
    groups: dict[str, dict]
    replaced: list[str]
    skew_lines: tuple[str, ...] = ()  # parallel.skew: verdict at the assumed EP skew, margin

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides.to_cli(self.groups)]

    def describe(self) -> str:
        run = self.run
        lines = [
            f"DAPO, verl 0.9.1 V1 trainer, mcore_ep actor on {RUN_LABELS[run.device]} "
            f"x {run.plan.world}",
            f"plan: {run.plan.describe()}",
        ]
        if self.model_fit is not None:  # the memory model is for accelerators
            lines += ["memory (parallel/ model):", *[f"  {line}" for line in run.fit.lines()]]
            lines += [f"  {line}" for line in self.skew_lines]
            lines += self._layout_and_warnings()
            lines += ["traffic besides forward and backward (parallel/):"]
            lines += [f"  {line}" for line in self._traffic_lines()]
        lines += stack.describe(run.device)  # npu: which A2 set is installed, R3 there
        lines += replay_lines(self.groups, run.device)
        lines.append(f"Ray: {ray_line(run)}")
        lines += ["environment (this process and every Ray worker):"]
        lines += [f"  {k}={v}" for k, v in run.env.items()]
        if self.replaced:
            lines.append(f"replaced by pass-through overrides: {', '.join(self.replaced)}")
        for group, values in self.groups.items():
            lines.append(f"[{group}]")
            lines += [f"  {item}" for item in overrides.to_cli({group: values})]
        lines.append("command: " + " ".join(self.command[:3]) + " <the overrides above>")
        return "\n".join(lines)

    def _traffic_lines(self) -> list[str]:
        """Routes per batch, the checkpoint per save, one weight sync (the DAPO settings)."""
        from parallel.traffic import route_lines, save_size
        from parallel.weight_sync import DEFAULT_BUCKET_MB, LINKS, sync_cost

        spec, plan, dapo = self.model_fit.spec, self.run.plan, overrides.DAPO
        samples = [dapo[k] * dapo["n"] for k in ("train_batch_size", "gen_batch_size")]
        lines = route_lines(spec, *samples, overrides.MEAN_SAMPLE_TOKENS, plan.pp)
        every = overrides.value_of(self.groups, "trainer.save_freq")
        lines += save_size(spec, plan.world).lines(int(every))
        mb = overrides.value_of(
            self.groups, f"actor_rollout_ref.actor.{BACKEND}.weight_sync_bucket_mb"
        )
        bucket = int(float(DEFAULT_BUCKET_MB if mb is None else mb) * 2**20)
        links = LINKS[self.run.device]
        return lines + sync_cost(spec, plan, bucket, links).lines(links, bucket)

    def _layout_and_warnings(self) -> list[str]:
        from parallel.advice import cross_node_warnings, expert_notes, expert_warnings, listed
        from parallel.layout import RankLayout
        from parallel.report import layout_summary

        layout = RankLayout(self.run.plan)
        tokens = overrides.MICRO_BATCH_TOKENS
        warnings = cross_node_warnings(layout) + expert_warnings(self.model_fit, tokens)
        return [
            layout_summary(layout),
            *listed("notes", expert_notes(self.model_fit, tokens)),
            *listed("warnings", warnings),
        ]


R3_ROLLOUT = {
    "cuda": "vLLM >= 0.22 (enable_return_routed_experts); the cuda set has vllm 0.24.0",
    "npu": "vLLM >= 0.22 with a vllm-ascend built for it; per A2 set: the stack lines above",
    "cpu": (
        "vLLM's CPU build returns them (recipes/local/vllm_layers.py reports the CPU MoE "
        "kernel's experts)"
    ),
}


def ray_line(run: overrides.RunSpec) -> str:
    if run.ray_address:
        return f"the running cluster at {run.ray_address} (--ray-address)"
    if run.device == "cpu":
        return "a new one, started by verl's ray.init() for this run (the embedded run)"
    return "the running cluster Ray finds from this node (ray status; --ray-address to name it)"


def replay_lines(groups: dict[str, dict], device: str) -> list[str]:
    """What routing replay needs from the rollout (printed by the dry run)."""
    mode = str(
        overrides.value_of(groups, f"actor_rollout_ref.actor.{BACKEND}.router_replay") or "disabled"
    )
    if mode == "disabled":
        return []
    lines = [f"routing replay: {mode} (docs/routing_replay.md)"]
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    on = str(overrides.value_of(groups, key)).lower() == "true"
    if mode == "R3":
        source = R3_ROLLOUT[device]
        lines.append(f"  R3 needs the rollout's routed_experts: {source}")
        if not on:
            lines.append(f"  warning: set {key}=True, or the first step stops without routes")
    elif on:
        lines.append(f"  warning: R2 records its own routes: verl refuses {key}=True with R2")
    return lines


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


def check_data(train: str | None, val: str | None, groups: dict, counts: bool = False) -> None:
    """Each data file given (a dry run may give either or none), its data_source values
    against the reward these overrides configure."""
    given = [(p, d) for p, d in ((train, data.TRAIN), (val, data.VAL)) if p is not None]
    scorer = reward_scorer(groups) if given else None
    for path, dataset in given:
        report = data.check_file(Path(path).expanduser(), dataset, counts=counts, scorer=scorer)
        if not report.ok:
            raise LaunchError(f"{dataset.name} {report.path}: " + "; ".join(report.problems))


def reward_scorer(groups: dict):
    """The scoring function verl's reward manager will use (data.check_file's `scorer`): None
    for a custom_reward_function (it scores every data_source), else verl's default one."""
    custom = overrides.value_of(groups, "reward.custom_reward_function.path")
    if custom not in (None, "", "null"):
        if not (cluster.REPO / Path(str(custom)).expanduser()).is_file():
            raise LaunchError(
                f"reward.custom_reward_function.path {custom} does not exist: pass the file "
                "that defines the reward function (relative paths start at the repository)"
            )
        return None
    manager = overrides.value_of(groups, "reward.reward_manager.name") or data.DAPO_MANAGER
    return data.default_scorer(str(manager))


def resolve(args, device: str, extra: list[str]) -> Resolved:
    """Everything checked and decided; nothing started. Raises with one line on misuse."""
    from parallel.models import load_spec
    from parallel.plan import PlanError, plan_for_model
    from recipes.dapo.fit import fit_rollout

    local = [f"--{n}" for n in LOCAL_ONLY if getattr(args, n) not in (None, False)]
    if local:
        raise LaunchError(
            f"{', '.join(local)} configure the local CPU run, not a {device} cluster run: "
            "drop them (pass verl overrides after --, e.g. -- trainer.total_training_steps=N)"
        )
    # a dry run needs no files: the embedded Qwen3-30B-A3B config stands in for --model
    if not args.dry_run:
        _require(args, "model", "train_file", "val_file", "ckpt_dir")
    dims = {d: v if getattr(args, d) is None else getattr(args, d) for d, v in CLUSTER_PLAN.items()}
    check_actor_cp(dims["cp"])
    model = check_model(args.model) if args.model else None
    spec = load_spec(str(model) if model else None)
    model_fit = plan_for_model(
        spec, args.nodes, args.devices_per_node, **dims
    )  # model reasons first
    plan = model_fit.plan
    rollout_tp = overrides.DAPO["rollout_tp"]
    if plan.world % rollout_tp:
        raise PlanError(f"{plan.world} devices do not split into vLLM engines of TP {rollout_tp}")
    skew = _assumed_skew(args.skew_from)
    fit = fit_rollout(model_fit, device, overrides.MICRO_BATCH_TOKENS, rollout_tp, skew.value)
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
        ray_address=args.ray_address,
    )
    built = overrides.build(run)
    # the engine's SkewGuard warns when measured routing exceeds what the verdict assumed
    built["engine"][f"{overrides.ENGINE}.monitor.assumed_ep_skew"] = skew.value
    groups, replaced = overrides.merge(built, extra)
    check_data(args.train_file, args.val_file, groups)  # before Ray: verl scores at step 1
    groups = overrides.name_the_run(groups)
    return Resolved(run, model_fit, groups, replaced, _skew_lines(model_fit, fit, skew))


def _assumed_skew(report: str | None):
    from parallel.skew import default_skew, skew_from_report

    return skew_from_report(report) if report else default_skew()


def _skew_lines(model_fit, fit, skew) -> tuple[str, ...]:
    """The actor update at the assumed EP skew (report, or the default), and the skew margin."""
    from parallel.memory import MemoryOptions
    from parallel.skew import skew_lines

    options = MemoryOptions(
        fit.device_gib,
        overrides.MICRO_BATCH_TOKENS,
        recompute=fit.recompute,
        offload_params=fit.param_offload,
        offload_optimizer=fit.optimizer_offload,
    )
    return tuple(skew_lines(model_fit, options, skew))


def resolve_local(args, extra: list[str]) -> tuple[Resolved, Path, Path]:
    """The embedded run: the same overrides on the tiny model and task (recipes.local); with
    --ray-address on that cluster's --nodes x --devices-per-node ranks."""
    from parallel.plan import ParallelPlan
    from recipes.dapo.fit import Fit
    from recipes.local import run as local
    from recipes.local.tiny_model import TINY_QWEN3_MOE

    given = [n for n in CLUSTER_ONLY if getattr(args, n)]
    if given:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise LaunchError(
            f"{flags} configure a cluster run: add --device npu or cuda "
            "(this machine has no accelerator; the local run uses the tiny model)"
        )
    tp, ep, pp = args.tp or 1, args.ep or 1, args.pp or 1
    layers = TINY_QWEN3_MOE["num_hidden_layers"]
    if layers % pp:
        raise LaunchError(f"--pp {pp} does not divide the tiny model's {layers} layers: use 1 or 2")
    nodes, per_node = _local_layout(args, tp, ep, pp)
    plan = ParallelPlan(nodes=nodes, devices_per_node=per_node, tp=tp, ep=ep, pp=pp)
    out = Path(args.ckpt_dir or LOCAL_OUT).expanduser().absolute()
    if not args.resume and not args.dry_run:
        _start_over(out)
    hf_dir, files = local.prepare(out, seed=args.seed or 0)
    # memory figures nominal (the CPU rollout reads no memory fraction); offload as on an A2,
    # so verl's offload/onload calls run between rollout and update here too
    fit = Fit(1.0, 0.0, 0.0, 0.0, 0.0, param_offload=True, optimizer_offload=True)
    run = overrides.RunSpec(
        "cpu", plan, fit, str(hf_dir), str(files["train"]), str(files["val"]),
        str(out / "checkpoints"), local.job_env(out),
        steps=args.steps or LOCAL_STEPS, save_freq=LOCAL_SAVE_FREQ, ray_address=args.ray_address,
    )  # fmt: skip
    groups, replaced = overrides.merge(overrides.build(run), extra)
    groups = overrides.name_the_run(groups)
    _check_cpu_rollout_model(Path(str(overrides.value_of(groups, "actor_rollout_ref.model.path"))))
    return Resolved(run, None, groups, replaced), out, hf_dir


def _local_layout(args, tp: int, ep: int, pp: int) -> tuple[int, int]:
    """(nodes, ranks per node): the cluster's with --ray-address; else one node of the
    smallest dp that lets the experts fold over the ranks."""
    import math

    if args.ray_address:
        return args.nodes, args.devices_per_node
    return 1, math.lcm(tp, ep) * pp


def _check_cpu_rollout_model(model: Path) -> None:
    """The model the local run serves with vLLM's CPU backend: its limits, one line each."""
    from recipes.local.cpu_limits import problems
    from recipes.local.overrides import ROLLOUT_TP

    found = problems(model, ROLLOUT_TP)
    if found:
        raise LaunchError(found[0])


def _start_over(out: Path) -> None:
    """A fresh run in a used directory: its checkpoints would be resumed (resume_mode=auto)."""
    import shutil

    old = [out / "checkpoints", out / "metrics", out / "tensorboard", out / "logs",
           out / "alarms.jsonl"]  # fmt: skip
    if any(p.exists() for p in old):
        print(f"starting over in {out} (add --resume to continue the run there)")
        for p in old:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def run(args, extra: list[str]) -> int:
    device = pick_device(args.device)
    t0 = time.perf_counter()
    if device == "cpu":
        resolved, out, hf_dir = resolve_local(args, extra)
    else:
        resolved = resolve(args, device, extra)
    if args.dry_run:
        print(resolved.describe())
        return 0
    stack.check_installed(device)  # the target's package set, before Ray or any model work
    settle_resume(resolved.groups)  # what verl will resume from and unpickle, first
    if device == "npu":
        cluster.raise_open_files()
    env, watch = resolved.run.env, None
    if device != "cpu" or args.ray_address:  # a running cluster: the same steps on every device
        cluster.check_ray(device, resolved.run.plan.world, args.ray_address, env)
        watch = lost_node.NodeWatch(args.ray_address, env)
    if device == "cpu":
        from recipes.local.run import run as run_local

        return run_local(resolved, out, hf_dir, t0, verbose=args.verbose, debug=args.debug,
                         watch=watch)  # fmt: skip
    return run_cluster(resolved, args.verbose, args.debug, watch)


def run_cluster(resolved: Resolved, verbose: bool, debug: bool = False, watch=None) -> int:
    """verl's entry point through the console, watching the cluster's nodes (`watch`,
    recipes.dapo.lost_node); then the routing report with the alarms. A checkpoint the engine
    refused raises its CheckpointError (recipes.dapo.cluster)."""
    from recipes.dapo.console import next_index, open_console
    from recipes.dapo.health import latest_actor_checkpoint, routing_report

    run_dir = Path(resolved.run.ckpt_dir)
    console = open_console(run_dir, next_index(run_dir / "logs"), verbose, None,
                           resolved.run.env.get("TENSORBOARD_DIR"), debug=debug)  # fmt: skip
    try:
        console.header(resolved.describe())
        code = cluster.run_command(resolved.command, resolved.run.env, console, watch)
        actor = latest_actor_checkpoint(run_dir) if code == 0 else None
        with console.capture():
            written = routing_report(actor / "moe_report.json", run_dir) if actor else {}
    finally:
        console.close()
    for name, path in written.items():
        print(f"{name}: {path}")
    resume_hint = "relaunch the same command (trainer.resume_mode=auto resumes it)"
    lost = lost_node.failure_line(watch, resolved.run.ckpt_dir, resume_hint) if code else None
    if lost:
        print(lost, file=sys.stderr)
    return code


def settle_resume(groups: dict[str, dict]) -> None:
    """The checkpoint verl will resume from: a complete one (a line says which, when a
    stopped run left one half written), and what verl will unpickle, checked."""
    note = resume.settle_unfinished(groups, cluster.REPO)
    if note:
        print(note)
    resume.check_resume(groups, cluster.REPO)


def main(argv: list[str] | None = None) -> int:
    from backend.device import DeviceError
    from backend.optional import MissingDependencyError

    own, extra = split_argv(list(sys.argv[1:] if argv is None else argv))
    args = parse_or_exit_code(build_parser(), own)
    if isinstance(args, int):  # --help, or a usage error already printed in one line
        return args
    return run_cli(
        lambda: run(args, extra),
        debug=args.debug,
        user_errors=(ValueError, LaunchError, MissingDependencyError, DeviceError),
        interrupted="nothing was started",
    )


if __name__ == "__main__":
    raise SystemExit(main())
