"""The SFT warm-up: verl's own SFT trainer (verl/trainer/sft_trainer.py) on our mcore_ep engine,
exported to the HF folder RL starts from (recipes.local.warmup)."""

import pytest

from recipes.local.warmup import WarmupError, last_metrics, sft_config, warm_up

pytestmark = pytest.mark.trainer_flow  # a launch of verl's (SFT) trainer: the 0.16.1 set


def test_sft_config_is_verls_with_our_engine_section(tmp_path):
    """verl's sft_trainer_engine.yaml, composed from its package, with the FSDP engine section
    replaced by ours: catches a config verl's TrainingWorker would build its FSDP engine
    from, one whose engine section our config class refuses, or a warm-up on other modules
    than the RL run's."""
    from verl.utils.config import omega_conf_to_dataclass

    from recipes.dapo.engine.config import McoreEpEngineConfig

    cfg = sft_config(tmp_path / "m", tmp_path / "d.parquet", tmp_path / "o", 7,
                     {"tp": 1, "ep": 2}, world=2)  # fmt: skip
    engine = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(engine, McoreEpEngineConfig)
    assert (engine.strategy, engine.expert_model_parallel_size) == ("mcore_ep", 2)
    # the RL run's modules, not the megatron-core reference "auto" picks on CPU (1.8x slower)
    assert (engine.experts, engine.attention, engine.packed) == ("grouped", "sdpa", True)
    # no heap trim at verl's per-step offload: the next step faulted it back in, +20% a step
    assert engine.cpu_trim_heap == "off"
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


def _inputs(tmp_path):
    """A base model directory and an SFT corpus, as files (the key reads their bytes)."""
    base, corpus = tmp_path / "mini_hf", tmp_path / "sft.parquet"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (base / "model.safetensors").write_bytes(b"weights")
    corpus.write_bytes(b"corpus")
    return base, corpus


def test_the_warm_up_key_follows_everything_that_decides_it(tmp_path):
    """Catches a cache that would hand one warm-up to another: a different seed (weights),
    corpus, step count or setting gives another key; the same inputs the same key."""
    from recipes.local.warmup import WARMUP
    from recipes.local.warmup_cache import warmup_key

    base, corpus = _inputs(tmp_path)
    key = warmup_key(base, corpus, 200, WARMUP)
    assert key == warmup_key(base, corpus, 200, dict(WARMUP)) and len(key) == 16
    # two data-parallel ranks sum the gradient in another order than one: another warm-up
    assert warmup_key(base, corpus, 200, {**WARMUP, "ranks": 1}) != warmup_key(
        base, corpus, 200, {**WARMUP, "ranks": 2})  # fmt: skip
    assert key != warmup_key(base, corpus, 201, WARMUP)
    assert key != warmup_key(base, corpus, 200, {**WARMUP, "lr": 1e-3})
    corpus.write_bytes(b"another corpus")
    assert key != warmup_key(base, corpus, 200, WARMUP)
    corpus.write_bytes(b"corpus")
    (base / "model.safetensors").write_bytes(b"other weights")
    assert key != warmup_key(base, corpus, 200, WARMUP)


def test_a_new_run_directory_reuses_an_identical_warm_up(tmp_path):
    """The issue-56 rerun: a second run directory with the same model, corpus and steps gets
    the cached warm-up copied in (its bytes checked against the manifest), says so in one
    line, and starts no trainer (its work directory is never made)."""
    from recipes.local.warmup import warmup_settings
    from recipes.local.warmup_cache import cache_root, keep, warmup_key

    base, corpus = _inputs(tmp_path)
    made = tmp_path / "made"
    made.mkdir()
    (made / "tokenizer.json").write_text('{"made": 1}')
    (made / "model.safetensors").write_bytes(b"trained")
    out = tmp_path / "runs" / "second"
    out.mkdir(parents=True)
    root = cache_root(out)
    assert root == tmp_path / "runs" / ".warmup_cache"
    keep(root, warmup_key(base, corpus, 200, warmup_settings()), made)
    lines: list[str] = []
    final = warm_up(out, base, corpus, steps=200, say=lines.append)
    assert final == out / "sft_hf" and (final / "model.safetensors").read_bytes() == b"trained"
    assert len(lines) == 1 and lines[0].startswith(f"warm-up: reused {root}/")
    assert not (out / "warmup").exists()


def test_a_damaged_cache_entry_is_made_again_never_trained_from(tmp_path):
    """Catches a flipped byte in the cache reaching RL: the entry fails its manifest, is
    removed with one line, and the warm-up runs again (here it fails: no real corpus, so the
    trainer's own error shows that it ran)."""
    from recipes.local.warmup import warmup_settings
    from recipes.local.warmup_cache import cache_root, keep, lookup, warmup_key

    base, corpus = _inputs(tmp_path)
    made = tmp_path / "made"
    made.mkdir()
    (made / "model.safetensors").write_bytes(b"trained")
    out = tmp_path / "runs" / "r"
    out.mkdir(parents=True)
    key = warmup_key(base, corpus, 200, warmup_settings())
    entry = keep(cache_root(out), key, made)
    (entry / "model.safetensors").write_bytes(b"trainee")  # same size, other bytes
    lines: list[str] = []
    assert lookup(cache_root(out), key, lines.append) is None and not entry.exists()
    assert len(lines) == 1 and "does not match its manifest" in lines[0]
    assert lines[0].endswith("making it again")


def test_the_ranks_share_the_cores_and_a_failed_rank_ends_the_others(tmp_path):
    """The warm-up's two data-parallel ranks: one world (distinct ranks, one port), the cores
    shared out; a rank that fails ends the one waiting on it (in a collective it would wait
    forever) and its exit code is the warm-up's. Bug caught: a hung warm-up after a crash."""
    import json
    import os
    import sys
    import time

    from recipes.local.warmup import _run_ranks

    record = ("import json, os; keys = ('RANK', 'WORLD_SIZE', 'MASTER_PORT', 'OMP_NUM_THREADS');"
              f"open({str(tmp_path)!r} + '/r' + os.environ['RANK'], 'w').write("
              "json.dumps([os.environ[k] for k in keys]))")  # fmt: skip
    with open(tmp_path / "log.txt", "w") as sink:
        assert _run_ranks([sys.executable, "-c", record], 2, tmp_path / "m", sink, None) == 0
    (r0, w0, port0, omp0), (r1, w1, port1, omp1) = (
        json.loads((tmp_path / f"r{r}").read_text()) for r in (0, 1))  # fmt: skip
    assert (r0, r1, w0, w1) == ("0", "1", "2", "2") and port0 == port1
    assert int(omp0) == int(omp1) == max(1, (os.cpu_count() or 1) // 2)
    crash = "import os, sys, time; time.sleep(60) if os.environ['RANK'] == '0' else sys.exit(3)"
    began = time.perf_counter()
    with open(tmp_path / "log.txt", "w") as sink:
        assert _run_ranks([sys.executable, "-c", crash], 2, tmp_path / "m", sink, None) == 3
    assert time.perf_counter() - began < 15
