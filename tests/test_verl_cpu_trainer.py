"""verl's own DAPO trainer end to end on CPU: the path a cluster runs, with the CPU platform.

`python -m recipes.dapo.launch --device cpu` (what `bash scripts/train_mcore.sh` runs without
an accelerator) starts `verl.trainer.main_ppo`: Ray, the V1 trainer with dynamic sampling,
our mcore_ep engine with megatron-core's distributed optimizer, verl's vLLM rollout (vLLM's CPU
build, fp32 here so that the sync check is exact; the main job runs it in bf16) fed only by
verl's weight sync, the dapo reward manager, checkpoints in verl's layout. A few steps each;
the learning curve itself is measured by the main command (README). resume_mode=auto
past a half-written background save runs here; the resume after a lost node on a two-node Ray
cluster (tests/test_ray_cluster.py).
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SYNC_TOLERANCE = 1e-4  # rollout (vLLM) vs actor (megatron-core) log-probs, fp32
FP32_ROLLOUT = "actor_rollout_ref.rollout.dtype=float32"
# console lines besides the step lines: start-up warnings once each, their counts, alarms,
# summary (the 35-step main job: 35 step lines + these, under 300)
CONSOLE_FIXED = 100
STEP_ROW = re.compile(r"^\[[#.]{20}\] +(\d+)/(\d+) \| ")


def launch(out: Path, *flags: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recipes.dapo.launch", "--device", "cpu", "--ckpt-dir", str(out),
           *flags, "--", "trainer.val_before_train=false", "trainer.test_freq=-1", FP32_ROLLOUT,
           *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-5000:])
    return proc


def history(out: Path) -> dict[int, dict]:
    from recipes.local.run import read_history

    return {row["step"]: row for row in read_history(out / "metrics")}


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    """Three steps at world 1, checkpoints after steps 2 and 3."""
    out = tmp_path_factory.mktemp("cpu_dapo")
    proc = launch(out, "--steps", "3", overrides=("trainer.save_freq=2",))
    assert proc.returncode == 0
    return out, proc


def test_every_weight_sync_gives_the_rollout_the_actors_weights(run3):
    out, _ = run3
    rows = history(out)
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        # the rollout's per-token log-probs (transformers, weights only from verl's sync)
        # against the actor's old log-probs on the same sequences (megatron-core)
        assert row["training/rollout_probs_diff_valid"] == 1.0, step
        assert row["training/rollout_probs_diff_max"] < SYNC_TOLERANCE, step
        assert row["actor/grad_norm"] > 0, step


def test_dynamic_sampling_evicts_groups_without_variance(run3):
    rows = history(run3[0])
    # the random policy answers most prompts wrong n times out of n: those groups must go
    # (verl logs the count only for steps that evicted something)
    assert sum(row.get("training/filter_groups/evicted_samples", 0) for row in rows.values()) > 0
    assert all(row["critic/advantages/max"] > 0 for row in rows.values())


def test_monitor_and_aux_loss_act_inside_verls_update(run3):
    """The aux loss's gradient went back through every router call of verl's updates at the
    DP scale (1 here): catches an aux gradient scaled to 0 or never reaching backward, which
    `applied` (the setting) cannot."""
    row = history(run3[0])[3]
    assert row["actor/moe/aux_loss/applied"] == 1.0
    assert row["actor/moe/aux_loss/grad_scale"] == 1.0
    assert row["actor/moe/update/tokens"] > 0 and row["actor/moe/old_log_prob/tokens"] > 0
    assert "actor/timing/comm_share" in row and row["actor/timing/forward_backward_s"] > 0
    report = json.loads((run3[0] / "routing_report.json").read_text())
    assert report["steps"], "the routing report holds the run's steps"
    # its step axis is verl's: 4 updates (mini-batches) in each of the 3 trainer steps
    assert [s["trainer_step"] for s in report["steps"]] == [1] * 4 + [2] * 4 + [3] * 4
    assert report["meta"]["run"] == "tiny-qwen3-moe-cpu-tp1-ep1"
    assert report["meta"]["trainer_steps"] == 3


def test_the_console_shows_a_line_per_step_and_the_summary_last(run3):
    """Everything verl, Ray and the workers print is in the run's log; the console has a line
    per step, each warning once, and the summary last (the 35-step run: under 300 lines)."""
    out, proc = run3
    lines = proc.stdout.splitlines()
    steps = [m.groups() for line in lines if (m := STEP_ROW.match(line))]
    assert steps == [("1", "3"), ("2", "3"), ("3", "3")]
    assert len(lines) - len(steps) <= CONSOLE_FIXED and 35 + CONSOLE_FIXED < 300
    assert lines[-1].startswith("wall time: ") and "alarms: none" in lines
    log = out / "logs" / "launch_000.log"
    assert f"log: {log}" in lines
    logged = log.read_text()
    assert re.search(r"step:3 - .*actor/entropy:", logged)  # verl's own step line, in full
    assert "target_num_threads" not in logged  # TQ_NUM_THREADS fits the machine's cores
    assert len(logged.splitlines()) > 10 * len(lines)


def test_checkpoints_in_verls_layout_and_the_export_reloads(run3):
    out, proc = run3
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    from recipes.dapo.weights import is_complete

    for step in (2, 3):  # step 2 written in the background and sealed later, 3 the last
        actor = ckpt / f"global_step_{step}" / "actor"
        assert (actor / "model" / "dist_ckpt" / ".metadata").is_file()
        assert (actor / "optim" / "dist_ckpt" / ".metadata").is_file()
        assert is_complete(actor)  # every directory sealed with its manifest
        assert json.loads((actor / "meta.json").read_text())["global_step"] == step
    # verl's own data.pt: the exact allow-list the launcher and the engine check it with
    from converters.safe_pickle import TORCH_SAVE_ALLOWED
    from recipes.dapo.resume import check_data_state
    from tests.test_resume import pickled_globals

    check_data_state(ckpt / "global_step_2")
    assert pickled_globals(ckpt / "global_step_2" / "data.pt") == TORCH_SAVE_ALLOWED
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export_max_logits_diff"] < 1e-4
    assert (out / "export_hf" / "config.json").is_file()
    assert (out / "reward_curve.png").is_file()
    assert "export reloads in transformers" in proc.stdout


# The resume checks, as helpers another launch can call: tag the training prompts before the
# killed run, read its dataloader position from a save, then check the resumed run's load line
# and the prompts of its first step.


def tag_train_rows(data: Path) -> int:
    """Rewrite data/train.parquet with each prompt prefixed by its row ("17*3+3="), so that the
    rows a run trains on can be read from its rollout dump; same rows, order and lengths of
    the dataloader's epoch. Returns the row count."""
    import pandas as pd

    train = pd.read_parquet(data / "train.parquet")
    train["prompt"] = [
        [{**turn, "content": f"{row}*{turn['content']}"} for turn in prompt]
        for row, prompt in enumerate(train["prompt"])
    ]
    train.to_parquet(data / "train.parquet")
    return len(train)


def sampler_state(data_pt: Path, rows: int) -> tuple[int, list[int]]:
    """(prompts drawn so far, the epoch's order of rows) of verl's dataloader state
    (torchdata's StatefulDataLoader, RandomSampler: randperm from the saved generator)."""
    import torch

    state = torch.load(data_pt, weights_only=True)["_sampler_iter_state"]
    generator = torch.Generator().set_state(state["sampler_iter_state"]["generator"])
    return state["samples_yielded"], torch.randperm(rows, generator=generator).tolist()


def trained_rows(dump: Path) -> set[int]:
    """Row indices of the prompts in verl's rollout dump of a step (trainer.rollout_data_dir)."""
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    return {int(re.search(r"(\d+)\*\d\+\d=", row["input"])[1]) for row in lines}


def checkpoint_norm(actor: Path, template: Path, tmp: Path) -> float:
    """The checkpoint's weights' L2 norm, read by the converters (not megatron-core)."""
    from converters.cli import main as converters_main
    from converters.hf_io import read_state_dict
    from tests.test_verl_engine import weights_norm_of

    argv = ["mcore-to-hf", str(actor), str(tmp), "--template", str(template), "--no-progress"]
    assert converters_main(argv) == 0
    return weights_norm_of(read_state_dict(tmp).values())


def check_resumed_weights(log: str, saved: Path, step: int, template: Path, tmp: Path) -> None:
    """The engine's load line in `log` names `saved` (a global_step_N folder): its global
    step, the optimizer update its schedule recorded, and the norm of its weights as the
    converters read them (a no-op load: update 0 and the HF weights' norm)."""
    from tests.test_verl_engine import loaded_line

    loaded_step, update, norm = loaded_line(log, saved / "actor")
    schedule = json.loads((saved / "actor/optim/dist_ckpt/schedule.json").read_text())
    assert (loaded_step, update) == (step, schedule["updates"]) and update > 0
    assert norm == pytest.approx(checkpoint_norm(saved / "actor", template, tmp), rel=1e-9)


def check_resumed_prompts(
    killed: tuple[int, list[int]], resumed: Path, dump: Path, rows: int, batch: int = 8
) -> None:
    """The first resumed step trained (rollout dump `dump`) the `batch` prompts after the
    killed run's position (`killed`: its save's sampler_state) and before the resumed save's
    (`resumed`: a global_step_N folder): the dataloader state was restored (without data.pt
    the epoch starts again: the first prompts)."""
    drawn, order = killed
    drawn_after, _ = sampler_state(resumed / "data.pt", rows)
    positions = sorted(order.index(row) for row in trained_rows(dump))
    assert len(positions) == batch and drawn <= positions[0] and positions[-1] < drawn_after, (
        f"the resumed step trained the prompts at positions {positions}; the killed run had "
        f"drawn {drawn}, the resumed one {drawn_after}"
    )


@pytest.mark.trainer_flow
def test_resume_after_a_kill_continues_from_the_last_save(run3, tmp_path):
    """A run killed while writing its step-3 save in the background: its step-2 save is the
    newest complete one; resume_mode=auto loads it (one line says why) and trains step 3,
    whose save replaces the half-written one. Checked from inside the resumed run: the
    engine's load line names the checkpoint's step and update and its weights' norm (read
    from the files by the converters), and the prompts of step 3 are the dataloader's next
    ones after the killed run's position (data.pt). Catches a no-op load
    (recipes/dapo/engine.py's load_checkpoint reading neither model nor optimizer state:
    update 0, the HF weights' norm) and a dataloader not restored (the save's data.pt
    missing: step 3 draws the epoch's first prompts again).

    On the 0.16.1 set only (trainer_flow): what differs by release is the engine's checkpoint
    load, tested on both (tests/test_verl_engine.py, tests/test_pipeline_engine.py)."""
    src, _ = run3
    out = resumable_copy(src, tmp_path / "resumed")
    train_rows = tag_train_rows(out / "data")
    saved = out / "checkpoints" / "global_step_2"
    killed = sampler_state(saved / "data.pt", train_rows)  # where the killed run was
    half = out / "checkpoints" / "global_step_3"
    shutil.copytree(src / "checkpoints" / "global_step_3", half)
    for d in half.glob("actor/*/dist_ckpt"):  # as a kill before the writes were finalized
        for name in (".metadata", "metadata.json", "manifest.json"):
            (d / name).unlink()
    rows = (src / "metrics" / "launch_000.jsonl").read_text().splitlines()
    # the killed run logged steps 1-2 and half a line of step 3
    (out / "metrics").mkdir()
    (out / "metrics" / "launch_000.jsonl").write_text("\n".join(rows[:2]) + "\n" + rows[2][:40])
    dump = out / "rollouts"
    proc = launch(out, "--resume", "--steps", "3",
                  overrides=("trainer.save_freq=2", f"trainer.rollout_data_dir={dump}"))  # fmt: skip
    assert proc.returncode == 0
    assert "Resuming from" in (out / "logs" / "launch_001.log").read_text()
    assert (
        f"resuming from {out / 'checkpoints/global_step_2'}, the newest complete checkpoint: "
        f"{half} was not completely written" in proc.stdout
    )
    log = (out / "logs" / "launch_001.log").read_text()  # the console shows less
    check_resumed_weights(log, saved, 2, src / "tiny_hf", tmp_path / "hf")
    check_resumed_prompts(killed, out / "checkpoints/global_step_3", dump / "3.jsonl", train_rows)
    resumed = history(out)
    assert sorted(resumed) == [1, 2, 3]
    # the rollout got the loaded weights through the sync: its log-probs are the actor's
    assert resumed[3]["training/rollout_probs_diff_max"] < SYNC_TOLERANCE
    assert resumed[3]["training/global_step"] == 3
    assert (
        json.loads((out / "checkpoints/global_step_3/actor/meta.json").read_text())["global_step"]
        == 3
    )
    from recipes.dapo.weights import is_complete

    assert is_complete(half / "actor")  # written again by the resumed run, and sealed


def resumable_copy(src: Path, out: Path) -> Path:
    """A run directory holding run3's model, data and its step-2 save as the latest."""
    shutil.copytree(src / "tiny_hf", out / "tiny_hf")
    shutil.copytree(src / "data", out / "data")
    shutil.copytree(src / "checkpoints" / "global_step_2", out / "checkpoints" / "global_step_2")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    return out


@pytest.mark.trainer_flow
def test_a_checkpoint_the_engine_refuses_ends_the_resume_in_one_line(run3, tmp_path):
    """Tensor bytes changed after the save: the launcher's checks (the pickles) pass them and
    the engine's manifest check refuses them in verl's actor worker. Through Ray and verl's
    driver that reaches the user as the engine's one line and exit 2, the traceback only in
    the launch's log. The relaunch ends at verl's checkpoint load, before any step."""
    out = resumable_copy(run3[0], tmp_path / "damaged")
    model = out / "checkpoints" / "global_step_2" / "actor" / "model" / "dist_ckpt"
    chunks = json.loads((model / "manifest.json").read_text())["files"]["__0_0.distcp"]
    offset, length, _ = max(chunks["chunks"], key=lambda chunk: chunk[1])  # a tensor's
    raw = bytearray((model / "__0_0.distcp").read_bytes())
    raw[offset + length // 2] ^= 0xFF
    (model / "__0_0.distcp").write_bytes(bytes(raw))
    proc = launch(out, "--resume", "--steps", "3")
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
    assert "Traceback (most recent call last)" in logged


@pytest.mark.trainer_flow
def test_tp2_ep2_on_two_ranks_with_packed_sequences(tmp_path):
    """Two ranks (tp2/ep2) with mcore_ep.packed=true (THD micro-batches) in verl's own DAPO
    loop: the actor's old log-probs still equal the rollout's after every sync (the padded
    path runs in the world-1 run above; one launch covers both the plan and the packing).
    On the 0.16.1 set only (trainer_flow): packed tp2/ep2 engine parity runs on both releases
    (tests/test_packed.py, tests/test_verl_engine_multiproc.py)."""
    proc = launch(tmp_path, "--tp", "2", "--ep", "2", "--steps", "2",
                  overrides=("trainer.save_freq=2",
                             "actor_rollout_ref.actor.mcore_ep.packed=true"))  # fmt: skip
    assert proc.returncode == 0
    rows = history(tmp_path)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["training/rollout_probs_diff_max"] < SYNC_TOLERANCE
    meta = json.loads((tmp_path / "checkpoints/global_step_2/actor/meta.json").read_text())
    assert meta["plan"]["tp"] == 2 and meta["plan"]["ep"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["export_max_logits_diff"] < 1e-4
