"""The SFT warm-up: verl's own SFT trainer (verl/trainer/sft_trainer.py) on our mcore_ep engine,
exported to the HF folder RL starts from (recipes.local.warmup)."""

import pytest

from recipes.local.warmup import WarmupError, last_metrics, sft_config, warm_up

pytestmark = pytest.mark.trainer_flow  # a launch of verl's (SFT) trainer: the 0.16.1 set


def test_sft_config_is_verls_with_our_engine_section(tmp_path):
    """verl's sft_trainer_engine.yaml, composed from its package, with the FSDP engine section
    replaced by ours: catches a config verl's TrainingWorker would build its FSDP engine
    from, or one whose engine section our config class refuses."""
    from verl.utils.config import omega_conf_to_dataclass

    from recipes.dapo.engine.config import McoreEpEngineConfig

    cfg = sft_config(tmp_path / "m", tmp_path / "d.parquet", tmp_path / "o", 7,
                     {"tp": 1, "ep": 2}, world=2)  # fmt: skip
    engine = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(engine, McoreEpEngineConfig)
    assert (engine.strategy, engine.expert_model_parallel_size) == ("mcore_ep", 2)
    assert (
        cfg.model.external_lib == "recipes.dapo.engine.verl_engine"
    )  # registers mcore_ep in the ranks
    assert cfg.trainer.total_training_steps == 7 and cfg.data.pad_mode == "no_padding"


def test_a_failed_warm_up_names_its_log_and_leaves_no_model(tmp_path):
    """Catches a failed SFT taken for a model (RL would start from the random weights) or an
    error that hides where the trainer's traceback is. (The warm-up that works: the mini
    model's in tests/recipes/test_verl_cpu_trainer.py, before its RL steps.)"""
    from recipes.local.task.built_models import make_built

    base = make_built(tmp_path, "tiny")
    with pytest.raises(WarmupError, match=r"SFT warm-up failed \(exit \d+\): see .*log.txt"):
        warm_up(tmp_path, base, tmp_path / "missing.parquet", steps=2, say=lambda _: None)
    assert not (tmp_path / "sft_hf").exists()
    assert "Traceback" in (tmp_path / "warmup" / "log.txt").read_text()


def test_a_warmed_model_is_made_once_per_run_directory(tmp_path):
    """A relaunch in the directory (a resume) reuses the warmed model without starting the
    trainer: catches a warm-up that reruns and hands RL a different starting policy than
    its checkpoints came from."""
    sft = tmp_path / "sft_hf"
    sft.mkdir()
    (sft / "tokenizer.json").write_text("{}")
    lines: list[str] = []
    assert warm_up(tmp_path, tmp_path / "base", tmp_path / "none.parquet", say=lines.append) == sft
    assert lines == [] and not (tmp_path / "warmup").exists()


def test_last_metrics_skips_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "data": {"train/loss": 2.0}}\n{"step": 2, "da')
    assert last_metrics(path)["step"] == 1 and last_metrics(tmp_path / "none") == {}
