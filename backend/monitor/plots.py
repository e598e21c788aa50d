"""matplotlib figures for the monitor (Figure + Agg canvas: no pyplot, no global backend)."""

import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from backend.monitor.metrics import as_counts, ep_max_over_mean_L, ep_rank_load_LR


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _fit(n: int, per: float, lo: float, hi: float) -> float:
    return float(min(hi, max(lo, n * per)))


def expert_axis(ax, num_experts: int, ep: int = 1) -> None:
    """Expert ids legible at any E: at most 16 labels (every 8th at 128), a minor tick per
    expert up to 256; with ep > 1 each EP rank's block of experts is marked and named on top."""
    step = 1 << max(0, math.ceil(math.log2(num_experts / 16)))
    ax.set_xticks(np.arange(0, num_experts, step))
    if 1 < step and num_experts <= 256:
        ax.set_xticks(np.arange(num_experts), minor=True)
    ax.set_xlim(-0.5, num_experts - 0.5)
    if ep <= 1 or num_experts % ep:
        return
    block = num_experts // ep
    for r in range(1, ep):
        ax.axvline(r * block - 0.5, color="0.3", linewidth=1.2, linestyle="--")
    if ep <= 16:
        top = ax.secondary_xaxis("top")
        top.set_xticks((np.arange(ep) + 0.5) * block - 0.5,
                       labels=[f"EP rank {r}" if ep <= 8 else str(r) for r in range(ep)])  # fmt: skip
        top.tick_params(length=0, labelsize="small")


def heatmap_figure(counts_LE, title: str, ep: int = 1) -> Figure:
    """Each expert's load over its layer's mean (log colours: white even, red hot, blue cold,
    black dead), layers down, experts across; with ep > 1 the EP ranks' blocks marked."""
    counts = as_counts(counts_LE)
    x_mean_LE = (counts / counts.mean(-1, keepdim=True)).nan_to_num(0.0).numpy()
    num_layers, num_experts = x_mean_LE.shape
    bound = max(2.0, float(x_mean_LE.max()))
    fig = _figure(_fit(num_experts, 0.08, 6, 12.5), _fit(num_layers, 0.12, 2.6, 8))
    ax = fig.add_subplot()
    cmap = colormaps["RdBu_r"].with_extremes(bad="black", under=colormaps["RdBu_r"](0.0))
    image = ax.imshow(np.ma.masked_less_equal(x_mean_LE, 0.0), aspect="auto", cmap=cmap,
                      interpolation="nearest", norm=LogNorm(1.0 / bound, bound))  # fmt: skip
    ax.set(title=title, xlabel="expert (global index)", ylabel="layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    expert_axis(ax, num_experts, ep)
    bar = fig.colorbar(image, ax=ax, label="load / layer mean (black: no token)")
    ticks = [2.0**i for i in range(-6, 7) if 1.0 / bound <= 2.0**i <= bound]
    bar.set_ticks(ticks, labels=[f"{t:g}x" if t >= 1 else f"1/{1 / t:g}x" for t in ticks])
    bar.minorticks_off()
    return fig


def delta_heatmap_figure(delta_LE: np.ndarray, title: str) -> Figure:
    """Change of each expert's share (B - A), diverging colours centred on zero."""
    num_layers, num_experts = delta_LE.shape
    bound = float(np.abs(delta_LE).max()) or 1e-9
    fig = _figure(_fit(num_experts, 0.08, 6, 12.5), _fit(num_layers, 0.12, 2.6, 8))
    ax = fig.add_subplot()
    image = ax.imshow(
        delta_LE, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-bound, vmax=bound
    )
    ax.set(title=title, xlabel="expert (global index)", ylabel="layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    expert_axis(ax, num_experts)
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


def ep_load_figure(counts_LE, degrees: list[int], title: str) -> Figure:
    """Per EP degree, each rank's load over the mean rank load: all layers together (bars
    from 1, red above) and the layer with the highest max/mean (dots, named in the title)."""
    fig = _figure(_fit(len(degrees), 3.6, 5, 12), 3.4)
    axes = fig.subplots(1, len(degrees), sharey=True, squeeze=False)[0]
    for ax, ep in zip(axes, degrees, strict=True):
        load_LR = ep_rank_load_LR(counts_LE, ep)
        all_R = (load_LR.sum(0) / load_LR.sum(0).mean()).numpy()
        skew_L = ep_max_over_mean_L(counts_LE, ep).nan_to_num(0.0)
        worst = int(skew_L.argmax())
        ranks = np.arange(ep)
        ax.bar(ranks, all_R - 1.0, bottom=1.0, color=np.where(all_R > 1, "C3", "C0"),
               label="all layers (red: over the mean)")  # fmt: skip
        ax.plot(ranks, (load_LR[worst] / load_LR[worst].mean()).numpy(), "o", color="k",
                label="worst layer")  # fmt: skip
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"ep={ep}: worst L{worst} {skew_L[worst].item():.2f}x", xlabel="EP rank",
               xticks=ranks if ep <= 16 else ranks[:: ep // 8])  # fmt: skip
    axes[0].set_ylabel("load / mean rank load")
    fig.suptitle(title)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize="small")  # fmt: skip
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
