"""Per-phase time of one training step, for step_bench.py --breakdown.

One step runs under torch.profiler. Forward pre/post hooks on the modules open and close a
record_function range per phase:
    attention_core  self_attention.core_attention
    attention_proj  self_attention.linear_qkv, linear_proj
    router          mlp.router
    experts         mlp.experts
    moe_dispatch    the rest of the MoE layer `mlp`: the token dispatcher (not a Module) and
                    the permute / unpermute around the experts
    lm_head_loss    output_layer, plus the loss (token_log_probs and the mean)
    other           everything outside these: embedding, norms, rotary, residual adds,
                    gradient accumulation
Each op's own time (on GPU the CUDA kernels it launched, on CPU its self CPU time) goes to
the innermost range it ran under. Backward ops run under an autograd node whose sequence
number is that of the forward op that created it, so they go to that forward op's phase.
phases_ms sums to total_ms (busy time; below step_ms on GPU, which also holds idle gaps).
"""

import bisect
import time

import torch

PHASE_PREFIX = "step_bench/"
BACKWARD_NODE = "autograd::engine::evaluate_function: "
MODULE_PHASES = (  # module name suffix -> phase; the first match wins
    (".self_attention.core_attention", "attention_core"),
    (".self_attention.linear_qkv", "attention_proj"),
    (".self_attention.linear_proj", "attention_proj"),
    (".mlp.router", "router"),
    (".mlp.experts", "experts"),
    (".mlp", "moe_dispatch"),
    (".output_layer", "lm_head_loss"),
)
PHASES = (
    "attention_core",
    "attention_proj",
    "router",
    "experts",
    "moe_dispatch",
    "lm_head_loss",
    "other",
)


def module_phase(name: str) -> str | None:
    dotted = "." + name
    return next((phase for suffix, phase in MODULE_PHASES if dotted.endswith(suffix)), None)


class PhaseRanges:
    """record_function ranges around the modules of each phase, via forward pre/post hooks."""

    def __init__(self, model):
        self.open, self.handles = [], []
        for name, module in model.named_modules():
            phase = module_phase(name)
            if phase:
                self.handles.append(module.register_forward_pre_hook(self._enter_hook(phase)))
                self.handles.append(module.register_forward_hook(self._exit_hook))

    def _enter_hook(self, phase: str):
        def enter(module, args):
            scope = torch.profiler.record_function(PHASE_PREFIX + phase)
            scope.__enter__()
            self.open.append(scope)

        return enter

    def _exit_hook(self, module, args, output):
        self.open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def enclosing(event) -> tuple[str, object]:
    """('forward', phase or None) or ('backward', autograd sequence number) of an op."""
    node = event
    while node is not None:
        if node.name.startswith(PHASE_PREFIX):
            return "forward", node.name.removeprefix(PHASE_PREFIX)
        if node.name.startswith(BACKWARD_NODE):
            return "backward", node.sequence_nr
        node = node.cpu_parent
    return "forward", None


def own_time_us(event, on_gpu: bool) -> float:
    """GPU: the kernels this op launched itself; CPU: its self CPU time (ranges included)."""
    if on_gpu:
        return 0.0 if event.is_user_annotation else sum(k.duration for k in event.kernels)
    return event.self_cpu_time_total


def phase_times_us(events, on_gpu: bool) -> dict[str, float]:
    """Own time of every op summed per phase; backward ops take their forward op's phase."""
    from torch.autograd import DeviceType

    ops = sorted(
        (e for e in events if e.device_type == DeviceType.CPU and not e.is_async),
        key=lambda e: e.time_range.start,
    )
    places = [(op, enclosing(op)) for op in ops]
    seq_phase = {}  # the last forward op seen with a sequence number is the node's creator
    for op, (direction, phase) in places:
        if direction == "forward" and op.sequence_nr >= 0:
            seq_phase[op.sequence_nr] = phase
    recorded = sorted(seq_phase)
    totals = dict.fromkeys(PHASES, 0.0)
    for op, (direction, where) in places:
        phase = backward_phase(where, seq_phase, recorded) if direction == "backward" else where
        totals[phase or "other"] += own_time_us(op, on_gpu)
    return totals


def backward_phase(seq: int, seq_phase: dict, recorded: list[int]) -> str | None:
    """Phase of the forward op that created autograd node `seq`. Nodes no recorded op owns
    (CopySlices / AsStrided of in-place writes into views) take the phase of the closest earlier
    one; AccumulateGrad (seq -1) has none."""
    if seq < 0:
        return None
    if seq in seq_phase:
        return seq_phase[seq]
    i = bisect.bisect_right(recorded, seq) - 1
    return seq_phase[recorded[i]] if i >= 0 else None


def profile_phases(model, step, device: str, synchronize) -> dict:
    """Time per phase of one profiled step (see the module docstring); `synchronize(device)`
    waits for the device."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    ranges = PhaseRanges(model)
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            step()
            synchronize(device)
            step_ms = (time.perf_counter() - start) * 1e3
    finally:
        ranges.remove()
    totals = phase_times_us(prof.events(), on_gpu)
    total = sum(totals.values())
    return dict(
        clock="cuda kernel time" if on_gpu else "cpu self time",
        step_ms=round(step_ms, 3),
        total_ms=round(total / 1e3, 3),
        phases_ms={k: round(v / 1e3, 3) for k, v in totals.items()},
        phases_pct={k: round(100 * v / total, 1) if total else None for k, v in totals.items()},
    )
