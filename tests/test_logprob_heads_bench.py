"""The log-prob heads benchmark runs end to end at a toy size (its children, its table)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.bench
def test_toy_run_measures_every_head_and_pass(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("lph", ROOT / "scripts/bench/logprob_heads.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "b.json"
    argv = [
        "--tokens",
        "256",
        "--seq",
        "128",
        "--vocab",
        "512",
        "--hidden",
        "64",
        "--out",
        str(out),
    ]
    results = bench.main([*argv, "--repeats", "0", "--threads", "1"])
    assert {(r["head"], r["pass"]) for r in results} == {
        (h, p) for h in bench.HEADS for p in bench.PASSES
    }
    assert all(r["seconds"] > 0 for r in results)
    assert json.loads(out.read_text())["results"] == results
    assert "mem ratio" in capsys.readouterr().out
