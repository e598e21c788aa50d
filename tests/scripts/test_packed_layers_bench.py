"""scripts/bench/packed_layers.py (packed vs padded on the model, what the one-GPU run does on
the 4L preset) runs on the tiny preset on CPU with verl unimportable, and its JSON holds: the
same real tokens in both modes, the ratio of the measured rates, and the same log-prob sum
(same model, same sequences: a wrong packed layout shows as a different sum)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the device machine has no verl: block it, so any import of it in the chain fails the run
# (`python -m scripts.bench.packed_layers ARGS` with verl blocked; cwd: the repository root)
NO_VERL = (
    "import runpy, sys; sys.modules['verl'] = None; "
    "runpy.run_module('scripts.bench.packed_layers', run_name='__main__', alter_sys=True)"
)


@pytest.mark.bench
def test_tiny_packed_vs_padded_on_cpu_without_verl(tmp_path):
    out = tmp_path / "packed_tiny.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--warmup", "1", "--iters", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", NO_VERL, *argv, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert json.loads(proc.stdout) == doc
    assert doc["error"] is None and doc["settings"]["complete"]
    assert doc["env"]["device"] == "cpu" and doc["shape"]["dtype"] == "float32"
    assert "experts='grouped', attention='sdpa'" in doc["build"]
    batch, padded, packed = doc["batch"], doc["results"]["padded"], doc["results"]["packed"]
    assert batch["rows"] == 32 and len(batch["micro_batches"]) > 1
    real = batch["real_tokens"]
    assert real == sum(mb["real"] for mb in batch["micro_batches"]) == batch["packed_tokens"]
    assert batch["padded_slots"] > real  # the padded plan does pad
    for mb in batch["micro_batches"]:  # the preset's budget: 2 x 64 padded slots
        assert mb["real"] <= mb["padded_slots"] <= doc["settings"]["budget"] == 128
    for r in (padded, packed):
        assert r["real_tokens"] == real
        assert r["tokens_per_s"] == pytest.approx(real / (r["ms_per_step"] / 1e3), rel=1e-3)
        assert r["peak_mem_gib"] is None and r["step_mem_gib"] is None  # no memory on CPU
        assert len(r["logprob_sums"]) == 2 and len(set(r["logprob_sums"])) == 1  # no optimizer
    ratio = doc["ratio"]
    assert ratio["tokens_per_s"] == pytest.approx(
        packed["tokens_per_s"] / padded["tokens_per_s"], rel=1e-3
    )
    assert ratio["peak_mem"] is None and ratio["step_mem"] is None
    # fp32, same weights and sequences: the sums agree to rounding (0 here); a packed layout
    # with one sequence over the whole row moves the sum by ~5e-4 relative on this model
    assert packed["logprob_sum"] < 0
    assert packed["logprob_sum"] == pytest.approx(padded["logprob_sum"], rel=1e-5)
    assert doc["logprob_rel_diff"] < 1e-5
    assert "[packed_layers]" in proc.stderr and "ratio" in proc.stderr
