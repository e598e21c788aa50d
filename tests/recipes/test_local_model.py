"""The local run's `--model` (recipes.launcher.local_model): mini by default where
parallel.models defines it, tiny, or the user's own HF Qwen3-MoE directory, which the dry run
names, the launch trains in place and the finish exports against. The broken directories
are rows of tests/support/bad_inputs_model.py."""

import shutil
from pathlib import Path

import pytest

from recipes.dapo.cluster import ray_job
from recipes.dapo.console import health_report
from recipes.launcher import launch, resolution, run_spec
from recipes.local import run as local_run
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    """A small valid HF Qwen3-MoE directory with its tokenizer: the tiny model, renamed."""
    from recipes.local.task.built_models import make_built

    built = make_built(tmp_path_factory.mktemp("built"), "tiny")
    return Path(shutil.copytree(built, tmp_path_factory.mktemp("user") / "my_moe"))


def _resolve(argv: list[str]):
    """The local run's resolution, its directory and its model (recipes.launcher.run_spec)."""
    spec = spec_of(["--device", "cpu", *argv])
    return resolution.resolve_local(spec), spec.out, spec.local


def test_a_dry_run_on_a_valid_dir_names_it_and_writes_nothing(user_model, tmp_path, capsys):
    """Catches --model DIR refused as cluster-only, or the dry run still naming the tiny model."""
    out = tmp_path / "run"
    assert launch.main(["--device", "cpu", "--model", str(user_model), "--ckpt-dir", str(out),
                        "--dry-run"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert f"model: {user_model} (8 experts, top-2; your HF Qwen3-MoE, used in place)" in printed
    assert f"actor_rollout_ref.model.path={user_model}" in printed
    assert "tiny_hf" not in printed and not out.exists()


@pytest.mark.parametrize("how", ["--model", "pass-through"])
def test_the_launch_trains_and_finishes_on_the_users_dir(how, user_model, tmp_path, monkeypatch):
    """Catches the bug users met: the run trained DIR, then the finish exported against
    <out>/tiny_hf (`checkpoint has global shape (32, 128), tiny_hf implies (32, 64)`). Either
    way of naming DIR, verl gets it, no tiny model is built, and finish gets DIR."""
    started, finished = [], []
    monkeypatch.setattr(run_spec, "pick_device", lambda requested: "cpu")
    monkeypatch.setattr(ray_job, "run_command", lambda cmd, *a, **k: started.append(cmd) or 0)
    monkeypatch.setattr(
        local_run, "finish", lambda out, model, *a, **k: finished.append(model) or 0
    )
    out = tmp_path / "run"
    named = (["--model", str(user_model)] if how == "--model"
             else ["--", f"actor_rollout_ref.model.path={user_model}"])  # fmt: skip
    assert launch.main(["--steps", "2", "--ckpt-dir", str(out), *named]) == 0
    assert f"actor_rollout_ref.model.path={user_model}" in started[0]
    assert finished == [user_model]
    assert not [p.name for p in out.iterdir() if p.name.endswith("_hf")]  # used in place


def test_finish_exports_against_the_model_it_is_given(user_model, tmp_path, monkeypatch):
    """The finish's export and reload check take the trained model's dir as their template
    (a fake run dir: a checkpoint path, no verl)."""
    from recipes.local import export

    actor, templates = tmp_path / "checkpoints" / "global_step_3" / "actor", []
    monkeypatch.setattr(health_report, "latest_actor_checkpoint", lambda root: actor)
    monkeypatch.setattr(health_report, "routing_report", lambda *a: {})
    monkeypatch.setattr(
        export, "check_export", lambda a, template, o: templates.append((a, template)) or (o, 0.0)
    )
    (tmp_path / "metrics").mkdir()
    summary = local_run._finish_files(tmp_path, user_model, 1.0, 1.0, 0.9, 1)
    assert templates == [(actor, user_model)]
    assert summary["model"] == str(user_model) and summary["export"] == str(tmp_path / "export_hf")


def test_trained_model_is_what_verl_was_given(user_model, tmp_path):
    """`trained_model` reads the merged overrides: the built model by default, the user's
    directory through --model or the pass-through override."""
    out = tmp_path / "run"
    default, _, model = _resolve(["--ckpt-dir", str(out), "--dry-run"])
    assert local_run.trained_model(default.groups) == out / "sft_hf" == model.path  # mini, warmed
    for argv in (
        ["--model", str(user_model)],
        ["--", f"actor_rollout_ref.model.path={user_model}"],
    ):
        resolved, _, _ = _resolve(["--ckpt-dir", str(out), "--dry-run", *argv])
        assert local_run.trained_model(resolved.groups) == user_model


MINI = dict(num_experts=128, num_experts_per_tok=8)  # a stand-in shape: tiny with 128 experts


def test_mini_only_where_parallel_models_defines_it(tmp_path, monkeypatch, capsys):
    """Catches `--model mini` building a model this tree has no shape for; where the shape
    exists, the run builds it in <out>/mini_hf, never the tiny_hf an earlier tiny run left
    in the directory (its config is not read for the plan either)."""
    import parallel.models
    from parallel.models import TINY_QWEN3_MOE

    out = tmp_path / "run"
    (out / "tiny_hf").mkdir(parents=True)
    (out / "tiny_hf" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    monkeypatch.delattr(parallel.models, "MINI_QWEN3_MOE", raising=False)
    assert launch.main(["--device", "cpu", "--model", "mini", "--ckpt-dir", str(out)]) == 2
    assert "has no MINI_QWEN3_MOE, so the mini model is not available" in capsys.readouterr().err
    monkeypatch.setattr(parallel.models, "MINI_QWEN3_MOE", {**TINY_QWEN3_MOE, **MINI},
                        raising=False)  # fmt: skip
    resolved, _, model = _resolve(["--model", "mini", "--ckpt-dir", str(out), "--dry-run"])
    assert model.path == out / "sft_hf" and local_run.trained_model(resolved.groups) == model.path
    assert resolved.model_line == (
        "model: mini (128 experts, top-8; built, then an SFT warm-up on the sums task, once, "
        f"in {model.path})"
    )
    assert sorted(p.name for p in out.iterdir()) == ["tiny_hf"]  # the dry run wrote nothing


def test_warmup_steps_belong_to_the_mini_model(tmp_path, capsys):
    """--warmup-steps on a model without a warm-up is one line, exit 2, before anything is
    written: catches a flag silently ignored (the user believes the policy was warmed)."""
    code = launch.main(["--device", "cpu", "--model", "tiny", "--ckpt-dir", str(tmp_path / "r"), "--warmup-steps",
                        "5", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--warmup-steps applies to --model mini" in err
    assert not (tmp_path / "r").exists()
    resolved, out, model = _resolve(["--model", "mini", "--ckpt-dir", str(tmp_path / "m")])
    assert model.warmed and model.path == out / "sft_hf" and resolved.run.task == "sums"
    assert "SFT warm-up on the sums task" in resolved.describe()


def test_task_flag_picks_the_mini_models_variant_and_only_its(tmp_path, capsys):
    """--task guessing_sums: the variant's steps reach verl, the dry run names the task; on the
    tiny model it is one line, exit 2, nothing written; --resume of a run made on the other
    task is refused. Catches a flag silently ignored or a resume onto another task's data."""
    from recipes.dapo.job.overrides import value_of

    resolved, out, model = _resolve(["--task", "guessing_sums", "--ckpt-dir", str(tmp_path / "m"),
                                     "--dry-run"])  # fmt: skip
    assert model.task == resolved.run.task == "guessing_sums" and model.warmed
    groups = resolved.groups
    assert value_of(groups, "data.max_response_length") == 48
    assert value_of(groups, "trainer.total_training_steps") == 40
    assert "SFT warm-up on the guessing_sums task" in resolved.model_line
    code = launch.main(["--device", "cpu", "--model", "tiny", "--task", "guessing_sums",
                        "--ckpt-dir", str(tmp_path / "t")])  # fmt: skip
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and "--task guessing_sums is a task of --model mini" in err
    )
    assert not (tmp_path / "t").exists()
    (out / "data").mkdir(parents=True)
    (out / "data" / "task.json").write_text('{"task": "sums"}')
    (out / "checkpoints" / "global_step_2").mkdir(parents=True)
    code = launch.main(["--device", "cpu", "--task", "guessing_sums", "--ckpt-dir", str(out),
                        "--resume", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--resume: the run in" in err and "trained on the sums task" in err


def test_data_of_another_task_is_made_again_with_its_warmup(tmp_path, monkeypatch):
    """A directory a tiny (doubles) or sums run prepared, relaunched on guessing_sums: its data is
    made for the new task and the old warm-up's export is dropped (it learnt the other corpus).
    Catches a run training the variant on the default's data or from its warm-up."""
    from recipes.local import warmup

    warmed = []
    monkeypatch.setattr(warmup, "warm_up", lambda out, base, sft, steps: warmed.append(sft) or out)
    out = tmp_path / "run"
    _, files = local_run.prepare(out, model="tiny")
    assert local_run.data_task(out) == "doubles" and set(files) == {"train", "val"}
    (out / "sft_hf").mkdir()
    (out / "sft_hf" / "tokenizer.json").write_text("{}")  # an earlier warm-up's export
    _, files = local_run.prepare(out, model="tiny", task="guessing_sums")
    assert local_run.data_task(out) == "guessing_sums" and set(files) == {"train", "val", "sft"}
    assert warmed == [files["sft"]] and not (out / "sft_hf").exists()
    _, again = local_run.prepare(out, model="tiny", task="guessing_sums")  # made once
    assert again == files and len(warmed) == 2  # warm_up is asked, and finds its own export
