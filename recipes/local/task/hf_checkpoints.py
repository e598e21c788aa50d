"""The tiny and the mini random Qwen3-MoE, written as HF checkpoints by transformers itself.

Their shapes (parallel.models.TINY_QWEN3_MOE and MINI_QWEN3_MOE, where the planner's model
configs live) are the architecture of Qwen3-30B-A3B shrunk: the tiny one so CPU runs take
seconds (8 experts, top-2), the mini one at the real routing's count (128 experts, top-8)
and GQA 8:1, at a width CPUs still train.
"""

from pathlib import Path

import torch

from parallel.models import MINI_QWEN3_MOE, TINY_QWEN3_MOE

SHAPES = {"tiny": TINY_QWEN3_MOE, "mini": MINI_QWEN3_MOE}


def model_config(shape: str = "tiny", **overrides):
    """A Qwen3MoeConfig of SHAPES[shape]; keyword overrides win."""
    from transformers import Qwen3MoeConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: choose one of {', '.join(SHAPES)}")
    return Qwen3MoeConfig(**{**SHAPES[shape], **overrides})


def tiny_config(**overrides):
    """A Qwen3MoeConfig with the tiny shape; keyword overrides win."""
    return model_config("tiny", **overrides)


def make_checkpoint(out_dir: str | Path, shape: str = "tiny", seed: int = 0, **overrides) -> Path:
    """Randomly initialise the model of `shape` and save_pretrained it (safetensors) to out_dir.

    Every embedding row is drawn, the pad token's too, as in a pretrained checkpoint:
    transformers' init zeroes the row of `pad_token_id` (nn.Embedding's padding_idx), and a
    zero row, once the policy emits that token, meets the first RMSNorm at x = 0, whose
    backward scales by 1 / sqrt(eps) (1000 at eps 1e-6): the first update's gradient norm
    was 70 instead of 1.8, all of it on that row (tests/recipes/test_first_update.py). The model is
    built without the pad id and the id is written to the saved configs, so every other
    weight is the same draw as before.
    """
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    torch.manual_seed(seed)
    config = model_config(shape, **overrides)
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


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """The tiny model's checkpoint (make_checkpoint with shape "tiny")."""
    return make_checkpoint(out_dir, "tiny", seed, **overrides)
