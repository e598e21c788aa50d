"""Packed (THD) vs right-padded micro-batches through the mcore_ep engine: tokens/s as a ratio.

One process, world 1, CPU fp32 (or the device verl picks): two engines on the same weights
(a small random Qwen3-MoE written by transformers), the same DAPO-like batch, timed one after
another, alternating, so both see the same machine state:
- lengths: prompts near-fixed (uniform in [--prompt-min, --prompt-max]), responses long-tailed
  (log-normal, median --response-median, clipped to --response-max), as DAPO's rollouts;
- update: forward_backward_batch with verl's ppo_loss (DAPO clip-higher, token-mean),
  micro-batches planned by --max-tokens (ppo_max_token_len_per_gpu) as the engine plans
  them (recipes.dapo.engine.batches.plan_lengths: padded slots <= the budget; packed tokens <= the
  padded plan's largest micro-batch);
- old log-probs: infer_batch (forward only) on the same batch;
- the packed-length ladder (--ladder, mcore_ep.packed_length_step: 512 on npu): the slots it
  adds over packing without it and the distinct packed lengths it leaves (`ladder`).
Both engines run our SDPA attention (the only one with a packed path). tokens/s counts real
tokens only. Prints one JSON line; `ratio` = packed tokens/s / padded tokens/s per pass.

--memory adds peak memory, as scripts/bench/logprob_heads.py measures it: each (engine, pass)
in its own child process (one engine only, glibc's MALLOC_MMAP_THRESHOLD_ fixed, so freed
tensors go back to the OS), one warm-up pass, then for each of --mem-passes passes the
kernel's resident high-water mark is reset (/proc/self/clear_refs 5) and the peak is VmHWM
minus resident memory just before the pass; the median is reported. The threshold is 64 KiB
here, not logprob_heads' 1 MiB: this model's [T, 128] fp32 activations are ~1 MiB at
T ~ 2048, and a threshold there would put the smaller micro-batches' on the heap, where freed
memory stays resident, and the largest in their own maps. `memory_ratio` = packed peak /
padded peak per pass; `per_micro_batch` gives the tokens each plan puts in a micro-batch
(padded slots for the padded plan, real tokens for the packed one), which bound the
activations.

    .venv/bin/python -m scripts.bench.packed_vs_padded
    .venv/bin/python -m scripts.bench.packed_vs_padded --rows 64 --iters 5 --out packed.json
    .venv/bin/python -m scripts.bench.packed_vs_padded --memory --no-timing
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

MODEL = dict(
    vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=48)
    p.add_argument("--prompt-max", type=int, default=80)
    p.add_argument("--response-median", type=float, default=160.0)
    p.add_argument("--response-sigma", type=float, default=0.8)
    p.add_argument("--response-max", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--ladder", type=int, default=512, help="packed-length ladder step reported")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--memory", action="store_true", help="peak memory, one child per run")
    p.add_argument("--no-timing", action="store_true", help="skip tokens/s (with --memory)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the children")
    p.add_argument("--mem-passes", type=int, default=3, help="measured passes per child")
    p.add_argument("--mmap-threshold", type=int, default=2**16, help="MALLOC_MMAP_THRESHOLD_")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="children run this many at a time (peaks are per process; their times then share the cores)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # engine,pass: one memory measurement
    return p.parse_args(argv)


def dapo_lengths(args) -> list[tuple[int, int]]:
    """(prompt, response) lengths: near-fixed prompts, log-normal long-tailed responses."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=gen)
    normal = torch.randn(args.rows, generator=gen) * args.response_sigma
    responses = (args.response_median * normal.exp()).round().clamp(1, args.response_max)
    return list(zip(prompts.tolist(), responses.long().tolist(), strict=True))


def make_batch(lengths, vocab: int, max_tokens: int, seed: int):
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p_len, r_len in lengths:
        ids = torch.randint(0, vocab, (p_len + r_len,), generator=gen)
        ones = torch.ones(r_len, dtype=torch.long)
        rows.append(
            dict(
                prompts=ids[:p_len],
                responses=ids[p_len:],
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(len(ids)),
                response_mask=ones,
                loss_mask=ones,
                advantages=torch.randn(r_len, generator=gen),
                old_log_probs=-torch.rand(r_len, generator=gen) - 5.0,
            )  # fmt: skip
        )
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(
        data, use_dynamic_bsz=True, max_token_len_per_gpu=max_tokens, temperature=1.0,
        calculate_entropy=False, global_batch_size=len(rows),
    )  # fmt: skip
    return data


def ladder_stats(lengths: list[int], max_tokens: int, step: int) -> dict:
    """The packed plan with its totals on a ladder of `step` tokens (mcore_ep
    .packed_length_step): the slots it adds over packing without it, the shapes it leaves."""
    from recipes.dapo.engine.batches import micro_batch_slots, plan_lengths

    slots = {}
    for s in (1, step):
        plans = plan_lengths(lengths, max_tokens, 1, True, s)
        slots[s] = [micro_batch_slots([lengths[i] for i in p], s, True) for p in plans]
    return {
        "step": step,
        "extra_slot_share": (sum(slots[step]) - sum(slots[1])) / sum(lengths),
        "packed_lengths": {"without": len(set(slots[1])), "with": len(set(slots[step]))},
    }


def padding_stats(data, max_tokens: int, ladder: int = 1) -> dict:
    """Micro-batches and padded-token share of the padded plan vs the packed one (the engine's
    planner at world 1, tp 1), and what a packed-length ladder adds."""
    from recipes.dapo.engine.batches import (
        _lengths,
        micro_batch_slots,
        packed_slot_budget,
        plan_lengths,
    )

    lengths = _lengths(data["input_ids"]).tolist()
    plans = {packed: plan_lengths(lengths, max_tokens, 1, packed) for packed in (False, True)}
    slots = [micro_batch_slots([lengths[i] for i in p], 1, False) for p in plans[False]]
    real = {packed: [sum(lengths[i] for i in p) for p in plan] for packed, plan in plans.items()}
    per_mb = {
        "padded_slots": {"max": max(slots), "mean": statistics.mean(slots)},
        "padded_real": {"max": max(real[False]), "mean": statistics.mean(real[False])},
        "packed_real": {"max": max(real[True]), "mean": statistics.mean(real[True])},
    }
    return {
        "micro_batches": {"padded": len(plans[False]), "packed": len(plans[True])},
        "packed_slot_budget": packed_slot_budget(lengths, max_tokens, 1),
        "padded_token_share": 1 - sum(lengths) / sum(slots),
        "real_tokens": sum(lengths),
        "per_micro_batch": per_mb,
        "ladder": ladder_stats(lengths, max_tokens, ladder),
    }


def timed(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def passes(engine, data):
    from verl.workers.utils.losses import ppo_loss

    from recipes.dapo.engine.config import McoreEpActorConfig

    config = McoreEpActorConfig(
        rollout_n=1, use_dynamic_bsz=True, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=10.0, loss_agg_mode="token-mean",
    )  # fmt: skip
    loss_fn = partial(ppo_loss, config=config)

    def update():
        with engine.train_mode(disable_auto_offload=True):
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(data, loss_fn)
            engine.optimizer_zero_grad()

    def old_log_prob():
        with engine.eval_mode(disable_auto_offload=True):
            engine.infer_batch(data)

    return {"update": update, "old_log_prob": old_log_prob}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def child(args) -> dict:
    """One engine, one pass: warm up, reset the high-water mark, measure the next pass."""
    import gc

    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint
    from tests.recipes.test_verl_engine import build_engine

    torch.set_num_threads(args.threads)
    name, which = args.child.split(",")
    hf_dir = make_tiny_checkpoint(tempfile.mkdtemp(prefix="packed_mem_"), seed=0, **MODEL)
    data = make_batch(dapo_lengths(args), MODEL["vocab_size"], args.max_tokens, args.seed)
    engine = build_engine(hf_dir, attention="sdpa", packed=name == "packed")
    run = passes(engine, data)[which]
    run()  # lazy state (grads, optimizer, caches) is there before the measured passes
    peaks = []
    for _ in range(args.mem_passes):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current resident memory
        before = _status_kib("VmRSS")
        run()
        peaks.append((_status_kib("VmHWM") - before) / 1024)
    return {
        "engine": name, "pass": which, "peak_mib": statistics.median(peaks), "passes_mib": peaks,
    }  # fmt: skip


def measure_memory(args) -> dict:
    """Peak MiB per (engine, pass), each in its own process, and packed / padded."""
    env = {
        **os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold), "OMP_NUM_THREADS": str(args.threads),
        "VERL_ENGINE_DEVICE": os.environ.get("VERL_ENGINE_DEVICE", "cpu"),
    }  # fmt: skip
    shape = ("rows", "prompt_min", "prompt_max", "response_median", "response_sigma")
    shape += ("response_max", "max_tokens", "seed", "threads", "mem_passes")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in shape]
    peaks = {n: {} for n in ("padded", "packed")}

    def child(run: tuple[str, str]) -> dict:
        name, which = run
        cmd = [sys.executable, "-m", "scripts.bench.packed_vs_padded", *argv]
        cmd += ["--child", f"{name},{which}"]
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"child {name},{which} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    runs = [(name, which) for which in ("update", "old_log_prob") for name in peaks]
    with ThreadPoolExecutor(args.jobs) as pool:  # each child a process of its own
        outs = list(pool.map(child, runs))
    for (name, which), out in zip(runs, outs, strict=True):
        peaks[name][which] = out["peak_mib"]
        runs_mib = " ".join(f"{m:.1f}" for m in out["passes_mib"])
        print(
            f"peak {name:<6} {which:<12} {out['peak_mib']:8.1f} MiB ({runs_mib})", file=sys.stderr
        )
    ratio = {p: peaks["packed"][p] / peaks["padded"][p] for p in ("update", "old_log_prob")}
    return {"peak_mib": peaks, "memory_ratio": ratio}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    if args.child:
        print(json.dumps(child(args)))
        return {}
    lengths = dapo_lengths(args)
    data = make_batch(lengths, MODEL["vocab_size"], args.max_tokens, args.seed)
    stats = padding_stats(data, args.max_tokens, args.ladder)
    result = {
        "lengths": {"rows": args.rows, "tokens": stats["real_tokens"], "longest": max(a + b for a, b in lengths)},
        **stats,
        "max_tokens": args.max_tokens,
    }  # fmt: skip
    if args.memory:
        result.update(measure_memory(args))
    if not args.no_timing:
        result.update(timing(args, data, stats["real_tokens"]))
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return result


def timing(args, data, tokens: int) -> dict:
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint
    from tests.recipes.test_verl_engine import build_engine

    hf_dir = make_tiny_checkpoint(tempfile.mkdtemp(prefix="packed_bench_"), seed=0, **MODEL)
    engines = {
        name: build_engine(hf_dir, attention="sdpa", packed=name == "packed")
        for name in ("padded", "packed")
    }
    runs = {name: passes(engine, data) for name, engine in engines.items()}
    times = {name: {p: [] for p in ("update", "old_log_prob")} for name in engines}
    for p in ("update", "old_log_prob"):
        for name in engines:
            timed(runs[name][p], args.warmup, 0)
        for _ in range(args.iters):  # alternate: both systems see the same machine state
            for name in engines:
                times[name][p] += timed(runs[name][p], 0, 1)
    tps = {n: {p: tokens / statistics.median(t) for p, t in d.items()} for n, d in times.items()}
    return {
        "tokens_per_s": tps,
        "ratio": {p: tps["packed"][p] / tps["padded"][p] for p in ("update", "old_log_prob")},
        "seconds": times,
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    main()
