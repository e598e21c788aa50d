"""The step benchmark runs every system on the tiny preset (CPU) and writes a complete JSON:
what the one-GPU run relies on, kept working between device sessions."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "step_bench", ROOT / "scripts/bench/step_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.bench
def test_tiny_preset_times_every_system(world1, tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = [
        "--preset",
        "tiny",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--breakdown",
        "--out",
        str(out),
        "--systems",
        "ours,mcore-local,hf-grouped_mm,hf-eager",
    ]
    doc = _bench().main(argv)
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == doc
    assert doc["settings"]["complete"] and doc["shape"]["tokens"] == 128
    by_name = {r["system"]: r for r in doc["results"]}
    assert list(by_name) == ["ours", "mcore-local", "hf-grouped_mm", "hf-eager"]
    for name, result in by_name.items():
        assert "error" not in result, (name, result.get("error"))
        assert result["ms_per_step"] > 0 and result["tokens_per_s"] > 0, name
        assert result["vs_hf_grouped_mm"]["speedup"] > 0, name
    assert "experts='grouped', attention='sdpa'" in by_name["ours"]["build"]
    assert "experts='sequential', attention='local'" in by_name["mcore-local"]["build"]
    phases = by_name["ours"]["breakdown"]["phases_ms"]
    assert phases["experts"] > 0 and phases["attention_core"] > 0
