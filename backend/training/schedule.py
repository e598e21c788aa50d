"""Micro-batches through megatron-core's own schedules, pp = 1 and pipeline stages alike.

`get_forward_backward_func()` returns forward_backward_no_pipelining at pp = 1 and the
non-interleaved 1F1B schedule at pp > 1: each stage sends its [S(/tp), B, H] output to the
next (shapes exchanged first: the model config's `variable_seq_lengths`, as micro-batches
differ in length) and runs backward in 1F1B order, up to pp - stage forwards in flight.

`step(i)` runs micro-batch i's forward on this stage and returns (output, anchor): output
is the tensor sent on, or on the last stage the micro-batch's loss (None: no loss, a
forward-only pass); anchor is the stage's decoder output. megatron averages the last
stage's losses over the micro-batches; ours are already normalised over the whole step
(verl's losses), so the loss is multiplied back by their number before it is handed over.

`on_backward(i)` runs when micro-batch i's backward reaches this stage (a gradient hook on
its anchor), before any layer's activation recompute replays that micro-batch's forward:
per-micro-batch state the replay reads (the router tap's token mask and forced routes) is
restored there, because under 1F1B later micro-batches' forwards run in between.
"""

from collections.abc import Callable
from functools import partial

import torch

Step = Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]]


def run_micro_batches(
    model: torch.nn.Module,
    num: int,
    step: Step,
    forward_only: bool,
    shape_BS: tuple[int, int],
    on_backward: Callable[[int], None] | None = None,
) -> None:
    """Forward (and backward) of micro-batches 0..num-1 on this stage, in megatron's order.

    shape_BS: the first micro-batch's [B, S] (megatron's nominal shape; with
    variable_seq_lengths each send carries its own)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, _model):
        i = next(data_iterator)
        output, anchor = step(i)
        if on_backward is not None and anchor is not None and anchor.requires_grad:
            anchor.register_hook(partial(_before_backward, on_backward, i))
        if output is None:  # forward-only last stage without a loss
            output = torch.zeros((), device=anchor.device if anchor is not None else "cpu")
        return output, partial(_undo_mean, num)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(num)),
        model=[model],
        num_microbatches=num,
        seq_length=shape_BS[1],
        micro_batch_size=shape_BS[0],
        forward_only=forward_only,
    )


def _undo_mean(num: int, loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return loss * num, {}


def _before_backward(on_backward: Callable[[int], None], i: int, grad: torch.Tensor):
    on_backward(i)
    return grad


def is_last_stage(groups) -> bool:
    return groups.rank("pp") == groups.size("pp") - 1
