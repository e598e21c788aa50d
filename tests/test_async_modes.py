"""verl's two async trainer modes with our engine, end to end on CPU (tiny model, a few steps):
`--trainer-mode colocate_async` (partial rollouts across weight updates, on the trainer's
devices) and `--trainer-mode separate_async` (a vLLM engine of its own, fed by the gloo weight
channel, recipes.dapo.weight_channel). The colocate run's checkpoint holds the TransferQueue
state verl unpickles on resume: the launcher's resume check vets it (converters.queue_state)."""

import pytest

from converters.hf_io import CheckpointError
from converters.queue_state import check_queue_state
from recipes.dapo.step_line import LAG_LEGEND
from tests.test_verl_cpu_trainer import STEP_ROW, history, launch

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


def test_the_console_shows_the_lag(separate_run):
    out, proc = separate_run
    shown = proc.stdout.splitlines()
    steps = [s for s in shown if STEP_ROW.match(s)]
    assert len(steps) == 3
    assert LAG_LEGEND in shown
    assert any("| lag " in s for s in steps)


def test_colocate_async_runs_and_its_queue_state_passes_the_resume_check(tmp_path):
    """Bug caught: the async modes' TransferQueue state refused (or passed unchecked) by the
    launcher's resume check, on the state verl really writes. (The resumed launch itself,
    verl restoring the prompt groups into our engine's run, was run by hand: docs/async_modes.md;
    a relaunch here costs two minutes of CI.)"""
    from recipes.dapo import resume

    out = tmp_path / "colocate"
    first = launch(
        out, "--trainer-mode", "colocate_async", "--steps", "2", overrides=("trainer.save_freq=1",)
    )
    assert first.returncode == 0
    assert [r["training/global_step"] for r in rows_of(out)] == [1, 2]
    queue = out / "checkpoints" / "global_step_2" / "transfer_queue"
    assert check_queue_state(queue) >= 2  # genuine state passes the allow-list
    groups = {"trainer": {"trainer.default_local_dir": str(out / "checkpoints"),
                          "trainer.resume_mode": "auto", "trainer.v1.trainer_mode": "colocate_async"}}  # fmt: skip
    assert resume.check_resume(groups, tmp_path) == out / "checkpoints" / "global_step_2"
    storage = next(p for p in queue.rglob("*") if p.is_file())
    storage.write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would run a command
    with pytest.raises(CheckpointError):
        resume.check_resume(groups, tmp_path)
