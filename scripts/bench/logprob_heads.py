"""Peak memory and time of the log-prob pass: full-logits heads vs the lean head, as ratios.

Two passes on a one-layer Qwen3-MoE (megatron-core GPTModel, world 1, fp32 CPU) with a
scaled-down vocab, T tokens in rows of --seq:
- logprob: the old-log-prob pass, forward with entropy under no_grad;
- update:  forward (log-probs, entropy off as in DAPO's update) and backward of their sum.
Heads: "full" (recipes.dapo.engine.logprobs.full_head_outputs: [B, S, V] logits and their fp32
copies) and "lean" (backend.model.lean_head: chunks, the output projection fused).
--scope head measures the head alone, on final hidden states computed before the pass (the
update: their gradient too), and reports parallel/head_memory.py's estimate of it beside each
peak (model_bytes); --chunk-mib sets the lean head's chunk buffer (a toy size then still
splits T into chunks).

Peak memory: each (head, pass, T) runs in its own process, and its peak activation memory is
that process's high-water mark of resident memory (VmHWM, reset just before the pass through
/proc/self/clear_refs) minus its resident memory just before the pass, with model, inputs and
libraries loaded. torch's CPU allocator has no cache (every tensor is a malloc), and
MALLOC_MMAP_THRESHOLD_ (fixed at 1 MiB in the children) makes glibc map every tensor above it
on its own and unmap it when freed, so resident memory follows the live tensors. Where the
mark cannot be reset (ru_maxrss then), a pass whose peak does not rise above the process's
earlier high-water mark is reported as unmeasured. Time: wall time of the pass,
the best of --repeats runs after the measured one (a shared machine: expect noise).

    python -m scripts.bench.logprob_heads                      # V 16384, T 8K, 16K, 32K
    python -m scripts.bench.logprob_heads --tokens 32768 --vocab 32768
    python -m scripts.bench.logprob_heads --scope head --tokens 2048 --hidden 64 --chunk-mib 16
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEADS = ("full", "lean")
PASSES = ("logprob", "update")
SCOPES = ("pass", "head")
TARGET = 0.5  # issue #17: lean log-prob pass peak <= 1/2 of today's at 32K tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384,32768", help="comma-separated T")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=2048, help="tokens per row (T / seq rows)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the measured one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scope", choices=SCOPES, default="pass", help="the whole pass or the head")
    p.add_argument("--chunk-mib", type=int, help="lean head chunk buffer (default: backend's)")
    p.add_argument("--out", help="JSON path (default: runs/bench/logprob_heads.json)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="children run this many at a time (peaks are per process; their times then share the cores)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # head,pass,tokens: one measurement
    return p.parse_args(argv)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    """The kernel's resident high-water mark of this process: VmHWM (which _reset_peak resets),
    or ru_maxrss where /proc has no status."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak() -> None:
    """Reset VmHWM to the current resident memory (Linux: "5" to clear_refs), so the pass's own
    peak is measured even below the set-up's (the model build, the hidden states' forward)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then a pass below the earlier high-water mark reports no peak


def build(args):
    from backend.model.build import BuildOptions, build_model
    from backend.platform.device import prepare_device
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import tiny_config

    groups = init_parallel(prepare_device("cpu"))
    config = tiny_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=256,
        max_position_embeddings=max(args.seq, 256),
    )  # fmt: skip
    opts = BuildOptions(experts="grouped", attention="sdpa")  # SDPA: no [S, S] scores
    return build_model(load_qwen3_moe_spec(config), groups, opts)


def run_pass(model, ids_BS, head: str, which: str, temperature: float, hidden_SBH=None) -> None:
    """One pass; with hidden_SBH (final hidden states) the head alone on them."""
    import torch

    from recipes.dapo.engine.logprobs import head_outputs

    lean, entropy = head == "lean", which == "logprob"
    if hidden_SBH is not None:
        hidden_SBH = hidden_SBH.detach().requires_grad_(which == "update")
        outputs = lambda: head_on_hidden(model, hidden_SBH, ids_BS, temperature, lean, entropy)  # noqa: E731
    else:
        outputs = lambda: head_outputs(model, ids_BS, temperature, entropy=entropy, lean=lean)  # noqa: E731
    if which == "logprob":
        with torch.no_grad():
            outputs()
        return
    outputs()["log_probs"].sum().backward()
    model.zero_grad(set_to_none=True)


def head_on_hidden(model, hidden_SBH, ids_BS, temperature, lean: bool, entropy: bool) -> dict:
    """head_outputs' head on final hidden states: the lean one, or GPTModel's output layer
    (its [B, S, V] logits, as forward_logits returns them) and the full head on its logits."""
    from backend.model.lean_head import gpt_of
    from recipes.dapo.engine.logprobs import full_head_from_logits, head_from_hidden

    if lean:
        return head_from_hidden(model, hidden_SBH, ids_BS, temperature, entropy)
    logits_BSV, _ = gpt_of(model).output_layer(hidden_SBH)
    logits_BSV = logits_BSV.transpose(0, 1).contiguous()  # [S, B, V] freed, as in GPTModel
    return full_head_from_logits(logits_BSV, ids_BS, temperature, entropy)


def child(args) -> dict:
    import gc

    import torch

    import backend.model.lean_head
    from backend.model.lean_head import forward_hidden

    torch.set_num_threads(args.threads)
    if args.chunk_mib:
        backend.model.lean_head.CHUNK_BYTES = args.chunk_mib * 2**20
    head, which, tokens = args.child.split(",")
    model = build(args)
    rows = int(tokens) // args.seq
    ids_BS = torch.randint(
        0, args.vocab, (rows, args.seq), generator=torch.Generator().manual_seed(0)
    )
    hidden_SBH = None
    if args.scope == "head":
        with torch.no_grad():
            hidden_SBH = forward_hidden(model, ids_BS)
    gc.collect()
    _reset_peak()
    before, high_before = _rss_bytes(), _max_rss_bytes()
    start = time.perf_counter()
    run_pass(model, ids_BS, head, which, args.temperature, hidden_SBH)
    seconds = [time.perf_counter() - start]
    peak = _max_rss_bytes()
    for _ in range(args.repeats):
        start = time.perf_counter()
        run_pass(model, ids_BS, head, which, args.temperature, hidden_SBH)
        seconds.append(time.perf_counter() - start)
    measured = peak > high_before
    return {
        "head": head, "pass": which, "tokens": int(tokens),
        "peak_bytes": peak - before if measured else None,
        "seconds": min(seconds[1:] or seconds),
        **({"model_bytes": model_bytes(args, head, which, int(tokens))}
           if args.scope == "head" else {}),
    }  # fmt: skip


def model_bytes(args, head: str, which: str, tokens: int) -> float:
    """parallel/head_memory.py's peak of the head alone (fp32, tp 1, this chunk size)."""
    import backend.model.lean_head
    from parallel.head_memory import head_bytes

    return head_bytes(tokens, args.vocab, args.hidden, 4, head == "lean", which == "update",
                      backend.model.lean_head.CHUNK_BYTES)  # fmt: skip


def measure(args, head: str, which: str, tokens: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": str(args.threads)}
    shape = ("vocab", "hidden", "seq", "temperature", "repeats", "threads", "scope")
    argv = [f"--{k}={getattr(args, k)}" for k in shape]
    if args.chunk_mib:
        argv.append(f"--chunk-mib={args.chunk_mib}")
    run = f"{head},{which},{tokens}"
    cmd = [sys.executable, "-m", "scripts.bench.logprob_heads", *argv, "--child", run]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {head},{which},{tokens} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:9.0f}" if nbytes is not None else "      n/a"


def report(results: list[dict]) -> list[str]:
    by = {(r["head"], r["pass"], r["tokens"]): r for r in results}
    lines = [
        f"{'pass':<8}{'T':>7}  {'full MiB':>9}  {'lean MiB':>9}  {'mem ratio':>9}  "
        f"{'full s':>7}  {'lean s':>7}  {'time ratio':>10}"
    ]
    for which in PASSES:
        for tokens in sorted({r["tokens"] for r in results}):
            full, lean = by[("full", which, tokens)], by[("lean", which, tokens)]
            mem = (
                f"{lean['peak_bytes'] / full['peak_bytes']:9.3f}"
                if full["peak_bytes"] and lean["peak_bytes"]
                else "      n/a"
            )
            lines.append(
                f"{which:<8}{tokens:>7}  {_mib(full['peak_bytes'])}  {_mib(lean['peak_bytes'])}  "
                f"{mem}  {full['seconds']:7.2f}  {lean['seconds']:7.2f}  "
                f"{lean['seconds'] / full['seconds']:10.2f}"
            )
    if all("model_bytes" in r for r in results):
        lines.append("the head alone, measured / parallel/head_memory.py's estimate:")
        for r in results:
            ratio = f"{r['peak_bytes'] / r['model_bytes']:6.3f}" if r["peak_bytes"] else "   n/a"
            lines.append(f"  {r['head']:<5}{r['pass']:<8}{r['tokens']:>7}  {_mib(r['peak_bytes'])}"
                         f" / {_mib(r['model_bytes'])} MiB  {ratio}")  # fmt: skip
    return lines


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return []
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"log-prob heads, fp32 CPU, one-layer Qwen3-MoE, V {args.vocab}, hidden {args.hidden}, "
        f"rows of {args.seq}, temperature {args.temperature}, scope {args.scope}; peak = "
        "resident high-water mark - RSS before the pass, one process each; ratios lean / full"
    )
    runs = [(h, w, t) for t in tokens for w in PASSES for h in HEADS]
    with ThreadPoolExecutor(args.jobs) as pool:  # each child a process of its own
        results = list(pool.map(lambda run: measure(args, *run), runs))
    print("\n".join(report(results)))
    out = Path(args.out or REPO / "runs/bench/logprob_heads.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
