"""Compare the routing of two runs, or of two windows of one run, layer by layer.

Counts are per global expert, so the EP degree of either run does not matter for shares
and divergences; EP-rank metrics use each side's own EP degree (or --ep for both).
"""

import math
from dataclasses import dataclass

import torch

from backend.monitor.metrics import layer_metrics, shares_LE, top_n_share_L
from backend.monitor.report import ReportError

TOP_N = 3  # the sentence's "top 3 experts"


@dataclass(frozen=True)
class Side:
    label: str
    counts_LE: torch.Tensor
    ep: int
    agreement_L: torch.Tensor | None = None  # rollout-vs-trainer routing agreement, if measured


@dataclass(frozen=True)
class Thresholds:
    jsd_bits: float = 0.05  # a layer whose distribution moved this far is flagged
    top_share: float = 0.10  # ... or whose top-3 share moved this many points (0.10 = 10%)
    movers: int = 10  # experts listed as moving most


def jensen_shannon_L(a_LE, b_LE) -> torch.Tensor:
    """JSD (bits, in [0, 1]) between each layer's expert distributions; NaN for empty layers."""
    p, q = shares_LE(a_LE), shares_LE(b_LE)
    m = (p + q) / 2

    def kl(x):
        return torch.where(x > 0, x * (x / m).log2(), torch.zeros_like(x)).sum(-1)

    return ((kl(p) + kl(q)) / 2).clamp(min=0.0)


def check_comparable(a: Side, b: Side) -> None:
    if a.counts_LE.shape != b.counts_LE.shape:
        (la, ea), (lb, eb) = a.counts_LE.shape, b.counts_LE.shape
        raise ReportError(
            f"layer/expert count mismatch: {a.label} is {la}x{ea}, {b.label} is "
            f"{lb}x{eb}: compare runs of the same model"
        )
    for side in (a, b):
        if side.counts_LE.sum() == 0:
            raise ReportError(
                f"{side.label} has no tokens in this phase/window: pick another --phase or --window"
            )


def top_movers(a: Side, b: Side, n: int) -> list[dict]:
    """The (layer, expert) pairs whose share of their layer changed most."""
    delta_LE = (shares_LE(b.counts_LE) - shares_LE(a.counts_LE)).nan_to_num(0.0)
    order = delta_LE.abs().flatten().argsort(descending=True)[:n]
    share_a, share_b = shares_LE(a.counts_LE), shares_LE(b.counts_LE)
    num_experts = delta_LE.shape[1]
    rows = []
    for flat in order.tolist():
        layer, expert = divmod(flat, num_experts)
        rows.append(
            {
                "layer": layer,
                "expert": expert,
                "share_a": share_a[layer, expert].item(),
                "share_b": share_b[layer, expert].item(),
                "delta": delta_LE[layer, expert].item(),
            }
        )
    return rows


def _sentence(layer: int, row: dict, mover: dict) -> str:
    text = (
        f"layer {layer}: top {TOP_N} experts now take {row['top3_b']:.0%} of tokens, "
        f"was {row['top3_a']:.0%}"
    )
    if row["dead_b"] != row["dead_a"]:
        text += f"; {row['dead_b']:.0f} experts get no tokens, was {row['dead_a']:.0f}"
    return (
        text + f"; expert {mover['expert']} {mover['share_a']:.0%} -> "
        f"{mover['share_b']:.0%} (JSD {row['jsd']:.3f} bits)"
    )


def _agreement_row(a: Side, b: Side, layer: int) -> dict:
    """agreement_a / _b / _delta of one layer (NaN where a side did not measure it)."""
    va = a.agreement_L[layer].item() if a.agreement_L is not None else math.nan
    vb = b.agreement_L[layer].item() if b.agreement_L is not None else math.nan
    return {"agreement_a": va, "agreement_b": vb, "agreement_delta": vb - va}


def compare(a: Side, b: Side, limits: Thresholds = Thresholds()) -> dict:
    """Per-layer metrics of both sides, deltas, JSD, top movers, and sentences for big changes."""
    check_comparable(a, b)
    ma, mb = layer_metrics(a.counts_LE, a.ep), layer_metrics(b.counts_LE, b.ep)
    top_a, top_b = top_n_share_L(a.counts_LE, TOP_N), top_n_share_L(b.counts_LE, TOP_N)
    jsd_L = jensen_shannon_L(a.counts_LE, b.counts_LE)
    layers, sentences = [], []
    for layer in range(a.counts_LE.shape[0]):
        row = {
            "layer": layer,
            "jsd": jsd_L[layer].item(),
            "top3_a": top_a[layer].item(),
            "top3_b": top_b[layer].item(),
            "dead_a": ma["dead"][layer].item(),
            "dead_b": mb["dead"][layer].item(),
        }
        for name in ma:
            row[f"{name}_a"], row[f"{name}_b"] = ma[name][layer].item(), mb[name][layer].item()
            row[f"{name}_delta"] = row[f"{name}_b"] - row[f"{name}_a"]
        row.update(_agreement_row(a, b, layer))
        row["flagged"] = bool(
            row["jsd"] >= limits.jsd_bits or abs(row["top3_b"] - row["top3_a"]) >= limits.top_share
        )
        if row["flagged"]:
            sentences.append(
                _sentence(
                    layer,
                    row,
                    top_movers(
                        Side(a.label, a.counts_LE[layer : layer + 1], 1),
                        Side(b.label, b.counts_LE[layer : layer + 1], 1),
                        1,
                    )[0],
                )
            )
        layers.append(row)
    finite = [r for r in layers if not math.isnan(r["jsd"])]
    worst = max(finite, key=lambda r: r["jsd"]) if finite else None
    summary = (
        f"{len(sentences)} of {len(layers)} layers changed notably"
        if sentences
        else "no layer changed notably"
    )
    if worst is not None:
        summary += f" (largest JSD {worst['jsd']:.3f} bits, layer {worst['layer']})"
    return {
        "a": a.label,
        "b": b.label,
        "ep_a": a.ep,
        "ep_b": b.ep,
        "summary": summary,
        "sentences": sentences,
        "layers": layers,
        "movers": top_movers(a, b, limits.movers),
        "thresholds": vars(limits),
    }
