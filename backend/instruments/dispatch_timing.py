"""MoE dispatch / combine timed into a StepTimer, inside megatron-core's token dispatcher.

    dispatch = MoEDispatchTimer(model, timer)    # sections moe_dispatch / moe_combine
    ...                                          # steps as usual
    dispatch.remove()                            # when done: the dispatchers are as built

It wraps two bound methods of each dispatcher instance (instance attributes shadowing the
class methods; `remove()` deletes them again):
  megatron-core >= 0.13 (0.16.1): token_dispatch / token_combine, the communication only;
  megatron-core 0.12.1: token_permutation / token_unpermutation, which also include the
  local permutation (that version has no separate communication method).
The backward of each is timed too: identity autograd marks on the method's input and output
start the section when the output's gradient arrives and stop it when the input's gradient
leaves, so the section covers the gradient all-to-all (plus whatever independent autograd
work the engine runs in between).
"""

import torch

from backend.instruments.timing import StepTimer

# Off by default: its cost on the tiny model on CPU is over 1% of a step
# (scripts/bench/timing_overhead.py; figures in the README), so the engine attaches it on request.
DISPATCH_TIMING_DEFAULT = False

# (dispatch method, combine method) by megatron-core API generation, newest first
DISPATCHER_METHODS = (
    ("token_dispatch", "token_combine"),  # >= 0.13: communication only
    ("token_permutation", "token_unpermutation"),  # 0.12: permutation + communication
)


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `callback` (times the backward of the wrapped method)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def _mark(x, callback):
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        return _Mark.apply(x, callback)
    return x


def _timed(method, timer: StepTimer, name: str):
    def timed(hidden, *args, **kwargs):
        hidden = _mark(hidden, lambda: timer.stop(name, strict=False))  # its grad leaves last
        timer.start(name)
        try:
            out = method(hidden, *args, **kwargs)
        finally:
            timer.stop(name)
        start_backward = lambda: timer.start(name)  # noqa: E731 - the output's grad arrives first
        if isinstance(out, tuple):
            return (_mark(out[0], start_backward), *out[1:])
        return _mark(out, start_backward)

    return timed


class MoEDispatchTimer:
    """Times every MoE layer's token dispatch and combine into `timer` (see module doc)."""

    def __init__(self, model: torch.nn.Module, timer: StepTimer):
        self.timer = timer
        self._wrapped: list[tuple[object, str]] = []
        dispatchers = [
            m.token_dispatcher
            for m in model.modules()
            if getattr(m, "token_dispatcher", None) is not None
        ]
        if not dispatchers:
            raise ValueError("model has no MoE token dispatcher: is it a megatron-core MoE model?")
        for dispatcher in dispatchers:
            self._wrap(dispatcher)

    def _wrap(self, dispatcher) -> None:
        methods = [pair for pair in DISPATCHER_METHODS if hasattr(type(dispatcher), pair[0])]
        if not methods:
            raise TypeError(
                f"{type(dispatcher).__name__} has none of the known dispatch methods "
                f"{DISPATCHER_METHODS}: megatron-core version not supported"
            )
        dispatch, combine = methods[0]
        for method, section in ((dispatch, "moe_dispatch"), (combine, "moe_combine")):
            if method in vars(dispatcher):
                raise RuntimeError(
                    f"{type(dispatcher).__name__}.{method} is already wrapped: "
                    "remove the other MoEDispatchTimer first"
                )
            setattr(dispatcher, method, _timed(getattr(dispatcher, method), self.timer, section))
            self._wrapped.append((dispatcher, method))

    @property
    def num_dispatchers(self) -> int:
        return len(self._wrapped) // 2

    def remove(self) -> None:
        """Restore the dispatchers' own methods."""
        for dispatcher, method in self._wrapped:
            delattr(dispatcher, method)
        self._wrapped.clear()
