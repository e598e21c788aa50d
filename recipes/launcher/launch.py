"""Resolve and launch the DAPO run (scripts/train_mcore.sh runs `python -m recipes.launcher`).

The flags are parsed (recipes.launcher.arguments) and validated once into a RunSpec
(recipes.launcher.run_spec: device, plan against the model, mode, engine); everything below
reads that object.

Cluster run (--device npu|cuda, or the accelerator this machine has): check the plan against
the model (parallel/), the model and data files, the device stack; decide offload with the
memory model; print the resolved config; check `ray status`; start verl's own entry point
(`python -m verl.trainer.main_ppo` + our overrides) on the running Ray cluster, watching its
nodes (recipes.dapo.cluster.lost_node).
Local run (no accelerator, or --device cpu): the embedded CPU recipe, whose verl starts its
own Ray, on the model --model chose (recipes.launcher.local_model); with --ray-address, the
same job on that running cluster, through the cluster run's steps (`ray status` check, job
environment, node watch): the one-box rehearsal. Its directory is written only once every
check passed (`prepare_local`): an earlier run there is moved to <dir>.<UTC timestamp> without --resume (recipes.launcher.local_checks), never deleted.
Everything after `--` passes through as verl overrides.
This module runs the resolved job (verl's trainer through the console, the resume it will
take, the lost-node watch); the job a RunSpec makes is recipes.launcher.resolution's, the
printed config recipes.launcher.dry_run's.
Console (recipes.dapo.console.screen): the child's whole output goes to <run>/logs/launch_NNN.log;
the screen shows a line per trainer step, each distinct warning once, the run-health
alarms and the summary (`--verbose`: every line, as verl prints them).

Exit codes (backend.shared.cli_contract): 0 done (a dry run: resolved), 2 misuse, a missing file or
a checkpoint refused on resume (one line naming it and the fix; the launcher's own checks run
before anything starts, the engine's refusal comes back from the training child with its
traceback in the launch's log; --debug shows the tracebacks on the console: the launcher's and
that one), the training child's own status otherwise (SIGINT / SIGTERM are passed on to it
and it is waited for: 130 / 143 when it ends by them).
"""

import sys
import time
from pathlib import Path

from backend.shared.cli_contract import parse_or_exit_code, run_cli
from recipes.dapo.checkpoints import resume
from recipes.dapo.checkpoints.files import ACTOR
from recipes.dapo.cluster import lost_node, ray_job
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import overrides
from recipes.launcher import local_checks, run_spec, stack
from recipes.launcher.arguments import build_parser, split_argv
from recipes.launcher.resolution import Resolved, resolve, resolve_local
from recipes.launcher.run_spec import RunSpec


def run(spec: RunSpec) -> int:
    t0 = launched_at()  # the run's wall time and start-up lines count from here
    resolved = resolve_local(spec) if spec.is_local else resolve(spec)
    if spec.dry_run:  # writes nothing
        print(resolved.describe())
        if spec.is_local and not spec.resume and local_checks.earlier_run(spec.out):
            print(local_checks.would_set_aside(spec.out))
        return 0
    stack.check_installed(spec.device)  # the target's package set, before Ray or any model work
    prepared_s = prepare_local(spec) if spec.is_local else 0.0
    settle_resume(resolved.groups)  # what verl will resume from and unpickle, first
    if spec.device == "npu":
        ray_job.raise_open_files()
    env, watch = resolved.run.env, None
    if not spec.is_local or spec.ray_address:  # a running cluster: the same steps everywhere
        devices = spec.plan.world + spec.split.rollout_devices
        ray_job.check_ray(spec.device, devices, spec.ray_address, env)
        watch = lost_node.NodeWatch(spec.ray_address, env)
    if spec.is_local:
        from recipes.local.run import run as run_local

        return run_local(resolved, spec.out, t0, verbose=spec.verbose, debug=spec.debug,
                         watch=watch, prepared_s=prepared_s)  # fmt: skip
    return run_cluster(resolved, spec.verbose, spec.debug, watch, started=t0)


def launched_at() -> float:
    """When this process started, on time.perf_counter's clock (Linux: /proc/self/stat's
    start time against /proc/uptime), so that the wall time includes Python's start and the
    launcher's imports; now where that is not known."""
    import os

    now = time.perf_counter()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(age, 0.0), 3600.0)


def prepare_local(spec: RunSpec) -> float:
    """The local run's directory, once every check passed: an earlier run there moved aside
    (without --resume; never deleted), then the model (tiny / mini: built once, the mini
    one's warm-up too; a directory: used in place) and data made. Returns its seconds."""
    from recipes.local.run import prepare

    t0 = time.perf_counter()
    out = spec.out
    if not spec.resume and local_checks.earlier_run(out):
        print(local_checks.set_aside_line(out, local_checks.set_aside(out)))
    prepare(
        out,
        seed=spec.seed or 0,
        model=spec.local.name,
        warmup_steps=spec.warmup_steps,
        task=spec.local.task,
    )
    return time.perf_counter() - t0


def run_cluster(resolved: Resolved, verbose: bool, debug: bool = False, watch=None,
                started: float | None = None) -> int:  # fmt: skip
    """verl's entry point through the console, watching the cluster's nodes (`watch`,
    recipes.dapo.cluster.lost_node); then the routing report with the alarms. A checkpoint the engine
    refused raises its CheckpointError (recipes.dapo.cluster.ray_job). The driver and what it started
    on this machine end with the run (recipes.dapo.cluster.run_scope). started: the launcher's start
    (launched_at), whence the console's start-up lines count."""
    from recipes.dapo.cluster.run_scope import RunScope
    from recipes.dapo.console.health_report import latest_actor_checkpoint, routing_report
    from recipes.dapo.console.screen import next_index, open_console

    run_dir = Path(resolved.run.ckpt_dir)
    console = open_console(run_dir, next_index(run_dir / "logs"), verbose, None,
                           resolved.run.env.get("TENSORBOARD_DIR"), debug=debug,
                           device=resolved.run.device, started=started)  # fmt: skip
    try:
        console.header(resolved.describe())
        with RunScope(run_dir / "logs") as scope:  # the driver's processes end with the run
            console.log.write(f"run id: {scope.id} (temp dir {scope.tmp}; {scope.log})\n")
            env = {**resolved.run.env, **scope.env}
            code = ray_job.run_command(resolved.command, env, console, watch)
        actor = latest_actor_checkpoint(run_dir) if code == 0 else None
        with console.capture():
            written = routing_report(actor / "moe_report.json", run_dir) if actor else {}
    finally:
        console.close()
    for name, path in written.items():
        print(f"{name}: {path}")
    resume_hint = "relaunch the same command (trainer.resume_mode=auto resumes it)"
    lost = (
        (console.oom.failure_line(resolved.run.ckpt_dir, resume_hint) if code else None)
        or ray_job.interrupted_line(code, resolved.run.ckpt_dir)
        or (lost_node.failure_line(watch, resolved.run.ckpt_dir, resume_hint) if code else None)
    )
    if lost or code:  # a stop by signal: interrupted_line; a failure: its cause
        print(lost or console.failure_line(code), file=sys.stderr)
    return code


def settle_resume(groups: dict[str, dict]) -> None:
    """The checkpoint verl will resume from: a complete one (a line says which, when a
    stopped run left one half written), and what verl will unpickle, checked; the engine is
    told which, to check its bytes when it starts rather than after the rollout's start-up."""
    note = resume.settle_unfinished(groups, ray_job.REPO)
    if note:
        print(note)
    step_dir = resume.check_resume(groups, ray_job.REPO)
    if step_dir is not None and not note:  # the note names it where one was half written
        print(resume.resuming_line(step_dir))
    if step_dir is not None and overrides.runs_ours(groups):
        key = f"{overrides.ENGINE}.resume_from"
        groups["engine"][key] = str((step_dir / ACTOR).resolve())


def main(argv: list[str] | None = None) -> int:
    from backend.platform.device import DeviceError
    from backend.platform.optional import MissingDependencyError

    own, extra = split_argv(list(sys.argv[1:] if argv is None else argv))
    args = parse_or_exit_code(build_parser(), own)
    if isinstance(args, int):  # --help, or a usage error already printed in one line
        return args
    return run_cli(  # the arguments are read once, into a RunSpec; nothing after reads args
        lambda: run(run_spec.from_args(args, extra)),
        debug=args.debug,
        user_errors=(ValueError, LaunchError, MissingDependencyError, DeviceError),
        interrupted="nothing was started",
    )


if __name__ == "__main__":
    raise SystemExit(main())
