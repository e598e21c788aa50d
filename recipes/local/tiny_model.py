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
    """Randomly initialise the tiny model and save_pretrained it (safetensors) to out_dir.

    Every embedding row is drawn, the pad token's too, as in a pretrained checkpoint:
    transformers' init zeroes the row of `pad_token_id` (nn.Embedding's padding_idx), and a
    zero row, once the policy emits that token, meets the first RMSNorm at x = 0, whose
    backward scales by 1 / sqrt(eps) (1000 at eps 1e-6): the first update's gradient norm
    was 70 instead of 1.8, all of it on that row (tests/test_first_update.py). The model is
    built without the pad id and the id is written to the saved configs, so every other
    weight is the same draw as before.
    """
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    pad_token_id, config.pad_token_id = config.pad_token_id, None
    model = Qwen3MoeForCausalLM(config)
    model.config.pad_token_id = model.generation_config.pad_token_id = pad_token_id
    out = Path(out_dir)
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # one small shard: no bar on the launcher's stderr
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if shown:
            logging.enable_progress_bar()
    return out
