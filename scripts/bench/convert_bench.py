"""Benchmark the converters on a synthetic checkpoint with Qwen3-30B-A3B's real tensor shapes.

Writes an HF checkpoint (bf16 safetensors shards + index, --layers decoder layers), then
times against each other, on the same bytes: a plain copy of the shards (shutil.copyfile +
fsync), `python -m converters hf-to-mcore` and `mcore-to-hf` (separate processes; peak RSS
from wait4's ru_maxrss and a psutil sampler). Prints JSON; deletes its files unless --keep.

    .venv/bin/python scripts/bench/convert_bench.py --layers 2 [--json out.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    torch_dtype="bfloat16", decoder_sparse_step=1, mlp_only_layers=[],
)
GB = 1e9


def hf_tensor_list(config: dict):
    """Name, shape and dtype of every HF tensor: the converters' own layout and table."""
    from backend.hf_config import load_qwen3_moe_spec
    from converters.convert import hf_specs
    from converters.layout import build_layout

    spec = load_qwen3_moe_spec(config)
    return hf_specs(build_layout(spec, torch.bfloat16), spec)


def _values(pool: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """n values of the pool at a tensor-dependent offset (tiled when the pool is smaller)."""
    if n > pool.numel():
        return pool.repeat(-(-n // pool.numel()))[:n]
    start = (i * 7919) % (pool.numel() - n + 1)
    return pool[start:start + n]


def write_synthetic(out: Path, layers: int, shard_bytes: int) -> list:
    """The synthetic HF checkpoint; returns its tensor list."""
    from converters.hf_writer import ShardedWriter

    config = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    specs = hf_tensor_list(config)
    pool = (torch.randn(1 << 26) * 0.02).to(torch.bfloat16)  # sliced: random-looking, fast
    writer = ShardedWriter(out, specs, shard_bytes)
    for i, s in enumerate(specs):
        writer.write(s.name, _values(pool, i, torch.Size(s.shape).numel()).reshape(s.shape).clone())
    writer.close()
    return specs


def _sha256_speed() -> float:
    """The manifest's cost: every byte is hashed once (one core's speed here)."""
    import hashlib

    data = os.urandom(256 << 20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / GB / (time.perf_counter() - start)


def copy_baseline(src: Path, dst: Path) -> float:
    dst.mkdir()
    os.sync()
    start = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        shutil.copyfile(f, dst / f.name)
        with open(dst / f.name, "rb") as fh:
            os.fsync(fh.fileno())
    return time.perf_counter() - start


def run_measured(argv: list[str]) -> dict:
    """Run a child; its wall time and peak RSS (its VmHWM, and a 20 ms psutil sampler)."""
    os.sync()  # no writeback of an earlier step in this one's time
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak, done = [0], threading.Event()

    def sample():
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                peak[0] = max(peak[0], ps.memory_info().rss)
            except psutil.Error:
                return
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status = os.waitpid(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    err = proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")
    timings = _timings(err)
    # VmHWM is the child's own peak; wait4's ru_maxrss would include the RSS this parent
    # had when it forked (Linux keeps maxrss across exec)
    return {"seconds": wall, "peak_rss_gb": timings.pop("vmhwm_bytes", peak[0]) / GB,
            "sampled_peak_rss_gb": peak[0] / GB, "timings": timings}


def _timings(stderr: str) -> dict:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("BENCH ")]
    return json.loads(lines[-1][6:]) if lines else {}


def _vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(verb: str, args: list[str]) -> None:
    """Run one conversion in this process, reporting setup vs streaming time on stderr."""
    import converters.convert as convert
    import converters.dist_ckpt as dist_ckpt
    import converters.hf_writer as hf_writer

    t = {"start": time.perf_counter()}
    real_save, real_writer = dist_ckpt.save_streaming, convert.ShardedWriter

    def save_streaming(*a, **k):
        t["stream"] = time.perf_counter()
        return real_save(*a, **k)

    class Writer(real_writer):
        def __init__(self, *a, **k):
            t["stream"] = time.perf_counter()
            super().__init__(*a, **k)

    dist_ckpt.save_streaming, convert.ShardedWriter, hf_writer.ShardedWriter = save_streaming, Writer, Writer
    from converters.cli import main

    code = main([verb, *args, "--no-progress"])
    t["end"] = time.perf_counter()
    timings = {"setup_s": t["stream"] - t["start"], "stream_s": t["end"] - t["stream"],
               "vmhwm_bytes": _vmhwm()}
    print("BENCH " + json.dumps(timings), file=sys.stderr)
    raise SystemExit(code)


def result(nbytes: int, copy_s: float, run: dict) -> dict:
    stream = run["timings"].get("stream_s")
    return {**run, "gb_per_s": nbytes / GB / run["seconds"],
            "vs_copy": copy_s / run["seconds"],
            "stream_gb_per_s": nbytes / GB / stream if stream else None,
            "stream_vs_copy": copy_s / stream if stream else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source shard size")
    parser.add_argument("--dir", help="work dir (default: a temp dir); must have room for ~3x the model")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])

    work = Path(tempfile.mkdtemp(prefix="convert_bench_", dir=args.dir))
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    try:
        src, copy, dist, back = work / "hf", work / "copy", work / "mcore", work / "hf_back"
        specs = write_synthetic(src, args.layers, int(args.shard_gb * GB))
        nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        copy_s = copy_baseline(src, copy)
        shutil.rmtree(copy)
        to_mcore = run_measured(me + ["hf-to-mcore", str(src), str(dist)])
        to_hf = run_measured(me + ["mcore-to-hf", str(dist), str(back), "--template", str(src)])
        verify = subprocess.run([sys.executable, "-m", "converters", "verify", str(src), str(back)],
                                cwd=ROOT, capture_output=True, text=True)
        largest = max(s.nbytes for s in specs)
        report = {
            "layers": args.layers, "bytes": nbytes, "gb": nbytes / GB, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "copy": {"seconds": copy_s, "gb_per_s": nbytes / GB / copy_s},
            "hf_to_mcore": result(nbytes, copy_s, to_mcore),
            "mcore_to_hf": result(nbytes, copy_s, to_hf),
            "largest_tensor_gb": largest / GB, "rss_bound_gb": 4 + largest / GB,
            "sha256_gb_per_s_one_core": _sha256_speed(),
            "round_trip_bit_exact": verify.returncode == 0, "verify": verify.stdout.strip().splitlines()[-1:],
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
