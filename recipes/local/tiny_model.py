"""A tiny random Qwen3-MoE, written as an HF checkpoint by transformers itself.

Its shape (parallel.models.TINY_QWEN3_MOE, where the planner's model configs live) is the
architecture of Qwen3-30B-A3B shrunk so CPU runs take seconds.
"""

from pathlib import Path

import torch

from parallel.models import TINY_QWEN3_MOE


def tiny_config(**overrides):
    """A Qwen3MoeConfig with the tiny shape; keyword overrides win."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Randomly initialise the tiny model and save_pretrained it (safetensors) to out_dir."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**overrides))
    out = Path(out_dir)
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # one small shard: no bar on the launcher's stderr
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if shown:
            logging.enable_progress_bar()
    return out
