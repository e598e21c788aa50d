"""The job a RunSpec makes (recipes.launcher.run_spec): verl's overrides, checked.

`resolve`: a cluster run (npu / cuda): offload decided by the memory model at the assumed EP
skew, the model's weights and the data files, the reward its overrides configure.
`resolve_local`: the embedded CPU run on the model --model chose (recipes.launcher.local_model:
tiny, mini or the user's directory), or with --ray-address the same job on that running
cluster, checked as recipes.launcher.local_checks says. Either way a `Resolved` (overrides by
group, verl's command line), the pass-through overrides checked against verl's config
(recipes.launcher.verl_schema), nothing started or written; misuse raises LaunchError with
one line.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

from recipes.dapo.cluster import ray_job
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import actors, overrides, trainer_modes
from recipes.launcher import a2_replay, datasets, dry_run
from recipes.launcher.run_spec import RunSpec
from recipes.launcher.verl_schema import check_overrides
from recipes.local.cpu_overrides import TASKS, cpu_overrides
from recipes.local.cpu_overrides import recompute as cpu_recompute

LOCAL_SAVE_FREQ = 10  # the local run saves every 10 steps


@dataclass(frozen=True)
class Resolved:
    run: overrides.JobSpec
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


def resolve(spec: RunSpec) -> Resolved:
    """A cluster run: its job decided and checked (offload, files, reward, overrides); nothing
    started. Raises with one line on misuse."""
    from recipes.dapo.job.fit import fit_rollout

    plan, device = spec.plan, spec.device
    skew = _assumed_skew(spec.skew_from, plan.ep)
    rollout_tp = overrides.DAPO["rollout_tp"]
    fit = fit_rollout(spec.model_fit, device, overrides.MICRO_BATCH_TOKENS, rollout_tp, skew.value)
    if not spec.dry_run and device == "npu":  # what only a real launch needs
        from backend.platform.optional import require

        require("torch_npu", "--device npu")
    ckpt_dir = spec.ckpt_dir or Path("<ckpt-dir>")
    env = {**ray_job.job_env(device, spec.ifname), "TENSORBOARD_DIR": str(ckpt_dir / "tensorboard")}
    run = overrides.JobSpec(
        device,
        plan,
        fit,
        str(spec.model_dir or "<model: not given, Qwen3-30B-A3B config assumed>"),
        str(spec.train_file or "<train-file>"),
        str(spec.val_file or "<val-file>"),
        str(ckpt_dir),
        env,
        ray_address=spec.ray_address,
        trainer_mode=spec.trainer_mode,
        rollout_nodes=spec.split.rollout_nodes,
        engine=spec.engine,
    )
    built = overrides.build(run)
    if spec.engine == actors.BACKEND:
        # the engine's SkewGuard warns when measured routing exceeds what the verdict assumed
        built["engine"][f"{overrides.ENGINE}.monitor.assumed_ep_skew"] = skew.value
    groups, replaced = overrides.merge(built, list(spec.extra))
    check_overrides(overrides.to_cli(groups), overrides.to_cli(built), list(spec.extra))
    check_mode(spec.trainer_mode, groups)
    a2_replay.check_r3_rollout(device, groups)  # R3 on A2: rollouts vllm-ascend 0.23 cannot record
    check_data(spec.train_file, spec.val_file, groups)  # before Ray: verl scores at step 1
    groups = overrides.name_the_run(groups)
    return Resolved(
        run, spec.model_fit, groups, replaced, dry_run.assumed_skew_lines(spec.model_fit, fit, skew)
    )


def check_mode(mode: str, groups: dict[str, dict]) -> None:
    """The trainer mode against the values the run ends up with (pass-through overrides
    included): trainer_modes.check_values's one line."""
    of = lambda key: overrides.value_of(groups, key)  # noqa: E731
    trainer_modes.check_values(mode, {
        "router_replay": of(f"{overrides.ACTOR}.{overrides.BACKEND}.router_replay"),
        "train_batch": of("data.train_batch_size"),
        "mini_batch": of(f"{overrides.ACTOR}.ppo_mini_batch_size"),
        "sync_step": of(trainer_modes.SYNC_STEP),
        "bypass_mode": of(trainer_modes.BYPASS),
    })  # fmt: skip


def _assumed_skew(report: str | None, ep: int):
    from parallel.skew import default_skew, skew_from_report

    return skew_from_report(report, ep=ep) if report else default_skew()


def resolve_local(spec: RunSpec) -> Resolved:
    """The embedded run: the same overrides on the chosen model and the toy task
    (recipes.local); with --ray-address on that cluster's --nodes x --devices-per-node ranks.
    Checks only: nothing is written (recipes.launcher.local_checks; the launch prepares the
    directory after them)."""
    from recipes.dapo.job.fit import Fit
    from recipes.launcher import local_checks as checks
    from recipes.local import run as local

    out, model = spec.out, spec.local
    data_dir = out / "data"
    fresh = not spec.resume and checks.earlier_run(out)  # the launch moves that run aside
    # memory figures nominal (the CPU rollout reads no memory fraction); offload as on an A2,
    # so verl's offload/onload calls run between rollout and update here too
    fit = Fit(1.0, 0.0, 0.0, 0.0, 0.0, param_offload=True, optimizer_offload=True,
              recompute=cpu_recompute(spec.plan.world))  # fmt: skip
    run = overrides.JobSpec(
        "cpu", spec.plan, fit, str(model.path), str(data_dir / "train.parquet"),
        str(data_dir / "val.parquet"), str(out / "checkpoints"), local.job_env(out, fresh, spec.plan.world),
        steps=spec.steps or TASKS[model.task]["steps"], save_freq=LOCAL_SAVE_FREQ,
        ray_address=spec.ray_address, task=model.task, trainer_mode=spec.trainer_mode,
        rollout_nodes=spec.split.rollout_nodes, engine=spec.engine,
    )  # fmt: skip
    built = overrides.build(run, on_top=cpu_overrides(run))
    groups, replaced = overrides.merge(built, list(spec.extra))
    check_overrides(overrides.to_cli(groups), overrides.to_cli(built), list(spec.extra))
    check_mode(spec.trainer_mode, groups)
    groups = overrides.name_the_run(groups)
    checks.check_rollout_model(model, rollout_tp_of(groups))
    if spec.resume:
        checks.check_resume(groups, out)
    return Resolved(run, None, groups, replaced, model_line=model.describe())


ROLLOUT_TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def rollout_tp_of(groups: dict) -> int:
    """The run's rollout TP (the CPU default or a `--` override), a positive integer."""
    value = overrides.value_of(groups, ROLLOUT_TP_KEY)
    try:
        tp = int(str(value))
    except ValueError:
        tp = 0
    if tp < 1:
        raise LaunchError(f"{ROLLOUT_TP_KEY}={value}: give a positive integer (the CPU run's "
                          "default: 1 up to world 4, world / 2 beyond)")  # fmt: skip
    return tp
