"""Benchmark the converters on a synthetic checkpoint with Qwen3-30B-A3B's real tensor shapes.

Writes an HF checkpoint (bf16 safetensors shards + index, --layers decoder layers), then
times against each other, on the same bytes: a plain copy of the shards (shutil.copyfile +
fsync), `python -m converters hf-to-mcore` and `mcore-to-hf` (separate processes set up as
`python -m converters` sets itself up; peak RSS from the child's VmHWM and a psutil
sampler). Copies and conversions alternate for --repeats rounds and medians are reported
(on a shared VM the copy time of the same bytes varies widely from run to run). Each step
reads its input cold: earlier writes are flushed and the input dropped from the page cache.

Each conversion is split into start-up (process start, imports, layout, checks), the data
phase (first parameter read to the output renamed into place) and exit, and compared with
the copy twice: end to end and data phase only. The data phase's CPU time and sha256's
speed on one core show whether it is bound by the CPUs or the disk. Prints JSON (the
"summary" block first answers the targets); deletes its files unless --keep.

    .venv/bin/python -m scripts.bench.convert_bench --layers 2 [--repeats 3] [--json out.json]
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from backend.shared.integers import ceil_div
from parallel.models import QWEN3_30B_A3B

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9


def hf_tensor_list(config: dict):
    """Name, shape and dtype of every HF tensor: the converters' own layout and table."""
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.convert import hf_specs
    from converters.dist_layout import build_layout

    spec = load_qwen3_moe_spec(config)
    return hf_specs(build_layout(spec, torch.bfloat16), spec)


def _values(pool: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """n values of the pool at a tensor-dependent offset (tiled when the pool is smaller)."""
    if n > pool.numel():
        return pool.repeat(ceil_div(n, pool.numel()))[:n]
    start = (i * 7919) % (pool.numel() - n + 1)
    return pool[start : start + n]


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
    """The manifest's cost: every byte is hashed once, GB/s on one core."""
    import hashlib

    data = os.urandom(256 << 20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / GB / (time.perf_counter() - start)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_cold(source: Path) -> None:
    """Flush earlier writes and drop `source`'s files from the page cache, so every measured
    step reads its input from the disk: as a real checkpoint (57 GB against 23 GiB of RAM)
    is read, and the same for the copy and both conversions whatever wrote their input."""
    os.sync()  # also: no writeback of an earlier step in this one's time
    for path in source.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def copy_baseline(src: Path, dst: Path) -> dict:
    """Copy the shards (sendfile, in the kernel) and fsync them."""
    dst.mkdir()
    start_cold(src)
    start, cpu = time.perf_counter(), _cpu()
    for f in sorted(src.glob("*.safetensors")):
        shutil.copyfile(f, dst / f.name)
        with open(dst / f.name, "rb") as fh:
            os.fsync(fh.fileno())
    return {"seconds": time.perf_counter() - start, "cpu_s": _cpu() - cpu}


def run_measured(argv: list[str], source: Path) -> dict:
    """Run a child reading `source`; its wall time, CPU time and peak RSS (its VmHWM, and a
    20 ms psutil sampler)."""
    start_cold(source)
    start = time.monotonic()
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
    _, status, usage = os.wait4(proc.pid, 0)
    end = time.monotonic()
    done.set()
    sampler.join()
    err = proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")
    t = _timings(err)
    # VmHWM is the child's own peak; wait4's ru_maxrss would include the RSS this parent
    # had when it forked (Linux keeps maxrss across exec)
    return {
        "seconds": end - start,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "startup_s": t["data_start"] - start,
        "data_s": t["data_end"] - t["data_start"],
        "exit_s": end - t["data_end"],
        "data_cpu_s": t["data_cpu_s"],
        "minor_faults": usage.ru_minflt,
        "peak_rss_gb": t["vmhwm_bytes"] / GB,
        "sampled_peak_rss_gb": peak[0] / GB,
    }


def _timings(stderr: str) -> dict:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("BENCH ")]
    return json.loads(lines[-1][6:]) if lines else {}


def _vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(verb: str, args: list[str]) -> None:
    """Run one conversion as `python -m converters` does, reporting on stderr when its data
    phase starts and ends (monotonic clock, shared with the parent) and its CPU time."""
    import converters.__main__ as entry  # `python -m converters`' process set-up
    import converters.convert as convert
    import converters.dist_ckpt as dist_ckpt
    import converters.hf_writer as hf_writer

    t = {}
    real_save, real_writer = dist_ckpt.save_streaming, convert.ShardedWriter

    def data_start():
        t["data_start"], t["cpu"] = time.monotonic(), _cpu()

    def save_streaming(*a, **k):
        data_start()
        return real_save(*a, **k)

    class Writer(real_writer):
        def __init__(self, *a, **k):
            data_start()
            super().__init__(*a, **k)

    dist_ckpt.save_streaming, convert.ShardedWriter, hf_writer.ShardedWriter = (
        save_streaming,
        Writer,
        Writer,
    )
    code = entry.main([verb, *args, "--no-progress"])
    timings = {
        "data_start": t["data_start"],
        "data_end": time.monotonic(),
        "data_cpu_s": _cpu() - t["cpu"],
        "vmhwm_bytes": _vmhwm(),
    }
    print("BENCH " + json.dumps(timings), file=sys.stderr)
    entry.exit_now(code)


def direction(nbytes: int, copy_s: float, runs: list[dict]) -> dict:
    """One conversion's medians over the repeats (peak RSS: the highest) against the copy."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs)
    return {
        **med,
        "runs_seconds": [r["seconds"] for r in runs],
        "runs_data_s": [r["data_s"] for r in runs],
        "gb_per_s": nbytes / GB / med["seconds"],
        "vs_copy": copy_s / med["seconds"],
        "data_gb_per_s": nbytes / GB / med["data_s"],
        "data_vs_copy": copy_s / med["data_s"],
    }


TARGET = 0.8  # of the copy's bandwidth


def summary(run: dict, rss_bound_gb: float) -> dict:
    return {
        "end_to_end_vs_copy": round(run["vs_copy"], 2),
        "data_vs_copy": round(run["data_vs_copy"], 2),
        "startup_s": round(run["startup_s"], 2),
        "data_s": round(run["data_s"], 2),
        "exit_s": round(run["exit_s"], 2),
        # 1.0: every core of the machine was busy in this process for the whole data phase
        "data_cpu_busy": round(run["data_cpu_s"] / (os.cpu_count() * run["data_s"]), 2),
        "peak_rss_gb": round(run["peak_rss_gb"], 2),
        "meets": {
            "end_to_end": run["vs_copy"] >= TARGET,
            "data_phase": run["data_vs_copy"] >= TARGET,
            "rss": run["peak_rss_gb"] <= rss_bound_gb,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="source shard size")
    parser.add_argument(
        "--dir", help="work dir (default: a temp dir); must have room for ~3x the model"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="copy/convert rounds; medians are reported"
    )
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])

    work = Path(tempfile.mkdtemp(prefix="convert_bench_", dir=args.dir))
    me = [sys.executable, "-m", "scripts.bench.convert_bench", "--child"]  # cwd: ROOT
    try:
        src, copy = work / "hf", work / "copy"
        specs = write_synthetic(src, args.layers, int(args.shard_gb * GB))
        nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        load = [os.getloadavg()[0]]
        # Every measured step starts right after a model's worth of files is removed: the
        # page cache it freed is reused at once, whereas memory the VM has not touched lately
        # is slow to get, so a copy right after another write runs much slower than one
        # right after a removal.
        stale = [work / "stale_a", work / "stale_b"]
        for path in stale:
            copy_baseline(src, path)  # not measured: only removed
        copies, runs = [], {"hf_to_mcore": [], "mcore_to_hf": []}
        for r in range(args.repeats):  # interleaved: each conversion next to a copy
            dist, back = work / f"mcore{r}", work / f"hf_back{r}"
            shutil.rmtree(stale.pop(0))
            copies.append(copy_baseline(src, copy))
            shutil.rmtree(copy)
            runs["hf_to_mcore"].append(run_measured(me + ["hf-to-mcore", str(src), str(dist)], src))
            shutil.rmtree(stale.pop(0))
            copies.append(copy_baseline(src, copy))
            shutil.rmtree(copy)
            runs["mcore_to_hf"].append(
                run_measured(
                    me + ["mcore-to-hf", str(dist), str(back), "--template", str(src)], dist
                )
            )
            stale = [back, dist]
        load.append(os.getloadavg()[0])
        verify = subprocess.run(
            [sys.executable, "-m", "converters", "verify", str(src), str(back)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        largest = max(s.nbytes for s in specs)
        sha256 = _sha256_speed()
        copy_s = statistics.median(c["seconds"] for c in copies)
        report = {
            "layers": args.layers,
            "bytes": nbytes,
            "gb": nbytes / GB,
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "load_average_1min": load,
            "copy": {
                "seconds": copy_s,
                "gb_per_s": nbytes / GB / copy_s,
                "cpu_s": statistics.median(c["cpu_s"] for c in copies),
                "runs_seconds": [c["seconds"] for c in copies],
            },
            **{verb: direction(nbytes, copy_s, rs) for verb, rs in runs.items()},
            # the manifest hashes every byte once: on its own, one core needs this long
            "sha256_gb_per_s_one_core": sha256,
            "sha256_s_one_core": nbytes / GB / sha256,
            "largest_tensor_gb": largest / GB,
            "rss_bound_gb": 4 + largest / GB,
            "round_trip_bit_exact": verify.returncode == 0,
            "verify": verify.stdout.strip().splitlines()[-1:],
        }
        report = {
            "summary": {
                "gb": round(nbytes / GB, 2),
                "copy_gb_per_s": round(nbytes / GB / copy_s, 2),
                "sha256_gb_per_s_one_core": round(sha256, 2),
                "target_vs_copy": TARGET,
                # the data phase's ceiling while one thread hashes every byte (2 cores: one spare)
                "hash_bound_vs_copy": round(sha256 / (nbytes / GB / copy_s), 2),
                "rss_bound_gb": round(report["rss_bound_gb"], 2),
                **{verb: summary(report[verb], report["rss_bound_gb"]) for verb in runs},
            },
            **report,
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    emit(report, args.json)


def emit(report: dict, json_path: str | None) -> None:
    """The report on stdout, and in json_path when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


if __name__ == "__main__":
    main()
