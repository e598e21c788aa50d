"""Write a comparison to OUTDIR: compare.json, index.html and its PNGs (atomically)."""

import json
from pathlib import Path

import numpy as np

import backend.monitor.htmlpage as h
import backend.monitor.plots as plots
from backend.monitor.compare import Side
from backend.monitor.metrics import shares_LE
from backend.monitor.outdir import atomic_dir
from backend.monitor.report import _strict

LAYER_COLUMNS = (
    "jsd",
    "top3_a",
    "top3_b",
    "max_over_mean_a",
    "max_over_mean_b",
    "cv_a",
    "cv_b",
    "entropy_a",
    "entropy_b",
    "dead_a",
    "dead_b",
    "ep_max_over_mean_a",
    "ep_max_over_mean_b",
    "agreement_a",
    "agreement_b",
)


def _curve(result: dict, key: str) -> np.ndarray:
    return np.asarray([row[key] for row in result["layers"]], dtype=float)


def _plots(result: dict, a: Side, b: Side, tmp: Path) -> list[str]:
    labels = (a.label, b.label)
    delta_LE = (shares_LE(b.counts_LE) - shares_LE(a.counts_LE)).nan_to_num(0.0).numpy()
    figures = {
        "jsd.png": plots.jsd_figure(_curve(result, "jsd"), f"{b.label} vs {a.label}"),
        "share_delta.png": plots.delta_heatmap_figure(delta_LE, f"share: {b.label} - {a.label}"),
        "max_over_mean.png": plots.metric_delta_figure(
            _curve(result, "max_over_mean_a"),
            _curve(result, "max_over_mean_b"),
            "max_over_mean",
            labels,
        ),
        "ep_max_over_mean.png": plots.metric_delta_figure(
            _curve(result, "ep_max_over_mean_a"),
            _curve(result, "ep_max_over_mean_b"),
            "ep_max_over_mean",
            (f"{a.label} (ep={a.ep})", f"{b.label} (ep={b.ep})"),
        ),
    }
    for name, fig in figures.items():
        plots.save_png(fig, tmp / name)
    return [h.image(name, name) for name in figures]


def render_compare(result: dict, a: Side, b: Side, out: str | Path, force: bool = True) -> Path:
    with atomic_dir(out, force) as tmp:
        (tmp / "compare.json").write_text(json.dumps(_strict(result), indent=1, allow_nan=False))
        parts = [h.paragraph(f"A = {a.label}, B = {b.label}"), h.paragraph(result["summary"])]
        parts += [h.paragraph(s, "flag") for s in result["sentences"]]
        parts += _plots(result, a, b, tmp)
        parts.append(h.heading("experts whose share moved most"))
        movers = result["movers"]
        parts.append(h.table(list(movers[0]) if movers else [], [list(m.values()) for m in movers]))
        parts.append(h.heading("per layer"))
        rows = [[r["layer"], *(r[c] for c in LAYER_COLUMNS)] for r in result["layers"]]
        parts.append(h.table(["layer", *LAYER_COLUMNS], rows))
        (tmp / "index.html").write_text(
            h.page(f"Routing comparison: {b.label} vs {a.label}", parts)
        )
    return Path(out)
