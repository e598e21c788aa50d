"""The launcher's local run before Ray: a rerun never deletes the last run (it is moved to
<dir>.<UTC timestamp>, byte for byte), a dry run writes nothing, and Hydra's `+key=` and
`~key` pass-through overrides reach verl as written. The bad inputs (plans, counts, --resume,
unknown keys) are rows of tests/support/bad_inputs.py."""

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from recipes.dapo.cluster import ray_job
from recipes.dapo.job import overrides
from recipes.launcher import launch, resolution
from tests.support import oracles
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: a file's sha256, a directory's marker."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "/"
        for p in sorted(root.rglob("*"))
    }


def fake_verl(step_bytes: bytes, seen: list):
    """verl's trainer as far as the run's directory sees it: a checkpoint and its tracker."""

    def run_command(cmd, env, *args, **kwargs):
        ckpt = Path(
            next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.default_local_dir="))
        )
        seen.append(sorted(p.name for p in ckpt.parent.iterdir()))  # what the run started in
        step = ckpt / "global_step_10" / "actor"
        step.mkdir(parents=True)
        (step / "weights.bin").write_bytes(step_bytes)
        (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
        Path(env["VERL_FILE_LOGGER_PATH"]).write_text('{"step": 1, "data": {}}\n')
        return 0

    return run_command


def test_a_rerun_moves_the_last_run_aside_and_deletes_nothing(tmp_path, monkeypatch, capsys):
    """Catches a second launch without --resume deleting the first one's checkpoints, metrics
    and logs (it removed them as "starting over"): two launches in one directory, the first
    one's files afterwards in <dir>.<timestamp>, byte for byte; the dry run between them says
    so and changes nothing."""
    from backend.qwen3_moe import load_qwen3_moe_spec
    from recipes.local import run as local_run
    from recipes.local.cpu.rollout_limits import problems
    from recipes.local.task.doubles import VOCAB_SIZE

    monkeypatch.setattr(local_run, "finish", lambda *args, **kwargs: 0)
    out, seen = tmp_path / "run", []
    monkeypatch.setattr(ray_job, "run_command", fake_verl(b"first run", seen))
    assert (
        launch.main(["--device", "cpu", "--model", "tiny", "--steps", "2", "--ckpt-dir", str(out)])
        == 0
    )
    first = snapshot(out)
    assert (
        "checkpoints/global_step_10/actor/weights.bin" in first and "logs/launch_000.log" in first
    )
    # what the dry run checked in memory is what the launch wrote
    written = json.loads((out / "tiny_hf" / "config.json").read_text())
    shapes = [  # what the plan's checks and the rollout's limits read (not the aux coefficient)
        {**asdict(load_qwen3_moe_spec(c)), "router_aux_loss_coef": None}
        for c in (oracles.tiny_hf_config(), written)
    ]
    assert shapes[0] == shapes[1]
    assert problems(out / "tiny_hf") == [] and written["vocab_size"] == VOCAB_SIZE
    capsys.readouterr()

    assert (
        launch.main(["--device", "cpu", "--model", "tiny", "--ckpt-dir", str(out), "--dry-run"])
        == 0
    )
    assert snapshot(out) == first and len(list(tmp_path.iterdir())) == 1
    assert f"a launch without --resume moves the last run in {out} to {out}.<UTC timestamp>" in (
        capsys.readouterr().out
    )

    monkeypatch.setattr(ray_job, "run_command", fake_verl(b"second run", seen))
    assert (
        launch.main(["--device", "cpu", "--model", "tiny", "--steps", "2", "--ckpt-dir", str(out)])
        == 0
    )
    line = re.search(
        rf"moved the last run in {out} to (\S+) \(--resume would have", capsys.readouterr().out
    )
    moved = Path(line[1])
    assert re.fullmatch(r"run\.\d{8}T\d{6}Z", moved.name) and moved.parent == tmp_path
    assert snapshot(moved) == first  # every file of the first run, byte for byte
    assert seen[1] == ["data", "logs", "metrics", "tiny_hf"]  # it started afresh: no checkpoints
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["cleanup.log", "launch_000.log"]
    assert (out / "checkpoints/global_step_10/actor/weights.bin").read_bytes() == b"second run"
    assert sorted(p.name for p in (out / "metrics").iterdir()) == ["launch_000.jsonl"]
    # the moved run can still be continued where it now lies
    assert (
        launch.main(
            [
                "--device",
                "cpu",
                "--model",
                "tiny",
                "--resume",
                "--ckpt-dir",
                str(moved),
                "--dry-run",
            ]
        )
        == 0
    )


@pytest.mark.parametrize("where", ["default dir", "new dir", "used dir", "cluster"])
def test_a_dry_run_writes_nothing(where, tmp_path, monkeypatch, capsys):
    """Catches a dry run that writes: the local one made data/, tiny_hf/ and metrics/ in
    --ckpt-dir; the tree around --ckpt-dir (its parent) is the same after a dry run."""
    monkeypatch.chdir(tmp_path)  # the default --ckpt-dir, runs/local_dapo, is relative to it
    monkeypatch.setattr(ray_job, "run_command", lambda *a, **k: pytest.fail("started"))
    if where == "used dir":  # an earlier run's outputs, which a real launch would move
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("5")
    argv = {"default dir": [], "cluster": ["--device", "cuda"]}.get(
        where, ["--ckpt-dir", str(tmp_path / "run")]
    )
    if where == "cluster":
        argv += ["--ckpt-dir", str(tmp_path / "ckpt")]
    before = snapshot(tmp_path)
    assert launch.main([*argv, "--dry-run"]) == 0
    assert snapshot(tmp_path) == before
    assert ("moves the last run" in capsys.readouterr().out) == (where == "used dir")


def test_plus_and_tilde_overrides_reach_verl_as_written(tmp_path, monkeypatch):
    """Catches the schema check or the merge refusing Hydra's own syntax: `+key=` adds a key,
    `~key` deletes verl's (and drops ours, which is then not passed twice); verl composes the
    result."""
    from recipes.launcher.verl_schema import compose

    extra = ["+trainer.note=1", "~trainer.total_epochs", "~trainer.val_before_train",
             "~actor_rollout_ref.actor.mcore_ep.packed"]  # fmt: skip
    spec = spec_of(["--device", "cpu", "--ckpt-dir", str(tmp_path), "--dry-run", "--", *extra])
    resolved = resolution.resolve_local(spec)
    cli = overrides.to_cli(resolved.groups)
    assert {"+trainer.note=1", "~trainer.total_epochs", "~trainer.val_before_train"} <= set(cli)
    assert not [item for item in cli if "val_before_train=" in item or ".packed" in item]
    assert {"trainer.val_before_train", "actor_rollout_ref.actor.mcore_ep.packed"} <= set(
        resolved.replaced
    )
    cfg = compose([c for c in cli if "<" not in c])
    assert cfg.trainer.note == 1 and "total_epochs" not in cfg.trainer
    assert (
        "val_before_train" not in cfg.trainer
        and "packed" not in cfg.actor_rollout_ref.actor.mcore_ep
    )
