"""The local DAPO recipe on 2 CPU ranks (torchrun): the same run as one rank, export, resume."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_local_dapo

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "3", "--save-freq", "2", *test_local_dapo.SMALL]
# sampled tokens and token counts are discrete: equal; losses and norms: up to reduction order
EXACT = (
    "rollout/reward_mean",
    "rollout/acc_mean",
    "dapo/kept_prompts",
    "moe/rollout/tokens",
    "moe/old_log_prob/tokens",
    "moe/update/tokens",
    "moe/update/layer_1/max_over_mean",
)
CLOSE = ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "moe/aux_loss/total")


def _dapo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recipes.local.dapo", "--out", str(out), *SMALL, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.fixture(scope="module")
def world1_rows(tmp_path_factory):
    from recipes.local.dapo import main

    out = tmp_path_factory.mktemp("world1")
    assert main(["--out", str(out), *SMALL]) == 0
    return _rows(out)


def _assert_same_run(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, ref in zip(rows, reference, strict=True):
        assert {k: row[k] for k in EXACT} == {k: ref[k] for k in EXACT}, row["step"]
        for key in CLOSE:
            assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (row["step"], key)


@pytest.mark.slow
def test_tp2_ep2_matches_one_rank_exports_and_resumes_exactly(tmp_path, world1_rows):
    out = tmp_path / "run"
    first = _dapo(out, "--tp", "2", "--ep", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    original = _rows(out)
    _assert_same_run(original, world1_rows)
    assert {"rank_00.pt", "rank_01.pt"} <= {
        p.name for p in (out / "checkpoints" / "step_000002").iterdir()
    }
    assert json.loads((out / "summary.json").read_text())["export_max_logits_diff"] < 1e-4
    assert json.loads((out / "routing_report.json").read_text())["meta"]["plan"]["ep"] == 2

    shutil.rmtree(out / "checkpoints" / "step_000003")  # killed after the step-2 checkpoint
    (out / "checkpoints" / "latest").write_text("step_000002")
    again = _dapo(out, "--tp", "2", "--ep", "2", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    assert _rows(out)[2] == original[2]
    assert "actor/grad_norm" in original[2]  # the compared step did update the policy


@pytest.mark.slow
def test_dp2_ep2_matches_one_rank(tmp_path, world1_rows):
    """tp=1, ep=2 folds into dp=2: each DP rank trains on half of every mini-batch."""
    result = _dapo(tmp_path / "run", "--ep", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dp=2" in result.stdout
    _assert_same_run(_rows(tmp_path / "run"), world1_rows)
