"""Packed (THD) vs right-padded micro-batches through the mcore_ep engine: tokens/s as a ratio.

One process, world 1, CPU fp32 (or the device verl picks): two engines on the same weights
(a small random Qwen3-MoE written by transformers), the same DAPO-like batch, timed one after
another, alternating, so both see the same machine state:
- lengths: prompts near-fixed (uniform in [--prompt-min, --prompt-max]), responses long-tailed
  (log-normal, median --response-median, clipped to --response-max), as DAPO's rollouts;
- update: forward_backward_batch with verl's ppo_loss (DAPO clip-higher, token-mean),
  micro-batches planned by --max-tokens (ppo_max_token_len_per_gpu: padded tokens for the
  padded engine, real tokens for the packed one);
- old log-probs: infer_batch (forward only) on the same batch.
Both engines run our SDPA attention (the only one with a packed path). tokens/s counts real
tokens only. Prints one JSON line; `ratio` = packed tokens/s / padded tokens/s per pass.

    .venv/bin/python scripts/bench/packed_vs_padded.py
    .venv/bin/python scripts/bench/packed_vs_padded.py --rows 64 --iters 5 --out packed.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

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
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
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


def padding_stats(data, max_tokens: int) -> dict:
    """Micro-batches and padded-token share of the padded plan vs the packed one."""
    from recipes.dapo.batches import _lengths, _round_up, plan_by_real_tokens, plan_by_tokens

    lengths = _lengths(data["input_ids"]).tolist()
    padded = plan_by_tokens(lengths, max_tokens, 1)
    packed = plan_by_real_tokens(lengths, max_tokens, 1)
    slots = sum(len(p) * _round_up(max(lengths[i] for i in p), 1) for p in padded)
    return {
        "micro_batches": {"padded": len(padded), "packed": len(packed)},
        "padded_token_share": 1 - sum(lengths) / slots,
        "real_tokens": sum(lengths),
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

    from recipes.dapo.config import McoreEpActorConfig

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


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")
    from recipes.local.tiny_model import make_tiny_checkpoint
    from tests.test_verl_engine import build_engine

    hf_dir = make_tiny_checkpoint(tempfile.mkdtemp(prefix="packed_bench_"), seed=0, **MODEL)
    lengths = dapo_lengths(args)
    data = make_batch(lengths, MODEL["vocab_size"], args.max_tokens, args.seed)
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
    stats = padding_stats(data, args.max_tokens)
    tokens = stats["real_tokens"]
    tps = {n: {p: tokens / statistics.median(t) for p, t in d.items()} for n, d in times.items()}
    result = {
        "lengths": {"rows": args.rows, "tokens": tokens, "longest": max(a + b for a, b in lengths)},
        **stats,
        "max_tokens": args.max_tokens,
        "tokens_per_s": tps,
        "ratio": {p: tps["packed"][p] / tps["padded"][p] for p in ("update", "old_log_prob")},
        "seconds": times,
        "torch_threads": torch.get_num_threads(),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
