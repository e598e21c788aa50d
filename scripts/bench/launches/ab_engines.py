"""Side by side: the same DAPO job on verl's FSDP2 actor and on ours, one table.

Per model and world size, two main-job launches (`scripts/train_mcore.sh --engine fsdp|mcore_ep`,
the embedded CPU run; world 2 is `--ep 2`: ours as ep 2, FSDP sharded over the same two
ranks), the same seed, model, data, rollout and DAPO settings; the first launch of a model
makes its model, data (and the mini model's warm-up), the others start from copies. While a
launch runs, the actor workers' peak RSS (VmHWM of each Ray actor-worker process; on an
accelerator the device memory verl logs) is sampled, and each rank's memory is broken down
from inside it (parameters, gradients, optimizer states, what it keeps between steps, its
passes' peak: scripts/bench/launches/memory_breakdown.py). From verl's metrics over the trained
steps after the first (step 1 carries one-time compiles): update tokens/s, old-log-prob
tokens/s, step time, weight-sync time, the reward by step; and ours / FSDP for each. Before the
launches, step 1 on both engines in one process from the same HF weights (scripts/bench/
ab_parity.py): old log-probs, loss and grad norm of the first update. Writes
<out>/ab_engines.json and prints the table (markdown), with the goal: ours >= 2x FSDP's update
tokens/s at <= 1.0x its peak memory, on mini at world 2.

    python -m scripts.bench.launches.ab_engines                              # tiny and mini, world 1 and 2
    python -m scripts.bench.launches.ab_engines --models tiny --worlds 1 --steps 3
    python -m scripts.bench.launches.ab_engines --table-only --out DIR       # reduce earlier runs again
    python -m scripts.bench.launches.ab_engines --engines fsdp ... -- trainer.save_freq=1  # overrides
    python -m scripts.bench.launches.ab_engines --models mini --worlds 8 --plan "--tp 4 --ep 8"
        # the mission's plan: ours at tp4 x ep8, FSDP over the same 8 ranks

On a cluster: `--cluster "ARGS"` gives both launches the main job's arguments (--device,
--model DIR, data files, --nodes ...; each engine's --ckpt-dir a directory under --out; `--plan "--tp 4 --ep 8"` for
ours alone), the steps
as verl's trainer.total_training_steps; peak memory is then the device memory verl logs
(recipes/README.md).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from backend.instruments.memory_probe import MEMORY_PROBE_ENV
from scripts.bench.launches.memory_breakdown import breakdown, memory_table
from scripts.bench.launches.mission_plan_run import tree
from scripts.bench.launches.replay_modes import read_rows, seed_from

REPO = Path(__file__).resolve().parents[3]
ENGINES = ("fsdp", "mcore_ep")  # the baseline first
# verl's actor workers (the training engine's process; vLLM servers and the driver are others)
ACTOR_TITLE = re.compile(r"^ray::(WorkerDict|ActorRollout\w*|TrainingWorker\w*)")
GOAL = {"model": "mini", "world": 2, "update_speedup": 2.0, "memory_ratio": 1.0}
SCORE = "critic/score/mean"
PROBE_DIR = "memory_probe"  # in each launch's run directory


class PeakRss:
    """Samples /proc for the actor workers' VmHWM (peak RSS) while a launch runs: the
    processes of the launch's own tree (`root` and its descendants), never another job's
    workers on the same machine."""

    def __init__(self, root: int, period_s: float = 0.5):
        self.root, self.period_s, self._stop = root, period_s, threading.Event()
        self._peaks, self._titles = {}, {}  # pid -> MiB, pid -> its latest Ray title
        self._parents = {}  # pid -> parent pid
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peaks(self) -> dict[str, int]:
        """{pid: peak RSS MiB} of the processes that were actor workers when last seen (Ray
        reuses worker processes: one titled WorkerDict for a moment may serve vLLM next)."""
        workers = {pid for pid in self._peaks if ACTOR_TITLE.match(self._titles.get(pid, ""))}
        # a rank's own forks (its background checkpoint writers) carry its title: their
        # pages are mostly the rank's, so the rank's peak is the figure, not their sum
        return {pid: self._peaks[pid] for pid in workers if self._parents.get(pid) not in workers}

    def _loop(self):
        while not self._stop.wait(self.period_s):
            for pid in tree(self.root):
                self._sample(Path(f"/proc/{pid}"))

    def _sample(self, proc: Path):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::"):
                return
            self._titles[proc.name] = title
            if not ACTOR_TITLE.match(title):
                return
            status = (proc / "status").read_text()
        except OSError:
            return  # gone meanwhile
        hwm, parent = re.search(r"VmHWM:\s+(\d+) kB", status), re.search(r"PPid:\s+(\d+)", status)
        if parent:
            self._parents[proc.name] = parent.group(1)
        if hwm:
            self._peaks[proc.name] = max(self._peaks.get(proc.name, 0), int(hwm.group(1)) // 1024)


# verl's FSDP workers have no thread setting and run at the job env's one thread; ours would
# take the cores' share (2 at world 1 on 2 cores): the side by side holds both at one
SAME_THREADS = "+actor_rollout_ref.actor.mcore_ep.cpu_threads=1"


def launch_command(engine: str, model: str, world: int, steps: int, run_dir: Path,
                   cluster: str | None = None, plan: str = "", extra: list[str] = ()):  # fmt: skip
    """The main job's command line for one engine; `extra` (verl overrides) goes to both."""
    cmd = ["bash", str(REPO / "scripts/train_mcore.sh"), "--engine", engine,
           "--ckpt-dir", str(run_dir)]  # fmt: skip
    ours = shlex.split(plan) if engine == "mcore_ep" else []  # FSDP splits no layer
    if cluster is None:  # FSDP over `world` ranks; ours too, or at `plan` (its world `world`)
        threads = [SAME_THREADS] if engine == "mcore_ep" else []
        world_args = ours or (["--ep", str(world)] if world > 1 else [])
        return [*cmd, "--model", model, "--steps", str(steps), *world_args, "--", *threads, *extra]
    return [
        *cmd,
        *shlex.split(cluster),
        *ours,
        "--",
        f"trainer.total_training_steps={steps}",
        *extra,
    ]


def launch(engine: str, model: str, world: int, steps: int, run_dir: Path, console: Path,
           cluster: str | None = None, plan: str = "", extra: list[str] = ()):  # fmt: skip
    """One main-job launch; returns (exit code, {pid: peak RSS MiB} of its actor workers)."""
    cmd = launch_command(engine, model, world, steps, run_dir, cluster, plan, extra)
    env = dict(os.environ)
    if cluster is None:  # the memory probe's lines land on this machine (memory_breakdown.py)
        env[MEMORY_PROBE_ENV] = str(run_dir / PROBE_DIR)
    with open(console, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        with PeakRss(proc.pid) as rss:
            code = proc.wait()
    return code, rss.peaks


def _mean(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _tokens_per_s(rows: list[dict], phase: str) -> float:
    """Tokens of the batch over the seconds of verl's `timing_s/<phase>` (update_actor: one
    epoch over the batch, DAPO's)."""
    seconds = sum(r.get(f"timing_s/{phase}", 0.0) for r in rows)
    return sum(r.get("perf/total_num_tokens", 0) for r in rows) / max(seconds, 1e-9)


def reduce_run(rows: list[dict], peaks: dict, memory: list[dict] = ()) -> dict:
    """One launch's figures over its trained steps after the first."""
    train = [r for r in rows if r["step"] >= 1 and "timing_s/update_actor" in r]
    steady = train[1:] or train
    device_gb = max((r.get("perf/max_memory_allocated_gb", 0.0) for r in train), default=0.0)
    return {
        "steps": len(train),
        "update_tokens_per_s": _tokens_per_s(steady, "update_actor"),
        "old_log_prob_tokens_per_s": _tokens_per_s(steady, "old_log_prob"),
        "step_s": _mean(steady, "timing_s/step"),
        "update_s": _mean(steady, "timing_s/update_actor"),
        "old_log_prob_s": _mean(steady, "timing_s/old_log_prob"),
        "gen_s": _mean(steady, "timing_s/gen"),
        "weight_sync_s": _mean(steady, "timing_s/update_weights"),
        "first_step": {
            k: train[0].get(k)
            for k in (
                "timing_s/update_actor",
                "timing_s/old_log_prob",
                "actor/grad_norm",
                "actor/pg_loss",
            )
        }
        if train
        else {},  # fmt: skip
        "peak_rss_mib_per_rank": sorted(peaks.values(), reverse=True),
        "peak_mib": max(peaks.values()) if peaks else None,
        "peak_device_gib": device_gb or None,
        "reward_by_step": [(r["step"], r.get(SCORE)) for r in train],
        "memory": list(memory),  # per rank (memory_breakdown.py); [] where none was probed
    }


RATIOS = ("update_tokens_per_s", "old_log_prob_tokens_per_s", "step_s", "update_s",
          "weight_sync_s", "peak_mib")  # fmt: skip


def ratios(ours: dict, fsdp: dict) -> dict:
    return {k: (ours[k] / fsdp[k] if ours.get(k) and fsdp.get(k) else None) for k in RATIOS}


def goal(results: dict) -> dict:
    row = results.get(f"{GOAL['model']}/world{GOAL['world']}")
    if not row:
        return {"measured": False, **GOAL}
    r = row["ratio"]
    met = (r["update_tokens_per_s"] or 0) >= GOAL["update_speedup"] and (
        r["peak_mib"] or 9e9
    ) <= GOAL["memory_ratio"]
    return {"measured": True, "met": met, **GOAL, "update_speedup_measured": r["update_tokens_per_s"],
            "memory_ratio_measured": r["peak_mib"]}  # fmt: skip


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _spread(r: dict, key: str, spec: str) -> str:
    """A median with its runs' range, `1234 (1200-1300, 3 runs)`; a single run's figure alone."""
    if "spread" not in r or r["spread"].get(key) is None:
        return _f(r[key], spec)
    lo, hi = r["spread"][key]
    return f"{_f(r[key], spec)} ({_f(lo, spec)}-{_f(hi, spec)}, {len(r['runs'])} runs)"


def table(results: dict, parity: dict) -> str:
    lines = ["| model, world | engine | update tok/s | old-log-prob tok/s | step s | update s "
             "| weight sync s | peak RSS MiB/rank | step-1 grad norm | reward by step |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, row in results.items():
        for engine in ENGINES:
            r = row[engine]
            reward = ", ".join(_f(v) for _, v in r["reward_by_step"])
            peak = "/".join(str(m) for m in r["peak_rss_mib_per_rank"])
            lines.append(f"| {key} | {engine} | {_spread(r, 'update_tokens_per_s', '.0f')} "
                         f"| {_f(r['old_log_prob_tokens_per_s'], '.0f')} | {_f(r['step_s'], '.1f')} "
                         f"| {_f(r['update_s'])} | {_f(r['weight_sync_s'], '.3f')} "
                         f"| {_spread(r, 'peak_mib', '.0f') if 'spread' in r else peak} "
                         f"| {_f(r['first_step'].get('actor/grad_norm'))} | {reward} |")  # fmt: skip
        q = row["ratio"]
        lines.append(f"| {key} | **ours / FSDP** | **{_f(q['update_tokens_per_s'])}x** "
                     f"| {_f(q['old_log_prob_tokens_per_s'])}x | {_f(q['step_s'])}x "
                     f"| {_f(q['update_s'])}x | {_f(q['weight_sync_s'])}x | **{_f(q['peak_mib'])}x** | | |")  # fmt: skip
    for model, p in parity.items():
        lines.append(f"\nstep 1 on {model} (one batch of {p['tokens']} response tokens, fp32, aux "
                     f"loss off): old log-probs max |diff| {p['old_log_prob_max_abs_diff']:.2e}, "
                     f"loss |diff| {p['loss_abs_diff']:.2e}, grad norm {p['grad_norm']['fsdp']:.6f} "
                     f"(FSDP) vs {p['grad_norm']['mcore_ep']:.6f} (ours), rel diff "
                     f"{p['grad_norm_rel_diff']:.2e}")  # fmt: skip
    return "\n".join(lines)


def run_parity(hf_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench.launches.ab_parity", str(hf_dir)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ab_parity.py failed: {out.stderr[-2000:]}")
    from scripts.bench.launches.ab_parity import MARK

    return json.loads(out.stdout.split(MARK, 1)[1].splitlines()[0])


def parse(argv: list[str] | None):
    """The bench's arguments; what follows `--` goes to every launch as verl overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,mini")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="runs per engine; medians reported")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="the ones to launch; the others' runs must be in --out already")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "runs/ab_engines")
    p.add_argument("--table-only", action="store_true", help="reduce the runs already in --out")
    p.add_argument("--cluster", metavar="ARGS", help="the main job's arguments on a cluster")
    p.add_argument("--plan", metavar="ARGS", default="", help="ours only, e.g. '--tp 4 --ep 8'")
    args = p.parse_args(argv[:cut])
    args.overrides = argv[cut + 1 :]
    args.launch = [] if args.table_only else args.engines.split(",")
    if args.cluster is not None:  # one row: the cluster's own plan and model
        args.models, args.worlds = "cluster", "0"
    return args


def run_name(model: str, world: int, engine: str, repeat: int = 0) -> str:
    """A launch's directory under --out: the first run of a pair keeps the plain name."""
    return f"{model}-w{world}-{engine}" + (f"-r{repeat}" if repeat else "")


def run_one(args, model: str, world: int, engine: str, seed: Path | None, peaks: dict,
            repeat: int = 0) -> int:  # fmt: skip
    """One launch into <out>/<run_name> (made from `seed`'s model and data)."""
    run_dir = args.out / run_name(model, world, engine, repeat)
    if seed is not None and seed != run_dir:
        seed_from(seed, run_dir)
    print(f"{model}/world{world} {engine}: {args.steps} steps in {run_dir}", flush=True)
    t0 = time.perf_counter()
    code, peaks[run_dir.name] = launch(engine, model, world, args.steps, run_dir,
                                       args.out / f"{run_dir.name}.console", args.cluster,
                                       args.plan, args.overrides)  # fmt: skip
    print(f"{model}/world{world} {engine}: exit {code} after {time.perf_counter() - t0:.0f} s")
    (args.out / "peaks.json").write_text(json.dumps(peaks))
    if code != 0:
        print(f"error: the {model}/world{world} {engine} run failed: see {run_dir.name}.console")
    return code


def model_rows(args, model: str, peaks: dict) -> dict | int:
    """{model/worldW: {fsdp, mcore_ep, ratio}} for one model, launching what --engines names
    --repeats times (the engines alternating); each engine's figures are the median of its
    runs, their spread beside them."""
    rows, worlds = {}, list(map(int, args.worlds.split(",")))
    dirs = [args.out / run_name(model, w, e) for w in worlds for e in ENGINES]
    seed = next((d for d in dirs if (d / "data").is_dir()), None)  # model and data made once
    for world in worlds:
        runs = {engine: [] for engine in ENGINES}
        for repeat in range(args.repeats):
            for engine in ENGINES:
                if engine in args.launch:
                    if run_one(args, model, world, engine, seed, peaks, repeat) != 0:
                        return 1
                    seed = seed or args.out / run_name(model, world, engine)
                run_dir = args.out / run_name(model, world, engine, repeat)
                if not list((run_dir / "metrics").glob("*.jsonl")):
                    print(
                        f"error: {run_dir} holds no run's metrics: launch it (--engines {engine})"
                    )
                    return 2
                runs[engine].append(reduce_run(read_rows(run_dir), *rank_memory(run_dir, peaks)))
        row = {engine: median_run(runs[engine]) for engine in ENGINES}
        rows[f"{model}/world{world}"] = {**row, "ratio": ratios(row["mcore_ep"], row["fsdp"])}
    return rows


def median_run(runs: list[dict]) -> dict:
    """The first run's record with each figure of RATIOS replaced by the median over `runs`,
    `spread` {figure: [min, max]} and `runs` (every run's record) added."""
    if len(runs) == 1:
        return runs[0]
    out = {**runs[0], "runs": runs, "spread": {}}
    for key in RATIOS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        out["spread"][key] = [min(values), max(values)] if values else None
    return out


def rank_memory(run_dir: Path, peaks: dict) -> tuple[dict, list[dict]]:
    """The launch's {pid: peak MiB} and its ranks' memory breakdown. The probe resets each
    rank's VmHWM at its points, so a rank's peak is the larger of the sampler's and the
    probe's."""
    sampled = dict(peaks.get(run_dir.name, {}))
    ranks = breakdown(run_dir / PROBE_DIR, sampled)
    for rank in ranks:
        sampled[str(rank["pid"])] = max(sampled[str(rank["pid"])], round(rank["peak"]))
    return sampled, ranks


def start_weights(args, model: str) -> Path | None:
    """The HF weights RL started from (the mini model's warm-up export, else the built model)."""
    for world in args.worlds.split(","):
        for engine in ENGINES:
            made = args.out / f"{model}-w{world}-{engine}"
            for hf in (made / "sft_hf", made / f"{model}_hf"):
                if hf.is_dir():
                    return hf
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    peaks_file, earlier = args.out / "peaks.json", args.out / "ab_engines.json"
    peaks = json.loads(peaks_file.read_text()) if peaks_file.is_file() else {}
    parity = json.loads(earlier.read_text()).get("parity", {}) if earlier.is_file() else {}
    results = {}
    for model in args.models.split(","):
        rows = model_rows(args, model, peaks)
        if isinstance(rows, int):
            return rows
        results |= rows
        hf = start_weights(args, model)
        if hf is not None and args.launch and args.cluster is None:
            parity[model] = run_parity(hf)
    summary = {"runs": results, "parity": parity, "goal": goal(results)}
    earlier.write_text(json.dumps(summary, indent=1))
    print(table(results, parity))
    print(memory_table(results))
    g = summary["goal"]
    if g["measured"]:
        print(f"goal (ours >= {GOAL['update_speedup']}x FSDP update tok/s at <= "
              f"{GOAL['memory_ratio']}x peak memory, {GOAL['model']} world {GOAL['world']}): "
              f"{'met' if g['met'] else 'not met'} ({_f(g['update_speedup_measured'])}x, "
              f"{_f(g['memory_ratio_measured'])}x)")  # fmt: skip
    print(f"written: {earlier}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
