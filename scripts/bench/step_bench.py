"""Time one training step (forward + backward) of Qwen3-30B-A3B-shaped MoE layers on one device.

All systems run in one process, one after another, on the same shape; a system that fails
(not built yet, out of memory, no kernel for this device) has its error recorded in the JSON
and the run goes on:
- ours: backend.model.build.build_model with spec "local", our grouped-GEMM experts and SDPA core
  attention (BuildOptions experts="grouped", attention="sdpa"),
- mcore-local: the same builder with megatron-core's SequentialMLP experts and its unfused
  DotProductAttention (experts="sequential", attention="local"; plain spec="local" on a
  BuildOptions without those fields, which builds the same modules),
- hf-grouped_mm: transformers' Qwen3MoeForCausalLM, grouped_mm experts, SDPA attention,
- hf-eager: the same with transformers' eager per-expert loop.

    .venv/bin/python -m scripts.bench.step_bench --preset 4L --out step_4L.json
    .venv/bin/python -m scripts.bench.step_bench --preset 12L --systems ours,hf-grouped_mm
    .venv/bin/python -m scripts.bench.step_bench --preset tiny --breakdown    # CPU, seconds

Presets (Qwen3-30B-A3B layers: hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 with
norm_topk_prob, expert ffn 768, vocab 151936, untied lm_head; parallel.models): 4L = 4 layers,
2 x 4096 tokens; 12L = 12 layers, 1 x 4096; tiny = the CPU run's tiny Qwen3-MoE
(parallel.models.TINY_QWEN3_MOE: 2 layers, hidden 64, 4 / 2 heads of 24, 8 experts top-2,
ffn 32, vocab 128), 2 x 64 tokens. --layers / --batch / --seq override the preset.
bf16 on GPU, fp32 on CPU (--dtype overrides).

One step: random token ids; mcore: forward_logits -> token_log_probs(logits[:, :-1],
ids[:, 1:]) -> loss = -mean -> backward; HF: model(input_ids=ids, labels=ids).loss.backward()
(the same next-token loss). Gradients are set to None before each step; no optimizer.
Weights: each library's own random init, normal with std 0.02 (megatron's init_method_std,
HF's initializer_range; megatron also scales output projections by 1/sqrt(2 * layers); norms
are ones). Values therefore differ between systems; shapes, FLOPs and the near-uniform expert
load of random routers do not.

Per system: ms per step (mean of --iters steps after --warmup, each followed by a device
synchronise; median / min / max / std too), tokens/s, model TFLOP/s and MFU against
--peak-tflops (default 989, H100/H200 dense bf16 datasheet; no MFU on CPU unless given),
peak device memory (torch.cuda.max_memory_allocated over warm-up and timed steps, reset after
the build so the weights are included; None on CPU), and `vs_hf_grouped_mm`: speedup
(hf-grouped_mm's ms / this system's ms) and peak-memory ratio against hf-grouped_mm measured
in the same run.

Model FLOPs per step (matmuls only, forward + backward = 3 x forward = 6 x MACs):
    6 * tokens * (layers * (q, k, v, o projections + top_k experts * 3 GEMMs + router) + H * V)
  + 6 * tokens * layers * heads * head_dim * seq      (q k^T and p v, halved for causality)

--breakdown (mcore systems): one more step under torch.profiler, its time split into phases
(attention core / projections, router, experts, MoE dispatch, LM head + loss, other): see
step_phases.py.
"""

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from parallel.models import QWEN3_30B_A3B as RELEASED_CONFIG
from parallel.models import TINY_QWEN3_MOE
from scripts.bench.step_phases import PHASE_PREFIX, profile_phases
from scripts.bench.step_results import compare_to_reference, error_result, speed

# the released config (parallel.models); the dtype is this script's choice (--dtype)
QWEN3_30B_A3B = {k: v for k, v in RELEASED_CONFIG.items() if k != "torch_dtype"}
PRESETS = {  # name: (layers, batch, seq, config overrides)
    "4L": (4, 2, 4096, {}),
    "12L": (12, 1, 4096, {}),
    "tiny": (2, 2, 64, TINY_QWEN3_MOE),  # the tiny Qwen3-MoE of the CPU run
}
MCORE_SYSTEMS = ("ours", "mcore-local")
HF_SYSTEMS = ("hf-grouped_mm", "hf-eager")
SYSTEMS = MCORE_SYSTEMS + HF_SYSTEMS
DEFAULT_PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16, datasheet
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 1024**3


# ---------------------------------------------------------------- shape and FLOPs


def model_config(args) -> dict:
    """The HF Qwen3-MoE config dict of the benchmarked shape."""
    layers, _, _, overrides = PRESETS[args.preset]
    return {**QWEN3_30B_A3B, **overrides, "num_hidden_layers": args.layers or layers}


def step_flops(spec, batch: int, seq: int) -> dict:
    """Model FLOPs of one forward + backward step (formula in the module docstring)."""
    h, layers = spec.hidden_size, spec.num_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attention_proj = h * (q + 2 * kv) + q * h
    experts = spec.top_k * 3 * h * spec.moe_ffn_hidden_size
    router = h * spec.num_experts
    active = layers * (attention_proj + experts + router) + h * spec.vocab_size
    attention = layers * spec.num_heads * spec.head_dim * seq
    tokens = batch * seq
    return dict(active_params_per_token=active, flops_per_step=6 * tokens * (active + attention))


def model_shape(spec, dtype: torch.dtype) -> dict:
    """The model's shape fields of a bench JSON."""
    return dict(
        layers=spec.num_layers,
        hidden=spec.hidden_size,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        experts=spec.num_experts,
        top_k=spec.top_k,
        moe_ffn=spec.moe_ffn_hidden_size,
        vocab=spec.vocab_size,
        dtype=str(dtype).removeprefix("torch."),
    )


def shape_info(spec, args, dtype: torch.dtype) -> dict:
    tokens = dict(batch=args.batch, seq=args.seq, tokens=args.batch * args.seq)
    return {**model_shape(spec, dtype), **tokens, **step_flops(spec, args.batch, args.seq)}


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_info(device: str) -> dict:
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=version_of("transformers"),
        megatron_core=version_of("megatron-core"),
        device=device,
        gpu=gpu,
        cuda=torch.version.cuda if device == "cuda" else None,
        cpu_threads=torch.get_num_threads(),
    )


# ---------------------------------------------------------------- systems


def mcore_options(name: str, device: str, dtype: torch.dtype):
    """BuildOptions for `ours` / `mcore-local` (raises TypeError while the fields are missing)."""
    from backend.model.build import BuildOptions

    base = dict(device=device, dtype=dtype, spec="local")
    if name == "ours":
        return BuildOptions(**base, experts="grouped", attention="sdpa")
    fields = {f.name for f in dataclasses.fields(BuildOptions)}
    if {"experts", "attention"} <= fields:
        return BuildOptions(**base, experts="sequential", attention="local")
    return BuildOptions(**base)  # local spec = SequentialMLP + DotProductAttention


def build_mcore(name: str, ctx: dict):
    """(model, step, build options) for an mcore system; step runs forward + backward."""
    if ctx["mcore_error"]:
        raise RuntimeError(ctx["mcore_error"])
    from backend.model.build import build_model
    from backend.model.forward import forward_logits, token_log_probs

    opts = mcore_options(name, ctx["device"], ctx["dtype"])
    model = build_model(ctx["spec"], ctx["groups"], opts)
    model.train()
    ids = ctx["ids"]

    def step():
        model.zero_grad(set_to_none=True)
        logits = forward_logits(model, ids)
        with torch.profiler.record_function(PHASE_PREFIX + "lm_head_loss"):
            loss = -token_log_probs(logits[:, :-1], ids[:, 1:]).mean()
        loss.backward()

    return model, step, repr(opts)


def build_hf(name: str, ctx: dict):
    """(model, step, build options) for an HF system."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{k: v for k, v in ctx["config"].items() if k != "model_type"})
    experts = name.removeprefix("hf-")
    with torch.device(ctx["device"]):
        model = Qwen3MoeForCausalLM._from_config(
            config, attn_implementation="sdpa", experts_implementation=experts, dtype=ctx["dtype"]
        )
    model.train()
    ids = ctx["ids"]

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    built = dict(
        attn=model.config._attn_implementation, experts=model.config._experts_implementation
    )
    return model, step, json.dumps(built)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each timed step, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_system(name: str, ctx: dict, args) -> dict:
    device = ctx["device"]
    build = build_mcore if name in MCORE_SYSTEMS else build_hf
    start = time.perf_counter()
    model, step, options = build(name, ctx)
    result = dict(system=name, build=options, build_s=round(time.perf_counter() - start, 2))
    if device == "cuda":
        result["weights_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
        torch.cuda.reset_peak_memory_stats()
    result.update(speed(time_steps(step, device, args.warmup, args.iters), ctx))
    result["peak_mem_gib"] = (
        round(torch.cuda.max_memory_allocated() / GIB, 3) if device == "cuda" else None
    )
    if args.breakdown and name in MCORE_SYSTEMS:
        result["breakdown"] = profile_phases(model, step, device, synchronize)
    return result


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- run


def setup(args, systems: list[str]) -> dict:
    """Device, process groups (mcore only), spec, shape and the batch of token ids."""
    from backend.platform.device import prepare_device, resolve_device
    from backend.qwen3_moe import load_qwen3_moe_spec

    device = resolve_device(args.device)
    groups, mcore_error = None, None
    if any(s in MCORE_SYSTEMS for s in systems):
        try:  # a missing megatron-core fails the mcore systems only
            from backend.training.distributed import init_parallel

            groups = init_parallel(prepare_device(device))
        except Exception as err:
            mcore_error = f"megatron-core setup failed: {type(err).__name__}: {err}"
    dtype = (
        DTYPES[args.dtype]
        if args.dtype
        else (torch.bfloat16 if device == "cuda" else torch.float32)
    )
    config = model_config(args)
    spec = load_qwen3_moe_spec(config)
    peak = (
        args.peak_tflops
        if args.peak_tflops
        else (DEFAULT_PEAK_TFLOPS if device == "cuda" else None)
    )
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.seq), device=device)
    return dict(
        device=device,
        dtype=dtype,
        config=config,
        spec=spec,
        groups=groups,
        ids=ids,
        mcore_error=mcore_error,
        peak_tflops=peak,
        shape=shape_info(spec, args, dtype),
    )


def document(args, ctx: dict, results: list[dict], complete: bool) -> dict:
    settings = dict(
        warmup=args.warmup,
        iters=args.iters,
        peak_tflops=ctx["peak_tflops"],
        breakdown=args.breakdown,
        complete=complete,
    )
    return {
        "env": env_info(ctx["device"]),
        "preset": args.preset,
        "settings": settings,
        "shape": ctx["shape"],
        "results": results,
    }


def write(doc: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="4L")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--batch", type=int, help="override the preset's batch size")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma list from {', '.join(SYSTEMS)}"
    )
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help=f"MFU denominator (default {DEFAULT_PEAK_TFLOPS:g} on GPU)",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="profile one extra step per mcore system"
    )
    p.add_argument("--out", help="write the JSON document here (also rewritten after each system)")
    args = p.parse_args(argv)
    _, batch, seq, _ = PRESETS[args.preset]
    args.batch, args.seq = args.batch or batch, args.seq or seq
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    ctx = setup(args, args.system_list)
    results = []
    bar = tqdm(args.system_list, desc="systems", unit="system", file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        try:
            result = run_system(name, ctx, args)
        except Exception as err:  # recorded; the next system still runs
            result = error_result(name, err)
        free_memory(ctx["device"])
        results.append(result)
        tqdm.write(f"{name}: {result.get('ms_per_step', result.get('error'))}", file=sys.stderr)
        compare_to_reference(results)
        write(document(args, ctx, results, complete=False), args.out)
    doc = document(args, ctx, results, complete=True)
    write(doc, args.out)
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
