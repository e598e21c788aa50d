"""scripts/bench/launches/replay_modes.py's reduction of a run's metrics into the replay table (the
launches themselves are the main job's, tested in test_verl_cpu_trainer.py)."""

import json
from pathlib import Path

import pytest

from scripts.bench.launches import replay_modes

AGREE, MATCH, DIFF = replay_modes.AGREE, replay_modes.MATCH, replay_modes.DIFF


def step(n: int, score: float, agree: tuple | None, match: float | None, diff: float) -> dict:
    data = {"critic/score/mean": score, "timing_s/step": 10.0 + n,
            f"{DIFF}/mean": diff, f"{DIFF}/p99": 10 * diff, f"{DIFF}/max": 100 * diff}  # fmt: skip
    if agree is not None:
        data |= {f"{AGREE}/layer_{i:02d}": a for i, a in enumerate(agree)}
        data |= {f"{AGREE}/mean": sum(agree) / len(agree), f"{AGREE}/min": min(agree) - 0.1}
    if match is not None:
        data |= {f"{MATCH}/mean": match, f"{MATCH}/min": match - 0.2}
    return {"step": n, "data": data}


def write_run(run_dir: Path, rows: list[dict], torn_tail: bool = False) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + ('{"step": 3, "da' if torn_tail else "")
    (run_dir / "metrics" / "launch_000.jsonl").write_text(text)


def test_a_runs_metrics_reduce_to_the_tables_row(tmp_path):
    """Catches the table averaging the wrong steps (validation-only step 0 counted as a
    training step), a minimum or maximum taken over means, per-layer agreement out of layer
    order, or a torn last line (a killed run) failing the reduction."""
    val = {"step": 0, "data": {"val-aux/math_dapo/reward/mean@8": 0.2}}
    rows = [val, step(1, -0.5, (0.9, 0.8), 0.7, 1e-3), step(2, 0.5, (1.0, 0.6), 0.9, 3e-3)]
    rows.append({"step": 2, "data": {"val-aux/math_dapo/reward/mean@8": 0.95}})
    write_run(tmp_path / "R3", rows, torn_tail=True)
    r = replay_modes.reduce_run(replay_modes.read_rows(tmp_path / "R3"))
    assert r["steps"] == 2
    assert r["agreement_per_layer"] == pytest.approx([0.95, 0.7])
    assert r["agreement_mean"] == pytest.approx(0.825)
    assert r["agreement_min"] == pytest.approx(0.5)  # the smallest per-step min
    assert (r["route_match_mean"], r["route_match_min"]) == pytest.approx((0.8, 0.5))
    assert r["logprob_diff_mean"] == pytest.approx(2e-3)
    assert r["logprob_diff_p99"] == pytest.approx(2e-2)
    assert r["logprob_diff_max"] == pytest.approx(0.3)  # the largest max, not a mean
    assert r["train_reward_first_last"] == [-0.5, 0.5]
    assert r["val_reward"] == [(0, 0.2), (2, 0.95)]
    assert r["step_s_median"] == pytest.approx(11.5)


def test_the_table_says_not_logged_where_a_mode_has_no_rollout_routes(tmp_path, capsys):
    """R2 returns no rollout routes, so it has no agreement or route match: catches a table
    printing 0 or crashing for it, and --table-only relaunching instead of re-reading."""
    write_run(tmp_path / "R2", [step(1, 0.1, None, None, 2e-3)])
    write_run(tmp_path / "R3", [step(1, 0.2, (0.97, 0.98), 1.0, 1e-3)])
    assert replay_modes.main(["--table-only", "--out", str(tmp_path), "--modes", "R2,R3"]) == 0
    out = capsys.readouterr().out
    r2 = next(line for line in out.splitlines() if line.startswith("| R2 |"))
    assert r2.startswith("| R2 | not logged | not logged | 2.0e-03 / 2.0e-02 / 2.0e-01 |")
    assert "| R3 | 0.9750 (0.970 / 0.980), 0.870 | 1.000, 0.800 |" in out
    saved = json.loads((tmp_path / "replay_modes.json").read_text())
    assert list(saved) == ["R2", "R3"] and saved["R2"]["agreement_mean"] is None


def test_an_unknown_mode_or_a_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    """Catches a typo'd mode launching nothing useful, and --table-only on a directory without
    the runs crashing or writing a table of empty rows."""
    assert replay_modes.main(["--modes", "R4", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().out == "error: --modes R4: choose from disabled, R2, R3, R3+TIS\n"
    assert replay_modes.main(["--table-only", "--out", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().out == (
        f"error: {tmp_path}/none/disabled holds no run's metrics: run the disabled mode "
        "without --table-only first\n"
    )
    assert list(tmp_path.iterdir()) == []
