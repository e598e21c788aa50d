"""scripts/bench/launches/mission_plan_run.py's memory sampler counts the launch's own process tree:
a grandchild's memory (Ray's workers are the launcher's grandchildren) is in it, another
process on the machine is not (a sampler that read every process would count a second job)."""

import subprocess
import sys
import time

import pytest

from scripts.bench.launches.mission_plan_run import TreeRss

HOLD = "import time; x = bytearray({mib} << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(4)"


def test_the_sampler_counts_the_launchs_tree_and_nothing_else():
    outsider = subprocess.Popen([sys.executable, "-c", HOLD.format(mib=300)])
    launch = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{HOLD.format(mib=120)}"'])
    try:
        time.sleep(0.5)
        rss = TreeRss(launch.pid, every_s=0.2).start()
        time.sleep(2.5)
        rss.stop()
    finally:
        launch.wait()
        outsider.wait()
    held = [mib for title, mibs in rss.per_title().items() for mib in mibs if "bytearray" in title]
    assert len(held) == 1 and 120 <= held[0] < 200  # the grandchild, not the 300 MiB outsider
    assert 120 <= rss.peak_total_mib < 300  # PSS of the tree: the grandchild and bash


def test_the_scale_table_counts_bytes_per_trained_step():
    """scale_table's per-rank figures: the warm-up's rows and the weight sync before step 1
    left out, every call's bytes summed and divided by the steps, the model taken call by call
    on the same tokens, the save's collectives apart. A table that divided by calls instead
    of steps, or counted the warm-up or the first sync, would show another plan's traffic."""
    from backend.qwen3_moe.config import spec_from_config
    from parallel.models import MINI_QWEN3_MOE
    from parallel.plan import ParallelPlan, check_against_model
    from parallel.step_traffic import Settings, phase_bytes
    from scripts.bench.launches.scale_table import per_step

    spec = spec_from_config({**MINI_QWEN3_MOE, "model_type": "qwen3_moe", "vocab_size": 32})
    fit = check_against_model(ParallelPlan.for_world(4, tp=2, ep=4), spec)

    def row(phase, tokens, tp, ep, dp, other=0):
        return {"phase": phase, "tokens": tokens,
                "bytes": {"tp": tp, "ep": ep, "dp": dp, "pp": 0, "other": other}}  # fmt: skip

    warmup = [row("update", 64, 0, 0, 0), row("old_log_prob", 64, 0, 0, 0)]  # SFT, world 1
    rows = [*warmup, row("weight_sync", 0, 999, 999, 0)]  # then the rollout's first weights
    for tokens in (100, 300):  # two steps
        rows += [row("old_log_prob", tokens, 10, 20, 1), row("update", tokens, 30, 40, 50),
                 row("weight_sync", 0, 5, 6, 0), row("save", 0, 0, 0, 0, other=7)]  # fmt: skip
    got = per_step(rows, fit)
    assert got["steps"] == 2 and got["update_tokens"] == 200
    assert got["measured"] == {"tp": 45, "ep": 66, "dp": 51} and got["other_phases"] == 7
    want = {
        k: sum(phase_bytes(fit, p, t, Settings(4))[k] for p, t in
               [("old_log_prob", 100), ("update", 100), ("weight_sync", 0),
                ("old_log_prob", 300), ("update", 300), ("weight_sync", 0)]) / 2
        for k in ("tp", "ep", "dp")
    }  # fmt: skip
    assert got["model"] == pytest.approx(want)
