"""The checkpoint-save benchmarks end to end at small settings (their figures at the shipped
size: docs/checkpoints.md, "At Qwen3-30B-A3B size")."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_module(name: str):
    return importlib.import_module(f"scripts.bench.{name}")


@pytest.mark.bench
def test_save_blocking_times_background_and_in_place_saves(world1, monkeypatch, capsys):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    bench = _bench_module("save_blocking")
    args = ["--hidden", "64", "--layers", "2", "--experts", "4", "--saves", "1", "--warmup", "1"]
    assert bench.main([*args, "--step-s", "0.05"]) == 0
    doc = json.loads(capsys.readouterr().out)
    median = doc["median_blocked_s"]
    assert all(len(doc["saves"][m]) == 1 for m in ("background", "in_place"))
    assert doc["ratio"] == pytest.approx(median["background"] / median["in_place"])
    assert doc["checkpoint_bytes"] > 0 and all(s > 0 for s in median.values())
    # a background save returns before its write; the step polls it until sealed
    assert doc["saves"]["background"][0]["polls"] >= 1
    assert doc["plan_s"]["first"] > 0 and doc["plan_s"]["cached"] > 0


@pytest.mark.bench
def test_save_planning_times_one_rank_of_a_fake_world(tmp_path):
    """Its own process: it joins torch's fake process group as each rank in turn."""
    out = tmp_path / "plan.json"
    argv = ["--model", "tiny", "--tp", "1", "--ep", "2", "--world", "2", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.save_planning", *argv, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert 0 < doc["rank0_entries"] < doc["all_ranks_entries"]
    assert doc["uncached_s"] > 0 and doc["cached_s"] > 0
    assert doc["uncached_s"] >= sum(doc["uncached_parts_s"].values()) * 0.999
    assert all(b > 0 for b in doc["gathered_bytes"].values())
