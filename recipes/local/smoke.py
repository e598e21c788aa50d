"""Forward/backward smoke run of the tiny Qwen3-MoE through the megatron-core actor on CPU.

HF checkpoint -> mcore model (our converter) -> parity check against transformers ->
a few optimizer steps on a learnable toy task -> export back to HF and check it loads.
Run: python -m recipes.local.smoke [--steps N] [--out runs/local]
"""

import argparse
import time
from pathlib import Path

import torch

PARITY_TOL = 1e-5  # max |logits diff| vs transformers in fp32 (tests/backend/test_parity.py's)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/local"))
    return p.parse_args(argv)


def counting_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences x, x+1, x+2, ... (mod vocab): next token is learnable from the current one."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(seq)) % vocab


def main(argv=None) -> int:
    args = _parse(argv)
    from backend.platform.device import prepare_device

    device = prepare_device("cpu")
    from tqdm import tqdm
    from transformers import Qwen3MoeForCausalLM

    from backend.model.build import build_model
    from backend.model.forward import forward_logits, next_token_log_probs
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel
    from converters.hf_io import read_state_dict
    from converters.sharding import load_hf_into_model, model_to_hf
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    t0 = time.perf_counter()
    hf_dir = make_tiny_checkpoint(args.out / "tiny_hf", seed=args.seed)
    spec = load_qwen3_moe_spec(hf_dir)
    groups = init_parallel(device, seed=args.seed)
    model = build_model(spec, groups)
    load_hf_into_model(model, read_state_dict(hf_dir), spec)

    gen = torch.Generator().manual_seed(args.seed)
    probe = counting_batch(2, args.seq, spec.vocab_size, gen)
    reference = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        parity = (forward_logits(model, probe) - reference(probe).logits).abs().max().item()
    print(f"parity: max |mcore - transformers| logits = {parity:.2e}")

    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for _ in (bar := tqdm(range(args.steps), desc="fwd/bwd", unit="step")):
        ids = counting_batch(args.batch, args.seq, spec.vocab_size, gen)
        loss = -next_token_log_probs(model, ids).mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")

    export = args.out / "export_hf"
    reference.load_state_dict(model_to_hf(model, spec, fused_experts=True))
    reference.save_pretrained(export)
    reloaded = Qwen3MoeForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (forward_logits(model, probe) - reloaded(probe).logits).abs().max().item()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
    print(f"export: {export} (transformers reloads it; max logits diff {diff:.2e})")
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0 if losses[-1] < losses[0] and diff < 1e-4 and parity < PARITY_TOL else 1


if __name__ == "__main__":
    raise SystemExit(main())
