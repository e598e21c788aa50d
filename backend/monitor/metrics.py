"""Load-balance metrics as pure functions of a [layers x experts] token-count tensor.

`counts_LE[l, e]` is the number of (token, expert) assignments layer l sent to expert e
(each token counts top_k times). Metrics are computed in float64 on the CPU; a layer with
no tokens yields NaN for ratio metrics (there is no load to be imbalanced).

Definitions (per layer, c = counts of the E experts, N = sum c, p = c / N):
- max_over_mean: max(c) / mean(c); 1 is perfect balance, E is total collapse.
- cv: population standard deviation / mean of c.
- entropy: -sum p log p / log E, in [0, 1]; 1 is uniform.
- dead: number of experts with zero tokens.
- top10_share: share of tokens taken by the ceil(E / 10) busiest experts.
- ep_max_over_mean: EP-rank loads (global expert e lives on rank e // (E / ep)), max / mean;
  the slowest EP rank sets the pace of the layer.
- ep_rank_<r>_share (overall): EP rank r's share of all layers' assignments.
- ep_straggler (overall): sum over layers of the busiest rank's load / sum of mean rank loads,
  i.e. the expected slowdown of the expert compute of one step versus perfect balance.

Shape-free forms of the per-layer metrics, given E and the router's top-k K (the run-health
alarms read them so that one threshold means the same at 8 experts top-2 and 128 top-8):
- concentration(entropy): the entropy placed on its bounds for top-k routing, 0 at log E
  (even load) and 1 at log K (the load on K experts, the lowest a top-k router reaches: a
  token's K experts are distinct, so no expert holds more than 1/K of the assignments).
  At concentration x the entropy is that of an even load on E^(1-x) K^x experts: 0.5 is 4
  of 8 at top-2 and 32 of 128 at top-8.
- hot_share(max_over_mean): the share of tokens whose top-k holds the busiest expert,
  max(c) / T = max_over_mean x K / E; K / E when even, 1 when every token picks it.
- dead / E: the share of experts that got no token.
All three are affine in the metric they come from, so a mean over updates (verl's reduction
of a trainer step's metrics) maps to the mean of the shape-free values.

The hottest experts (hottest_experts), named by (layer, expert), each with its share of the
layer's assignments (1/E even), x the mean = count / mean count = share x E (1 even, E/K at
most: every token picks it) and, given K, the share of tokens picking it = share x K (K/E
even, 1 at most; hot_share of the busiest). EP-rank loads at other EP degrees than the run's
(ep_degrees) reuse ep_rank_load_LR: counts are per global expert, placement is contiguous.
"""

import math

import torch

from backend.shared.integers import ceil_div

LAYER_METRICS = ("max_over_mean", "cv", "entropy", "dead", "top10_share", "ep_max_over_mean")


def as_counts(counts_LE) -> torch.Tensor:
    """A float64 CPU copy of a [L, E] count tensor (or nested list); one-line error otherwise."""
    counts = torch.as_tensor(counts_LE).detach().to("cpu", torch.float64)
    if counts.dim() != 2:
        raise ValueError(f"counts must be [layers, experts], got shape {tuple(counts.shape)}")
    if (counts < 0).any():
        raise ValueError("counts must be non-negative token counts")
    return counts


def shares_LE(counts_LE) -> torch.Tensor:
    """Each expert's share of its layer's tokens (NaN rows for empty layers)."""
    counts = as_counts(counts_LE)
    return counts / counts.sum(-1, keepdim=True)


def max_over_mean_L(counts_LE) -> torch.Tensor:
    counts = as_counts(counts_LE)
    return counts.amax(-1) / counts.mean(-1)


def cv_L(counts_LE) -> torch.Tensor:
    counts = as_counts(counts_LE)
    return counts.std(-1, correction=0) / counts.mean(-1)


def entropy_L(counts_LE) -> torch.Tensor:
    """Normalised entropy of each layer's expert distribution, 0 log 0 = 0."""
    p = shares_LE(counts_LE)
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    return -plogp.sum(-1) / math.log(p.shape[-1]) if p.shape[-1] > 1 else torch.ones(p.shape[0])


def dead_L(counts_LE) -> torch.Tensor:
    return (as_counts(counts_LE) == 0).sum(-1).to(torch.float64)


def top_n_share_L(counts_LE, n: int) -> torch.Tensor:
    """Share of tokens taken by each layer's n busiest experts."""
    counts = as_counts(counts_LE)
    n = max(1, min(n, counts.shape[-1]))
    return counts.topk(n, dim=-1).values.sum(-1) / counts.sum(-1)


def top10_count(num_experts: int) -> int:
    """ceil(E / 10) in integers (0.1 * E in floats rounds up wrongly, e.g. 30 -> 4)."""
    return max(1, ceil_div(num_experts, 10))


def top10_share_L(counts_LE) -> torch.Tensor:
    counts = as_counts(counts_LE)
    return top_n_share_L(counts, top10_count(counts.shape[-1]))


def ep_rank_load_LR(counts_LE, ep: int) -> torch.Tensor:
    """Tokens each EP rank receives per layer: experts are laid out in contiguous blocks."""
    counts = as_counts(counts_LE)
    num_layers, num_experts = counts.shape
    if ep < 1 or num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}: pick a divisor")
    return counts.reshape(num_layers, ep, num_experts // ep).sum(-1)


def ep_max_over_mean_L(counts_LE, ep: int) -> torch.Tensor:
    load_LR = ep_rank_load_LR(counts_LE, ep)
    return load_LR.amax(-1) / load_LR.mean(-1)


def ep_straggler(counts_LE, ep: int) -> float:
    load_LR = ep_rank_load_LR(counts_LE, ep)
    return (load_LR.amax(-1).sum() / load_LR.mean(-1).sum()).item()


def hottest_experts(counts_LE, n: int, top_k: int | None = None, per_layer: bool = False):
    """The n busiest (layer, expert) pairs over all layers, busiest first (ties: lower layer,
    then lower expert), or with per_layer the n busiest of each layer, layer by layer; each
    {layer, expert, count, share, x_mean[, token_share]}. Empty layers name none."""
    counts = as_counts(counts_LE)
    share_LE = shares_LE(counts)
    layers = [i for i in range(counts.shape[0]) if counts[i].sum() > 0]
    if per_layer:
        pairs = [(i, e) for i in layers for e in _busiest(counts[i], n)]
    else:
        num_experts = counts.shape[1]
        flat = share_LE[layers].flatten()
        order = torch.sort(flat, descending=True, stable=True).indices[:n].tolist()
        pairs = [(layers[j // num_experts], j % num_experts) for j in order]
    out = []
    for layer, expert in pairs:
        share = share_LE[layer, expert].item()
        row = {"layer": layer, "expert": expert, "count": int(counts[layer, expert].item()),
               "share": share, "x_mean": share * counts.shape[1]}  # fmt: skip
        out.append(row | ({"token_share": share * top_k} if top_k else {}))
    return out


def _busiest(counts_E: torch.Tensor, n: int) -> list[int]:
    """The n busiest experts, ties to the lower id (a stable sort)."""
    return torch.sort(counts_E, descending=True, stable=True).indices[: max(0, n)].tolist()


def ep_degrees(num_experts: int, run_ep: int = 1, wanted: tuple[int, ...] = (2, 4)) -> list[int]:
    """The EP degrees to show loads for: `wanted` and the run's own, those > 1 dividing E."""
    return sorted({d for d in (*wanted, run_ep) if 1 < d <= num_experts and num_experts % d == 0})


def layer_metrics(counts_LE, ep: int = 1) -> dict[str, torch.Tensor]:
    """Every per-layer metric, name -> [L] float64."""
    counts = as_counts(counts_LE)
    return {
        "max_over_mean": max_over_mean_L(counts),
        "cv": cv_L(counts),
        "entropy": entropy_L(counts),
        "dead": dead_L(counts),
        "top10_share": top10_share_L(counts),
        "ep_max_over_mean": ep_max_over_mean_L(counts, ep),
    }


def concentration(entropy: float, num_experts: float, top_k: float) -> float:
    """Normalised entropy (entropy_L, 1 = even) -> 0 (even) .. 1 (all load on K experts)."""
    log_e, log_k = math.log(num_experts), math.log(top_k)
    return (1.0 - entropy) * log_e / (log_e - log_k)


def hot_share(max_over_mean: float, num_experts: float, top_k: float) -> float:
    """max_over_mean -> the share of tokens that pick the busiest expert (K / E .. 1)."""
    return max_over_mean * top_k / num_experts


def experts_in_use(concentration_value: float, num_experts: float, top_k: float) -> float:
    """exp(entropy): how many experts an even load of the same entropy would use."""
    return num_experts ** (1.0 - concentration_value) * top_k**concentration_value


def _nan_agg(values_L: torch.Tensor, how: str) -> float:
    finite = values_L[~values_L.isnan()]
    if finite.numel() == 0:
        return math.nan
    return {"mean": finite.mean, "max": finite.max, "min": finite.min}[how]().item()


def overall_metrics(counts_LE, ep: int = 1, per_layer: dict | None = None) -> dict[str, float]:
    """Aggregates over layers: mean and worst layer of each metric, totals, EP straggler.

    `per_layer` (layer_metrics of the same counts) saves recomputing it."""
    counts = as_counts(counts_LE)
    per_layer = per_layer if per_layer is not None else layer_metrics(counts, ep)
    worst = {"entropy": "min"}  # low entropy is bad; for every other metric high is bad
    out = {"assignments": counts.sum().item(), "dead_total": per_layer["dead"].sum().item()}
    for name, values in per_layer.items():
        if name == "dead":
            continue
        out[f"{name}_mean"] = _nan_agg(values, "mean")
        out[f"{name}_{worst.get(name, 'max')}"] = _nan_agg(values, worst.get(name, "max"))
    out["ep_straggler"] = ep_straggler(counts, ep) if counts.sum() > 0 else math.nan
    if ep > 1:  # which rank is the straggler: its share of all layers' assignments
        load_R = ep_rank_load_LR(counts, ep).sum(0)
        out.update(
            {f"ep_rank_{r}_share": v for r, v in enumerate((load_R / load_R.sum()).tolist())}
        )
    return out


def flatten(prefix: str, overall: dict[str, float], per_layer: dict | None) -> dict[str, float]:
    """`prefix/metric` overall and `prefix/layer_<l>/metric` per layer, NaNs left out."""
    out = {f"{prefix}/{k}": v for k, v in overall.items()}
    for name, values in (per_layer or {}).items():
        for layer, value in enumerate(values.tolist()):
            out[f"{prefix}/layer_{layer}/{name}"] = value
    return {k: v for k, v in out.items() if not math.isnan(v)}


def flat_metrics(counts_LE, ep: int, prefix: str, per_layer: bool = True) -> dict[str, float]:
    """All metrics of one counts tensor as a flat `moe/...`-style dict."""
    layers = layer_metrics(counts_LE, ep)
    return flatten(prefix, overall_metrics(counts_LE, ep, layers), layers if per_layer else None)
