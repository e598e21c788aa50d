"""Overhead of backend.instruments.timing.StepTimer sections + backend.instruments.dispatch_timing.MoEDispatchTimer on a forward + backward step.

Three modes, interleaved in rotating order within one process (same model, same batch):
- off:      no timer, dispatchers as built;
- sections: StepTimer with a forward_backward section, step_end after every step;
- on:       sections + the MoE dispatch/combine instrument (forward and backward marks in
            every layer).
Reports the median ratios over off (and the paired and best-case ratios) and writes JSON.
On CPU steps are timed in process CPU time (time.process_time): the instrument's cost is CPU
work, and wall time on a machine shared with other jobs swings by more than the effect.

    python -m scripts.bench.timing_overhead --preset tiny
    python -m scripts.bench.timing_overhead --device cuda --preset qwen3-layer
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from scripts.bench.monitor_overhead import PRESETS, actor_step, build, make_batch, write_json

MODES = ("off", "sections", "on")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu", "auto"))
    parser.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds of every mode")
    parser.add_argument(
        "--out", help="JSON path (default: runs/bench/timing_overhead_<preset>_<device>.json)"
    )
    return parser.parse_args(argv)


def run_step(mode, model, timer, ids_BS, mask_BS, sync, clock) -> float:
    sync()
    start = clock()
    if mode != "off":
        timer.step_begin()
        with timer.section("forward_backward"):
            actor_step(model, ids_BS, mask_BS)
        timer.step_end()
    else:
        actor_step(model, ids_BS, mask_BS)
    sync()
    return clock() - start


def measure(model, device, ids_BS, mask_BS, repeats, warmup, sync) -> dict[str, list[float]]:
    clock = time.process_time if device == "cpu" else time.perf_counter
    from backend.instruments.dispatch_timing import MoEDispatchTimer
    from backend.instruments.timing import StepTimer

    timer = StepTimer(device)
    times = {mode: [] for mode in MODES}
    for round_ in range(warmup + repeats):
        for mode in MODES[round_ % 3 :] + MODES[: round_ % 3]:  # no mode always first
            instrument = MoEDispatchTimer(model, timer) if mode == "on" else None
            seconds = run_step(mode, model, timer, ids_BS, mask_BS, sync, clock)
            if instrument is not None:
                instrument.remove()
            if round_ >= warmup:
                times[mode].append(seconds)
    return times


def summarise(times: dict[str, list[float]]) -> dict:
    """Ratio of medians, median of per-round ratios, ratio of minima (least disturbed by load)."""
    median = {k: statistics.median(v) for k, v in times.items()}
    out = {"median_s": median}
    for mode in MODES[1:]:
        pairs = zip(times[mode], times["off"], strict=True)
        out[f"ratio_{mode}_over_off"] = median[mode] / median["off"]
        out[f"paired_ratio_{mode}_over_off"] = statistics.median(a / b for a, b in pairs)
        out[f"min_ratio_{mode}_over_off"] = min(times[mode]) / min(times["off"])
    return {**out, "samples_s": times}


def main(argv=None) -> dict:
    from backend.platform.device import prepare_device

    args = parse_args(argv)
    device = prepare_device(args.device)
    if device == "cpu":
        torch.set_num_threads(1)  # multi-thread barriers on a shared machine swamp the ratio
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape = dict(PRESETS[args.preset])
    spec, _, model = build(shape, device, dtype)
    ids_BS, mask_BS = make_batch(shape, next(model.parameters()).device)
    sync = torch.accelerator.synchronize if device != "cpu" else (lambda: None)
    result = {
        "preset": args.preset,
        "device": device,
        "shape": shape,
        "layers": spec.num_layers,
        **summarise(measure(model, device, ids_BS, mask_BS, args.repeats, args.warmup, sync)),
    }
    out = Path(args.out or f"runs/bench/timing_overhead_{args.preset}_{device}.json")
    write_json(result, out)
    off_ms = result["median_s"]["off"] * 1e3
    print(f"timing overhead ({args.preset}, {device}): median step off {off_ms:.2f} ms -> {out}")
    for mode in MODES[1:]:
        print(
            f"  {mode}: ratio {result[f'ratio_{mode}_over_off']:.4f} (paired "
            f"{result[f'paired_ratio_{mode}_over_off']:.4f}, best-case "
            f"{result[f'min_ratio_{mode}_over_off']:.4f})"
        )
    return result


if __name__ == "__main__":
    main()
