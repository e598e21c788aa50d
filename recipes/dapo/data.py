"""The DAPO datasets: what verl's DAPO recipe reads from them, and checks that say what is wrong.

Files (as the DAPO recipe's prepare_dapo_data.sh fetches them):
  dapo-math-17k.parquet  BytedTsinghua-SIA/DAPO-Math-17k   training prompts
  aime-2024.parquet      BytedTsinghua-SIA/AIME-2024       validation (its card says each of
                         the 30 problems is repeated 32 times, for best-of-32 metrics)
Columns verl reads: prompt (chat messages: list of {role, content}), data_source (selects the
math_dapo scorer), reward_model.ground_truth, ability, extra_info. Expected unique prompts:
17,917 and 30 (the released datasets' figures; the files may repeat rows, so prompts are
counted, not rows).
"""

from dataclasses import dataclass, field
from pathlib import Path

HF = "https://huggingface.co/datasets/BytedTsinghua-SIA"


@dataclass(frozen=True)
class Dataset:
    name: str
    filename: str
    url: str
    unique_prompts: int


TRAIN = Dataset(
    "DAPO-Math-17k",
    "dapo-math-17k.parquet",
    f"{HF}/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet",
    17_917,
)
VAL = Dataset(
    "AIME-2024", "aime-2024.parquet", f"{HF}/AIME-2024/resolve/main/data/aime-2024.parquet", 30
)
COLUMNS = ("prompt", "data_source", "reward_model", "ability", "extra_info")
# verl.utils.reward_score.default_compute_score sends these (and aime*) to math_dapo
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")


@dataclass
class Report:
    path: Path
    problems: list[str] = field(default_factory=list)
    rows: int | None = None
    unique_prompts: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _schema_problems(schema) -> list[str]:
    import pyarrow as pa

    names = set(schema.names)
    problems = [f"column `{c}` is missing" for c in COLUMNS if c not in names]
    if "reward_model" in names:
        rm = schema.field("reward_model").type
        if not pa.types.is_struct(rm) or rm.get_field_index("ground_truth") < 0:
            problems.append("column `reward_model` has no `ground_truth` field")
    if "prompt" in names:
        prompt = schema.field("prompt").type
        item = (
            prompt.value_type
            if pa.types.is_list(prompt) or pa.types.is_large_list(prompt)
            else None
        )
        if item is None or not pa.types.is_struct(item) or item.get_field_index("content") < 0:
            problems.append(
                "column `prompt` is not a list of chat messages with `content` "
                "(verl's chat-format prompts)"
            )
    return problems


def scorer_problems(path: Path) -> list[str]:
    """data_source values verl's default scorer cannot grade (it raises at the first reward)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    sources = pc.unique(pq.read_table(path, columns=["data_source"]).column(0)).to_pylist()
    bad = [s for s in sources if s not in MATH_DAPO_SOURCES and not str(s).startswith("aime")]
    return (
        [
            f"data_source {bad[0]!r} ({len(bad)} unknown) has no math_dapo scorer in verl: "
            f"use one of {', '.join(MATH_DAPO_SOURCES)} or aime*"
        ]
        if bad
        else []
    )


def count_unique_prompts(path: Path) -> tuple[int, int]:
    """(rows, distinct prompt texts), streaming the prompt column."""
    import pyarrow.parquet as pq

    seen, rows = set(), 0
    for batch in pq.ParquetFile(path).iter_batches(columns=["prompt"], batch_size=65536):
        for messages in batch.column(0).to_pylist():
            seen.add(hash(tuple(m.get("content") for m in messages or ())))
            rows += 1
    return rows, len(seen)


def check_file(path: str | Path, dataset: Dataset, counts: bool = True) -> Report:
    """Schema (always) and unique-prompt count (when `counts`) of one parquet file."""
    import pyarrow.parquet as pq

    report = Report(Path(path))
    if not report.path.is_file():
        report.problems.append(f"missing: download it with `wget -O {report.path} {dataset.url}`")
        return report
    try:
        schema = pq.read_schema(report.path)
    except Exception as err:  # pyarrow raises several types for a broken file
        report.problems.append(
            f"not a readable parquet file ({err}): download it again from {dataset.url}"
        )
        return report
    report.problems += _schema_problems(schema)
    if counts and report.ok:
        report.problems += scorer_problems(report.path)
        report.rows, report.unique_prompts = count_unique_prompts(report.path)
        if report.unique_prompts != dataset.unique_prompts:
            report.problems.append(
                f"{report.unique_prompts:,} distinct prompts, {dataset.name} has "
                f"{dataset.unique_prompts:,}: is it the right or a complete file?"
            )
    return report


def describe(report: Report, dataset: Dataset) -> list[str]:
    """Lines for the user: one verdict, then one line per problem."""
    if report.ok:
        counts = (
            ""
            if report.rows is None
            else (f": {report.rows:,} rows, {report.unique_prompts:,} distinct prompts")
        )
        return [f"ok  {dataset.name} {report.path}{counts}"]
    return [f"BAD {dataset.name} {report.path}"] + [f"    {p}" for p in report.problems]
