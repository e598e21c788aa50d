"""The main job at world 1, 2, 4 and 8 (the mini model, the same global batch, 5 steps each):
update tokens/s, the step's phases, peak RSS per actor rank, and the bytes each rank moves per
step in its collectives by TP / EP / DP group, beside parallel.step_traffic's model of the
same plan; then the model alone for Qwen3-30B-A3B at tp4 x ep8 on 4x8.

One launch per plan through scripts.bench.launches.mission_plan_run (its process-tree memory
sampler and phase means), with the engine's collective counter on
(backend.instruments.comm_bytes: torch's flight recorder, per rank and phase). Plans already
measured in --out are kept, so the table can be filled over several sittings.

    python -m scripts.bench.launches.scale_table --out runs/bench_scale        # ~40 min, 2 cores
    python -m scripts.bench.launches.scale_table --out DIR --plans w1 w2       # some of them
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from backend.instruments import comm_bytes
from backend.qwen3_moe.config import load_qwen3_moe_spec
from parallel.models import load_spec
from parallel.plan import plan_for_model
from parallel.step_traffic import KINDS, Settings, phase_bytes
from recipes.local import warmup_cache
from scripts.bench.launches import mission_plan_run
from scripts.bench.launches.ab_engines import ACTOR_TITLE

PLANS = {  # world: tp, ep (dp 2 from world 2 on: every kind of group moves something)
    "w1": (1, 1, 1),
    "w2": (2, 1, 2),
    "w4": (4, 2, 4),
    "w8": (8, 4, 8),
}
STEPS = 5
MODELLED = ("old_log_prob", "update", "weight_sync")
# the cluster's step for the full model: data.train_batch_size 32 x n 16 samples of ~4900
# tokens (recipes.dapo.job.overrides), split over dp, bf16, the alltoall dispatcher
CLUSTER_SAMPLES, CLUSTER_SAMPLE_TOKENS = 32 * 16, 4900


def rank_rows(comm_dir: Path) -> dict[int, list[dict]]:
    return {
        int(f.stem.removeprefix("rank")): [json.loads(x) for x in f.read_text().splitlines()]
        for f in sorted(comm_dir.glob("rank*.jsonl"))
    }


def per_step(rows: list[dict], fit, recompute: str = "none") -> dict:
    """One rank's bytes per trained step by kind, measured and modelled call by call. The
    RL run starts at its first weight sync (the rollout's first weights, left out): rows
    before it are the SFT warm-up's (rank 0 of a world of one: nothing moves)."""
    first = next(i for i, r in enumerate(rows) if r["phase"] == "weight_sync")
    rows = rows[first + 1 :]
    steps = sum(r["phase"] == "old_log_prob" for r in rows)
    measured = dict.fromkeys(KINDS, 0.0)
    model = dict.fromkeys(KINDS, 0.0)
    other = 0.0
    for r in rows:
        if r["phase"] not in MODELLED:
            other += sum(r["bytes"].values())
            continue
        for k in KINDS:
            measured[k] += r["bytes"][k]
        for k, v in phase_bytes(
            fit, r["phase"], r["tokens"], Settings(4, recompute=recompute)
        ).items():
            model[k] += v
    tokens = sum(r["tokens"] for r in rows if r["phase"] == "update") / steps
    return {
        "steps": steps,
        "update_tokens": tokens,
        "measured": {k: v / steps for k, v in measured.items()},
        "model": {k: v / steps for k, v in model.items()},
        "other_phases": other / steps,
    }


def comm_summary(comm_dir: Path, fit, recompute: str) -> dict:
    """Mean and max over ranks of the per-step bytes, measured and modelled."""
    ranks = [per_step(rows, fit, recompute) for rows in rank_rows(comm_dir).values()]
    out = {"ranks": len(ranks), "steps": ranks[0]["steps"]}
    for what in ("measured", "model"):
        out[what] = {k: statistics.fmean(r[what][k] for r in ranks) for k in KINDS}
    out["measured_max"] = {k: max(r["measured"][k] for r in ranks) for k in KINDS}
    out["other_phases"] = statistics.fmean(r["other_phases"] for r in ranks)
    return out


def engine_recompute(run_dir: Path) -> str:
    """The engine's activation recompute in the run's resolved config (full recompute runs
    each layer's forward, and its collectives, again in the backward)."""
    import yaml

    config = yaml.safe_load((run_dir / "checkpoints/hydra/.hydra/config.yaml").read_text())
    return str(config["actor_rollout_ref"]["actor"]["mcore_ep"]["recompute"])


def measure(name: str, out: Path) -> dict:
    world, tp, ep = PLANS[name]
    where = out / name
    comm_dir = where / "comm"
    if not (where / "mission_plan_run.json").exists():
        os.environ[comm_bytes.ENV] = str(comm_dir)
        os.environ[comm_bytes.FR_BUFFER_ENV] = str(comm_bytes.FR_BUFFER)
        os.environ.setdefault(warmup_cache.CACHE_ENV, str(out / ".warmup_cache"))  # one for all
        code = mission_plan_run.main(
            ["--out", str(where), "--plan", f"--tp {tp} --ep {ep}", "--steps", str(STEPS)]
        )
        if code != 0:
            raise SystemExit(f"{name}: the launch exited {code}: see {where / 'console.log'}")
    run = json.loads((where / "mission_plan_run.json").read_text())
    spec, recompute = (
        load_qwen3_moe_spec(where / "run" / "mini_hf"),
        engine_recompute(where / "run"),
    )
    fit = plan_for_model(spec, nodes=1, devices_per_node=world, tp=tp, ep=ep)
    by_title = run["peak_rss_mib_by_title"].items()
    # ab_engines' actor titles, the method running after them ("...WorkerDict.actor_rollout_
    # update_actor"); a rank's forked checkpoint writer carries its title: the max is the rank
    actors = [mib for title, mibs in by_title if ACTOR_TITLE.match(title) for mib in mibs]
    return {
        "plan": fit.plan.describe(),
        "wall_s": run["wall_s"],
        "phases_mean_s": run["phases_mean_s"],
        "actor_peak_rss_mib": max(actors) if actors else None,
        "peak_total_pss_mib": run["peak_total_pss_mib"],
        "recompute": recompute,
        "comm": comm_summary(comm_dir, fit, recompute) if world > 1 else None,
    }


def cluster_recompute() -> str:
    """The recompute the launcher picks for the full model at tp4 x ep8 on H100s (its memory
    model: the least whose update fits), read from its resolved overrides."""
    from recipes.dapo.job import overrides
    from recipes.launcher.arguments import build_parser, split_argv
    from recipes.launcher.resolution import resolve
    from recipes.launcher.run_spec import from_args

    own, extra = split_argv(["--device", "cuda", "--tp", "4", "--ep", "8", "--dry-run"])
    groups = resolve(from_args(build_parser().parse_args(own), extra)).groups
    return str(overrides.value_of(groups, f"{overrides.ACTOR}.{overrides.BACKEND}.recompute"))


def cluster_row() -> dict:
    fit = plan_for_model(load_spec(), nodes=4, devices_per_node=8, tp=4, ep=8)
    tokens = CLUSTER_SAMPLES * CLUSTER_SAMPLE_TOKENS // fit.plan.dp
    recompute = cluster_recompute()
    model = dict.fromkeys(KINDS, 0.0)
    for phase in MODELLED:
        how = Settings(2, dispatcher="alltoall", recompute=recompute)
        for k, v in phase_bytes(fit, phase, tokens, how).items():
            model[k] += v
    return {"plan": fit.plan.describe(), "update_tokens": tokens, "recompute": recompute,
            "model": model}  # fmt: skip


def mb(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def table(rows: dict, cluster: dict) -> str:
    lines = [
        "| world | plan | update tok/s | step s | gen / old-lp / update / sync s | actor RSS MiB "
        "| TP MiB/step | EP MiB/step | DP MiB/step | model TP / EP / DP MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        p, c = r["phases_mean_s"], r["comm"]
        phases = " / ".join(f"{p.get(k, 0):.1f}" for k in
                            ("gen", "old_log_prob", "update_actor", "update_weights"))  # fmt: skip
        if c:
            got = [mb(c["measured"][k]) for k in KINDS]
            model = " / ".join(mb(c["model"][k]) for k in KINDS)
        else:
            got, model = ["0", "0", "0"], "0 / 0 / 0"
        lines.append(
            f"| {PLANS[name][0]} | {r['plan'].split(' on ')[0]} | {p.get('update_tokens_per_s')} "
            f"| {p.get('step', 0):.1f} | {phases} | {r['actor_peak_rss_mib']} | "
            + " | ".join(got)
            + f" | {model} |"
        )
    gb = " / ".join(f"{cluster['model'][k] / 1e9:,.1f} GB" for k in KINDS)
    lines.append(f"\nQwen3-30B-A3B, {cluster['plan']}, {cluster['update_tokens']:,} tokens a DP "
                 f"rank per step (bf16, alltoall, recompute {cluster['recompute']}), model per "
                 f"rank per step: TP / EP / DP {gb}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plans", nargs="+", choices=list(PLANS), default=list(PLANS))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.plans:
        rows[name] = measure(name, args.out)
        print(f"{name}: {rows[name]['plan']} done", flush=True)
    result = {"plans": rows, "cluster_model": cluster_row()}
    (args.out / "scale_table.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows, result["cluster_model"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
