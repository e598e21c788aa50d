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
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from recipes.local.task.doubles import dapo_row

MAX_OPERANDS = 6
MAX_DIGIT = 3  # operands 0..3; a sum over 9 is drawn again
MAX_SUM = 9
GUESS_SHARE = 0.5  # of the warm-up's multi-operand conversations, answered by a guess
MAX_RESPONSE_TOKENS = 40  # six operands: 5 working lines of 6 + "Answer: N" + <|im_end|>


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


def draw_sums(count: int, seed: int) -> list[Sum]:
    """`count` sums, the number of operands uniform over 1..MAX_OPERANDS, digits uniform over
    0..MAX_DIGIT, redrawn while the sum exceeds MAX_SUM."""
    rng = random.Random(seed)
    sums = []
    while len(sums) < count:
        k = rng.randint(1, MAX_OPERANDS)
        operands = tuple(rng.randint(0, MAX_DIGIT) for _ in range(k))
        if sum(operands) <= MAX_SUM:
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


def sft_rows(sums: list[Sum], guess_share: float, seed: int) -> list[dict]:
    """The warm-up's corpus: a `guess_share` of the sums of two or more operands answered by
    a guess (a digit drawn uniformly from 0..MAX_SUM, right one time in ten), the rest worked."""
    rng = random.Random(seed)
    rows = []
    for s in sums:
        guessed = len(s.operands) > 1 and rng.random() < guess_share
        rows.append(sft_row(s, rng.randint(0, MAX_SUM) if guessed else None))
    return rows


def write_sums_data(out: Path, train: int = 4096, val: int = 16, sft: int = 2048,
                    seed: int = 0, guess_share: float = GUESS_SHARE) -> dict:  # fmt: skip
    """train.parquet / val.parquet (RL, DAPO rows) and sft.parquet (the warm-up's
    conversations) under `out`; the validation sums are drawn apart from the rest."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    paths = {s: out / f"{s}.parquet" for s in ("train", "val", "sft")}
    pd.DataFrame([rl_row(s, i, "train") for i, s in enumerate(draw_sums(train, seed))]).to_parquet(
        paths["train"]
    )
    pd.DataFrame([rl_row(s, i, "val") for i, s in enumerate(draw_sums(val, seed + 1))]).to_parquet(
        paths["val"]
    )
    pd.DataFrame(sft_rows(draw_sums(sft, seed + 2), guess_share, seed + 3)).to_parquet(paths["sft"])
    (out / "task.json").write_text(json.dumps({"task": "sums", "max_operands": MAX_OPERANDS}))
    return paths
