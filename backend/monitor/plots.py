"""matplotlib figures for the monitor (Figure + Agg canvas: no pyplot, no global backend)."""

from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from backend.monitor.metrics import ep_rank_load_LR, shares_LE


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _fit(n: int, per: float, lo: float, hi: float) -> float:
    return float(min(hi, max(lo, n * per)))


def heatmap_figure(counts_LE, title: str) -> Figure:
    """Each expert's share of its layer's tokens, layers down, experts across."""
    share_LE = shares_LE(counts_LE).nan_to_num(0.0).numpy()
    num_layers, num_experts = share_LE.shape
    fig = _figure(_fit(num_experts, 0.08, 6, 14), _fit(num_layers, 0.12, 2.5, 8))
    ax = fig.add_subplot()
    image = ax.imshow(share_LE, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set(title=title, xlabel="expert (global index)", ylabel="layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax, label="share of layer's tokens")
    return fig


def delta_heatmap_figure(delta_LE: np.ndarray, title: str) -> Figure:
    """Change of each expert's share (B - A), diverging colours centred on zero."""
    num_layers, num_experts = delta_LE.shape
    bound = float(np.abs(delta_LE).max()) or 1e-9
    fig = _figure(_fit(num_experts, 0.08, 6, 14), _fit(num_layers, 0.12, 2.5, 8))
    ax = fig.add_subplot()
    image = ax.imshow(
        delta_LE, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-bound, vmax=bound
    )
    ax.set(title=title, xlabel="expert (global index)", ylabel="layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax, label="share change")
    return fig


def imbalance_figure(steps: list[int], curve_SL: np.ndarray, name: str, title: str,
                     xlabel: str = "step", worst: str = "max") -> Figure:  # fmt: skip
    """A per-layer metric over steps: image (steps x layers) and mean / worst-layer lines
    (worst: "max" where high is bad, "min" where low is)."""
    fig = _figure(10, 6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    extent = (steps[0] - 0.5, steps[-1] + 0.5, curve_SL.shape[1] - 0.5, -0.5)
    image = top.imshow(
        curve_SL.T, aspect="auto", interpolation="nearest", extent=extent, cmap="magma"
    )
    top.set(title=title, ylabel="layer")
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=top, label=name)
    bottom.plot(steps, np.nanmean(curve_SL, axis=1), label="mean over layers")
    worst_S = (np.nanmax if worst == "max" else np.nanmin)(curve_SL, axis=1)
    bottom.plot(steps, worst_S, label="worst layer")
    bottom.set(xlabel=xlabel, ylabel=name)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend()
    return fig


def ep_load_figure(counts_LE, ep: int, title: str) -> Figure:
    """Each EP rank's share of all tokens, and the busiest layer's per-rank shares."""
    load_LR = ep_rank_load_LR(counts_LE, ep)
    share_LR = (load_LR / load_LR.sum(-1, keepdim=True)).nan_to_num(0.0)
    overall_R = (load_LR.sum(0) / load_LR.sum()).nan_to_num(0.0).numpy()
    worst = int((share_LR.amax(-1)).argmax())
    fig = _figure(_fit(ep, 0.5, 5, 12), 3.5)
    ax = fig.add_subplot()
    ranks = np.arange(ep)
    ax.bar(ranks, overall_R, label="all layers")
    ax.plot(ranks, share_LR[worst].numpy(), "o", color="C3", label=f"layer {worst} (worst)")
    ax.axhline(1.0 / ep, color="grey", linestyle="--", label="balanced")
    ax.set(title=title, xlabel="EP rank", ylabel="share of tokens", xticks=ranks)
    ax.legend()
    return fig


def jsd_figure(jsd_L: np.ndarray, title: str) -> Figure:
    fig = _figure(_fit(len(jsd_L), 0.15, 5, 12), 3.5)
    ax = fig.add_subplot()
    ax.bar(np.arange(len(jsd_L)), jsd_L)
    ax.set(title=title, xlabel="layer", ylabel="Jensen-Shannon divergence (bits)")
    return fig


def metric_delta_figure(
    a_L: np.ndarray, b_L: np.ndarray, name: str, labels: tuple[str, str]
) -> Figure:
    fig = _figure(_fit(len(a_L), 0.15, 5, 12), 3.5)
    ax = fig.add_subplot()
    layers = np.arange(len(a_L))
    ax.plot(layers, a_L, "o-", label=labels[0])
    ax.plot(layers, b_L, "s-", label=labels[1])
    ax.set(title=f"{name} per layer", xlabel="layer", ylabel=name)
    ax.legend()
    return fig


def series_figure(steps: list[int], series: dict[str, list[float]], title: str,
                  xlabel: str = "step", log: bool = False, ylabel: str = "") -> Figure:  # fmt: skip
    """A few scalars over steps (e.g. the router aux-loss values), one line each."""
    fig = _figure(10, 3.5)
    ax = fig.add_subplot()
    for name, values in series.items():
        ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=name)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if log:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    return fig


def save_png(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png")


def figure_rgb_HWC(fig: Figure) -> np.ndarray:
    """The rendered figure as uint8 RGB [H, W, 3] (for tensorboard's add_image)."""
    canvas = fig.canvas
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def as_numpy(values) -> np.ndarray:
    return values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values, dtype=float)
