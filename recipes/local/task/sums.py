"""The mini model's task: sums of one to six small digits, the working written out.

"2+1+3=" is answered "2+1=3\n3+3=6\nAnswer: 6": a line per addition with the running total,
then DAPO's "Answer: N", which verl's own math_dapo scorer grades (data_source `math_dapo`,
no reward function of ours). A single digit ("2=") is answered "Answer: 2". The responses run
from 10 tokens (one operand, with <|im_end|>) to 40 (six), so a batch's lengths vary 4x, and a
policy that does not stop meets the dapo reward manager's overlong buffer.

The running total stays a single digit (the sum is at most 9): each line is then one fact of
a small table the model learns in its warm-up (recipes.local.warmup: verl's SFT trainer on our
engine). The warm-up's corpus answers half of the sums of two or more operands by a guess,
the answer line alone with a random digit, as a careless teacher would: the warmed policy
works a sum out (and is then right) or guesses (and is right one time in ten), and what RL
has to learn is to work it out. Validation starts low and climbs while the responses grow
longer (docs/mini_task.md has the measured curve).

`--task guessing_sums` (GUESSING_SUMS) is the variant with headroom, for ranking trainer modes
and corrections over 40 steps and more: the same sums, from a teacher who guesses 80% of the
sums of two or more operands (the default's: 50%). The warmed policy rarely works a sum out
and, having seen each fact worked less often, gets some wrong when it does: RL makes working
the rule in ~10 steps, then sharpens the facts (docs/mini_task.md has the designs tried and
the curves). Its validation set is 32 prompts (256 answers at 8 samples each: one flipped
answer moves the mean accuracy by 0.004, the mean reward by 0.008).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from recipes.local.task.doubles import dapo_row


@dataclass(frozen=True)
class SumsTask:
    """What a sums task draws: its operand count, digits, largest total and guess share."""

    name: str
    max_operands: int = 6
    max_digit: int = 3  # operands 0..max_digit; a sum over max_sum is drawn again
    max_sum: int = 9
    guess_share: float = 0.5  # of the warm-up's multi-operand conversations, answered by a guess
    val: int = 16  # validation prompts

    @property
    def max_response_tokens(self) -> int:
        """The longest worked answer with its <|im_end|>: a line per addition after the
        first operand ("a+b=c\n", a the running total, one digit in the first line),
        "Answer: N", the end token."""
        total, digit = len(str(self.max_sum)), len(str(self.max_digit))
        first, line = digit + 1 + digit + 1 + total + 1, total + 1 + digit + 1 + total + 1
        lines = first + (self.max_operands - 2) * line if self.max_operands > 1 else 0
        return lines + len("Answer: ") + total + 1


SUMS = SumsTask("sums")
GUESSING_SUMS = SumsTask("guessing_sums", guess_share=0.8, val=32)
TASKS = {t.name: t for t in (SUMS, GUESSING_SUMS)}
# the default task's figures, as its docs and overrides quote them
MAX_OPERANDS, MAX_DIGIT, MAX_SUM, GUESS_SHARE = (SUMS.max_operands, SUMS.max_digit,
                                                 SUMS.max_sum, SUMS.guess_share)  # fmt: skip
MAX_RESPONSE_TOKENS = SUMS.max_response_tokens  # 40: six operands, 5 lines of 6, "Answer: N", end


@dataclass(frozen=True)
class Sum:
    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.operands)) + "="

    @property
    def answer(self) -> str:
        return str(sum(self.operands))

    @property
    def working(self) -> str:
        """The response a solved policy writes (without its <|im_end|>)."""
        lines, total = [], self.operands[0]
        for x in self.operands[1:]:
            lines.append(f"{total}+{x}={total + x}")
            total += x
        return "".join(f"{line}\n" for line in lines) + f"Answer: {total}"


def draw_sums(count: int, seed: int, task: SumsTask = SUMS) -> list[Sum]:
    """`count` sums, the number of operands uniform over 1..max_operands, digits uniform over
    0..max_digit, redrawn while the sum exceeds max_sum."""
    rng = random.Random(seed)
    sums = []
    while len(sums) < count:
        k = rng.randint(1, task.max_operands)
        operands = tuple(rng.randint(0, task.max_digit) for _ in range(k))
        if sum(operands) <= task.max_sum:
            sums.append(Sum(operands))
    return sums


def rl_row(s: Sum, index: int, split: str) -> dict:
    """The sum as a DAPO row (recipes.local.task.doubles.dapo_row), its operand count in extra_info."""
    return dapo_row(s, index, split, operands=len(s.operands))


def sft_row(s: Sum, guess: int | None = None) -> dict:
    """A conversation as verl's MultiTurnSFTDataset reads it (`messages`): the worked answer,
    or with `guess` the answer line alone holding that digit."""
    reply = s.working if guess is None else f"Answer: {guess}"
    return {
        "messages": [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": reply}]
    }


def sft_rows(sums: list[Sum], guess_share: float, seed: int, max_sum: int = MAX_SUM) -> list[dict]:
    """The warm-up's corpus: a `guess_share` of the sums of two or more operands answered by
    a guess (a number drawn uniformly from 0..max_sum, right one time in max_sum + 1), the rest
    worked."""
    rng = random.Random(seed)
    rows = []
    for s in sums:
        guessed = len(s.operands) > 1 and rng.random() < guess_share
        rows.append(sft_row(s, rng.randint(0, max_sum) if guessed else None))
    return rows


def write_sums_data(out: Path, train: int = 4096, val: int | None = None, sft: int = 2048,
                    seed: int = 0, task: SumsTask = SUMS) -> dict:  # fmt: skip
    """train.parquet / val.parquet (RL, DAPO rows; `val` prompts, the task's count by default)
    and sft.parquet (the warm-up's conversations) under `out`, and task.json naming the task;
    the validation sums are drawn apart from the rest."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    paths = {s: out / f"{s}.parquet" for s in ("train", "val", "sft")}
    val_sums = draw_sums(task.val if val is None else val, seed + 1, task)
    pd.DataFrame(
        [rl_row(s, i, "train") for i, s in enumerate(draw_sums(train, seed, task))]
    ).to_parquet(paths["train"])
    pd.DataFrame([rl_row(s, i, "val") for i, s in enumerate(val_sums)]).to_parquet(paths["val"])
    corpus = sft_rows(draw_sums(sft, seed + 2, task), task.guess_share, seed + 3, task.max_sum)
    pd.DataFrame(corpus).to_parquet(paths["sft"])
    (out / "task.json").write_text(
        json.dumps({"task": task.name, "max_operands": task.max_operands, "seed": seed})
    )
    return paths
