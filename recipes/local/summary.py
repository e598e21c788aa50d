"""End-of-run summary from verl's metrics: reward-curve PNG, summary.json, console lines.

The yardstick is verl's validation of the DAPO recipe (`trainer.test_freq`): the reward of
one sampled response per validation prompt (score and overlong penalty, as trained on) and
its accuracy. Train-batch scores are plotted too, but dynamic sampling keeps only groups
whose accuracy varies, so they stay below what the policy does.
The actor's `timing/*` (backend.instruments.timing, logged by verl as actor/timing/*) give the mean
communication share of its steps, with backend.instruments.timing's warning line when it is over 30%.
"""

import json
from pathlib import Path

from recipes.local.cpu_overrides import TOY

REWARD_KEY = f"val-aux/math_dapo/reward/mean@{TOY['val_n']}"
ACC_KEY = f"val-core/math_dapo/acc/mean@{TOY['val_n']}"
TRAIN_SCORE_KEY = "critic/score/mean"
STEP_TIME_KEYS = ("timing_s/step", "timing_s/testing")
# a step's phases as verl times them (timing_s/*): save and validation over the steps that ran one
STEP_PHASES = {"gen": "gen", "old-log-prob": "old_log_prob", "update": "update_actor",
               "weight sync": "update_weights", "save": "save_checkpoint", "validation": "testing"}  # fmt: skip
ACTOR_TIMING = "actor/timing/"  # the engine's timing/* as verl logs them


def first_step_at(history: list[dict], key: str, threshold: float) -> int | None:
    return next((row["step"] for row in history if row.get(key, float("-inf")) >= threshold), None)


def elapsed_at(history: list[dict], startup_s: float) -> dict[int, float]:
    """Wall seconds from launch to the end of each step: start-up + the steps' own timings."""
    out, total = {}, startup_s
    for row in history:
        total += sum(row.get(k, 0.0) for k in STEP_TIME_KEYS)
        out[row["step"]] = round(total, 1)
    return out


def step_phases(history: list[dict]) -> dict[str, float]:
    """Mean seconds of each STEP_PHASES phase over the training steps that logged it."""
    out = {}
    for name, key in STEP_PHASES.items():
        values = [r[f"timing_s/{key}"] for r in history if r["step"] > 0 and f"timing_s/{key}" in r]
        if values:
            out[name] = round(sum(values) / len(values), 2)
    return out


def comm_share_summary(history: list[dict], world: int = 1) -> dict:
    """Mean actor/timing/comm_share over the steps that logged it, and the warning line if it
    is over 30% (backend.instruments.comm_share.comm_share_warning, the steps' mean seconds as its parts; the
    advice for one CPU box of `world` ranks: gloo named as the cause)."""
    from backend.instruments.comm_share import CommLayout, comm_share_warning

    rows = [r for r in history if f"{ACTOR_TIMING}comm_share" in r]
    if not rows:
        return {}
    keys = {k for r in rows for k in r if k.startswith(ACTOR_TIMING)}
    means = {k.removeprefix("actor/"): sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    warning = comm_share_warning(rows[-1]["step"], means, layout=CommLayout(world, device="cpu"))
    return {
        "comm_share_mean": round(means["timing/comm_share"], 4),
        "comm_share_warning": warning.line() if warning else None,
    }


def plot_reward_curve(history: list[dict], path: Path, target: float, model: str = "tiny") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key, label in ((REWARD_KEY, "validation reward"), (ACC_KEY, "validation accuracy"),
                       (TRAIN_SCORE_KEY, "train batch score (kept groups)")):  # fmt: skip
        rows = [r for r in history if key in r]
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".", label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:g}")
    ax.set_xlabel("step")
    ax.set_ylim(-2.1, 1.05)
    ax.set_title(f"verl DAPO, Qwen3-MoE {model}, megatron-core actor on CPU")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(out: Path, history: list[dict], target: float, paths: dict, wall_s: float,
                  startup_s: float, world: int = 1, **extra) -> dict:  # fmt: skip
    """Write reward_curve.png and summary.json under `out`; return the summary dict."""
    validated = [r for r in history if REWARD_KEY in r]
    reached = first_step_at(validated, REWARD_KEY, target)
    steps = [r for r in history if r["step"] > 0]
    summary = {
        "steps": steps[-1]["step"] if steps else 0,
        "start_reward": validated[0][REWARD_KEY] if validated else None,
        "final_reward": validated[-1][REWARD_KEY] if validated else None,
        "final_accuracy": validated[-1][ACC_KEY] if validated else None,
        "target_reward": target,
        "first_step_at_target": reached,
        "seconds_to_target": elapsed_at(history, startup_s).get(reached),
        "startup_s": round(startup_s, 1),
        "step_phases_s": step_phases(history),
        "wall_s": round(wall_s, 1),
        "steps_per_min": round(
            60 * len(steps) / max(sum(r.get("timing_s/step", 0) for r in steps), 1e-9), 2
        ),
        "reward_curve": str(
            plot_reward_curve(history, out / "reward_curve.png", target, _model_name(paths))
        ),
        **comm_share_summary(history, world),
        **{k: str(v) if v is not None else None for k, v in paths.items()},
        **extra,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _model_name(paths: dict) -> str:
    """The trained model as the plot names it: a built one by its name (tiny_hf: tiny), else
    its directory's name."""
    from recipes.local.task.built_models import SFT_DIR

    model = paths.get("model")
    if model and Path(model).name == SFT_DIR:  # RL reads the warm-up's export
        return "mini, from its SFT warm-up"
    return Path(model).name.removesuffix("_hf") if model else "tiny"


def _startup_parts(summary: dict) -> str:
    """The start-up's parts: the bootstrap, the model, data and warm-up (or the warm-up
    reused), verl's start-up, the first validation; none when verl's is all there is."""
    parts = summary.get("startup_parts_s") or {}
    boot, prepared = parts.get("bootstrap", 0.0), parts.get("prepared", 0.0)
    validation_at, total = parts.get("validation_at"), summary["startup_s"]
    shown = [f"bootstrap {boot:.1f}s"] if boot >= 1.0 else []
    if parts.get("warmup") == "reused":
        shown.append(f"model and data {prepared:.1f}s, the warm-up reused")
    elif prepared >= 1.0:
        shown.append(f"model, data and warm-up {prepared:.1f}s")
    if not shown and validation_at is None:
        return ""
    verl_end = total if validation_at is None else validation_at
    shown.append(f"verl {verl_end - boot - prepared:.1f}s")
    if validation_at is not None:
        shown.append(f"the first validation {total - validation_at:.1f}s")
    return " (" + ", ".join(shown) + ")"


def print_summary(summary: dict) -> None:
    reached = summary["first_step_at_target"]
    when = (f"first at step {reached} ({summary['seconds_to_target']}s from launch)"
            if reached is not None else "not reached")  # fmt: skip
    start, final = summary["start_reward"], summary["final_reward"]
    if start is not None:
        print(f"validation reward {start:.3f} -> {final:.3f} over {summary['steps']} steps "
              f"(accuracy {summary['final_accuracy']:.2f}); >= {summary['target_reward']:g} "
              f"{when}")  # fmt: skip
    print(
        f"{summary['steps_per_min']} steps/min; start-up {summary['startup_s']}s"
        + _startup_parts(summary)
    )
    if summary.get("step_phases_s"):
        print(
            "a step (mean s): "
            + ", ".join(f"{k} {v:g}" for k, v in summary["step_phases_s"].items())
        )
    if summary.get("comm_share_mean") is not None:
        print(f"communication: {summary['comm_share_mean']:.1%} of the actor's step time "
              "(mean of actor/timing/comm_share)")  # fmt: skip
    if summary.get("comm_share_warning"):
        print(summary["comm_share_warning"])
    for key in ("model", "reward_curve", "routing_report", "routing_html", "tensorboard", "export",
                "checkpoint"):  # fmt: skip
        if summary.get(key):
            print(f"{key}: {summary[key]}")
    if summary.get("export_max_logits_diff") is not None:
        print("export reloads in transformers: max |logits diff| = "
              f"{summary['export_max_logits_diff']:.2e}")  # fmt: skip
    print(f"wall time: {summary['wall_s']:.1f}s")
