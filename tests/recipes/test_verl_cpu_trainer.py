"""verl's own DAPO trainer end to end on CPU: the path a cluster runs, with the CPU platform.

`python -m recipes.launcher.launch --device cpu` (what `bash scripts/train_mcore.sh` runs without
an accelerator) starts `verl.trainer.main_ppo`: Ray, the V1 trainer with dynamic sampling,
our mcore_ep engine with megatron-core's distributed optimizer, verl's vLLM rollout (vLLM's CPU
build, fp32 here so that the sync check is exact; the main job runs it in bf16) fed only by
verl's weight sync, the dapo reward manager, checkpoints in verl's layout. On the mini model
(128 experts, top-8) at ep 2, after its SFT warm-up through verl's SFT trainer on the same
engine (docs/mini_task.md). A few steps each; the learning curve itself is measured by the main command (docs/cpu_run.md). The resume
(resume_mode=auto) after a lost node and past a half-written background save runs on a
two-node Ray cluster (tests/recipes/test_ray_cluster.py).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.trainer_flow,
    pytest.mark.usefixtures("dev_shm_unchanged"),
]  # 0.16.1 set only (pyproject.toml)
REPO = Path(__file__).resolve().parents[2]
SYNC_TOLERANCE = 1e-4  # rollout (vLLM) vs actor (megatron-core) log-probs, fp32
FP32_ROLLOUT = "actor_rollout_ref.rollout.dtype=float32"
# console lines besides the step lines: start-up warnings once each, their counts, alarms,
# summary (the 35-step main job: 35 step lines + these, under 300)
CONSOLE_FIXED = 100
STEP_ROW = re.compile(r"^\[[#.]{20}\] +(\d+)/(\d+) \| ")


def launch(out: Path, *flags: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    model = () if "--model" in flags else ("--model", "tiny")  # the default is mini
    cmd = [sys.executable, "-m", "recipes.launcher.launch", "--device", "cpu", "--ckpt-dir", str(out),
           *model, *flags, "--", "trainer.val_before_train=false", "trainer.test_freq=-1", FP32_ROLLOUT,
           *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-5000:])
    return proc


def history(out: Path) -> dict[int, dict]:
    from recipes.local.run import read_history

    return {row["step"]: row for row in read_history(out / "metrics")}


# the mission's shape: the mini model (128 experts, top-8) at ep 2 on its worked sums, RL
# from a short SFT warm-up through verl's SFT trainer on our engine (a policy right on some
# sums, so that dynamic sampling finds groups with variance and evicts the rest); 8 samples
# of each prompt keep a step to seconds
MINI_EP2 = ("--model", "mini", "--ep", "2", "--warmup-steps", "20")
MINI_OVERRIDES = ("actor_rollout_ref.rollout.n=8",)


# mini_run: tests/conftest.py (a session fixture: tests/recipes/test_ab_engines.py compares verl's FSDP
# actor against the same run)


def test_the_warm_up_trained_our_engine_and_rl_started_from_its_export(mini_run):
    """verl's SFT trainer on the mcore_ep engine (recipes.local.warmup): its loss fell, its
    export holds trained weights (not the built model's) with the built model's tokenizer,
    and RL read that folder. Catches an SFT pass that trains nothing (a loss mask or
    optimizer not wired through our engine), an export of the base model, or RL started
    from the random weights."""
    from safetensors.torch import load_file

    out, proc = mini_run
    rows = [json.loads(x) for x in (out / "warmup" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["data"]["train/loss"] for r in rows]
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0]
    base, sft = (
        load_file(out / "mini_hf" / "model.safetensors"),
        load_file(out / "sft_hf" / "model.safetensors"),
    )
    assert base.keys() == sft.keys()
    assert not torch.equal(base["model.embed_tokens.weight"], sft["model.embed_tokens.weight"])
    assert (out / "sft_hf" / "chat_template.jinja").read_text() == (
        out / "mini_hf" / "chat_template.jinja"
    ).read_text()
    assert (
        f"actor_rollout_ref.model.path={out / 'sft_hf'}"
        in (out / "logs" / "launch_000.log").read_text()
    )
    shown = [line for line in proc.stdout.splitlines() if line.startswith("warm-up: ")]
    assert shown[0].startswith("warm-up: 20 SFT steps") and shown[-2].startswith("warm-up: done")
    assert shown[-1].startswith(f"warm-up: kept in {out.parent / '.warmup_cache'}/")


def test_every_weight_sync_gives_the_rollout_the_actors_weights(mini_run):
    out, _ = mini_run
    rows = history(out)
    assert sorted(rows) == [1, 2]
    for step, row in rows.items():
        # the rollout's per-token log-probs (transformers, weights only from verl's sync)
        # against the actor's old log-probs on the same sequences (megatron-core)
        assert row["training/rollout_probs_diff_valid"] == 1.0, step
        assert row["training/rollout_probs_diff_max"] < SYNC_TOLERANCE, step
        assert row["actor/grad_norm"] > 0, step


def test_r3_routes_reach_the_engine_at_one_byte_an_id(mini_run):
    """vLLM's uint8 routes (128 experts) arrive in the engine's batch as uint8 through verl's
    agent loop, queue and batch (recipes.dapo.engine.compact_routes): catches verl's int16 widening
    (twice the bytes of every route on its way) coming back."""
    rows = history(mini_run[0])
    assert [row["actor/moe/rollout_routes/id_bytes"] for row in rows.values()] == [1.0, 1.0]


def test_dynamic_sampling_evicts_groups_without_variance(mini_run):
    rows = history(mini_run[0])
    # the briefly warmed policy answers many sums wrong n times out of n: those groups must go
    # (verl logs the count only for steps that evicted something)
    assert sum(row.get("training/filter_groups/evicted_samples", 0) for row in rows.values()) > 0
    assert all(row["critic/advantages/max"] > 0 for row in rows.values())


def test_monitor_and_aux_loss_act_inside_verls_update(mini_run):
    """The aux loss's gradient went back through every router call of verl's updates at the
    DP scale (2 here): catches an aux gradient scaled to 0 or never reaching backward, which
    `applied` (the setting) cannot."""
    row = history(mini_run[0])[2]
    assert row["actor/moe/aux_loss/applied"] == 1.0
    assert row["actor/moe/aux_loss/grad_scale"] == 2.0  # ep 2 on 2 ranks: dp 2, DDP's mean
    assert row["actor/moe/update/tokens"] > 0 and row["actor/moe/old_log_prob/tokens"] > 0
    assert "actor/timing/comm_share" in row and row["actor/timing/forward_backward_s"] > 0
    report = json.loads((mini_run[0] / "routing_report.json").read_text())
    assert report["steps"], "the routing report holds the run's steps"
    # its step axis is verl's: 4 updates (mini-batches) in each of the 2 trainer steps
    assert [s["trainer_step"] for s in report["steps"]] == [1] * 4 + [2] * 4
    assert report["meta"]["run"] == "qwen3-moe-sums-cpu-tp1-ep2"
    assert (report["meta"]["num_experts"], report["meta"]["top_k"]) == (128, 8)
    assert report["meta"]["trainer_steps"] == 2


def test_the_console_shows_a_line_per_step_and_the_summary_last(mini_run):
    """Everything verl, Ray and the workers print is in the run's log; the console has a line
    per step, each warning once, and the summary last (the 35-step run: under 300 lines)."""
    out, proc = mini_run
    lines = proc.stdout.splitlines()
    steps = [m.groups() for line in lines if (m := STEP_ROW.match(line))]
    assert steps == [("1", "2"), ("2", "2")]
    assert len(lines) - len(steps) <= CONSOLE_FIXED and 35 + CONSOLE_FIXED < 300
    # the alarms' count line: a router collapsed as it came may fire at step 1 (alarms.py)
    assert lines[-1].startswith("wall time: ")
    assert sum(line.startswith("alarms: ") for line in lines) == 1
    log = out / "logs" / "launch_000.log"
    assert f"log: {log}" in lines
    logged = log.read_text()
    assert re.search(r"step:2 - .*actor/entropy:", logged)  # verl's own step line, in full
    assert "target_num_threads" not in logged  # TQ_NUM_THREADS fits the machine's cores
    assert len(logged.splitlines()) > 10 * len(lines)


def test_checkpoints_in_verls_layout_and_the_export_reloads(mini_run):
    out, proc = mini_run
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    from recipes.dapo.checkpoints.files import is_complete

    for step in (1, 2):  # step 1 written in the background and sealed later, 2 the last
        actor = ckpt / f"global_step_{step}" / "actor"
        assert (actor / "model" / "dist_ckpt" / ".metadata").is_file()
        assert (actor / "optim" / "dist_ckpt" / ".metadata").is_file()
        assert is_complete(actor)  # every directory sealed with its manifest
        assert json.loads((actor / "meta.json").read_text())["global_step"] == step
    # verl's own data.pt: the exact allow-list the launcher and the engine check it with
    from converters.pickles.safe_pickle import TORCH_SAVE_ALLOWED
    from recipes.dapo.checkpoints.resume import check_data_state
    from tests.recipes.test_resume import pickled_globals

    check_data_state(ckpt / "global_step_1")
    assert pickled_globals(ckpt / "global_step_1" / "data.pt") == TORCH_SAVE_ALLOWED
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export_max_logits_diff"] < 1e-4
    assert (out / "export_hf" / "config.json").is_file()
    assert (out / "reward_curve.png").is_file()
    assert "export reloads in transformers" in proc.stdout
    from recipes.local.run import EARLY_EXPORT

    # the export ran while verl's processes ended (recipes.local.export_ahead), not after
    assert EARLY_EXPORT in (out / "logs" / "launch_000.log").read_text()


def resumable_copy(src: Path, out: Path) -> Path:
    """A run directory holding the mini run's models (built and warmed), data and its step-2 save as
    the latest (its last)."""
    for made in ("mini_hf", "sft_hf", "data"):
        shutil.copytree(src / made, out / made)
    shutil.copytree(src / "checkpoints" / "global_step_2", out / "checkpoints" / "global_step_2")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    return out


def test_a_checkpoint_the_engine_refuses_ends_the_resume_in_one_line(mini_run, tmp_path):
    """Tensor bytes changed after the save: the launcher's checks (the pickles) pass them and
    the engine's manifest check refuses them in verl's actor worker. Through Ray and verl's
    driver that reaches the user as the engine's one line and exit 2, the traceback only in
    the launch's log. The relaunch ends when the engine starts (the launcher named the
    checkpoint to it), before verl starts the rollout."""
    out = resumable_copy(mini_run[0], tmp_path / "damaged")
    model = out / "checkpoints" / "global_step_2" / "actor" / "model" / "dist_ckpt"
    chunks = json.loads((model / "manifest.json").read_text())["files"]["__0_0.distcp"]
    offset, length, _ = max(chunks["chunks"], key=lambda chunk: chunk[1])  # a tensor's
    raw = bytearray((model / "__0_0.distcp").read_bytes())
    raw[offset + length // 2] ^= 0xFF
    (model / "__0_0.distcp").write_bytes(bytes(raw))
    proc = launch(out, "--model", "mini", "--ep", "2", "--resume", "--steps", "3",
                  overrides=MINI_OVERRIDES)  # fmt: skip
    assert proc.returncode == 2
    log = out / "logs" / "launch_000.log"  # the relaunch's own (no metrics launched before)
    assert proc.stderr == (
        f"error: {model / '__0_0.distcp'}: bytes {offset}-{offset + length} differ from "
        "manifest.json: the checkpoint was damaged or changed after it was written; restore it "
        f"from a good copy (the trainer's traceback: {log})\n"
    )
    assert "Traceback" not in proc.stdout and "exited with status" not in proc.stdout
    logged = log.read_text()
    assert "RayTaskError(CheckpointError)" in logged
    assert "vLLMHttpServer" not in logged  # refused before the rollout started
    assert "Traceback (most recent call last)" in logged
