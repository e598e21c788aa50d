"""The routing page's expert sections: the hottest experts by id, and the load per EP rank at
ep 2, 4 and the run's own (backend.monitor.metrics: hottest_experts, ep_degrees and the same
ep_rank_load_LR / ep_max_over_mean_L the run's metrics and the skew guard use).

Normalisation of "hottest" (one meaning at 8 experts top-2 and 128 top-8): an expert's share
of its layer's assignments (each token counts K times; 1/E when even), x the mean = share x E
(1 when even, E/K when every token picks it) and the tokens picking it = share x K (K/E even,
100% at most: the routing alarm's hot share). Experts are ranked by their share, which within
one model orders them as x the mean does.
"""

from pathlib import Path

import backend.monitor.htmlpage as h
import backend.monitor.plots as plots
from backend.monitor.metrics import (
    as_counts,
    ep_degrees,
    ep_max_over_mean_L,
    ep_rank_load_LR,
    ep_straggler,
    hottest_experts,
)

HOTTEST_N = 10  # the run's table
PER_LAYER_N = 3  # the per-layer table's column
DEAD_NAMED = 8  # dead experts named per layer, the rest counted


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def hottest_line(row: dict) -> str:
    """'L3 e17: 9.1% of assignments, 11.6x the mean, picked by 73% of tokens'."""
    picked = f", picked by {pct(row['token_share'])} of tokens" if "token_share" in row else ""
    return (f"L{row['layer']} e{row['expert']}: {pct(row['share'])} of assignments, "
            f"{row['x_mean']:.1f}x the mean{picked}")  # fmt: skip


def normalisation(num_experts: int, top_k: int | None) -> str:
    text = (f"share: of the layer's assignments (a token counts once per expert it picks), "
            f"{pct(1 / num_experts)} each when even; x the mean = share x E: 1 when even")  # fmt: skip
    if not top_k:
        return text + "."
    return text + (f", {num_experts / top_k:g} when every token picks the expert; tokens "
                   f"picking it = share x K: {pct(top_k / num_experts)} when even, 100% at most "
                   "(the routing alarm's hot share).")  # fmt: skip


def hottest_section(counts_LE, top_k: int | None, ep: int, phase: str) -> list[str]:
    """The HOTTEST_N busiest (layer, expert) pairs of the phase above their layer's mean (the
    busiest one at least), named, with the EP rank that holds each at the run's ep."""
    counts = as_counts(counts_LE)
    rows = hottest_experts(counts, HOTTEST_N, top_k)
    if not rows:
        return []
    rows = [r for r in rows if r["x_mean"] > 1.0] or rows[:1]
    num_experts = counts.shape[1]
    head = ["#", "layer", "expert"] + ([f"EP rank (ep={ep})"] if ep > 1 else [])
    head += ["assignments", "share", "x the mean"] + (["tokens picking it"] if top_k else [])
    table = []
    for i, row in enumerate(rows, 1):
        rank = [row["expert"] // (num_experts // ep)] if ep > 1 else []
        cells = [row["count"], pct(row["share"]), f"{row['x_mean']:.2f}x"]
        table.append([i, row["layer"], row["expert"], *rank, *cells]
                     + ([pct(row["token_share"])] if top_k else []))  # fmt: skip
    dead = int((counts == 0).sum())
    summary = (f"hottest: {hottest_line(rows[0])}; {dead} dead expert{'s' * (dead != 1)} "
               f"(no token) over {counts.shape[0]} layers")  # fmt: skip
    return [h.heading(f"{phase}: hottest experts", 3), h.paragraph(summary, "flag"),
            h.paragraph(normalisation(num_experts, top_k)), h.table(head, table)]  # fmt: skip


def layer_names(counts_LE) -> list[tuple[str, str]]:
    """Per layer: its PER_LAYER_N busiest experts ('e17 11.6x, ...') and its dead ones."""
    counts = as_counts(counts_LE)
    hot = {}
    for row in hottest_experts(counts, PER_LAYER_N, per_layer=True):
        hot.setdefault(row["layer"], []).append(f"e{row['expert']} {row['x_mean']:.1f}x")
    out = []
    for layer in range(counts.shape[0]):
        dead = [f"e{e}" for e in (counts[layer] == 0).nonzero().flatten().tolist()]
        more = f" +{len(dead) - DEAD_NAMED}" if len(dead) > DEAD_NAMED else ""
        out.append((", ".join(hot.get(layer, [])), " ".join(dead[:DEAD_NAMED]) + more))
    return out


def rank_loads(load_R) -> str:
    """'r0 24,576 (0.95x); r1 ...': each rank's assignments and its load over the mean."""
    mean = load_R.mean().item()
    return "; ".join(f"r{r} {int(v):,} ({v / mean:.2f}x)" for r, v in enumerate(load_R.tolist()))


def ep_rows(counts_LE, ep: int) -> list[dict]:
    """Per EP degree (ep_degrees): the ranks' loads over all layers and in the worst layer."""
    counts = as_counts(counts_LE)
    out = []
    for degree in ep_degrees(counts.shape[1], ep):
        load_LR = ep_rank_load_LR(counts, degree)
        skew_L = ep_max_over_mean_L(counts, degree).nan_to_num(0.0)
        worst = int(skew_L.argmax())
        total_R = load_LR.sum(0)
        out.append({"ep": degree, "load_LR": load_LR, "worst": worst,
                    "worst_max_over_mean": skew_L[worst].item(),
                    "all_max_over_mean": (total_R.max() / total_R.mean()).item(),
                    "straggler": ep_straggler(counts, degree)})  # fmt: skip
    return out


def ep_section(counts_LE, ep: int, phase: str, tmp: Path) -> list[str]:
    """The EP-rank load figure (one panel per degree) and its table."""
    counts = as_counts(counts_LE)
    rows = ep_rows(counts, ep)
    if not rows:
        return []
    name = f"{phase}_ep_load.png"
    title = f"{phase}: load per EP rank" + (f" (this run: ep={ep})" if ep > 1 else "")
    plots.save_png(plots.ep_load_figure(counts, [r["ep"] for r in rows], title), tmp / name)
    table = []
    for r in rows:
        label = f"{r['ep']} (this run)" if r["ep"] == ep else r["ep"]
        load_LR = r["load_LR"]
        table.append([label, counts.shape[1] // r["ep"], "all layers",
                      f"{r['all_max_over_mean']:.3f}x", f"{r['straggler']:.3f}x",
                      rank_loads(load_LR.sum(0))])  # fmt: skip
        table.append(["", "", f"L{r['worst']} (worst)", f"{r['worst_max_over_mean']:.3f}x", "",
                      rank_loads(load_LR[r["worst"]])])  # fmt: skip
    note = ("rank r holds experts [r E/ep, (r+1) E/ep) (megatron-core's contiguous placement); "
            "counts are per global expert, so one run reads at any EP degree dividing E. "
            "max/mean: the busiest rank's assignments over the mean rank's (the worst layer's "
            "at the run's ep is the metric table's ep_max_over_mean_max); straggler: sum over "
            "layers of the busiest rank's / of the mean's, the expert compute's slowdown "
            "against an even load.")  # fmt: skip
    head = ["ep", "experts per rank", "layers", "max/mean", "straggler", "assignments per rank"]
    return [h.heading(f"{phase}: load per EP rank", 3), h.image(name, "EP-rank load"),
            h.paragraph(note), h.table(head, table, cls="t1")]  # fmt: skip
