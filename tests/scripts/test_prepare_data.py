"""scripts/prepare_data.py and recipes.launcher.datasets: what a DAPO dataset must hold, said clearly."""

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes.launcher import datasets

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def write_dataset(
    path: Path, prompts: int, repeat: int = 1, source: str = "math_dapo", drop: str | None = None
):
    n = prompts * repeat
    columns = {
        "data_source": [source] * n,
        "prompt": [[{"content": f"problem {i % prompts}", "role": "user"}] for i in range(n)],
        "ability": ["MATH"] * n,
        "reward_model": [
            {"ground_truth": str(i % prompts), "style": "rule-lighteval/MATH_v2"} for i in range(n)
        ],
        "extra_info": [{"index": str(i % prompts)} for i in range(n)],
    }
    columns.pop(drop, None)
    pq.write_table(pa.table(columns), path)
    return path


def expecting(dataset: datasets.Dataset, prompts: int) -> datasets.Dataset:
    return dataclasses.replace(dataset, unique_prompts=prompts)


def prepare_data_main():
    from scripts.prepare_data import main

    return main


def test_good_file_counts_distinct_prompts_not_rows(tmp_path):
    path = write_dataset(tmp_path / "aime.parquet", prompts=30, repeat=32)  # like AIME-2024's card
    report = datasets.check_file(path, datasets.VAL)
    assert report.ok, report.problems
    assert (report.rows, report.unique_prompts) == (960, 30)


def test_wrong_prompt_count_is_named(tmp_path):
    report = datasets.check_file(
        write_dataset(tmp_path / "t.parquet", prompts=12), expecting(datasets.TRAIN, 17_917)
    )
    assert report.problems == [
        "12 distinct prompts, DAPO-Math-17k has 17,917: is it the right or a complete file?"
    ]


@pytest.mark.parametrize(
    "column", ["prompt", "reward_model", "extra_info", "ability", "data_source"]
)
def test_missing_column_is_named(tmp_path, column):
    report = datasets.check_file(
        write_dataset(tmp_path / "t.parquet", 5, drop=column), expecting(datasets.TRAIN, 5)
    )
    assert f"column `{column}` is missing" in report.problems


def test_unscorable_data_source_is_named(tmp_path):
    report = datasets.check_file(
        write_dataset(tmp_path / "t.parquet", 5, source="gsm8k"), expecting(datasets.TRAIN, 5)
    )
    assert len(report.problems) == 1 and "'gsm8k'" in report.problems[0]


def test_plain_string_prompts_are_refused(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": ["what is 1+1"],
                "data_source": ["math_dapo"],
                "ability": ["MATH"],
                "reward_model": [{"ground_truth": "2"}],
                "extra_info": [{"index": "0"}],
            }
        ),
        path,
    )
    report = datasets.check_file(path, expecting(datasets.TRAIN, 1))
    assert any("chat messages" in p for p in report.problems)


def test_script_says_what_is_missing_and_how_to_get_it(tmp_path, capsys):
    write_dataset(tmp_path / datasets.VAL.filename, prompts=30)
    assert prepare_data_main()(["--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"BAD DAPO-Math-17k {tmp_path / datasets.TRAIN.filename}"
    assert out[1].strip() == (
        f"missing: download it with `wget -O {tmp_path / datasets.TRAIN.filename} {datasets.TRAIN.url}`"
    )
    assert (
        out[2] == f"ok  AIME-2024 {tmp_path / datasets.VAL.filename}: 30 rows, 30 distinct prompts"
    )


def test_script_passes_on_good_files(tmp_path):
    write_dataset(tmp_path / datasets.TRAIN.filename, prompts=datasets.TRAIN.unique_prompts)
    write_dataset(
        tmp_path / datasets.VAL.filename,
        prompts=datasets.VAL.unique_prompts,
        repeat=32,
        source="aime2024",
    )
    assert prepare_data_main()(["--data-dir", str(tmp_path)]) == 0


# sources whose real scoring is harmless to run here (no code execution, no sandbox)
SOURCES = ["math_dapo", "aime2024", "math", "openai/gsm8k", "lighteval/MATH",
           "hiyouga/geometry3k", "searchR1_nq", "numina_olympiads", "gsm8k", "dapo", "", None]  # fmt: skip


@pytest.mark.parametrize("source", SOURCES)
def test_the_scorer_lookup_is_verls_own_dispatch(source):
    """has_scorer answers as verl's default_compute_score does when it really scores: it
    raises at its dispatch for a source it does not know (None included), else scores."""
    compute_score = datasets.default_scorer()
    # search-R1's scorer reads ground_truth["target"] when it prints, 1 call in 64 at random:
    # a plain string there failed CI once (TypeError), so it gets the dict its data carries
    truth = {"target": ["2"]} if str(source).startswith("searchR1") else "2"
    try:
        compute_score(source, "Answer: 2", truth)
        scored = True
    except (NotImplementedError, AttributeError):
        scored = False
    except ImportError:  # dispatched, to a scorer whose extra package is not installed here
        scored = True
    assert datasets.has_scorer(compute_score, source) == scored


def test_schema_only_checks_the_scorer_too(tmp_path, capsys):
    write_dataset(tmp_path / datasets.TRAIN.filename, prompts=3, source="gsm8k")
    write_dataset(tmp_path / datasets.VAL.filename, prompts=3, source="aime2024")
    assert prepare_data_main()(["--data-dir", str(tmp_path), "--schema-only"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"BAD DAPO-Math-17k {tmp_path / datasets.TRAIN.filename}"
    assert out[1].strip().startswith("data_source 'gsm8k' (1 of 1 distinct values) has no scorer")
    assert out[2] == f"ok  AIME-2024 {tmp_path / datasets.VAL.filename}"


def test_a_custom_reward_function_scores_every_source(tmp_path):
    path = write_dataset(tmp_path / "t.parquet", 3, source="my_task")
    assert not datasets.check_file(path, expecting(datasets.TRAIN, 3), scorer=None).problems
    assert datasets.check_file(path, expecting(datasets.TRAIN, 3)).problems
