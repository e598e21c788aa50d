"""Expert-load monitor and routing-balance reports for MoE training.

- ExpertLoadMonitor (monitor.py): counts tokens per expert per layer from a RouterTap,
  per labelled pass, reduced over ranks at each step end; flat `moe/...` metrics, tensorboard.
- metrics.py: pure functions over a [layers x experts] count tensor.
- report.py: the versioned JSON report; render.py / compare.py: HTML pages with PNG plots.
- CLI: `python -m backend.monitor render|compare ...`.

In the actor (every rank; counts are summed over the world at step end):

    tap = RouterTap(model, groups)
    monitor = ExpertLoadMonitor(spec.num_layers, spec.num_experts, groups, top_k=spec.top_k,
                                writer=tensorboard_writer(log_dir, groups)).attach(tap)
    with monitor.phase("update"):
        tap.set_token_mask(response_mask_BS)  # padding and prompts excluded
        ...  # forward + backward of every micro-batch
    metrics.update(monitor.step_end(step, aux_losses))  # collective
    monitor.write_report("routing.json", model="Qwen3-30B-A3B")  # first rank writes
"""

from backend.monitor.metrics import flat_metrics, layer_metrics, overall_metrics
from backend.monitor.monitor import PHASES, ExpertLoadMonitor, reduce_counts_
from backend.monitor.report import ReportError, load_report, save_report
from backend.monitor.tb import tensorboard_writer

__all__ = [
    "PHASES", "ExpertLoadMonitor", "ReportError", "flat_metrics", "layer_metrics",
    "load_report", "overall_metrics", "reduce_counts_", "save_report", "tensorboard_writer",
]
