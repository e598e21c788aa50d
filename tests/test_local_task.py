"""The CPU run's toy task: its problems, data files and score."""

import pandas as pd
import pytest

from recipes.local.task import compute_score, make_problems, write_data

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def test_doubles_one_per_answer_both_digits_name_it():
    problems = make_problems(3)
    assert [(p.prompt, p.answer) for p in problems] == [
        ("0+0=", "0"), ("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6")
    ]  # fmt: skip
    assert len({p.answer for p in make_problems(4)}) == 5


def test_answers_beyond_one_digit_are_refused():
    with pytest.raises(ValueError, match="single digit"):
        make_problems(5)


def test_data_files_hold_the_problems_in_verls_columns(tmp_path):
    paths = write_data(tmp_path, max_operand=2, repeats=4)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert len(train) == 12 and len(val) == 3
    assert [m[0]["content"] for m in val["prompt"]] == ["0+0=", "1+1=", "2+2="]
    assert [r["ground_truth"] for r in val["reward_model"]] == ["0", "2", "4"]
    assert set(train["data_source"]) == {"math_dapo"}


@pytest.mark.parametrize(
    "response, score",
    [("2", 1.0), ("2\n", 1.0), ("2+", 1.0), ("12", -1.0), ("", -1.0), ("x2", -1.0)],
)
def test_score_reads_the_leading_digits(response, score):
    assert compute_score("math_dapo", response, "2")["score"] == score
