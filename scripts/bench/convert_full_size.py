"""Convert a checkpoint of Qwen3-30B-A3B's full size both ways on this machine: time and peak RSS.

The synthetic HF checkpoint has every tensor of the real model (48 layers, 128 experts,
61 GB of bf16) but is sparse: each tensor holds random values in its first and last 4 KiB
and zeros, left as file holes, in between, so the source takes ~0.3 GB of disk. The
conversions still read, hash and write every byte. Before mcore-to-hf the dist
checkpoint's zero blocks are turned back into holes (`fallocate --dig-holes`, not timed),
so the run needs one model's worth of free disk instead of three. The round trip is
checked with `python -m converters verify` (every tensor, bit for bit: the random edges
catch any misplaced tensor).

A copy of the same bytes (sendfile + fsync, as convert_bench.py) is timed before each
direction. Reading a hole costs no disk time, in the copy as in the conversions, so the
ratios compare the write, hash and CPU paths at full size, where start-up is amortised.

    .venv/bin/python -m scripts.bench.convert_full_size [--layers 48] [--dir D] [--json out.json]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from converters.hf_writer import ShardedWriter, shard_header, write_index
from parallel.models import QWEN3_30B_A3B
from scripts.bench import convert_bench as bench

MARK = 4096  # random bytes at each end of a tensor
GB = bench.GB


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_sparse(out: Path, layers: int, shard_bytes: int) -> list:
    """The synthetic HF checkpoint, its tensors' ends random and their middles holes."""
    config = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    specs = bench.hf_tensor_list(config)
    plan = ShardedWriter(out, specs, shard_bytes)  # only its shard plan and file names
    for file, shard in zip(plan.files, plan.shards, strict=True):
        header = shard_header(shard)
        with open(out / file, "wb") as f:
            f.write(header)
            start = len(header)
            for t in shard:
                for offset, n in _marks(t.nbytes):
                    f.seek(start + offset)
                    f.write(
                        (torch.randn(n // 2) * 0.02)
                        .to(torch.bfloat16)
                        .view(torch.uint8)
                        .numpy()
                        .tobytes()
                    )
                start += t.nbytes
            f.truncate(start)
    write_index(out, plan.files, plan.shards)
    return specs


def _marks(nbytes: int) -> list[tuple[int, int]]:
    if nbytes <= 3 * MARK:
        return [(0, nbytes)]
    return [(0, MARK), (nbytes - MARK, MARK)]


def disk_gb(path: Path) -> float:
    """Bytes the files under path take on disk (holes excluded)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / GB


def dig_holes(path: Path) -> float:
    start = time.perf_counter()
    for f in sorted(path.rglob("*.distcp")):
        subprocess.run(["fallocate", "--dig-holes", str(f)], check=True)
    return time.perf_counter() - start


def timed_copy(src: Path, work: Path) -> dict:
    copy = work / "copy"
    result = bench.copy_baseline(src, copy)
    shutil.rmtree(copy)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument(
        "--shard-gb", type=float, default=4.0, help="source shard size (the hub's: ~4 GB)"
    )
    parser.add_argument("--dir", help="work dir (default: a temp dir); needs one model's size free")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert_full_", dir=args.dir))
    me = [sys.executable, "-m", "scripts.bench.convert_bench", "--child"]  # cwd: bench.ROOT
    src, dist, back = work / "hf", work / "mcore", work / "hf_back"
    try:
        log(f"writing the sparse {args.layers}-layer checkpoint in {work}")
        specs = write_sparse(src, args.layers, int(args.shard_gb * GB))
        nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        free = shutil.disk_usage(work).free
        if free < 1.05 * nbytes:
            raise SystemExit(
                f"{work}: {free / GB:.1f} GB free, the run needs {1.05 * nbytes / GB:.1f} GB: pass --dir on a bigger disk"
            )
        disk = {"source_gb": disk_gb(src)}
        log(
            f"{nbytes / GB:.1f} GB in {len(specs)} tensors ({disk['source_gb']:.2f} GB on disk); copy"
        )
        copies = [timed_copy(src, work)]
        log(f"copy {copies[-1]['seconds']:.1f} s; hf-to-mcore")
        h2m = bench.run_measured(me + ["hf-to-mcore", str(src), str(dist)], src)
        disk["dist_gb"] = disk_gb(dist)
        log(
            f"hf-to-mcore {h2m['seconds']:.1f} s, peak RSS {h2m['peak_rss_gb']:.2f} GB; digging holes"
        )
        dig_s = dig_holes(dist)
        disk["dist_dug_gb"] = disk_gb(dist)
        copies.append(timed_copy(src, work))
        log(f"copy {copies[-1]['seconds']:.1f} s; mcore-to-hf")
        m2h = bench.run_measured(
            me + ["mcore-to-hf", str(dist), str(back), "--template", str(src)], dist
        )
        disk["back_gb"] = disk_gb(back)
        log(f"mcore-to-hf {m2h['seconds']:.1f} s, peak RSS {m2h['peak_rss_gb']:.2f} GB; verify")
        start = time.perf_counter()
        verify = subprocess.run(
            [sys.executable, "-m", "converters", "verify", str(src), str(back)],
            cwd=bench.ROOT,
            capture_output=True,
            text=True,
        )
        verify_s = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)

    largest = max(s.nbytes for s in specs)
    rss_bound = 4 + largest / GB
    copy_s = [c["seconds"] for c in copies]
    runs = {
        "hf_to_mcore": bench.direction(nbytes, copy_s[0], [h2m]),
        "mcore_to_hf": bench.direction(nbytes, copy_s[1], [m2h]),
    }
    report = {
        "summary": {
            "layers": args.layers,
            "gb": round(nbytes / GB, 2),
            "tensors": len(specs),
            "machine_ram_gb": round(psutil.virtual_memory().total / GB, 1),
            "cpus": os.cpu_count(),
            "copy_gb_per_s": [round(nbytes / GB / s, 2) for s in copy_s],
            "rss_bound_gb": round(rss_bound, 2),
            **{verb: bench.summary(run, rss_bound) for verb, run in runs.items()},
            "round_trip_bit_exact": verify.returncode == 0,
        },
        "bytes": nbytes,
        "copy": copies,
        **runs,
        "disk_gb": disk,
        "dig_holes_s": dig_s,
        "verify_s": verify_s,
        "verify": (verify.stdout + verify.stderr).strip().splitlines()[-1:],
    }
    bench.emit(report, args.json)


if __name__ == "__main__":
    main()
