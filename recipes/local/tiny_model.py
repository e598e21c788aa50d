"""A tiny random Qwen3-MoE, written as an HF checkpoint by transformers itself.

Same architecture as Qwen3-30B-A3B (GQA, qk-norm, softmax top-k routing renormalised,
untied head), shrunk so CPU runs take seconds. head_dim differs from hidden/heads on
purpose, as it does in the real model (128 vs 2048/32 = 64).
"""

from pathlib import Path

import torch

TINY_QWEN3_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_config(**overrides):
    """A Qwen3MoeConfig with the tiny shape; keyword overrides win."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Randomly initialise the tiny model and save_pretrained it (safetensors) to out_dir."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**overrides))
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out
