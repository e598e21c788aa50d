"""Overhead of the expert-load monitor on the actor's forward + backward step.

Three modes, interleaved in rotating order within one process (same model, same batch), and
the median of each reported:
- off: no router hooks at all,
- tap: RouterTap with a no-op listener (the tap's own cost: it recomputes router logits),
- on:  RouterTap + ExpertLoadMonitor counting under phase("update"), plus step_end
       (the per-step all-reduce, copy to host and metrics) after every step.
Prints a summary and writes JSON with the ratios.

    python -m scripts.bench.monitor_overhead --preset tiny
    python -m scripts.bench.monitor_overhead --preset large --repeats 9
    python -m scripts.bench.monitor_overhead --device cuda --preset qwen3-layer
"""

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from parallel.models import MINI_QWEN3_MOE, QWEN3_30B_A3B, TINY_QWEN3_MOE
from recipes.local.cpu_overrides import CPU_ENGINE


def _shape(config: dict, layers: int, seq: int, batch: int) -> dict:
    """A preset from an HF Qwen3-MoE config dict (parallel.models), in SHAPE_KEYS order."""
    return dict(
        hidden=config["hidden_size"],
        experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        layers=layers,
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        moe_ffn=config["moe_intermediate_size"],
        vocab=config["vocab_size"],
        seq=seq,
        batch=batch,
    )


PRESETS = {
    # the tiny Qwen3-MoE of the CPU run
    "tiny": _shape(TINY_QWEN3_MOE, layers=TINY_QWEN3_MOE["num_hidden_layers"], seq=64, batch=4),
    # the CPU run's mini model (128 experts, top-8) at one update micro-batch: 2 prompts x 16
    # responses of prompt 40 + response 48 tokens
    "mini": _shape(MINI_QWEN3_MOE, layers=MINI_QWEN3_MOE["num_hidden_layers"], seq=88, batch=32),
    "large": dict(
        hidden=512,
        experts=16,
        top_k=2,
        layers=4,
        heads=8,
        kv_heads=4,
        head_dim=64,
        moe_ffn=512,
        vocab=4096,
        seq=512,
        batch=1,
    ),
    # Qwen3-30B-A3B per-layer shape, few layers (for a GPU)
    "qwen3-layer": _shape(QWEN3_30B_A3B, layers=4, seq=4096, batch=1),
}
SHAPE_KEYS = tuple(PRESETS["tiny"])
MODES = ("off", "tap", "on")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu", "auto"))
    parser.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
    for key in SHAPE_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help="override the preset")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="default: fp32 on cpu, else bf16")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="forward + backward passes per step (step_end runs once per step)",
    )
    parser.add_argument(
        "--modules",
        default="ours",
        choices=("ours", "auto"),
        help="ours: grouped experts and SDPA, as the runs train (default); auto: BuildOptions' "
        "choice (megatron-core's reference modules on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of all modes")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default 1 on cpu: "
        "multi-thread barriers stall on a shared machine and swamp the ratio)",
    )
    parser.add_argument(
        "--out", help="JSON path (default: runs/bench/monitor_overhead_<preset>_<device>.json)"
    )
    return parser.parse_args(argv)


def shape_of(args) -> dict:
    shape = dict(PRESETS[args.preset])
    shape.update({k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})
    return shape


def build(shape: dict, device: str, dtype: torch.dtype, modules: str = "ours"):
    from backend.model.build import BuildOptions, build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import tiny_config

    groups = init_parallel(device)
    config = tiny_config(
        hidden_size=shape["hidden"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        moe_intermediate_size=shape["moe_ffn"],
        intermediate_size=shape["moe_ffn"],
        vocab_size=shape["vocab"],
        max_position_embeddings=max(shape["seq"], 256),
    )
    spec = load_qwen3_moe_spec(config)
    # the CPU run's modules (BuildOptions has no packed switch: the bench's rows are padded)
    chosen = {k: CPU_ENGINE[k] for k in ("experts", "attention")} if modules == "ours" else {}
    return (
        spec,
        groups,
        build_model(spec, groups, BuildOptions(device=device, dtype=dtype, **chosen)),
    )


def make_batch(shape: dict, device: torch.device):
    """Random tokens; rows right-padded to 3/4 of the sequence, first 1/8 a prompt."""
    b, s = shape["batch"], shape["seq"]
    generator = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(0, shape["vocab"], (b, s), generator=generator)
    positions_S = torch.arange(s)
    mask_BS = (positions_S >= s // 8) & (positions_S < (3 * s) // 4)
    return ids_BS.to(device), mask_BS.expand(b, s).contiguous().to(device)


def actor_step(model, ids_BS, mask_BS) -> None:
    from backend.model.forward import forward_logits, token_log_probs

    logp_BS = token_log_probs(forward_logits(model, ids_BS)[:, :-1], ids_BS[:, 1:])
    (-(logp_BS * mask_BS[:, 1:]).sum() / mask_BS[:, 1:].sum()).backward()
    model.zero_grad(set_to_none=True)


class Modes:
    """Switches the router hooks between off / tap / on around one model."""

    def __init__(self, model, groups, spec, mask_BS, micro_batches: int = 1):
        from backend.monitor import ExpertLoadMonitor

        self.model, self.groups, self.mask_BS = model, groups, mask_BS
        self.micro_batches = micro_batches
        self.monitor = ExpertLoadMonitor(
            spec.num_layers, spec.num_experts, groups, top_k=spec.top_k, per_layer_keys=True
        )
        self.tap, self.steps = None, 0

    def set(self, mode: str) -> None:
        from backend.instruments.router_tap import RouterTap

        if self.tap is not None:
            self.tap.remove()
            self.tap = None
        if mode == "off":
            return
        self.tap = RouterTap(self.model, self.groups)
        self.tap.set_token_mask(self.mask_BS)
        self.tap.add_listener(self.monitor.record if mode == "on" else lambda call: None)

    def run(self, mode: str, ids_BS, sync) -> tuple[float, float]:
        """One step in `mode`; returns (step seconds, of which step_end seconds)."""
        sync()
        start = time.perf_counter()
        with self.monitor.phase("update") if mode == "on" else contextlib.nullcontext():
            for _ in range(self.micro_batches):
                actor_step(self.model, ids_BS, self.mask_BS)
        sync()  # queued device work belongs to the step, not to step_end
        end_start = time.perf_counter()
        if mode == "on":
            self.monitor.step_end(self.steps)
            self.steps += 1
        sync()
        stop = time.perf_counter()
        return stop - start, stop - end_start if mode == "on" else 0.0


def measure(modes: Modes, ids_BS, repeats: int, warmup: int, sync) -> dict[str, list[float]]:
    times = {mode: [] for mode in MODES}
    step_end = []
    for round_ in tqdm(range(warmup + repeats), desc="rounds", unit="round"):
        order = MODES[round_ % 3 :] + MODES[: round_ % 3]  # rotate: no mode always runs first
        for mode in order:
            modes.set(mode)
            seconds, end_seconds = modes.run(mode, ids_BS, sync)
            if round_ >= warmup:
                times[mode].append(seconds)
                if mode == "on":
                    step_end.append(end_seconds)
    times["step_end"] = step_end
    return times


def summarise(times: dict[str, list[float]]) -> dict:
    """Ratio of medians, plus the median of per-round ratios and the ratio of minima: on a
    shared machine the paired and best-case figures are the least disturbed by other load."""
    median = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}

    def paired(mode):
        return statistics.median(m / o for m, o in zip(times[mode], times["off"], strict=True))

    return {
        "median_s": median,
        "min_s": best,
        "ratio_on_over_off": median["on"] / median["off"],
        "ratio_tap_over_off": median["tap"] / median["off"],
        "paired_ratio_on_over_off": paired("on"),
        "paired_ratio_tap_over_off": paired("tap"),
        "min_ratio_on_over_off": best["on"] / best["off"],
        "step_end_share_of_off": median["step_end"] / median["off"],
        "samples_s": times,
    }


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> None:
    from backend.platform.device import prepare_device

    args = parse_args(argv)
    device = prepare_device(args.device)
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)
    dtype = (
        torch.float32
        if (args.dtype or ("fp32" if device == "cpu" else "bf16")) == "fp32"
        else torch.bfloat16
    )
    shape = shape_of(args)
    spec, groups, model = build(shape, device, dtype, args.modules)
    ids_BS, mask_BS = make_batch(shape, next(model.parameters()).device)
    sync = (lambda: None) if device == "cpu" else torch.accelerator.synchronize
    modes = Modes(model, groups, spec, mask_BS, args.micro_batches)
    times = measure(modes, ids_BS, args.repeats, args.warmup, sync)
    result = {
        "device": device,
        "dtype": str(dtype),
        "preset": args.preset,
        "modules": args.modules,
        "shape": shape,
        "micro_batches": args.micro_batches,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        **summarise(times),
    }
    out = Path(args.out or f"runs/bench/monitor_overhead_{args.preset}_{device}.json")
    write_json(result, out)
    med = result["median_s"]
    print(
        f"{args.preset} x{args.micro_batches} micro-batches on {device}: off {med['off'] * 1e3:.2f} ms, tap {med['tap'] * 1e3:.2f} ms, "
        f"on {med['on'] * 1e3:.2f} ms (step_end {med['step_end'] * 1e3:.2f} ms); "
        f"on/off = {result['ratio_on_over_off']:.4f} (paired {result['paired_ratio_on_over_off']:.4f},"
        f" best {result['min_ratio_on_over_off']:.4f}), tap/off = "
        f"{result['ratio_tap_over_off']:.4f} -> {out}"
    )


if __name__ == "__main__":
    main()
