"""The step benchmark runs every system on the tiny preset (CPU) and writes a complete JSON:
what the one-GPU run relies on, kept working between device sessions."""

import importlib
import json

import pytest


def _script(name: str):
    """A module of scripts/bench/ (imported when a test needs it: torch and the model code)."""
    return importlib.import_module(f"scripts.bench.{name}")


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
    bench = _script("step_bench")
    doc = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out) == doc
    assert doc["settings"]["complete"] and doc["shape"]["tokens"] == 128
    assert (doc["settings"]["iters"], doc["settings"]["warmup"]) == (1, 1)
    assert doc["env"]["device"] == "cpu" and doc["settings"]["peak_tflops"] is None
    shape, (layers, batch, seq, preset) = doc["shape"], bench.PRESETS["tiny"]
    assert (shape["layers"], shape["batch"], shape["seq"]) == (layers, batch, seq)
    assert (shape["hidden"], shape["experts"], shape["top_k"], shape["vocab"]) == (
        preset["hidden_size"],
        preset["num_experts"],
        preset["num_experts_per_tok"],
        preset["vocab_size"],
    )
    assert shape["flops_per_step"] == _docstring_flops(shape)
    by_name = {r["system"]: r for r in doc["results"]}
    assert list(by_name) == ["ours", "mcore-local", "hf-grouped_mm", "hf-eager"]
    reference = by_name["hf-grouped_mm"]  # timed in this same process and run
    for name, result in by_name.items():
        assert "error" not in result, (name, result.get("error"))
        ms = result["ms_per_step"]  # one timed step: mean = median = min = max
        assert ms > 0 and ms == result["ms_median"] == result["ms_min"] == result["ms_max"], name
        assert result["ms_std"] == 0, name
        # the derived figures are the measured time's, in their units (ms, tokens/s, TFLOP/s)
        assert result["tokens_per_s"] == pytest.approx(128 / (ms / 1e3), rel=1e-3), name
        tflops = shape["flops_per_step"] / (ms / 1e3) / 1e12
        assert result["model_tflops"] == pytest.approx(tflops, rel=1e-3), name
        assert result["mfu"] is None and result["peak_mem_gib"] is None, name  # CPU, no peak
        versus = result["vs_hf_grouped_mm"]
        assert versus["speedup"] == pytest.approx(reference["ms_per_step"] / ms, abs=1e-3), name
        assert versus["peak_mem_ratio"] is None, name
    assert reference["vs_hf_grouped_mm"]["speedup"] == 1.0
    assert "experts='grouped', attention='sdpa'" in by_name["ours"]["build"]
    assert "experts='sequential', attention='local'" in by_name["mcore-local"]["build"]
    assert json.loads(by_name["hf-eager"]["build"])["experts"] == "eager"
    assert json.loads(by_name["hf-grouped_mm"]["build"])["experts"] == "grouped_mm"
    for name in ("ours", "mcore-local"):
        breakdown = by_name[name]["breakdown"]
        phases = breakdown["phases_ms"]
        assert phases["experts"] > 0 and phases["attention_core"] > 0, name
        assert sum(phases.values()) == pytest.approx(breakdown["total_ms"], abs=0.01), name
    assert "breakdown" not in by_name["hf-eager"]  # --breakdown profiles the mcore systems only


def _docstring_flops(shape: dict) -> int:
    """step_bench's module docstring: 6 * tokens * (layers * (q, k, v, o projections + top_k
    experts * 3 GEMMs + router) + H * V) + 6 * tokens * layers * heads * head_dim * seq."""
    h, q, kv = (
        shape["hidden"],
        shape["heads"] * shape["head_dim"],
        shape["kv_heads"] * shape["head_dim"],
    )
    per_layer = h * q + 2 * h * kv + q * h + shape["top_k"] * 3 * h * shape["moe_ffn"]
    per_layer += h * shape["experts"]
    matmuls = shape["layers"] * per_layer + h * shape["vocab"]
    attention = shape["layers"] * shape["heads"] * shape["head_dim"] * shape["seq"]
    return 6 * shape["tokens"] * (matmuls + attention)


def test_speedup_and_rates_follow_the_measured_times():
    """speed() and compare_to_reference() on set times: a wrong ratio or unit shows here."""
    step_results = _script("step_results")
    ctx = {"shape": {"flops_per_step": 4e12, "tokens": 1000}, "peak_tflops": 10.0}
    fast = dict(system="ours", **step_results.speed([100.0, 200.0, 300.0], ctx), peak_mem_gib=2.0)
    assert (fast["ms_per_step"], fast["ms_median"], fast["ms_min"], fast["ms_max"]) == (
        200.0,
        200.0,
        100.0,
        300.0,
    )
    assert fast["tokens_per_s"] == 5000.0 and fast["model_tflops"] == 20.0 and fast["mfu"] == 2.0
    ref = dict(system=step_results.REFERENCE, **step_results.speed([500.0], ctx), peak_mem_gib=4.0)
    failed = dict(system="hf-eager", error="RuntimeError: out of memory")
    results = [fast, ref, failed]
    step_results.compare_to_reference(results)
    assert fast["vs_hf_grouped_mm"] == {"speedup": 2.5, "peak_mem_ratio": 0.5}
    assert ref["vs_hf_grouped_mm"] == {"speedup": 1.0, "peak_mem_ratio": 1.0}
    assert "vs_hf_grouped_mm" not in failed
