"""Expert-load monitor and routing-balance reports for MoE training.

- ExpertLoadMonitor (monitor.py): counts tokens per expert per layer from a RouterTap,
  per labelled pass, reduced over ranks at each step end; flat `moe/...` metrics, tensorboard.
- metrics.py: pure functions over a [layers x experts] count tensor.
- report.py: the versioned JSON report; render.py / compare.py: HTML pages with PNG plots
  (render_experts.py: the hottest experts by id, the load per EP rank at ep 2 and 4).
- alerts.py: SkewGuard (measured EP skew vs the memory plan's assumption) and RunWarning,
  one log line each, kept in the report's "warnings".
- CLI: `python -m backend.monitor render|compare ...`.

In the actor (every rank; counts are summed over the world at step end):

    tap = RouterTap(model, groups)
    guard = SkewGuard(assumed_skew=2.0, every_n_steps=50)  # parallel.skew's assumption
    monitor = ExpertLoadMonitor(spec.num_layers, spec.num_experts, groups, top_k=spec.top_k,
                                writer=tensorboard_writer(log_dir, groups),
                                skew_guard=guard).attach(tap)
    with monitor.phase("update"):
        tap.set_token_mask(response_mask_BS)  # padding and prompts excluded
        ...  # forward + backward of every micro-batch
    metrics.update(monitor.step_end(step, aux_losses))  # collective; checks the guard
    monitor.add_warning(w) for a backend.instruments.comm_share.comm_share_warning(...) that is not None
    monitor.write_report("routing.json", model="Qwen3-30B-A3B")  # first rank writes
"""

from backend.monitor.metrics import flat_metrics, layer_metrics, overall_metrics
from backend.monitor.monitor import PHASES, ExpertLoadMonitor, reduce_counts_
from backend.monitor.report import ReportError, load_report, save_report
from backend.monitor.run_warnings import RunWarning, SkewGuard
from backend.monitor.tb import tensorboard_writer

__all__ = [
    "PHASES",
    "ExpertLoadMonitor",
    "ReportError",
    "RunWarning",
    "SkewGuard",
    "flat_metrics",
    "layer_metrics",
    "load_report",
    "overall_metrics",
    "reduce_counts_",
    "save_report",
    "tensorboard_writer",
]
