"""Tensorboard output: scalars every step, a layers x experts heatmap image every N steps."""

from backend.training.distributed import ProcessGroups


def tensorboard_writer(log_dir, groups: ProcessGroups | None):
    """A SummaryWriter on the first rank, None elsewhere (the counts are already global)."""
    import torch.distributed as dist

    if groups is not None and dist.get_rank(groups.world) != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def log_scalars(writer, metrics: dict[str, float], step: int) -> None:
    for key, value in metrics.items():
        writer.add_scalar(key, value, step)


def log_heatmap(writer, tag: str, counts_LE, step: int) -> None:
    from backend.monitor.plots import figure_rgb_HWC, heatmap_figure

    image_HWC = figure_rgb_HWC(heatmap_figure(counts_LE, f"{tag}, step {step}"))
    writer.add_image(tag, image_HWC, step, dataformats="HWC")
