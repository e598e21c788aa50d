"""End-of-run summary: reward-curve PNG, summary.json, and the lines printed to the console."""

import json
from pathlib import Path

REWARD_KEY, ACC_KEY = "rollout/reward_mean", "rollout/acc_mean"


def first_step_at(history: list[dict], key: str, threshold: float) -> int | None:
    return next((row["step"] for row in history if row.get(key, float("-inf")) >= threshold), None)


def _clocks_at(history: list[dict], step: int | None) -> dict:
    row = next((r for r in history if r["step"] == step), None)
    return {
        "seconds_to_target": round(row["time/elapsed_s"], 1) if row else None,
        "cpu_seconds_to_target": round(row["time/cpu_s"], 1) if row else None,
    }


def plot_reward_curve(history: list[dict], path: Path, target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [row[REWARD_KEY] for row in history], label="mean reward (all rollouts)")
    ax.plot(steps, [row[ACC_KEY] for row in history], label="accuracy", alpha=0.7)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:g}")
    ax.set_xlabel("step")
    ax.set_ylim(-2.1, 1.05)
    ax.set_title("DAPO on the tiny Qwen3-MoE (megatron-core, CPU)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(
    out: Path, history: list[dict], target: float, paths: dict, wall_s: float, **extra
) -> dict:
    """Write reward_curve.png and summary.json under `out`; return the summary dict."""
    reached = first_step_at(history, REWARD_KEY, target)
    summary = {
        "steps": history[-1]["step"] if history else 0,
        "start_reward": history[0][REWARD_KEY] if history else None,
        "final_reward": history[-1][REWARD_KEY] if history else None,
        "target_reward": target,
        "first_step_at_target": reached,
        **_clocks_at(history, reached),
        "wall_s": round(wall_s, 1),
        "reward_curve": str(plot_reward_curve(history, out / "reward_curve.png", target)),
        **{k: str(v) if v is not None else None for k, v in paths.items()},
        **extra,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_summary(summary: dict) -> None:
    reached = summary["first_step_at_target"]
    when = (
        f"step {reached} ({summary['seconds_to_target']}s wall, "
        f"{summary['cpu_seconds_to_target']}s CPU)"
        if reached is not None
        else "never"
    )
    print(
        f"reward {summary['start_reward']:.3f} -> {summary['final_reward']:.3f} over "
        f"{summary['steps']} steps; >= {summary['target_reward']:g} first at {when}"
    )
    for key in ("reward_curve", "routing_report", "routing_html", "tensorboard", "export",
                "checkpoint"):  # fmt: skip
        if summary.get(key):
            print(f"{key}: {summary[key]}")
    print(f"wall time: {summary['wall_s']:.1f}s")
