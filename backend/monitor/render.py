"""Render one report to OUTDIR/index.html with PNG plots beside it.

The page: the run and model in the title; what was recorded (trainer steps and the optimizer
updates they hold); the alarms and warnings; per phase the expert-load heatmap (load over the
layer's mean, EP ranks' blocks marked), the hottest experts by id, the imbalance over trainer
steps (the phases on one axis), the load per EP rank at ep 2, 4 and the run's own
(render_experts) and the per-layer table; the routing agreement and rollout log-prob mismatch
over the steps; the router aux loss.
"""

import math
from pathlib import Path

import numpy as np

import backend.monitor.htmlpage as h
import backend.monitor.plots as plots
import backend.monitor.render_experts as experts
from backend.monitor.metrics import layer_metrics, overall_metrics
from backend.monitor.outdir import atomic_dir
from backend.monitor.report import Report

CURVE = "max_over_mean"
LAYERS_OPEN = 8  # the per-layer table is unfolded up to this many layers
AGREEMENT = "moe/routing_agreement/layer_{:02d}"
LOGPROB_DIFF = tuple(f"actor/rollout_logprob_abs_diff/{s}" for s in ("mean", "p99", "max"))


def title(report: Report) -> str:
    """Routing balance: <run> (<model>), from meta (the file's name for older reports)."""
    meta = report.meta
    run = meta.get("run") or report.label
    model = Path(meta["model"]).name if meta.get("model") else ""
    return f"Routing balance: {run}" + (f" ({model})" if model else "")


def _span(values: list[int]) -> str:
    return f"{len(values)} ({values[0]}-{values[-1]})" if values else "0"


def _meta_table(report: Report) -> str:
    meta = report.meta
    plan = ", ".join(f"{k}={v}" for k, v in meta["plan"].items())
    steps = report.data["steps"]
    rows = [
        ["run", meta.get("run") or "-"],
        ["model", meta.get("model") or "-"],
        ["plan", plan],
        ["layers x experts", f"{meta['num_layers']} x {meta['num_experts']}"],
        ["top_k", meta.get("top_k")],
    ]
    if report.on_trainer_steps:
        rows.append(["trainer steps", _span(sorted({s["trainer_step"] for s in steps}))])
    rows += [
        ["optimizer updates", _span([s["step"] for s in steps])],
        ["window", f"{meta['window_steps']} optimizer updates"],
        ["router replay", meta.get("router_replay") or "-"],
        ["created", meta.get("created")],
    ]
    return h.table(["", ""], rows)


def _phase_section(report: Report, phase: str, tmp: Path) -> list[str]:
    counts_LE, ep = report.cumulative(phase), report.ep
    top_k = report.meta.get("top_k")
    parts = [h.heading(f"phase: {phase}")]
    overall = overall_metrics(counts_LE, ep)
    parts.append(h.table(["metric (all steps)", "value"], [list(kv) for kv in overall.items()]))
    title_ = f"{phase}: expert load / layer mean, all steps"
    plots.save_png(plots.heatmap_figure(counts_LE, title_, ep), tmp / f"{phase}_heatmap.png")
    parts.append(h.image(f"{phase}_heatmap.png", "expert load heatmap"))
    parts += experts.hottest_section(counts_LE, top_k, ep, phase)
    steps, curve_SL = report.trainer_curve(phase, CURVE)
    if steps:
        fig = plots.imbalance_figure(steps, curve_SL, CURVE, f"{phase}: {CURVE} per layer",
                                     xlabel=report.axis_label)  # fmt: skip
        plots.save_png(fig, tmp / f"{phase}_imbalance.png")
        parts.append(h.image(f"{phase}_imbalance.png", "imbalance over steps"))
    parts += experts.ep_section(counts_LE, ep, phase, tmp)
    per_layer = layer_metrics(counts_LE, ep)
    names = experts.layer_names(counts_LE)
    rows = [[layer] + [v[layer].item() for v in per_layer.values()] + list(names[layer])
            for layer in range(report.shape[0])]  # fmt: skip
    head = ["layer", *per_layer, f"hottest {experts.PER_LAYER_N} (x the mean)", "dead experts"]
    table = h.table(head, rows, cls="t2")
    layers = report.shape[0]
    parts.append(h.details(f"{phase}: per-layer metrics ({layers} layers)", table,
                           open_=layers <= LAYERS_OPEN))  # fmt: skip
    return parts


def _aux_section(report: Report, tmp: Path) -> list[str]:
    """Aggregate aux-loss values over steps (per-layer keys are in the JSON, not plotted)."""
    keys = sorted({k for s in report.data["steps"] for k in s.get("aux_loss") or {}
                   if "/layer_" not in k})  # fmt: skip
    if not keys:
        return []
    steps, series = report.series("aux_loss", keys)
    fig = plots.series_figure(steps, series, "router aux loss", xlabel=report.axis_label)
    plots.save_png(fig, tmp / "aux_loss.png")
    return [h.heading("router aux loss"), h.image("aux_loss.png", "aux loss over steps")]


def _mismatch_section(report: Report, tmp: Path) -> list[str]:
    """Routing agreement per layer (router's own top-k vs the rollout's) and |rollout - actor
    log-prob| over the steps that measured them (the old-log-prob pass of each step)."""
    layers = range(report.shape[0])
    steps, series = report.series("mismatch", [AGREEMENT.format(i) for i in layers]
                                  + list(LOGPROB_DIFF))  # fmt: skip
    if not steps:
        return []
    parts = [
        h.heading("rollout vs actor: routing agreement and log-prob mismatch"),
        h.paragraph(
            "agreement: share of response tokens whose top-k expert set is the same in the "
            "rollout's routed_experts and in the router's own choice (1 = identical); "
            "|log-prob diff|: |actor old log-prob - rollout log-prob| over response tokens"
        ),
    ]
    agree_SL = np.asarray([series[AGREEMENT.format(i)] for i in layers], dtype=float).T
    if not np.isnan(agree_SL).all():
        fig = plots.imbalance_figure(steps, agree_SL, "routing agreement",
                                     "routing agreement per layer", xlabel=report.axis_label,
                                     worst="min")  # fmt: skip
        plots.save_png(fig, tmp / "agreement.png")
        parts.append(h.image("agreement.png", "routing agreement over steps"))
        mean_L = report.agreement_L()
        rows = [[i, mean_L[i].item(), agree_SL[-1, i]] for i in layers]
        parts.append(h.table(["layer", "agreement (mean over steps)", "last step"], rows))
    diffs = {k.rsplit("/", 1)[1]: v for k, v in series.items() if k in LOGPROB_DIFF}
    if any(v > 0 for values in diffs.values() for v in values if not math.isnan(v)):
        fig = plots.series_figure(steps, diffs, "rollout vs actor |log-prob diff|",
                                  xlabel=report.axis_label, log=True)  # fmt: skip
        plots.save_png(fig, tmp / "logprob_diff.png")
        parts.append(h.image("logprob_diff.png", "log-prob mismatch over steps"))
    return parts


def _when(w: dict) -> str:
    """Alarms count trainer steps; the engine's warnings optimizer updates (+ trainer step)."""
    if w.get("level") == "alarm":
        return f"step {w['step']}"
    if "trainer_step" in w:
        return f"step {w['trainer_step']} (update {w['step']})"
    return f"update {w['step']}"


def _warnings_section(report: Report) -> list[str]:
    """The run's alarms (launcher) and warnings (EP skew, communication share), one row each."""
    if not report.warnings:
        return []
    alarms = sum(w.get("level") == "alarm" for w in report.warnings)
    summary = f"{alarms} alarm(s), {len(report.warnings) - alarms} warning(s)"
    rows = [[w.get("level", "warning"), _when(w), w["kind"], w["text"]] for w in report.warnings]
    return [h.heading("alarms and warnings"), h.paragraph(summary, "flag"),
            h.table(["level", "when", "kind", "what"], rows, cls="log")]  # fmt: skip


def render(
    report: Report, out: str | Path, phases: list[str] | None = None, force: bool = True
) -> Path:
    """index.html + per-phase heatmap, imbalance-over-steps and EP-load PNGs (and the aux loss
    when the steps carry it), written atomically. force=False refuses an existing output (the
    CLI without --force); programmatic callers re-render their own directory."""
    names = phases or [p for p in report.data["phases"] if report.cumulative(p).sum() > 0]
    with atomic_dir(out, force) as tmp:
        parts = [_meta_table(report), *_warnings_section(report)]
        for phase in names:
            parts += _phase_section(report, phase, tmp)
        if not names:
            parts.append(h.paragraph("no tokens recorded in any phase", "flag"))
        parts += _mismatch_section(report, tmp)
        parts += _aux_section(report, tmp)
        (tmp / "index.html").write_text(h.page(title(report), parts))
    return Path(out)
