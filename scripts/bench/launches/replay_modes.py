"""The routing-replay table: the same DAPO job in each replay mode, from the same policy.

One main-job launch per mode (`scripts/train_mcore.sh`, the embedded CPU run; bf16 vLLM
rollout against the fp32 actor), each in its own run directory under --out; the first
launch makes the model, the data and the warm-up, the others start from copies of them, so
every mode begins at the same weights. Then, from each run's metrics (verl's file logger):
routing agreement per layer (rollout vs the actor's router, old-log-prob pass), the update
route match, |rollout - actor log-prob| mean / p99 / max, the train and validation reward.
Writes <out>/replay_modes.json and prints the table (markdown).

    python -m scripts.bench.launches.replay_modes                          # mini, 20 steps, 4 modes
    python -m scripts.bench.launches.replay_modes --model tiny --steps 10 --modes disabled,R3
    python -m scripts.bench.launches.replay_modes --table-only --out DIR   # reduce earlier runs again
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
# the overrides of each mode on top of the main job's (which asks vLLM for routes)
MODES = {
    "disabled": [f"+{ACTOR}.mcore_ep.router_replay=disabled"],
    # R2 records the old-log-prob pass's routes; verl refuses it beside rollout routes
    "R2": [f"+{ACTOR}.mcore_ep.router_replay=R2", f"{ROLLOUT}.enable_rollout_routing_replay=False"],
    "R3": [f"+{ACTOR}.mcore_ep.router_replay=R3"],
    "R3+TIS": [
        f"+{ACTOR}.mcore_ep.router_replay=R3",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
    ],
}
MADE_ONCE = ("data", "mini_hf", "tiny_hf", "sft_hf")  # what a launch makes in its directory
AGREE, MATCH = "actor/moe/routing_agreement", "actor/moe/update_route_match"
DIFF = "actor/rollout_logprob_abs_diff"
VAL = "val-aux/math_dapo/reward/mean@"


def read_rows(run_dir: Path) -> list[dict]:
    """{step: metrics} rows of a run's verl file logger, merged by step, in step order."""
    by_step: dict[int, dict] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line the run was killed while writing
            by_step.setdefault(int(row["step"]), {}).update(row.get("data", {}))
    return [by_step[s] | {"step": s} for s in sorted(by_step)]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def _extreme(rows: list[dict], key: str, pick) -> float | None:
    values = [r[key] for r in rows if key in r]
    return pick(values) if values else None


def reduce_run(rows: list[dict]) -> dict:
    """One mode's figures over its training steps: per-step means averaged, minima and maxima
    over the steps; None where the mode logs no such metric (R2 has no rollout routes)."""
    train = [r for r in rows if r["step"] >= 1 and "critic/score/mean" in r]
    layers = sorted(
        {k.rsplit("_", 1)[1] for r in train for k in r if k.startswith(f"{AGREE}/layer_")}
    )
    val = [(r["step"], v) for r in rows for k, v in r.items() if k.startswith(VAL)]
    return {
        "steps": len(train),
        "agreement_mean": _mean(train, f"{AGREE}/mean"),
        "agreement_per_layer": [_mean(train, f"{AGREE}/layer_{n}") for n in layers],
        "agreement_min": _extreme(train, f"{AGREE}/min", min),
        "route_match_mean": _mean(train, f"{MATCH}/mean"),
        "route_match_min": _extreme(train, f"{MATCH}/min", min),
        "logprob_diff_mean": _mean(train, f"{DIFF}/mean"),
        "logprob_diff_p99": _mean(train, f"{DIFF}/p99"),
        "logprob_diff_max": _extreme(train, f"{DIFF}/max", max),
        "train_reward_first_last": [train[0]["critic/score/mean"], train[-1]["critic/score/mean"]]
        if train
        else None,
        "val_reward": val,
        "step_s_median": statistics.median(
            [r["timing_s/step"] for r in train if "timing_s/step" in r]
        )
        if train
        else None,
    }


def _fmt(x, spec: str = ".4f") -> str:
    return "not logged" if x is None else format(x, spec)


def table(results: dict[str, dict]) -> str:
    head = (
        "| mode | routing agreement mean (per layer), min | update route match mean, min "
        "| \\|log-prob diff\\| mean / p99 / max | train reward first -> last | validation reward "
        "| step s (median) |\n" + "| --- " * 7 + "|"
    )
    lines = [head]
    for mode, r in results.items():
        layers = " / ".join(_fmt(x, ".3f") for x in r["agreement_per_layer"])
        agree = match = "not logged"  # R2: no rollout routes to compare with
        if r["agreement_mean"] is not None:
            agree = f"{_fmt(r['agreement_mean'])} ({layers}), {_fmt(r['agreement_min'], '.3f')}"
        if r["route_match_mean"] is not None:
            match = f"{_fmt(r['route_match_mean'], '.3f')}, {_fmt(r['route_match_min'], '.3f')}"
        diff = " / ".join(_fmt(r[k], ".1e") for k in ("logprob_diff_mean", "logprob_diff_p99",
                                                      "logprob_diff_max"))  # fmt: skip
        first_last = r["train_reward_first_last"] or [None, None]
        reward = f"{_fmt(first_last[0], '.3f')} -> {_fmt(first_last[1], '.3f')}"
        val = ", ".join(f"{s}: {v:.3f}" for s, v in r["val_reward"]) or "none"
        lines.append(f"| {mode} | {agree} | {match} | {diff} | {reward} | {val} "
                     f"| {_fmt(r['step_s_median'], '.1f')} |")  # fmt: skip
    return "\n".join(lines)


def seed_from(first: Path, run_dir: Path) -> None:
    """The first launch's model, data and warm-up, copied: every mode starts from them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in MADE_ONCE:
        if (first / name).exists() and not (run_dir / name).exists():
            shutil.copytree(first / name, run_dir / name)


def launch(model: str, steps: int, run_dir: Path, overrides: list[str], console: Path) -> int:
    cmd = ["bash", str(REPO / "scripts/train_mcore.sh"), "--model", model, "--ckpt-dir",
           str(run_dir), "--steps", str(steps), "--", *overrides]  # fmt: skip
    with open(console, "w") as sink:
        return subprocess.call(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)


def run_modes(modes: list[str], out: Path, steps: int, launch_one, table_only: bool):
    """Each mode's run directory under `out` ({mode: dir}), launched in turn unless
    `table_only` (the first launch's model, data and warm-up seed the others), or an exit
    code: 1 for a failed launch, 2 for a directory without a run's metrics."""
    runs = {}
    for mode in modes:
        run_dir = out / mode.replace("+", "_")
        if not table_only:
            seed_from(out / modes[0].replace("+", "_"), run_dir)
            console = out / f"{run_dir.name}.console"
            t0 = time.perf_counter()
            print(f"{mode}: {steps} steps in {run_dir} (console {console})", flush=True)
            rc = launch_one(mode, run_dir, console)
            print(f"{mode}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
            if rc != 0:
                print(f"error: the {mode} run failed (exit {rc}): see {console}")
                return 1
        if not list((run_dir / "metrics").glob("*.jsonl")):
            print(f"error: {run_dir} holds no run's metrics: run the {mode} mode without "
                  "--table-only first")  # fmt: skip
            return 2
        runs[mode] = run_dir
    return runs


def mode_args(argv, description: str, modes, out: Path, seed: bool = False):
    """The bench's arguments (--model, --steps, --modes, --out, --table-only; --seed), or
    None after the one line for an unknown mode. args.modes: the list."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="mini", help="tiny, mini or an HF directory (default mini)")
    p.add_argument("--steps", type=int, default=20)
    if seed:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(modes), help=f"of {', '.join(modes)}")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--table-only", action="store_true", help="reduce the runs already in --out")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if unknown := [m for m in args.modes if m not in modes]:
        print(f"error: --modes {','.join(unknown)}: choose from {', '.join(modes)}")
        return None
    return args


def main(argv: list[str] | None = None) -> int:
    args = mode_args(argv, __doc__.splitlines()[0], MODES, REPO / "runs/replay_modes")
    if args is None:
        return 2
    launch_one = lambda mode, run_dir, console: launch(  # noqa: E731
        args.model, args.steps, run_dir, MODES[mode], console
    )
    runs = run_modes(args.modes, args.out, args.steps, launch_one, args.table_only)
    if isinstance(runs, int):
        return runs
    results = {mode: reduce_run(read_rows(run_dir)) for mode, run_dir in runs.items()}
    return report(args.out / "replay_modes.json", results, table(results))


def report(path: Path, results: dict, text: str) -> int:
    """The results as JSON at `path`, the table on the console; exit 0."""
    path.write_text(json.dumps(results, indent=1))
    print(text)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
