"""scripts/bench/launches/mode_ranking.py: which runs it launches (only those not done, at most
--max-runs), each arm's command, and the reduction into the ranking's tables and plot (the
launches are the main job's; their figures go to docs/async_modes.md, not into tests)."""

import json
from pathlib import Path

import pytest

from scripts.bench.launches import mode_ranking as mr
from tests.scripts.test_async_modes_bench import write_run

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)
VAL, ACC = "val-aux/math_dapo/reward/mean@8", "val-core/math_dapo/acc/mean@8"


def finished_run(path: Path, accs: list[float], score: float = 0.5) -> None:
    """A run of 40 steps validated every 5 (accuracy accs[k] at step 5k, its reward
    2 accs[k] - 1), with its summary written."""
    rows = []
    for step in range(41):
        acc = accs[step // 5]
        row = {"step": step} | ({VAL: 2 * acc - 1, ACC: acc} if step % 5 == 0 else {})
        if step:
            row |= {"timing_s/step": 15.0, "critic/score/mean": score, "actor/entropy": 0.2,
                    "actor/ppo_kl": 1e-3, "perf/total_num_tokens": 3000}  # fmt: skip
        rows.append(row)
    write_run(path, rows)
    (path / "summary.json").write_text("{}")
    (path / "data").mkdir()
    (path / "data" / "task.json").write_text(json.dumps({"task": mr.TASK}))


def test_only_runs_not_done_are_launched_at_most_max_runs(tmp_path):
    """The table grows over sittings: a done run (its summary written, on the bench's task) is
    never launched again, and --max-runs bounds a sitting. Bug caught: a finished 15-minute run
    repeated, a partial one (killed, no summary) or one of another task taken as done."""
    finished_run(mr.run_dir(tmp_path, "sync", 0), [0.0] * 9)
    (mr.run_dir(tmp_path, "sync", 1) / "metrics").mkdir(parents=True)  # killed mid-run
    finished_run(mr.run_dir(tmp_path, "sync-R3", 1), [0.0] * 9)
    (mr.run_dir(tmp_path, "sync-R3", 1) / "data" / "task.json").write_text('{"task": "sums"}')
    calls = []
    launch = lambda arm, seed, steps, path: calls.append((arm, seed, steps, path.name)) or 0  # noqa: E731
    failed = mr.launch_missing(tmp_path, ["sync", "sync-R3"], [0, 1], 40, 2, launch)
    assert calls == [("sync", 1, 40, "sync-s1"), ("sync-R3", 0, 40, "sync-R3-s0")]
    assert failed == 2  # the fake wrote no summary: a launch that ends without one failed
    mr.launch_missing(tmp_path, ["sync-R3"], [1], 40, None, launch)
    assert calls[-1] == ("sync-R3", 1, 40, "sync-R3-s1")  # a default-task run is not this bench's


def test_each_arm_is_the_main_job_on_guessing_sums_with_its_overrides(tmp_path):
    """Bug caught: an arm that runs the default task, or its correction not reaching verl."""
    cmd = mr.command("colocate_async-noTIS", 1, 40, tmp_path / "x")
    assert cmd[1].endswith("scripts/train_mcore.sh")
    assert cmd[2:] == ["--model", "mini", "--task", "guessing_sums", "--steps", "40", "--seed", "1",
                       "--trainer-mode", "colocate_async", "--ckpt-dir", str(tmp_path / "x"), "--",
                       "algorithm.rollout_correction.rollout_is=null"]  # fmt: skip
    assert "--" not in mr.command("sync", 0, 40, tmp_path / "y")
    bypass = mr.command("separate_async-bypass", 0, 40, tmp_path / "z")
    assert "algorithm.rollout_correction.bypass_mode=true" in bypass


def test_a_difference_is_real_only_beyond_the_seed_range(tmp_path, capsys):
    """Late validation accuracy = the mean of the last three validations; a difference between
    arms is called real only where it exceeds the larger seed-to-seed range, and is shown seed
    by seed. Bug caught: one seed's lucky run ranking an arm, the range taken over the whole
    curve, the reward (a flip moves it by twice as much) taken for the accuracy."""
    rise = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    finished_run(mr.run_dir(tmp_path, "colocate_async-TIS", 0), rise)  # late 0.7
    finished_run(mr.run_dir(tmp_path, "colocate_async-TIS", 1), [v + 0.05 for v in rise])
    finished_run(mr.run_dir(tmp_path, "colocate_async-noTIS", 0), [v - 0.3 for v in rise])
    finished_run(mr.run_dir(tmp_path, "colocate_async-noTIS", 1), [v - 0.2 for v in rise])
    finished_run(mr.run_dir(tmp_path, "sync", 0), [v - 0.02 for v in rise])
    finished_run(mr.run_dir(tmp_path, "sync", 1), [v + 0.1 for v in rise])
    assert mr.main(["--table-only", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "mode_ranking.json").read_text())
    tis = result["arms"]["colocate_async-TIS"]
    assert tis["acc_late"] == pytest.approx(0.725) and tis["acc_late_range"] == pytest.approx(0.05)
    assert tis["steps_per_min"] == pytest.approx(4.0) and tis["acc_start"] == pytest.approx(0.025)
    assert tis["val_late"] == pytest.approx(0.45)  # the reward's, beside
    by_question = {c["question"]: c for c in result["comparisons"]}
    tis_row = by_question["TIS in colocate_async"]
    assert tis_row["diff"] == pytest.approx(0.275) and tis_row["exceeds_spread"] is True
    assert tis_row["paired"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.25)}
    vs_sync = by_question["colocate_async against sync"]
    assert vs_sync["diff"] == pytest.approx(-0.015) and vs_sync["exceeds_spread"] is False
    assert "R3 against no replay (sync)" not in by_question  # no sync-R3 run yet
    out = capsys.readouterr().out
    assert "| TIS in colocate_async (colocate_async-TIS - colocate_async-noTIS) | +0.275 " \
           "| s0 +0.300, s1 +0.250 | 0.100 | exceeds the seed spread |" in out  # fmt: skip
    assert (tmp_path / "mode_ranking.png").stat().st_size > 10_000


def test_one_seed_is_not_ranked_and_an_empty_out_exits_2(tmp_path, capsys):
    assert mr.main(["--table-only", "--out", str(tmp_path)]) == 2
    assert "holds no finished run" in capsys.readouterr().out
    finished_run(mr.run_dir(tmp_path, "sync", 0), [0.1] * 9)
    finished_run(mr.run_dir(tmp_path, "sync-R3", 0), [0.5] * 9)
    assert mr.main(["--table-only", "--out", str(tmp_path)]) == 0
    assert "| +0.400 | s0 +0.400 | - | needs 2 seeds on both sides |" in capsys.readouterr().out


def test_the_late_drop_is_measured_from_the_best_and_between_validations(tmp_path):
    """Bug caught: a late drop (the question of colocate_async's 1.000, 1.000, 1.000, 0.688)
    hidden by a mean, or a rise counted as a fall."""
    finished_run(mr.run_dir(tmp_path, "sync", 0), [0.1, 0.3, 0.2, 0.6, 0.9, 0.9, 0.7, 0.8, 0.6])
    finished_run(mr.run_dir(tmp_path, "sync", 1), [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert mr.main(["--table-only", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "mode_ranking.json").read_text())
    s0, s1 = result["runs"]["sync"]["0"], result["runs"]["sync"]["1"]
    assert s0["drop_from_best"] == pytest.approx(0.3) and s0["largest_fall"] == pytest.approx(0.2)
    assert s1["drop_from_best"] == 0 and s1["largest_fall"] == 0  # a rise is no fall
    assert result["arms"]["sync"]["drop_from_best"] == pytest.approx(0.15)


def test_the_plots_train_score_is_a_running_mean_of_five_steps():
    curve = [(1, 1.0), (2, 0.0), (3, 1.0), (4, 0.0), (5, 1.0), (6, 1.0)]
    assert mr.running_mean(curve) == [(1, 1.0), (2, 0.5), (3, 2 / 3), (4, 0.5), (5, 0.6), (6, 0.6)]
