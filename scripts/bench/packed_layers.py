"""Packed (THD) vs right-padded micro-batches on Qwen3-30B-A3B-shaped MoE layers, model level.

No verl: only torch, megatron-core and transformers (what the one-GPU machine has). The model
is step_bench's `ours` (backend.model.build.build_model, local spec, our grouped-GEMM experts and
SDPA attention) on one of step_bench's presets (4L / 12L: real Qwen3-30B-A3B layer shapes,
fewer layers; tiny: the CPU run's tiny Qwen3-MoE), bf16 on cuda, fp32 on cpu (--dtype
overrides). One process, world 1.

Batch: --rows sequences of a DAPO-like length mix (prompts near-fixed, uniform in
[--prompt-min, --prompt-max]; responses log-normal, median --response-median, clipped so a
sequence fits in the preset's sequence length), random token ids. Micro-batches are planned
once, as the engine plans padded ones (recipes/dapo/batches.plan_by_tokens, tp 1): longest
first, rows x longest row <= --budget (default: the preset's batch x seq tokens). Both modes
run the same micro-batches, the same rows:
- padded: [rows, longest] right-padded, causal attention (padding after every real token);
- packed: one [1, T] row with megatron-core's PackedSeqParams (backend/model/packing.py, the layout
  the engine's packed micro-batches use), attention and RoPE positions per sequence.

One step = every micro-batch's forward + backward (gradients accumulate, set to None before
the step; no optimizer, so the weights never change). Per micro-batch: backend.model.forward's
forward_logits -> token_log_probs(logits[:, :-1], ids[:, 1:]), the log-probs of real next
tokens of the same sequence summed; loss = -that sum. `logprob_sum` is the step's total:
the same model on the same sequences, so packed and padded agree (to fp32 rounding on CPU;
bf16 kernels on GPU differ slightly).

Timing: --warmup untimed steps per mode, then --iters timed steps per mode, alternating
padded / packed, each followed by a device synchronise. tokens/s counts real tokens only;
`ratio.tokens_per_s` = packed / padded. On cuda, peak memory per mode:
torch.cuda.max_memory_allocated over that mode's steps (reset before each step, the weights
included) and `step_gib` = that peak minus the memory allocated just before the step;
`ratio.peak_mem` / `ratio.step_mem` = packed / padded. None on cpu.

    .venv/bin/python -m scripts.bench.packed_layers --preset tiny --device cpu
    python3 -m scripts.bench.packed_layers --preset 4L --device cuda --out packed_4L.json

One JSON document to --out (and stdout), rewritten after each timed pair of steps (with
"error": "interrupted" until the run ends, so a timeout keeps what was measured); progress on
stderr.
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from backend.model.packing import packed_layout
from scripts.bench import step_bench  # presets, shapes, model options, env

MODES = ("padded", "packed")
GIB = 1024**3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(step_bench.PRESETS), default="4L")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--budget", type=int, help="padded tokens per micro-batch (preset b x s)")
    p.add_argument("--rows", type=int, default=32, help="sequences in the batch")
    p.add_argument("--prompt-min", type=int, help="default: preset seq / 32")
    p.add_argument("--prompt-max", type=int, help="default: preset seq / 16")
    p.add_argument("--response-median", type=float, help="default: preset seq / 8")
    p.add_argument("--response-sigma", type=float, default=0.8)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    p.add_argument("--iters", type=int, default=3, help="timed steps per mode")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--dtype", choices=sorted(step_bench.DTYPES), help="bf16 GPU, fp32 CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON document here")
    args = p.parse_args(argv)
    _, batch, seq, _ = step_bench.PRESETS[args.preset]
    args.seq = seq
    args.budget = args.budget or batch * seq
    args.prompt_min = args.prompt_min or max(1, seq // 32)
    args.prompt_max = args.prompt_max or max(args.prompt_min, seq // 16)
    args.response_median = args.response_median or seq / 8
    if args.iters < 1 or args.warmup < 0 or args.rows < 1:
        p.error("--iters and --rows must be >= 1, --warmup >= 0")
    if not 1 <= args.prompt_min <= args.prompt_max < min(seq, args.budget):
        p.error("need 1 <= --prompt-min <= --prompt-max < min(preset seq, budget)")
    return args


# ---------------------------------------------------------------- batch


def dapo_lengths(args) -> list[int]:
    """Sequence lengths: near-fixed prompts + log-normal responses, each <= min(seq, budget)."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=gen)
    normal = torch.randn(args.rows, generator=gen) * args.response_sigma
    room = min(args.seq, args.budget) - prompts
    responses = (args.response_median * normal.exp()).round().long().clamp(min=1)
    return (prompts + torch.minimum(responses, room)).tolist()


def padded_plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Longest first, greedily: rows x longest row <= budget (batches.plan_by_tokens, tp 1)."""
    plans: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if plans and (len(plans[-1]) + 1) * lengths[plans[-1][0]] <= budget:
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


def micro_batches(seqs: list[torch.Tensor], plans: list[list[int]], device: str) -> list[dict]:
    """Per plan: the padded [rows, longest] ids with their has-next mask, and the packed
    [1, T] row with its layout."""
    out = []
    for rows in plans:
        pieces = [seqs[i] for i in rows]
        lengths = [len(s) for s in pieces]
        longest = max(lengths)
        ids_BS = torch.zeros(len(rows), longest, dtype=torch.long)
        for b, s in enumerate(pieces):
            ids_BS[b, : len(s)] = s
        has_next_BS = torch.arange(longest)[None] < torch.tensor(lengths)[:, None] - 1
        layout = packed_layout(lengths, tp=1, device=device)
        out.append(
            dict(
                rows=rows,
                padded=(ids_BS.to(device), has_next_BS.to(device), None),
                packed=(layout.pack(pieces).to(device), layout.has_next(), layout.params),
                real=layout.real,
                padded_slots=ids_BS.numel(),
                packed_T=layout.total,
            )
        )
    return out


# ---------------------------------------------------------------- steps


def make_step(model, mbs: list[dict], mode: str):
    """One forward + backward over every micro-batch; returns the summed log-probs (float)."""
    from backend.model.forward import forward_logits, token_log_probs

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        total = None
        for mb in mbs:
            ids, has_next, packed = mb[mode]
            logits = forward_logits(model, ids, packed)
            log_probs = token_log_probs(logits[:, :-1], ids[:, 1:])
            picked = log_probs.masked_fill(~has_next[:, :-1], 0.0).sum()
            (-picked).backward()
            total = picked.detach() if total is None else total + picked.detach()
        return total

    return step


def synchronize(device: str) -> None:
    step_bench.synchronize(device)


def run(step, device: str) -> tuple[float, float, float | None, float | None]:
    """(ms, log-prob sum, peak GiB, step GiB) of one step; memory None off cuda."""
    base = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    synchronize(device)
    start = time.perf_counter()
    total = step()
    synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    if device != "cuda":
        return ms, float(total), None, None
    peak = torch.cuda.max_memory_allocated()
    return ms, float(total), peak / GIB, (peak - base) / GIB


def summarize(records: list[tuple], real: int, device: str) -> dict:
    times = [r[0] for r in records]
    ms = statistics.fmean(times)
    return dict(
        ms_per_step=round(ms, 3),
        ms_median=round(statistics.median(times), 3),
        ms_min=round(min(times), 3),
        ms_max=round(max(times), 3),
        tokens_per_s=round(real / (ms / 1e3), 1),
        logprob_sum=records[0][1],
        logprob_sums=[r[1] for r in records],
        peak_mem_gib=round(max(r[2] for r in records), 3) if device == "cuda" else None,
        step_mem_gib=round(max(r[3] for r in records), 3) if device == "cuda" else None,
    )


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


# ---------------------------------------------------------------- run


def setup(args) -> dict:
    from backend.model.build import build_model
    from backend.platform.device import prepare_device, resolve_device
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel

    device = resolve_device(args.device)
    groups = init_parallel(prepare_device(device))
    dtype = (
        step_bench.DTYPES[args.dtype]
        if args.dtype
        else (torch.bfloat16 if device == "cuda" else torch.float32)
    )
    spec = load_qwen3_moe_spec(step_bench.model_config(args))
    torch.manual_seed(args.seed)
    opts = step_bench.mcore_options("ours", device, dtype)
    model = build_model(spec, groups, opts)
    model.train()
    lengths = dapo_lengths(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=gen) for n in lengths]
    plans = padded_plan(lengths, args.budget)
    return dict(
        device=device,
        dtype=dtype,
        spec=spec,
        model=model,
        build=repr(opts),
        lengths=lengths,
        mbs=micro_batches(seqs, plans, device),
    )


def document(args, ctx: dict, results: dict, error: str | None) -> dict:
    spec, lengths, mbs = ctx["spec"], ctx["lengths"], ctx["mbs"]
    real = sum(lengths)
    padded, packed = results.get("padded"), results.get("packed")
    both = padded is not None and packed is not None
    lp_pad, lp_pack = (padded["logprob_sum"], packed["logprob_sum"]) if both else (None, None)
    return {
        "env": step_bench.env_info(ctx["device"]),
        "preset": args.preset,
        "build": ctx["build"],
        "settings": dict(
            warmup=args.warmup,
            iters=args.iters,
            seed=args.seed,
            budget=args.budget,
            rows=args.rows,
            prompt=[args.prompt_min, args.prompt_max],
            response_median=args.response_median,
            response_sigma=args.response_sigma,
            complete=both and error is None,
        ),
        "shape": step_bench.model_shape(spec, ctx["dtype"]),
        "batch": dict(
            rows=len(lengths),
            real_tokens=real,
            padded_slots=sum(mb["padded_slots"] for mb in mbs),
            packed_tokens=sum(mb["packed_T"] for mb in mbs),
            length_min=min(lengths),
            length_median=statistics.median(lengths),
            length_max=max(lengths),
            micro_batches=[
                dict(rows=len(mb["rows"]), real=mb["real"], padded_slots=mb["padded_slots"])
                for mb in mbs
            ],
        ),
        "results": {mode: dict(real_tokens=real, **r) for mode, r in results.items()},
        "ratio": dict(
            tokens_per_s=ratio(packed["tokens_per_s"], padded["tokens_per_s"]) if both else None,
            peak_mem=ratio(packed["peak_mem_gib"], padded["peak_mem_gib"]) if both else None,
            step_mem=ratio(packed["step_mem_gib"], padded["step_mem_gib"]) if both else None,
        ),
        "logprob_rel_diff": abs(lp_pack - lp_pad) / abs(lp_pad) if both and lp_pad else None,
        "error": error,
    }


def write(doc: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2) + "\n")


def log(msg: str) -> None:
    print(f"[packed_layers] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    ctx = setup(args)
    device, mbs, real = ctx["device"], ctx["mbs"], sum(ctx["lengths"])
    slots = sum(mb["padded_slots"] for mb in mbs)
    log(
        f"{args.preset} on {device}: built in {time.perf_counter() - start:.1f} s; "
        f"{len(ctx['lengths'])} rows, {real} real tokens, {len(mbs)} micro-batches, "
        f"{slots} padded slots ({slots / real:.2f}x)"
    )
    steps = {mode: make_step(ctx["model"], mbs, mode) for mode in MODES}
    records = {mode: [] for mode in MODES}
    results, error = {}, None
    try:
        for i in range(args.warmup):
            for mode in MODES:
                ms, lp, *_ = run(steps[mode], device)
                log(f"warm-up {i + 1}/{args.warmup} {mode}: {ms:.1f} ms, log-prob sum {lp:.6g}")
        for i in range(args.iters):
            for mode in MODES if i % 2 == 0 else reversed(MODES):  # alternate who goes first
                records[mode].append(run(steps[mode], device))
                log(f"step {i + 1}/{args.iters} {mode}: {records[mode][-1][0]:.1f} ms")
            partial = {m: summarize(records[m], real, device) for m in MODES}
            write(document(args, ctx, partial, "interrupted"), args.out)  # a timeout keeps it
    except Exception as err:  # recorded in the JSON with whatever was measured
        error = f"{type(err).__name__}: {err}".strip()[:2000]
        log(f"failed: {error}\n{traceback.format_exc()}")
    results = {m: summarize(records[m], real, device) for m in MODES if records[m]}
    doc = document(args, ctx, results, error)
    write(doc, args.out)
    print(json.dumps(doc, indent=2))
    log(f"ratio {doc['ratio']}, log-prob rel diff {doc['logprob_rel_diff']}")
    return doc


if __name__ == "__main__":
    main()
