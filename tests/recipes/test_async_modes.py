"""verl's separate_async trainer mode with our engine, end to end on CPU (tiny model, a few
steps): a vLLM engine of its own, fed by the gloo weight channel (recipes.dapo.engine.weight_channel).
Its checkpoint holds the TransferQueue state verl unpickles on resume: the launcher's resume
check vets it (converters.pickles.queue_state). colocate_async's overrides are tested in
tests/recipes/test_trainer_modes.py; its launch is measured by scripts/bench/launches/async_modes.py, not in CI
(docs/async_modes.md)."""

import pytest

from backend.shared.errors import CheckpointError
from converters.pickles.queue_state import check_queue_state
from recipes.dapo.console.step_line import LAG_LEGEND
from recipes.dapo.job.trainer_modes import DECOUPLED_MODE
from tests.recipes.test_verl_cpu_trainer import STEP_ROW, history, launch

pytestmark = [pytest.mark.slow, pytest.mark.trainer_flow]  # 0.16.1 set only (pyproject.toml)
LAG = "training/off_policy/trajectory_staleness_worst"


def rows_of(out):
    rows = history(out)
    return [rows[s] for s in sorted(rows)]


@pytest.fixture(scope="module")
def separate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("separate_async")
    proc = launch(out, "--trainer-mode", "separate_async", "--steps", "3")
    assert proc.returncode == 0
    return out, proc


def test_separate_async_trains_from_its_own_rollout_fed_over_gloo(separate_run):
    """Bug caught: a channel that sends nothing, or part of the model (the rollout would keep
    generating with its first weights while the lag bookkeeping looked fine)."""
    from safetensors import safe_open

    out, proc = separate_run
    rows = rows_of(out)
    assert [r["training/global_step"] for r in rows] == [1, 2, 3]
    with safe_open(str(out / "export_hf" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        mib = sum(f.get_tensor(n).numel() * 4 for n in names) / 2**20  # fp32 on CPU
    for row in rows:  # after every step, the whole model to the rollout's engine
        assert row["weight_sync/gloo/tensors"] >= len(names) - 1  # a tied head may be one name
        assert row["weight_sync/gloo/mib"] == pytest.approx(mib, rel=0.05)
    # a step is parameter_sync_step (4) mini-batch updates on what the rollout produced
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    # partial rollouts and the lag: the rollout moved on to new weights as they came
    assert max(r[f"{LAG}/max"] for r in rows) >= 1
    assert "export reloads in transformers" in proc.stdout


def test_separate_async_runs_decoupled_ppo_on_our_engine(separate_run):
    """verl's decoupled PPO (recipes.dapo.engine.decoupled): the old-log-prob pass runs on our
    engine each step and TIS weights the update, truncated at 2. Bug caught: the bypass mode
    back (no pass, no IS), or verl's DetachActorWorker refusing mcore_ep at step 1."""
    out, _ = separate_run
    for row in rows_of(out):
        assert row["actor/moe/old_log_prob/tokens"] > 0
        assert 0 < row["rollout_corr/rollout_is_mean"] <= row["rollout_corr/rollout_is_max"] <= 2.0


def test_the_console_shows_the_lag(separate_run):
    out, proc = separate_run
    shown = proc.stdout.splitlines()
    steps = [s for s in shown if STEP_ROW.match(s)]
    assert len(steps) == 3
    assert LAG_LEGEND in shown
    assert any("| lag " in s for s in steps)


def test_the_queue_state_verl_wrote_passes_the_resume_check(separate_run, tmp_path):
    """Bug caught: the async modes' TransferQueue state refused (or passed unchecked) by the
    launcher's resume check, on the state verl really writes. (Resumed launches of both async
    modes ran by hand and in earlier CI: docs/async_modes.md; a relaunch here, or a
    colocate_async launch, costs two to three minutes of CI.)"""
    import shutil

    from recipes.dapo.checkpoints import resume

    out = tmp_path / "copy"
    shutil.copytree(separate_run[0] / "checkpoints", out)
    queue = out / "global_step_3" / "transfer_queue"
    assert check_queue_state(queue) >= 2  # genuine state passes the allow-list
    groups = {"trainer": {"trainer.default_local_dir": str(out), "trainer.resume_mode": "auto",
                          "trainer.v1.trainer_mode": DECOUPLED_MODE}}  # fmt: skip
    assert resume.check_resume(groups, tmp_path) == out / "global_step_3"
    storage = next(p for p in sorted(queue.rglob("*")) if p.is_file())
    storage.write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would run a command
    with pytest.raises(CheckpointError):
        resume.check_resume(groups, tmp_path)
