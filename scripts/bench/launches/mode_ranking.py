"""The ranking of trainer modes and corrections on the guessing_sums task: 40 steps, 2 seeds each.

Each arm is a main-job launch (`scripts/train_mcore.sh --model mini --task guessing_sums`, the
embedded CPU run) per seed, in <out>/<arm>-s<seed>; the seed makes the model, the data and
the warm-up (kept in the warm-up cache, so each seed's is made once). A run whose directory
holds its summary.json is done and never launched again: the table grows over several
sittings (`--max-runs N` launches at most N new runs, then reduces everything in --out).
From each run's metrics (verl's file logger, scripts.bench.launches.async_modes): the train
score and validation curves, entropy, ppo_kl, |rollout - actor log-prob|, the lag,
steps/min, and how far validation falls late in a run. An arm's figure is its late validation
accuracy (the mean of the last LATE_VALIDATIONS), over its seeds; a difference between two
arms is called real only where it exceeds the larger of their seed-to-seed ranges, and is
shown seed by seed as well (a seed's arms share its warm-up). Writes <out>/mode_ranking.json and
<out>/mode_ranking.png (one plot: train score and validation, every arm and seed) and prints
the tables (markdown).

    python -m scripts.bench.launches.mode_ranking                      # every run not yet done
    python -m scripts.bench.launches.mode_ranking --arms sync,sync-R3 --max-runs 1
    python -m scripts.bench.launches.mode_ranking --table-only         # reduce what --out holds
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

from recipes.local.summary import ACC_KEY
from scripts.bench.launches.async_modes import reduce_run
from scripts.bench.launches.replay_modes import read_rows

REPO = Path(__file__).resolve().parents[3]
ACTOR, RC = "actor_rollout_ref.actor", "algorithm.rollout_correction"
# arm -> (trainer mode, verl overrides on top of the main job's)
ARMS = {
    "sync": ("sync", []),  # the main job: router replay disabled
    "sync-R3": ("sync", [f"+{ACTOR}.mcore_ep.router_replay=R3"]),
    "colocate_async-TIS": ("colocate_async", []),  # the mode's default correction
    "colocate_async-noTIS": ("colocate_async", [f"{RC}.rollout_is=null"]),
    "separate_async-decoupled": ("separate_async", []),  # ours: decoupled PPO with TIS
    "separate_async-bypass": (
        "separate_async",
        [f"{RC}.bypass_mode=true", f"{RC}.rollout_is=null"],
    ),
}
# (a, b, the question): a's late validation accuracy against b's
COMPARISONS = (
    ("colocate_async-TIS", "colocate_async-noTIS", "TIS in colocate_async"),
    ("separate_async-decoupled", "separate_async-bypass", "decoupled PPO against bypass"),
    ("sync-R3", "sync", "R3 against no replay (sync)"),
    ("colocate_async-TIS", "sync", "colocate_async against sync"),
    ("separate_async-decoupled", "sync", "separate_async against sync"),
)
SEEDS, STEPS, LATE_VALIDATIONS = (0, 1), 40, 3
SMOOTH = 5  # the plot's train score: a running mean over this many steps
TASK = "guessing_sums"
SCORE, ENTROPY = "critic/score/mean", "actor/entropy"


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / f"{arm}-s{seed}"


def done(path: Path) -> bool:
    """A run is done once the launcher wrote its summary (after verl's last step), on this
    bench's task (a directory of another task's run is launched again: the launcher sets that
    run aside)."""
    from recipes.local.run import data_task

    return (path / "summary.json").is_file() and data_task(path) == TASK


def command(arm: str, seed: int, steps: int, path: Path) -> list[str]:
    mode, extra = ARMS[arm]
    return ["bash", str(REPO / "scripts/train_mcore.sh"), "--model", "mini", "--task", TASK,
            "--steps", str(steps), "--seed", str(seed), "--trainer-mode", mode, "--ckpt-dir",
            str(path), *(["--", *extra] if extra else [])]  # fmt: skip


def launch(arm: str, seed: int, steps: int, path: Path) -> int:
    console = path.parent / f"{path.name}.console"
    with open(console, "w") as sink:
        return subprocess.call(command(arm, seed, steps, path), cwd=REPO, stdout=sink,
                               stderr=subprocess.STDOUT)  # fmt: skip


def launch_missing(out: Path, arms: list[str], seeds: list[int], steps: int, max_runs: int | None,
                   launch_one=launch) -> int:  # fmt: skip
    """Launches the runs not done yet, in arm then seed order, at most `max_runs`; returns how
    many failed (each failure is printed with its console; the others still run)."""
    todo = [(a, s) for a in arms for s in seeds if not done(run_dir(out, a, s))]
    failed = 0
    for i, (arm, seed) in enumerate(todo[:max_runs] if max_runs is not None else todo):
        path = run_dir(out, arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(todo)}] {arm}, seed {seed}: {steps} steps in {path}", flush=True)
        rc = launch_one(arm, seed, steps, path)
        print(f"  exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0 or not done(path):
            failed += 1
            print(f"  error: the run failed: see {path.parent / (path.name + '.console')}")
    return failed


def reduce_one(rows: list[dict]) -> dict:
    """One run: async_modes' figures plus its curves, entropy, and its late validation: the
    accuracy (0/1 an answer: one flipped answer of 256 moves it by 0.004; the reward, +-1 and
    the overlong penalty, moves by 0.008) and the reward."""
    r = reduce_run(rows)
    train = [x for x in rows if x["step"] >= 1 and SCORE in x]
    r["score_curve"] = [(x["step"], x[SCORE]) for x in train]
    r["entropy_mean"] = _mean([x[ENTROPY] for x in train if ENTROPY in x])
    r["acc_curve"] = [(x["step"], x[ACC_KEY]) for x in rows if ACC_KEY in x]
    for name, curve in (("val", [v for *_, v in r["val_curve"]]),
                        ("acc", [v for _, v in r["acc_curve"]])):  # fmt: skip
        late = len(curve) > LATE_VALIDATIONS
        r[f"{name}_late"] = _mean(curve[-LATE_VALIDATIONS:]) if late else None
        r[f"{name}_start"] = curve[0] if curve else None
    r |= falls(r["acc_curve"])
    r["score_last10"] = _mean([s for _, s in r["score_curve"][-10:]])
    return r


def falls(curve: list[tuple[int, float]]) -> dict:
    """The late-drop figures of a validation curve: how far its last point sits below its best
    (drop_from_best), and its largest fall from one validation to the next (largest_fall)."""
    values = [v for _, v in curve]
    if len(values) < 2:
        return {"drop_from_best": None, "largest_fall": None}
    return {
        "drop_from_best": max(values) - values[-1],
        "largest_fall": max(0.0, *(a - b for a, b in pairwise(values))),
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def arm_figures(runs: dict[int, dict]) -> dict:
    """An arm over its seeds: the mean of each figure, the late accuracy's range, and the
    per-seed late accuracy (for the paired differences)."""
    keys = ("acc_late", "acc_start", "val_late", "val_start", "score_last10", "entropy_mean",
            "ppo_kl_mean", "logprob_diff_mean", "lag_mean", "steps_per_min", "drop_from_best",
            "largest_fall")  # fmt: skip
    out = {"seeds": sorted(runs)}
    for k in keys:
        values = [r[k] for r in runs.values() if r.get(k) is not None]
        out[k] = _mean(values)
    late = {seed: r["acc_late"] for seed, r in runs.items() if r.get("acc_late") is not None}
    out["acc_late_by_seed"] = late
    out["acc_late_range"] = max(late.values()) - min(late.values()) if len(late) > 1 else None
    return out


def compare(arms: dict[str, dict]) -> list[dict]:
    """Each COMPARISONS pair present: the difference of late validation accuracy, the larger
    seed range, whether the difference exceeds it (None without 2 seeds on both sides), and
    the paired differences, seed by seed (both arms of a seed start from the same warm-up, so
    these leave out the seeds' own spread)."""
    rows = []
    for a, b, question in COMPARISONS:
        if a not in arms or b not in arms:
            continue
        fa, fb = arms[a], arms[b]
        ranges = (fa["acc_late_range"], fb["acc_late_range"])
        diff = None if None in (fa["acc_late"], fb["acc_late"]) else fa["acc_late"] - fb["acc_late"]
        spread = None if None in ranges else max(ranges)
        real = None if diff is None or spread is None else abs(diff) > spread
        by_a, by_b = fa["acc_late_by_seed"], fb["acc_late_by_seed"]
        paired = {s: by_a[s] - by_b[s] for s in sorted(by_a) if s in by_b}
        rows.append({"question": question, "a": a, "b": b, "diff": diff, "spread": spread,
                     "exceeds_spread": real, "paired": paired})  # fmt: skip
    return rows


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def tables(arms: dict[str, dict], comparisons: list[dict]) -> str:
    cols = ("arm", "seeds", "late accuracy (range)", "first accuracy", "late reward",
            "train score, last 10", "entropy", "ppo_kl", "\\|dlogp\\|", "lag", "steps/min",
            "drop from best", "largest fall")  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "| --- " * len(cols) + "|"]
    for name, f in arms.items():
        lines.append(
            f"| {name} | {','.join(map(str, f['seeds']))} | {_fmt(f['acc_late'])} "
            f"({_fmt(f['acc_late_range'])}) | {_fmt(f['acc_start'])} | {_fmt(f['val_late'])} "
            f"| {_fmt(f['score_last10'])} | {_fmt(f['entropy_mean'])} "
            f"| {_fmt(f['ppo_kl_mean'], '.1e')} | {_fmt(f['logprob_diff_mean'], '.1e')} "
            f"| {_fmt(f['lag_mean'], '.2f')} | {_fmt(f['steps_per_min'], '.2f')} "
            f"| {_fmt(f['drop_from_best'])} | {_fmt(f['largest_fall'])} |"
        )
    lines += ["", "| question | difference of late accuracy | seed by seed | larger seed range "
              "| verdict |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    verdict = {True: "exceeds the seed spread", False: "within the seed spread",
               None: "needs 2 seeds on both sides"}  # fmt: skip
    for c in comparisons:
        paired = ", ".join(f"s{s} {_fmt(d, '+.3f')}" for s, d in c["paired"].items()) or "-"
        lines.append(f"| {c['question']} ({c['a']} - {c['b']}) | {_fmt(c['diff'], '+.3f')} "
                     f"| {paired} | {_fmt(c['spread'])} | {verdict[c['exceeds_spread']]} |")  # fmt: skip
    return "\n".join(lines)


def running_mean(curve: list[tuple[int, float]], n: int | None = None) -> list[tuple[int, float]]:
    """(step, the mean of the score over this step and the n - 1 before it): one batch's score
    swings by 0.5 from step to step."""
    n = n or SMOOTH
    values = [v for _, v in curve]
    return [
        (s, statistics.fmean(values[max(0, i - n + 1) : i + 1])) for i, (s, _) in enumerate(curve)
    ]


def plot(runs: dict[str, dict[int, dict]], path: Path) -> Path:
    """Train score (left) and validation accuracy (right) against the step: a colour an arm,
    a line style a seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    score_ax, val_ax = fig.subplots(1, 2)
    for i, (arm, seeds) in enumerate(runs.items()):
        for j, (seed, r) in enumerate(sorted(seeds.items())):
            style = dict(color=f"C{i}", linestyle=("-", "--", ":")[j % 3], linewidth=1.2)
            label = f"{arm} s{seed}"
            if r["score_curve"]:
                score_ax.plot(
                    *zip(*running_mean(r["score_curve"]), strict=True), label=label, **style
                )
            if r["acc_curve"]:
                val_ax.plot(*zip(*r["acc_curve"], strict=True), marker=".", label=label, **style)
    score_ax.set(
        title=f"train batch score (kept groups), mean of {SMOOTH} steps",
        xlabel="step",
        ylabel="reward",
    )
    val_ax.set(title=f"validation accuracy ({TASK}, 256 answers)", xlabel="step", ylabel="accuracy")
    for ax in (score_ax, val_ax):
        ax.grid(alpha=0.3)
    val_ax.legend(fontsize=7, loc="lower right", ncols=2)
    fig.savefig(path)
    return path


def reduce_all(out: Path, arms: list[str], seeds: list[int]) -> dict:
    runs: dict[str, dict[int, dict]] = {}
    for arm in arms:
        for seed in seeds:
            if done(run_dir(out, arm, seed)):
                runs.setdefault(arm, {})[seed] = reduce_one(read_rows(run_dir(out, arm, seed)))
    figures = {arm: arm_figures(seeds_of) for arm, seeds_of in runs.items()}
    return {"runs": runs, "arms": figures, "comparisons": compare(figures)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--max-runs", type=int, default=None, help="new runs to launch at most")
    p.add_argument("--out", type=Path, default=REPO / "runs/mode_ranking")
    p.add_argument("--table-only", action="store_true", help="reduce the runs already in --out")
    args = p.parse_args(argv)
    args.arms, args.seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    if unknown := [a for a in args.arms if a not in ARMS]:
        p.error(f"--arms {','.join(unknown)}: choose from {', '.join(ARMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    failed = 0
    if not args.table_only:
        failed = launch_missing(args.out, args.arms, args.seeds, args.steps, args.max_runs)
    result = reduce_all(args.out, args.arms, args.seeds)
    if not result["runs"]:
        print(f"error: {args.out} holds no finished run: run without --table-only first")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mode_ranking.json").write_text(json.dumps(result, indent=1))
    print(tables(result["arms"], result["comparisons"]))
    print(
        f"written: {args.out / 'mode_ranking.json'}, {plot(result['runs'], args.out / 'mode_ranking.png')}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
