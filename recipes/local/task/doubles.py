"""The local task: single-digit doubles ("3+3=" -> "6"), in the files verl's trainer reads.

What verl lacks for a laptop run and nothing more: a character tokenizer with Qwen's ChatML
tokens and template (verl's agent loop builds prompts with it and stops at `<|im_end|>`),
the problems as DAPO-style parquet files (chat `prompt`, `data_source`, `reward_model`), and
the score: verl's math_dapo on "Answer: <response>" (+1 right, -1 wrong), which the `dapo`
reward manager then shapes with its overlong buffer, exactly as on the cluster.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# every character a prompt, an answer or the ChatML template ("user", "assistant") needs,
# one token each: a small vocabulary keeps the first right answers likely enough to learn from
CHARS = ("\n", *"0123456789", "+", "-", "*", "=", *"aeinrstu", "A", "w", ":", " ")  # "Answer: "
VOCAB = (*SPECIALS, *CHARS)
VOCAB_SIZE = 32  # the model's vocabulary: VOCAB, then reserved tokens up to a round size
# the tokenizer names every id the model can emit: verl's vLLM rollout bans ids past the
# tokenizer's length, which would renormalise the rollout's log-probs against the actor's
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(VOCAB)))
DATA_SOURCE = "math_dapo"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path) -> Path:
    """A character-level PreTrainedTokenizerFast with ChatML specials, saved to `out`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate((*VOCAB, *RESERVED))}
    core = Tokenizer(models.WordLevel(ids, unk_token=SPECIALS[0]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", *RESERVED],
        chat_template=CHATML,
    )
    tok.save_pretrained(out)
    return out


@dataclass(frozen=True)
class Problem:
    prompt: str  # "3+4="
    answer: str  # "7"


def make_problems(max_operand: int = 3) -> list[Problem]:
    """The doubles a+a for a in 0..max_operand: every answer distinct, both digits carry it.

    Why this set (measured, docs/cpu_run.md, "The toy task"): the random tiny model tells
    prompts apart by a token or two, and a prompt whose right answer loses that race early is
    answered wrong with certainty; its groups are then all wrong, DAPO's filter evicts them and
    it never gets a gradient again. With every a+b over 0..2 the run stopped at 6 of 9 prompts;
    with 0+0, 0+1, 1+1 the model read only the second digit and answered 0+1 like 1+1. In the
    doubles both digits name the answer and no answer repeats.
    """
    if not 0 <= max_operand <= 4:
        raise ValueError(f"max_operand={max_operand}: a+a must be a single digit, 0..4")
    return [Problem(f"{a}+{a}=", str(2 * a)) for a in range(max_operand + 1)]


def write_data(out: Path, max_operand: int = 3, repeats: int = 300) -> dict:
    """train.parquet (the problems, repeated for enough steps) and val.parquet (each once)."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    problems = make_problems(max_operand)
    train = problems * repeats
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    pd.DataFrame([dapo_row(p, i, "train") for i, p in enumerate(train)]).to_parquet(paths["train"])
    pd.DataFrame([dapo_row(p, i, "val") for i, p in enumerate(problems)]).to_parquet(paths["val"])
    (out / "task.json").write_text(json.dumps({"max_operand": max_operand}))
    return paths


def dapo_row(problem, index: int, split: str, **extra) -> dict:
    """A DAPO row as verl's RL dataset reads it (chat prompt, data_source, ground truth) of
    anything with a `prompt` and an `answer`; `extra` goes into extra_info."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index, **extra},
    }


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's math_dapo score (+1 / -1, `acc`) of the response's leading digits as the answer.

    Trailing characters cost nothing here: the dapo reward manager's overlong buffer
    penalises responses longer than the answer and its end token, which is what teaches
    the policy to stop.
    """
    from verl.utils.reward_score import math_dapo

    answer = re.match(r"\d*", solution_str.strip()).group()
    return math_dapo.compute_score(f"Answer: {answer}", ground_truth)
