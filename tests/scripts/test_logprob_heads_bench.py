"""The log-prob heads benchmark runs end to end at a toy size (its children, its tables), and
the head's measured peaks are parallel/head_memory.py's estimates."""

import json

import pytest

# the head alone (--scope head), fp32: T = 2048 tokens in chunks of 256 (16 MiB at V 16384),
# so the lean head holds two chunk buffers where the full one holds [T, V] logits and copies
TOY = ["--scope", "head", "--tokens", "2048", "--seq", "256", "--vocab", "16384"]
TOY += ["--hidden", "64", "--chunk-mib", "16", "--repeats", "0", "--threads", "1"]
TOY += ["--jobs", "2"]  # peaks are per child; two at a time on 2 cores
MODEL_RTOL = (0.9, 1.15)  # measured / estimate: 1.01-1.08 at this size


@pytest.mark.slow
@pytest.mark.bench
def test_toy_run_measures_what_the_memory_model_estimates(tmp_path, capsys):
    """Every head and pass measured, each peak within MODEL_RTOL of parallel/head_memory.py's
    estimate, the lean log-prob pass under a tenth of the full one. Catches the lean head
    holding a third chunk buffer (its backward's previous chunk gradient kept: 1.45x), the
    lean head holding the logits (one chunk of T tokens), a memory model that drifts from
    the code (parallel.head_memory.LEAN_CHUNK_BUFFERS = 1: 2x)."""
    from scripts.bench import logprob_heads as bench

    out = tmp_path / "b.json"
    results = bench.main([*TOY, "--out", str(out)])
    assert {(r["head"], r["pass"]) for r in results} == {
        (h, p) for h in bench.HEADS for p in bench.PASSES
    }
    assert all(r["seconds"] > 0 for r in results)
    assert json.loads(out.read_text())["results"] == results
    printed = capsys.readouterr().out
    assert "mem ratio" in printed and "measured / parallel/head_memory.py's estimate" in printed
    low, high = MODEL_RTOL
    for r in results:
        ratio = r["peak_bytes"] / r["model_bytes"]
        assert low < ratio < high, f"{r['head']} {r['pass']}: measured / estimate {ratio:.3f}"
    by = {(r["head"], r["pass"]): r["peak_bytes"] for r in results}
    assert by[("lean", "logprob")] < 0.1 * by[("full", "logprob")]
