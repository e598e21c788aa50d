"""Render one report to OUTDIR/index.html with PNG plots beside it."""

import math
from pathlib import Path

from backend.monitor import htmlpage as h
from backend.monitor import plots
from backend.monitor.metrics import layer_metrics, overall_metrics
from backend.monitor.outdir import atomic_dir
from backend.monitor.report import Report

CURVE = "max_over_mean"


def _meta_table(report: Report) -> str:
    meta = report.meta
    plan = ", ".join(f"{k}={v}" for k, v in meta["plan"].items())
    rows = [
        ["model", meta.get("model") or "-"],
        ["plan", plan],
        ["layers x experts", f"{meta['num_layers']} x {meta['num_experts']}"],
        ["top_k", meta.get("top_k")],
        ["steps", f"{meta['steps']} ({meta['first_step']}-{meta['last_step']})"],
        ["window", f"{meta['window_steps']} steps"],
        ["created", meta.get("created")],
    ]
    return h.table(["", ""], rows)


def _phase_section(report: Report, phase: str, tmp: Path) -> list[str]:
    counts_LE, ep = report.cumulative(phase), report.ep
    parts = [h.heading(f"phase: {phase}")]
    overall = overall_metrics(counts_LE, ep)
    parts.append(h.table(["metric (all steps)", "value"], [list(kv) for kv in overall.items()]))
    plots.save_png(
        plots.heatmap_figure(counts_LE, f"{phase}: expert share, all steps"),
        tmp / f"{phase}_heatmap.png",
    )
    parts.append(h.image(f"{phase}_heatmap.png", "expert share heatmap"))
    steps, curve_SL = report.step_curve(phase, CURVE)
    if steps:
        fig = plots.imbalance_figure(steps, curve_SL, CURVE, f"{phase}: {CURVE} per layer")
        plots.save_png(fig, tmp / f"{phase}_imbalance.png")
        parts.append(h.image(f"{phase}_imbalance.png", "imbalance over steps"))
    plots.save_png(
        plots.ep_load_figure(counts_LE, ep, f"{phase}: EP-rank load (ep={ep})"),
        tmp / f"{phase}_ep_load.png",
    )
    parts.append(h.image(f"{phase}_ep_load.png", "EP-rank load"))
    per_layer = layer_metrics(counts_LE, ep)
    rows = [
        [layer] + [v[layer].item() for v in per_layer.values()] for layer in range(report.shape[0])
    ]
    parts.append(h.table(["layer", *per_layer], rows))
    return parts


def _aux_section(report: Report, tmp: Path) -> list[str]:
    """Aggregate aux-loss values over steps (per-layer keys are in the JSON, not plotted)."""
    rows = [(s["step"], s.get("aux_loss") or {}) for s in report.data["steps"]]
    keys = sorted({k for _, aux in rows for k in aux if "/layer_" not in k})
    if not keys:
        return []
    steps = [step for step, _ in rows]
    series = {k: [math.nan if aux.get(k) is None else aux[k] for _, aux in rows] for k in keys}
    plots.save_png(plots.series_figure(steps, series, "router aux loss"), tmp / "aux_loss.png")
    return [h.heading("router aux loss"), h.image("aux_loss.png", "aux loss over steps")]


def _warnings_section(report: Report) -> list[str]:
    """The run's warnings (EP skew over the plan, communication share), one line each."""
    if not report.warnings:
        return []
    return [h.heading("warnings")] + [
        h.paragraph(f"step {w['step']}: {w['text']}", "flag") for w in report.warnings
    ]


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
        parts += _aux_section(report, tmp)
        title = f"Routing balance: {report.label}"
        (tmp / "index.html").write_text(h.page(title, parts))
    return Path(out)
