"""The models a local run builds itself (`--model tiny`, `--model mini`), once per run directory.

Each is a random Qwen3-MoE of a shape in parallel.models, with the toy task's vocabulary and
character tokenizer (recipes.local.task.doubles), written to `<out>/<name>_hf`: the directory is named
by the model, so a run directory made with one never hands the other's to a rerun.
`mini` (MINI_QWEN3_MOE, 128 experts, top-8: Qwen3-30B-A3B's routing) is the default;
`tiny` (TINY_QWEN3_MOE, 8 experts, top-2) is kept for fast tests. Each exists where
parallel.models defines it (`shape` says it is missing otherwise).
"""

import os
import shutil
from pathlib import Path

BUILT = ("tiny", "mini")
DEFAULT = "mini"
# each model's task (recipes.local.cpu_overrides.TASKS): the mini model answers worked sums from
# an SFT warm-up (recipes.local.warmup); the tiny one and a user's directory the doubles
TASK_OF = {"tiny": "doubles", "mini": "sums"}
# the tasks `--task` may pick for each: the default first (recipes.local.task.sums.TASKS)
TASK_CHOICES = {"tiny": ("doubles",), "mini": ("sums", "guessing_sums")}
WARMED = ("mini",)  # RL starts from <out>/sft_hf, the warm-up's export
SFT_DIR = "sft_hf"  # under the run directory: the warm-up's export
SHAPE_NAMES = {"tiny": "TINY_QWEN3_MOE", "mini": "MINI_QWEN3_MOE"}
# the ids of the task's tokenizer (recipes.local.task.doubles: <|endoftext|> pads, <|im_end|> ends)
TOKEN_IDS = dict(eos_token_id=2, pad_token_id=0)


def shape(name: str) -> dict | None:
    """The transformers Qwen3MoeConfig keywords of a built model; None when this tree's
    parallel.models does not define it."""
    import parallel.models

    return getattr(parallel.models, SHAPE_NAMES[name], None)


def built_dir(out: Path, name: str) -> Path:
    return out / f"{name}_hf"


def warmed_dir(out: Path) -> Path:
    """The warm-up's export (recipes.local.warmup), where RL starts for a WARMED model."""
    return out / SFT_DIR


def rl_dir(out: Path, name: str) -> Path:
    """Where RL reads the built model: the warm-up's export for a WARMED one."""
    return warmed_dir(out) if name in WARMED else built_dir(out, name)


def partial_dir(out: Path, name: str) -> Path:
    return out / f".{name}_hf.partial"


def built_config(name: str) -> dict:
    """config.json's architecture fields of the built model, in memory: what the launcher
    checks before anything is written (a dry run writes nothing)."""
    from recipes.local.task.doubles import VOCAB_SIZE

    return {"model_type": "qwen3_moe", **shape(name), "vocab_size": VOCAB_SIZE, **TOKEN_IDS}


def tokenizer_length() -> int:
    """Tokens of the task's tokenizer that the build writes with every built model."""
    from recipes.local.task.doubles import RESERVED, VOCAB

    return len(VOCAB) + len(RESERVED)


def make_built(out: Path, name: str, seed: int = 0) -> Path:
    """<out>/<name>_hf (model + tokenizer), made once: written under a partial name, then
    renamed, so a killed build is never taken for a model."""
    from recipes.local.task.doubles import write_tokenizer
    from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

    hf_dir = built_dir(out, name)
    if (hf_dir / "tokenizer.json").is_file():
        return hf_dir
    tmp = partial_dir(out, name)
    shutil.rmtree(tmp, ignore_errors=True)
    config = {k: v for k, v in built_config(name).items() if k != "model_type"}
    make_tiny_checkpoint(tmp, seed=seed, **config)  # the tiny shape overridden by this one's
    write_tokenizer(tmp)
    shutil.rmtree(hf_dir, ignore_errors=True)
    os.replace(tmp, hf_dir)
    return hf_dir
