"""The trainer-mode table: the same DAPO job in sync, colocate_async and separate_async.

One main-job launch per mode (`scripts/train_mcore.sh --trainer-mode M`, the embedded CPU
run), the same seed, each in its own run directory under --out; the first launch makes the
model, the data and the warm-up, the others start from copies of them (every mode begins at
the same weights). From each run's metrics (verl's file logger): steps/min and tokens/s over
the trained steps, the validation reward against wall time, the lag of the trained tokens,
the rollout-vs-actor gap (|log-prob diff| of the old-log-prob pass where there is one; the
update's ppo_kl and clip fraction against the rollout's log-probs in separate_async's bypass
mode), and against sync: the speed ratio and how much of generation no longer blocks a step
(overlap = 1 - gen wait per step / sync's gen per step). Writes <out>/async_modes.json and
prints the table (markdown).

    python -m scripts.bench.launches.async_modes                            # mini, 20 steps, 3 modes
    python -m scripts.bench.launches.async_modes --model tiny --steps 6 --modes sync,separate_async
    python -m scripts.bench.launches.async_modes --table-only --out DIR     # reduce earlier runs again
"""

import statistics
import subprocess
import sys
from pathlib import Path

from scripts.bench.launches.replay_modes import VAL, mode_args, read_rows, report, run_modes

REPO = Path(__file__).resolve().parents[3]
MODES = ("sync", "colocate_async", "separate_async")
LAG = "training/off_policy/trajectory_staleness_worst"
SPANS = "training/off_policy/trajectory_spans/mean"
DIFF = "actor/rollout_logprob_abs_diff/mean"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def reduce_run(rows: list[dict]) -> dict:
    """One mode's figures over its trained steps (None where the mode logs no such metric)."""
    train = [r for r in rows if r["step"] >= 1 and "timing_s/step" in r]
    wall = sum(r["timing_s/step"] for r in train)
    tokens = sum(r.get("perf/total_num_tokens", 0) for r in train)
    elapsed, val_curve = 0.0, []
    for r in rows:
        elapsed += r.get("timing_s/step", 0.0) if r["step"] >= 1 else 0.0
        val_curve += [(r["step"], round(elapsed, 1), v) for k, v in r.items() if k.startswith(VAL)]
    return {
        "steps": len(train),
        "train_s": wall,
        "steps_per_min": 60 * len(train) / wall if wall else None,
        "tokens_per_s": tokens / wall if wall else None,
        "gen_s_per_step": _mean(train, "timing_s/gen"),
        "update_s_per_step": _mean(train, "timing_s/update_actor"),
        "lag_mean": _mean(train, f"{LAG}/mean"),
        "lag_max": max((r[f"{LAG}/max"] for r in train if f"{LAG}/max" in r), default=None),
        "spans_mean": _mean(train, SPANS),
        "logprob_diff_mean": _mean(train, DIFF),
        "ppo_kl_mean": _mean(train, "actor/ppo_kl"),
        "clipfrac_mean": _mean(train, "actor/pg_clipfrac"),
        "val_curve": val_curve,  # (step, training seconds so far, validation reward)
        "val_last": val_curve[-1][2] if val_curve else None,
    }


def against_sync(results: dict[str, dict]) -> None:
    """Adds each mode's speed ratio and generation overlap against the sync run, in place."""
    base = results.get("sync")
    for r in results.values():
        ok = base and base["steps_per_min"] and r["steps_per_min"]
        r["speed_vs_sync"] = r["steps_per_min"] / base["steps_per_min"] if ok else None
        gen, sync_gen = r["gen_s_per_step"], base and base["gen_s_per_step"]
        r["gen_overlap"] = 1 - gen / sync_gen if gen is not None and sync_gen else None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict[str, dict]) -> str:
    cols = ("mode", "steps/min (x sync)", "tokens/s", "gen wait s/step (overlap)", "update s/step",
            "lag mean / max, spans", "\\|log-prob diff\\| (old-log-prob pass)", "ppo_kl, clipfrac",
            "validation reward (step @ training s)")  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "| --- " * len(cols) + "|"]
    for mode, r in results.items():
        val = ", ".join(f"{v:.3f} ({s} @ {t:.0f} s)" for s, t, v in r["val_curve"]) or "-"
        lines.append(" | ".join([
            f"| {mode}",
            f"{_fmt(r['steps_per_min'], '.2f')} ({_fmt(r['speed_vs_sync'], '.2f')}x)",
            _fmt(r["tokens_per_s"], ".0f"),
            f"{_fmt(r['gen_s_per_step'], '.2f')} ({_fmt(r['gen_overlap'], '.0%')})",
            _fmt(r["update_s_per_step"], ".2f"),
            f"{_fmt(r['lag_mean'], '.2f')} / {_fmt(r['lag_max'], '.0f')}, {_fmt(r['spans_mean'], '.2f')}",
            _fmt(r["logprob_diff_mean"], ".1e"),
            f"{_fmt(r['ppo_kl_mean'], '.1e')}, {_fmt(r['clipfrac_mean'], '.3f')}",
            val,
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def launch(model: str, steps: int, seed: int, mode: str, run_dir: Path, console: Path) -> int:
    cmd = ["bash", str(REPO / "scripts/train_mcore.sh"), "--model", model, "--ckpt-dir", str(run_dir),
           "--steps", str(steps), "--seed", str(seed), "--trainer-mode", mode]  # fmt: skip
    with open(console, "w") as sink:
        return subprocess.call(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    args = mode_args(argv, __doc__.splitlines()[0], MODES, REPO / "runs/async_modes", seed=True)
    if args is None:
        return 2
    launch_one = lambda mode, run_dir, console: launch(  # noqa: E731
        args.model, args.steps, args.seed, mode, run_dir, console
    )
    runs = run_modes(args.modes, args.out, args.steps, launch_one, args.table_only)
    if isinstance(runs, int):
        return runs
    results = {mode: reduce_run(read_rows(run_dir)) for mode, run_dir in runs.items()}
    against_sync(results)
    return report(args.out / "async_modes.json", results, table(results))


if __name__ == "__main__":
    sys.exit(main())
