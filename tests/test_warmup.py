"""The SFT warm-up: verl's own SFT trainer (verl/trainer/sft_trainer.py) on our mcore_ep engine,
exported to the HF folder RL starts from (recipes.local.warmup)."""

import json

import pytest
import torch

from recipes.local.warmup import WarmupError, last_metrics, sft_config, warm_up

pytestmark = pytest.mark.trainer_flow  # a launch of verl's (SFT) trainer: the 0.16.1 set


def test_sft_config_is_verls_with_our_engine_section(tmp_path):
    """verl's sft_trainer_engine.yaml, composed from its package, with the FSDP engine section
    replaced by ours: catches a config verl's TrainingWorker would build its FSDP engine
    from, or one whose engine section our config class refuses."""
    from verl.utils.config import omega_conf_to_dataclass

    from recipes.dapo.config import McoreEpEngineConfig

    cfg = sft_config(tmp_path / "m", tmp_path / "d.parquet", tmp_path / "o", 7,
                     {"tp": 1, "ep": 2}, world=2)  # fmt: skip
    engine = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(engine, McoreEpEngineConfig)
    assert (engine.strategy, engine.expert_model_parallel_size) == ("mcore_ep", 2)
    assert cfg.model.external_lib == "recipes.dapo.engine"  # registers mcore_ep in the ranks
    assert cfg.trainer.total_training_steps == 7 and cfg.data.pad_mode == "no_padding"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    from recipes.local.models import make_built
    from recipes.local.sums import write_sums_data

    out = tmp_path_factory.mktemp("run")
    base = make_built(out, "tiny")
    data = write_sums_data(out / "data", train=8, val=2, sft=64)
    lines: list[str] = []
    warmed = warm_up(out, base, data["sft"], steps=3, say=lines.append)
    return out, base, warmed, lines


def test_warm_up_trains_our_engine_and_exports_the_model_rl_starts_from(warmed):
    """Three SFT steps on the tiny model: the loss falls, the export's weights are the trained
    ones (not the base's), its tokenizer and template the base's, and transformers reloads
    it. Catches an SFT pass that trains nothing (a loss mask or optimizer not wired through
    our engine), an export of the base model, or a folder RL's vLLM cannot read."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    out, base, sft, lines = warmed
    rows = [json.loads(x) for x in (out / "warmup" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["data"]["train/loss"] for r in rows]
    assert len(losses) == 3 and losses[-1] < losses[0]
    before, after = load_file(base / "model.safetensors"), load_file(sft / "model.safetensors")
    assert before.keys() == after.keys()
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(sft).chat_template == (
        AutoTokenizer.from_pretrained(base).chat_template
    )
    Qwen3MoeForCausalLM.from_pretrained(sft)
    assert lines[0].startswith("warm-up: 3 SFT steps") and lines[-1].startswith("warm-up: done")
    assert not (out / ".sft_hf.partial").exists()


def test_warm_up_is_made_once_per_run_directory(warmed):
    """A second launch in the directory (a resume) reuses the warmed model: catches a warm-up
    that reruns and hands RL a different starting policy than its checkpoints came from."""
    out, base, sft, _ = warmed
    stamp = (sft / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    assert warm_up(out, base, out / "missing.parquet", steps=3, say=lines.append) == sft
    assert lines == [] and (sft / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_failed_warm_up_names_its_log_and_leaves_no_model(tmp_path, warmed):
    """Catches a failed SFT taken for a model (RL would start from the random weights) or an
    error that hides where the trainer's traceback is."""
    _, base, _, _ = warmed
    with pytest.raises(WarmupError, match=r"SFT warm-up failed \(exit \d+\): see .*log.txt"):
        warm_up(tmp_path, base, tmp_path / "missing.parquet", steps=2, say=lambda _: None)
    assert not (tmp_path / "sft_hf").exists()
    assert "Traceback" in (tmp_path / "warmup" / "log.txt").read_text()


def test_last_metrics_skips_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "data": {"train/loss": 2.0}}\n{"step": 2, "da')
    assert last_metrics(path)["step"] == 1 and last_metrics(tmp_path / "none") == {}
