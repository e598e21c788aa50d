"""scripts/bench/launches/async_modes.py's reduction of each mode's metrics into the trainer-mode table
(the launches themselves are the main job's, tested in test_async_modes.py)."""

import json
from pathlib import Path

import pytest

from scripts.bench.launches import async_modes

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)
LAG, VAL = async_modes.LAG, "val-aux/math_dapo/reward/mean@8"


def rows(step_s: float, gen_s: float, lag: int, vals: dict[int, float]) -> list[dict]:
    out = [{"step": 0, VAL: vals[0]}]
    for s in range(1, 5):
        row = {"step": s, "timing_s/step": step_s, "timing_s/gen": gen_s, "timing_s/update_actor": 2.0,
               "perf/total_num_tokens": 1000, f"{LAG}/mean": lag / 2, f"{LAG}/max": lag,
               "actor/ppo_kl": 0.01, "actor/pg_clipfrac": 0.1}  # fmt: skip
        out.append(row | ({VAL: vals[s]} if s in vals else {}))
    return out


def write_run(run_dir: Path, data: list[dict]) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    lines = [
        json.dumps({"step": r["step"], "data": {k: v for k, v in r.items() if k != "step"}})
        for r in data
    ]
    (run_dir / "metrics" / "launch_000.jsonl").write_text("\n".join(lines) + "\n")


def test_the_table_gives_speed_overlap_and_lag_against_sync(tmp_path, capsys):
    """Bug caught: a ratio taken against the wrong run, or the reward curve on step counts
    instead of the training seconds each mode spent (the comparison is reward against time)."""
    write_run(tmp_path / "sync", rows(10.0, 8.0, 0, {0: 0.2, 4: 0.9}))
    write_run(tmp_path / "separate_async", rows(8.0, 2.0, 2, {0: 0.2, 2: 0.6, 4: 0.95}))
    assert (
        async_modes.main(["--table-only", "--out", str(tmp_path), "--modes", "sync,separate_async"])
        == 0
    )
    result = json.loads((tmp_path / "async_modes.json").read_text())
    sync, sep = result["sync"], result["separate_async"]
    assert (sync["steps_per_min"], sync["tokens_per_s"]) == (6.0, 100.0)
    assert sep["speed_vs_sync"] == pytest.approx(10 / 8) and sep["gen_overlap"] == pytest.approx(
        0.75
    )
    assert (sep["lag_mean"], sep["lag_max"]) == (1.0, 2)
    assert sep["val_curve"] == [[0, 0.0, 0.2], [2, 16.0, 0.6], [4, 32.0, 0.95]]
    table = capsys.readouterr().out
    assert "| separate_async | 7.50 (1.25x) | 125 | 2.00 (75%) | 2.00 | 1.00 / 2, - |" in table


def test_unknown_modes_and_missing_runs_exit_2(tmp_path, capsys):
    assert async_modes.main(["--modes", "sync,fully_async", "--out", str(tmp_path)]) == 2
    assert (
        "error: --modes fully_async: choose from sync, colocate_async, separate_async"
        in capsys.readouterr().out
    )
    assert async_modes.main(["--table-only", "--out", str(tmp_path), "--modes", "sync"]) == 2
    assert "holds no run's metrics" in capsys.readouterr().out
