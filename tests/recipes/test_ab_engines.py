"""scripts/bench/launches/ab_engines.py: the same DAPO job on verl's FSDP2 actor and on ours, one table.

The reduction and the goal on recorded metrics; then the A/B at the goal's row (mini, 128
experts top-8, world 2) through the launcher: the bench launches verl's FSDP2 actor beside the
main-job run CI makes anyway (one launch, not two), its finish exports and reloads, the JSON's
fields and step 1's agreement; verl's FSDP checkpoint files of that run through the resume's
allow-list and completeness rules."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from backend.shared.errors import CheckpointError
from converters.pickles.fsdp_state import check_fsdp_checkpoint, is_complete, rank_files
from converters.pickles.safe_pickle import UnsafeCheckpointError
from scripts.bench.launches import ab_engines

REPO = Path(__file__).resolve().parents[2]


def rows(update_s: float, first_update_s: float, grad: float) -> list[dict]:
    out = [{"step": 0}]
    for s in range(1, 4):
        out.append({"step": s, "timing_s/update_actor": first_update_s if s == 1 else update_s,
                    "timing_s/old_log_prob": 0.5, "timing_s/step": 10.0, "timing_s/update_weights": 0.1,
                    "perf/total_num_tokens": 1000, "actor/grad_norm": grad if s == 1 else 1.0,
                    "critic/score/mean": -1.0 + s / 10})  # fmt: skip
    return out


def test_ratios_leave_out_step_one_and_the_goal_reads_mini_at_world_2():
    """Bugs caught: step 1's one-time compile counted in the speed (FSDP's torch.compile of
    the entropy takes ~10 s there), a ratio the wrong way round, the goal read off another row."""
    fsdp = ab_engines.reduce_run(rows(4.0, 14.0, 1.5), {"11": 900, "12": 880})
    ours = ab_engines.reduce_run(rows(1.0, 2.0, 1.5), {"21": 800, "22": 810})
    assert fsdp["update_tokens_per_s"] == 250.0 and ours["update_tokens_per_s"] == 1000.0
    assert fsdp["peak_rss_mib_per_rank"] == [900, 880] and ours["peak_mib"] == 810
    assert fsdp["first_step"]["timing_s/update_actor"] == 14.0
    ratio = ab_engines.ratios(ours, fsdp)
    assert ratio["update_tokens_per_s"] == 4.0 and ratio["peak_mib"] == pytest.approx(0.9)
    row = {"fsdp": fsdp, "mcore_ep": ours, "ratio": ratio}
    assert ab_engines.goal({"tiny/world2": row}) == {"measured": False, **ab_engines.GOAL}
    met = ab_engines.goal({"mini/world2": row})
    assert met["met"] and met["update_speedup_measured"] == 4.0
    slow = {**row, "ratio": {**ratio, "peak_mib": 1.2}}
    assert not ab_engines.goal({"mini/world2": slow})["met"]  # faster but heavier: not met


def test_repeats_give_medians_with_their_spread_and_the_ratio_of_medians():
    """Bugs caught: the ratio taken from one run (the first) instead of the medians, a spread
    that is not the runs' range, the table hiding how many runs a figure is from."""
    fsdp = [ab_engines.reduce_run(rows(4.0, 14.0, 1.5), {"11": m}) for m in (900, 960, 930)]
    ours = [ab_engines.reduce_run(rows(u, 2.0, 1.5), {"21": 800}) for u in (1.0, 4.0, 2.0)]
    median = ab_engines.median_run(ours)
    assert median["update_tokens_per_s"] == 500.0  # 1000, 250, 500 tokens/s
    assert median["spread"]["update_tokens_per_s"] == [250.0, 1000.0]
    assert len(median["runs"]) == 3 and median["reward_by_step"] == ours[0]["reward_by_step"]
    base = ab_engines.median_run(fsdp)
    assert base["peak_mib"] == 930 and base["spread"]["peak_mib"] == [900, 960]
    ratio = ab_engines.ratios(median, base)
    assert ratio["update_tokens_per_s"] == 2.0 and ratio["peak_mib"] == pytest.approx(800 / 930)
    assert ab_engines.median_run(ours[:1]) is ours[0]  # one run: its own record, no spread
    text = ab_engines.table({"mini/world2": {"fsdp": base, "mcore_ep": median, "ratio": ratio}}, {})
    assert "| mini/world2 | mcore_ep | 500 (250-1000, 3 runs) |" in text
    assert "| 930 (900-960, 3 runs) |" in text
    assert ab_engines.run_name("mini", 2, "fsdp", 0) == "mini-w2-fsdp"  # the CI test's, as before
    assert ab_engines.run_name("mini", 2, "fsdp", 2) == "mini-w2-fsdp-r2"


def test_both_launches_get_the_overrides_and_ours_runs_at_fsdps_thread_count(tmp_path):
    """Bugs caught: the overrides after `--` dropped (the bench took them and launched
    without them), and ours at the cores' share (2 threads at world 1 on 2 cores) against
    FSDP's one."""
    extra = ["trainer.save_freq=1"]
    for engine in ab_engines.ENGINES:
        cmd = ab_engines.launch_command(engine, "mini", 2, 6, tmp_path, extra=extra)
        after = cmd[cmd.index("--") + 1 :]
        assert cmd[cmd.index("--ep") + 1] == "2" and after[-1] == "trainer.save_freq=1"
        assert (ab_engines.SAME_THREADS in after) == (engine == "mcore_ep")
    plan = "--tp 4 --ep 8"  # the world-8 rows: ours at the mission's plan, FSDP over 8 ranks
    ours = ab_engines.launch_command("mcore_ep", "mini", 8, 4, tmp_path, plan=plan)
    fsdp = ab_engines.launch_command("fsdp", "mini", 8, 4, tmp_path, plan=plan)
    assert ours[ours.index("--tp") : ours.index("--")] == ["--tp", "4", "--ep", "8"]
    assert "--tp" not in fsdp and fsdp[fsdp.index("--ep") + 1] == "8"
    cluster = ab_engines.launch_command(
        "fsdp", "mini", 8, 5, tmp_path, cluster="--device cuda", extra=extra
    )
    assert cluster[-2:] == ["trainer.total_training_steps=5", "trainer.save_freq=1"]


HOLD = "import sys, time; x = bytearray(int(sys.argv[1]) << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(4)"


def test_the_peak_sampler_counts_its_launchs_workers_only(tmp_path):
    """Bug caught: a second job's actor workers on the same machine counted as this launch's
    ranks (a suite beside a small job saw 4 "FSDP ranks": 1168, 1146, 660, 629 MiB)."""
    import time

    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    # titled as verl's actor workers are; the launch's one is its grandchild, as Ray's are
    worker = f'exec -a "ray::WorkerDict" "{sys.executable}" {hold}'
    outsider = subprocess.Popen(["bash", "-c", f"{worker} 300"])
    launch = subprocess.Popen(["bash", "-c", f"bash -c '{worker} 120'; true"])
    try:
        with ab_engines.PeakRss(launch.pid, period_s=0.2) as rss:
            time.sleep(2.5)
    finally:
        launch.wait()
        outsider.wait()
    assert len(rss.peaks) == 1 and 120 <= next(iter(rss.peaks.values())) < 200


@pytest.fixture(scope="module")
def ab_run(mini_run, tmp_path_factory):
    """The side by side at the goal's row, mini at world 2: ours is the main-job run CI makes
    anyway (tests/conftest.py's mini_run, copied in), the bench launches verl's FSDP2 actor on
    the same job (its model, data and warm-up, the same overrides) and reduces both."""
    from tests.recipes.test_verl_cpu_trainer import FP32_ROLLOUT, MINI_OVERRIDES

    out = tmp_path_factory.mktemp("ab")
    # its metrics, model, data and summary (its checkpoints are not read here)
    shutil.copytree(mini_run[0], out / "mini-w2-mcore_ep", symlinks=True,
                    ignore=shutil.ignore_patterns("checkpoints", "export_hf"))  # fmt: skip
    # the run's overrides but its save every step (the FSDP run saves at its last, step 2)
    same = ["trainer.val_before_train=false", "trainer.test_freq=-1", FP32_ROLLOUT,
            *MINI_OVERRIDES]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.launches.ab_engines", "--models", "mini",
                           "--worlds", "2", "--steps", "2", "--engines", "fsdp", "--out", str(out),
                           "--", *same], cwd=REPO, capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.trainer_flow
@pytest.mark.slow
def test_mini_ab_at_world_2_reports_both_actors_and_step_one_agrees(ab_run):
    """Bugs caught: verl's FSDP engine not training under verl's own trainer on CPU (no
    engine for device cpu, an mcore_ep key it refuses), a finish that cannot read its
    checkpoint, no peak memory sampled, a JSON missing what the table reports, step 1 of the
    two actors apart at 128 experts, top-8."""
    out, proc = ab_run
    result = json.loads((out / "ab_engines.json").read_text())
    row = result["runs"]["mini/world2"]
    for engine in ("fsdp", "mcore_ep"):
        r = row[engine]
        assert r["steps"] == 2 and len(r["reward_by_step"]) == 2
        assert r["update_tokens_per_s"] > 0 and r["old_log_prob_tokens_per_s"] > 0
        assert r["weight_sync_s"] is not None and r["first_step"]["actor/grad_norm"] > 0
        summary = json.loads((out / f"mini-w2-{engine}" / "summary.json").read_text())
        assert summary["export_max_logits_diff"] < 1e-4  # the finish exported and reloaded
    assert len(row["fsdp"]["peak_rss_mib_per_rank"]) == 2  # its two actor ranks, sampled
    assert min(row["fsdp"]["peak_rss_mib_per_rank"]) > 100
    # each FSDP rank's memory read from inside it (the probe through the job env): its shard
    # of the fp32 parameters, as many gradient bytes, AdamW's two states a parameter
    memory = row["fsdp"]["memory"]
    assert len(memory) == 2 and all(rank["optimizer_steps"] >= 2 for rank in memory)
    with safe_open(out / "mini-w2-fsdp" / "sft_hf" / "model.safetensors", "pt") as f:
        model_mib = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4 / 2**20
    assert sum(rank["params"] for rank in memory) == pytest.approx(model_mib, rel=0.02)
    for rank in memory:
        assert rank["grads"] == pytest.approx(rank["params"], rel=0.01)
        assert rank["optimizer_states"] == pytest.approx(2 * rank["params"], rel=0.01)
        assert rank["peak"] >= rank["between_steps"] > rank["at_first_forward"] > 100
    assert set(row["ratio"]) == set(ab_engines.RATIOS) and row["ratio"]["update_tokens_per_s"]
    parity = result["parity"]["mini"]
    assert parity["old_log_prob_max_abs_diff"] <= 1e-5
    assert parity["loss_abs_diff"] <= 1e-6 and parity["grad_norm_rel_diff"] <= 1e-5
    assert result["goal"]["measured"] is True and "met" in result["goal"]
    assert "| mini/world2 | **ours / FSDP** |" in proc.stdout
    assert "goal (ours >= 2.0x FSDP update tok/s" in proc.stdout


def fsdp_actor(ab_run, step: int = 2) -> Path:
    return ab_run[0] / "mini-w2-fsdp" / "checkpoints" / f"global_step_{step}" / "actor"


@pytest.mark.trainer_flow
def test_verls_fsdp_checkpoint_passes_and_a_crafted_one_is_refused(ab_run, tmp_path):
    """Bug caught: a resume that hands verl's torch.load(weights_only=False) a file that runs
    code, or refuses the genuine files verl's FSDP engine writes (DTensor shards of 2 ranks)."""
    actor = fsdp_actor(ab_run)
    names = [p.name for p in rank_files(actor)]
    assert names == [f"{k}_world_size_2_rank_{r}.pt" for k in ("extra_state", "model", "optim")
                     for r in (0, 1)]  # fmt: skip
    assert is_complete(actor)
    check_fsdp_checkpoint(actor)  # genuine: passes

    crafted = tmp_path / "actor"
    shutil.copytree(actor, crafted)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            import os

            return os.system, (f"touch {marker}",)

    torch.save({"model": Payload()}, crafted / "optim_world_size_2_rank_1.pt")
    with pytest.raises(UnsafeCheckpointError, match="references posix.system"):
        check_fsdp_checkpoint(crafted)
    assert not marker.exists()

    data = (actor / "model_world_size_2_rank_0.pt").read_bytes()
    (crafted / "model_world_size_2_rank_0.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model_world_size_2_rank_0.pt is unreadable"):
        check_fsdp_checkpoint(crafted)

    (crafted / "model_world_size_2_rank_0.pt").unlink()
    assert not is_complete(crafted)  # a rank's model file missing: never resumed from


@pytest.mark.trainer_flow
def test_the_resume_takes_a_complete_fsdp_checkpoint_and_vets_it(ab_run, tmp_path):
    """Bug caught: the launcher's half-written-checkpoint rule (ours: manifest.json files)
    calling verl's FSDP checkpoint unfinished and starting afresh, or skipping its vetting."""
    from recipes.dapo.checkpoints import resume

    root = tmp_path / "checkpoints"
    shutil.copytree(fsdp_actor(ab_run).parent, root / "global_step_2")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    groups = {"trainer": {"trainer.default_local_dir": str(root), "trainer.resume_mode": "auto"}}
    assert resume.settle_unfinished(groups, tmp_path) is None
    assert resume.check_resume(groups, tmp_path) == root / "global_step_2"
    torch.save({"x": Path("/")}, root / "global_step_2/actor/extra_state_world_size_2_rank_0.pt")
    with pytest.raises(UnsafeCheckpointError, match="references pathlib"):
        resume.check_resume(groups, tmp_path)
