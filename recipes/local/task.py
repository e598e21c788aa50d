"""The local task: single-digit arithmetic ("3+4=" -> "7<eos>"), scored like math_dapo.

A character vocabulary of 16 tokens (the tiny model's vocab_size), prompts of fixed length
(4 tokens, so no left padding), answers of one digit. The reward is verl's own: its DAPO
reward manager (verl/workers/reward_manager/dapo.py, used as is: decode, score, overlong
shaping, reward on the last response token) calling math_dapo.compute_score on
"Answer: <decoded response>". math_dapo gives +1 / -1; the overlong buffer subtracts up to
`penalty_factor` for responses longer than max_response_length - buffer_len tokens.
"""

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

SPECIALS = ("<pad>", "<eos>")
VOCAB = (*SPECIALS, *"0123456789", "+", "-", "*", "=")
DATA_SOURCE = "math_dapo"
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class CharTokenizer:
    """One token per character; what the DAPO reward manager needs from a tokenizer."""

    pad_token, eos_token = SPECIALS

    def __init__(self):
        self.vocab = {tok: i for i, tok in enumerate(VOCAB)}
        self.pad_token_id = self.vocab[self.pad_token]
        self.eos_token_id = self.vocab[self.eos_token]

    def __len__(self) -> int:
        return len(VOCAB)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self.vocab))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the task vocabulary {VOCAB[2:]}")
        return [self.vocab[ch] for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        tokens = [VOCAB[i] for i in ids]
        if skip_special_tokens:
            tokens = [t for t in tokens if t not in SPECIALS]
        return "".join(tokens)


@dataclass(frozen=True)
class Problem:
    prompt: str  # "3+4="
    answer: str  # "7"


def make_problems(ops: str = "+-", max_operand: int = 9) -> list[Problem]:
    """Every a<op>b with single-digit operands and a single-digit, non-negative result."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown operator(s) {unknown}: choose from {''.join(OPS)}")
    problems = [
        Problem(f"{a}{op}{b}=", str(OPS[op](a, b)))
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if 0 <= OPS[op](a, b) <= 9
    ]
    if not problems:
        raise ValueError(f"no problem with ops={ops!r}, max_operand={max_operand}: widen them")
    return problems


def balanced(problems: list[Problem]) -> list[Problem]:
    """Problems repeated so that every answer is about equally frequent.

    With a+b over 0..4, "0+0=" is the only prompt answered 0: a rare answer gets pushed onto
    its neighbours by what the policy learns elsewhere before it is ever sampled right.
    """
    counts = Counter(p.answer for p in problems)
    most = max(counts.values())
    return [p for p in problems for _ in range(max(1, round(most / counts[p.answer])))]


def prompt_batch(problems: list[Problem], tokenizer: CharTokenizer) -> dict:
    """Tensors and verl's non-tensor fields of a prompt batch (before repeating n times)."""
    return {
        "prompt_ids_BP": torch.tensor([tokenizer.encode(p.prompt) for p in problems]),
        "reward_model": np.array([{"ground_truth": p.answer} for p in problems], dtype=object),
        "data_source": np.array([DATA_SOURCE] * len(problems), dtype=object),
    }


def math_dapo_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """verl's math_dapo.compute_score on the response read as a final answer line."""
    from verl.utils.reward_score import math_dapo

    return math_dapo.compute_score(f"Answer: {solution_str}", ground_truth)


@dataclass(frozen=True)
class OverlongBuffer:
    """verl's reward_model.overlong_buffer config (the attributes its reward manager reads)."""

    len: int
    penalty_factor: float
    enable: bool = True
    log: bool = True


def reward_manager(
    tokenizer: CharTokenizer, max_response_length: int, buffer_len: int, penalty_factor: float
):
    """verl's DAPORewardManager with math_dapo scoring and the overlong buffer."""
    from verl.workers.reward_manager.dapo import DAPORewardManager

    overlong = OverlongBuffer(buffer_len, penalty_factor) if buffer_len > 0 else None
    return DAPORewardManager(
        tokenizer, num_examine=0, compute_score=math_dapo_score,
        max_resp_len=max_response_length, overlong_buffer_cfg=overlong,
    )  # fmt: skip
