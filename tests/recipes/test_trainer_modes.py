"""`--trainer-mode`: what each of verl's V1 modes sets, the split and estimate the dry run
prints, the refusals before Ray, and the lag on the console (recipes.dapo.job.trainer_modes)."""

import io

import pytest

from recipes.dapo.console.screen import Console
from recipes.dapo.console.step_line import LAG_LEGEND, lag_parts, step_line
from recipes.dapo.errors import LaunchError
from recipes.dapo.job import overrides, trainer_modes
from recipes.launcher import launch, resolution
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def resolved(argv: list[str], extra: list[str] = ()):
    spec = spec_of([*argv, "--dry-run", "--", *extra])
    return resolution.resolve_local(spec) if spec.is_local else resolution.resolve(spec)


def cli(res) -> dict[str, str]:
    return dict(item.split("=", 1) for item in overrides.to_cli(res.groups))


@pytest.mark.parametrize("device, channel", [("npu", "hccl"), ("cuda", "nccl")])
def test_separate_async_on_the_cluster_gives_the_rollout_half_the_nodes(device, channel):
    """Bug caught: the trainer's plan laid over all 32 devices while the rollout takes 16 of
    them (verl would place both on the same nodes), or the channel of the other vendor."""
    res = resolved(["--device", device, "--trainer-mode", "separate_async"])
    assert (res.run.plan.world, res.run.plan.nodes, res.run.rollout_nodes) == (16, 2, 2)
    kv = cli(res)
    # verl's separate_async trainer under our name (decoupled PPO with mcore_ep), its section
    # an alias of verl's, its module imported by verl in every process of the job
    assert kv["trainer.v1.trainer_mode"] == trainer_modes.DECOUPLED_MODE
    assert kv[f"+trainer.v1.{trainer_modes.DECOUPLED_MODE}"] == "${trainer.v1.separate_async}"
    env = f"+ray_kwargs.ray_init.runtime_env.env_vars.{trainer_modes.MODULES_ENV}"
    assert kv[env] == f"'{trainer_modes.DECOUPLED_MODULE}'"  # quoted: Ray wants a str
    assert kv["trainer.nnodes"] == "2"
    assert (
        kv["actor_rollout_ref.rollout.nnodes"],
        kv["actor_rollout_ref.rollout.n_gpus_per_node"],
    ) == ("2", "8")
    assert kv["actor_rollout_ref.rollout.checkpoint_engine.backend"] == channel
    # the DAPO step is one mini-batch: verl's assert train_batch = sync step x mini-batch
    assert kv[trainer_modes.SYNC_STEP] == "1"
    assert kv["algorithm.rollout_correction.bypass_mode"] == "false"  # decoupled
    assert kv["algorithm.rollout_correction.rollout_is"] == "token"  # applied in decoupled mode
    assert "global_counts:counting_pass" in kv[f"{overrides.ENGINE}.aux_loss"]
    text = res.describe()
    assert (
        f"devices: trainer 2 x 8, rollout 2 x 8 (its own vLLM engines); weights over {channel}"
        in text
    )
    assert "old log-probs: recomputed with the cycle's first weights (decoupled PPO" in text
    assert "rollout devices: 8 vLLM engines of TP 2" in text
    # the seed's phases: full overlap 310.6 / 161.7; on half the devices each, no gain
    assert "bounds it at 161.7 s (1.92x)" in text
    assert "max(gen 323.4, train 314.8) = 323.4 s (0.96x)" in text


def test_the_embedded_run_adds_one_rollout_device_and_the_gloo_channel(tmp_path):
    res = resolved(
        ["--model", "tiny", "--ckpt-dir", str(tmp_path), "--trainer-mode", "separate_async"]
    )
    kv = cli(res)
    assert kv["+ray_kwargs.ray_init.num_gpus"] == "2"  # the trainer's rank and vLLM's engine
    # the CPU platform's module first (verl imports them in order), then the trainer's
    env = f"+ray_kwargs.ray_init.runtime_env.env_vars.{trainer_modes.MODULES_ENV}"
    assert kv[env] == f"'recipes.local.cpu.platform,{trainer_modes.DECOUPLED_MODULE}'"
    assert kv["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "gloo"
    assert (
        kv["actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"]
        == trainer_modes.CPU_CHANNEL_MODULE
    )
    assert kv[trainer_modes.SYNC_STEP] == "4"  # the toy's 8 prompts in mini-batches of 2
    # the engine counts trainer steps from verl's own key (the last save returns sealed)
    assert (
        kv[f"{overrides.ENGINE}.updates_per_step"]
        == "${trainer.v1.separate_async.parameter_sync_step}"
    )


def test_sync_stays_as_it_was_and_colocate_adds_only_the_mode_and_tis(tmp_path):
    """Bug caught: an async key leaking into the default sync run."""
    base = ["--model", "tiny", "--ckpt-dir", str(tmp_path)]
    sync, colocate = resolved(base), resolved([*base, "--trainer-mode", "colocate_async"])
    assert "trainer_mode" not in sync.groups and cli(sync)["trainer.v1.trainer_mode"] == "sync"
    assert "rollout_correction" not in " ".join(cli(sync))
    assert (
        sync.describe().splitlines()[3]
        == "trainer mode: sync (generate, then train, on the same devices)"
    )
    added = set(cli(colocate)) - set(cli(sync))
    assert added == {
        "algorithm.rollout_correction.rollout_is",
        "algorithm.rollout_correction.rollout_is_threshold",
    }
    assert cli(colocate)["trainer.v1.trainer_mode"] == "colocate_async"


@pytest.mark.parametrize(
    "argv, extra, message",
    [
        (
            ["--device", "npu", "--nodes", "1"],
            [],
            "needs whole nodes for the rollout and the trainer: --nodes 1 has one",
        ),
        (
            ["--model", "tiny"],
            [
                "+actor_rollout_ref.actor.mcore_ep.router_replay=R2",
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "router_replay R2 records routes in the old-log-prob pass, which separate_async "
            "skips in bypass mode",
        ),
        (
            ["--model", "tiny"],
            ["data.train_batch_size=6"],
            "train_batch_size 6 != parameter_sync_step 4 x ppo_mini_batch_size 2 (verl asserts it): "
            "set trainer.v1.separate_async.parameter_sync_step=3",
        ),
    ],
)
def test_a_separate_async_that_cannot_work_is_refused_in_one_line(argv, extra, message, tmp_path):
    argv = [*argv, "--trainer-mode", "separate_async"]
    if "--model" in argv:
        argv += ["--ckpt-dir", str(tmp_path)]
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolved(argv, extra)


def test_r2_runs_in_separate_async_with_decoupled_ppo(tmp_path):
    """Decoupled PPO runs the old-log-prob pass that records R2's routes: accepted."""
    argv = ["--model", "tiny", "--ckpt-dir", str(tmp_path), "--trainer-mode", "separate_async"]
    res = resolved(argv, ["+actor_rollout_ref.actor.mcore_ep.router_replay=R2"])
    assert cli(res)["algorithm.rollout_correction.bypass_mode"] == "false"


def test_the_launcher_exits_2_with_the_line(capsys):
    assert (
        launch.main(
            ["--device", "cuda", "--nodes", "1", "--trainer-mode", "separate_async", "--dry-run"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: --trainer-mode separate_async needs whole nodes"
    )


LAG = "training/off_policy/trajectory_staleness_worst"
SPANS = "training/off_policy/trajectory_spans/mean"
SPANS_MAX = "training/off_policy/trajectory_spans/max"


def test_the_step_line_shows_the_lag_of_off_policy_steps_only():
    """Bug caught: a sync run's line cluttered with lag 0/0, or an async one's lag hidden."""
    assert lag_parts({f"{LAG}/mean": 0.0, f"{LAG}/max": 0, SPANS: 1.0}) == []  # on-policy
    off = {f"{LAG}/mean": 0.25, f"{LAG}/max": 1, SPANS: 1.125, SPANS_MAX: 2, "timing_s/step": 7.0}
    # no response spans more than two versions: 1 in 8 spanned an update, exactly
    assert lag_parts(off) == ["lag 0.25/1", "spans 12%"]
    assert step_line(3, 4, off) == "[###############.....] 3/4 | lag 0.25/1 | spans 12% | 7.0s"
    assert lag_parts(off | {SPANS_MAX: 3}) == ["lag 0.25/1", "spans 1.12v"]  # a mean, then


def test_the_console_explains_the_lag_once_at_the_first_off_policy_step(tmp_path):
    out = io.StringIO()
    log = tmp_path / "run.log"
    con = Console(log.open("w", buffering=1), log, out=out, total_steps=3)
    for step, most in ((1, 0), (2, 1), (3, 1)):
        con.feed(
            f"step:{step} - {LAG}/mean:np.float64({most / 2}) - {LAG}/max:np.int64({most}) - {SPANS}:1.0\n"
        )
    shown = out.getvalue().splitlines()
    assert shown.count(LAG_LEGEND) == 1
    assert shown.index(LAG_LEGEND) == shown.index(next(s for s in shown if "2/3" in s)) - 1


def test_the_dry_run_says_when_tis_is_turned_off(tmp_path):
    """colocate_async without its TIS (`-- algorithm.rollout_correction.rollout_is=null`, the
    ranking's "no correction" arm): the dry run says no correction, not TIS. Bug caught: the
    mode's line naming TIS from the mode alone while verl's config has none."""
    base = ["--model", "tiny", "--ckpt-dir", str(tmp_path), "--trainer-mode", "colocate_async"]
    with_tis = resolved(base).describe()
    without = resolved(base, ["algorithm.rollout_correction.rollout_is=null"]).describe()
    assert "trainer mode: colocate_async, rollout correction TIS (token, weights <= 2)" in with_tis
    assert "trainer mode: colocate_async, rollout correction none (rollout_is=null" in without
