"""The mission's plan as a user runs it: `scripts/train_mcore.sh --tp 4 --ep 8` on the embedded
CPU run (world 8 on one box), timed, with the memory of every process it starts.

Too long for CI (about 11 minutes on 2 cores with a cold warm-up, 6-7 with the warm-up
reused), so it is a bench: one launch in a fresh run directory, then from the launch's own
process tree (the launcher, verl's driver, its Ray and every worker under it), sampled every
2 s from /proc, the peak of the summed PSS and each process's peak RSS by title (actor rank,
vLLM worker, engine core, API server, ...); from verl's metrics the step's phases; from the
console the summary (validation, start-up, export reload). Writes <out>/mission_plan_run.json
and prints a markdown table.

    python -m scripts.bench.launches.mission_plan_run --out runs/bench_mission              # tp4 x ep8
    python -m scripts.bench.launches.mission_plan_run --out DIR --plan "--tp 2 --ep 2" --steps 5
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "save_checkpoint", "testing")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return kids


def tree(root: int) -> list[int]:
    """root and every descendant now."""
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def title_and_memory(pid: int) -> tuple[str, int, int] | None:
    """(process title, RSS MiB, PSS MiB); None for a process that is gone. PSS shares each
    page among the processes mapping it: summed over the tree it counts shared memory (forked
    workers, vLLM's shared buffers) once, where summed RSS counted 32 GB on a 24 GB machine."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    rss = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS")), 0)
    pss = next((int(ln.split()[1]) for ln in rollup.splitlines() if ln.startswith("Pss:")), 0)
    words = [w.decode(errors="replace") for w in cmd if w]
    name = words[0] if words else "?"
    if name.startswith(("ray::", "VLLM::")):
        name = name.split(" ", 1)[0]
    elif name.endswith("python") and len(words) > 2:
        name = " ".join(words[1:3]).replace("\n", " ")[:60]
    return name, rss // 1024, pss // 1024


class TreeRss:
    """Samples a process tree: the peak of its summed PSS, and each pid's peak RSS with the
    title it had then (Ray reuses worker processes under new titles)."""

    def __init__(self, root: int, every_s: float = 2.0):
        self.root, self.every_s = root, every_s
        self.peak_total_mib, self.by_pid = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in tree(self.root):
                seen = title_and_memory(pid)
                if seen is None:
                    continue
                title, rss, pss = seen
                total += pss
                old_title, old_rss = self.by_pid.get(pid, ("?", -1))
                if rss > old_rss or old_title == "?":
                    self.by_pid[pid] = (title if title != "?" else old_title, max(rss, old_rss))
            self.peak_total_mib = max(self.peak_total_mib, total)
            self._stop.wait(self.every_s)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def per_title(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for title, mib in self.by_pid.values():
            out.setdefault(title, []).append(mib)
        return {t: sorted(v, reverse=True) for t, v in sorted(out.items())}


def phases(metrics_file: Path) -> dict:
    """Mean seconds of each phase of the trained steps after the first (step 1 carries
    one-time work), and the update's tokens/s (the batch's tokens over `update_actor`)."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r.get("data", r) for r in rows]
    train = [r for r in rows if "timing_s/update_actor" in r]
    steady = train[1:] or train
    out = {}
    for p in (*PHASES, "step"):
        values = [r[f"timing_s/{p}"] for r in steady if f"timing_s/{p}" in r]
        if values:
            out[p] = round(statistics.fmean(values), 2)
    seconds = sum(r["timing_s/update_actor"] for r in steady)
    tokens = sum(r.get("perf/total_num_tokens", 0) for r in steady)
    out["update_tokens_per_s"] = round(tokens / seconds, 1) if seconds else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", default="--tp 4 --ep 8")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    run_dir = args.out / "run"
    if run_dir.exists():
        print(f"error: {run_dir} exists: pass another --out", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(REPO / "scripts/train_mcore.sh"), *shlex.split(args.plan),
           "--steps", str(args.steps), "--ckpt-dir", str(run_dir)]  # fmt: skip
    console = args.out / "console.log"
    start = time.monotonic()
    with open(console, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        rss = TreeRss(proc.pid).start()
        code = proc.wait()
        rss.stop()
    lines = console.read_text().splitlines()
    result = {
        "command": " ".join(cmd),
        "exit": code,
        "wall_s": round(time.monotonic() - start, 1),
        "peak_total_pss_mib": rss.peak_total_mib,
        "peak_rss_mib_by_title": rss.per_title(),
        "phases_mean_s": phases(run_dir / "metrics" / "launch_000.jsonl") if code == 0 else {},
        "summary": [
            ln
            for ln in lines
            if ln.startswith(("plan:", "validation", "1.", "a step", "export reloads", "wall time"))
        ],  # fmt: skip
    }
    (args.out / "mission_plan_run.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| process | count | peak RSS MiB each |\n| --- | --- | --- |")
    for title, mibs in result["peak_rss_mib_by_title"].items():
        if max(mibs) >= 50:
            print(f"| `{title}` | {len(mibs)} | {', '.join(map(str, mibs))} |")
    print(f"\npeak summed PSS {rss.peak_total_mib} MiB; exit {code}; console {console}")
    return code


if __name__ == "__main__":
    sys.exit(main())
