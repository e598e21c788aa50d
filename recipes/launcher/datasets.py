"""The DAPO datasets: what verl's DAPO recipe reads from them, and checks that say what is wrong.

Files (as the DAPO recipe's prepare_dapo_data.sh fetches them):
  dapo-math-17k.parquet  BytedTsinghua-SIA/DAPO-Math-17k   training prompts
  aime-2024.parquet      BytedTsinghua-SIA/AIME-2024       validation (its card says each of
                         the 30 problems is repeated 32 times, for best-of-32 metrics)
Columns verl reads: prompt (chat messages: list of {role, content}), data_source (selects the
scorer: math_dapo for these), reward_model.ground_truth, ability, extra_info. Expected unique
prompts: 17,917 and 30 (the released datasets' figures; the files may repeat rows, so prompts
are counted, not rows).

Every data_source must have a scorer in the reward verl will run (`scorer_problems`): verl's
reward manager scores with the custom_reward_function when one is configured, else with
`get_default_compute_score(<manager>)` (verl/trainer/ppo/reward.py, load_reward_manager),
which dispatches on data_source and raises at the first reward, after the cluster started,
for one it does not know.
"""

import contextlib
import io
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
DAPO_MANAGER = "dapo"  # reward.reward_manager.name of the recipe (recipes.dapo.job.overrides)


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


def default_scorer(manager: str = DAPO_MANAGER):
    """The scoring function verl's reward manager `manager` uses without a custom function."""
    from verl.utils.reward_score import get_default_compute_score

    return get_default_compute_score(manager)


class _Probed(Exception):
    pass


class _Untouchable:
    """A response and a ground truth that stop a scorer at their first use: nothing is scored."""

    def _stop(self, *args, **kwargs):
        raise _Probed

    __getattr__ = __getitem__ = __len__ = __iter__ = __contains__ = __bool__ = _stop
    __str__ = __repr__ = __format__ = __eq__ = __hash__ = __add__ = __radd__ = _stop


def has_scorer(compute_score, data_source) -> bool:
    """Whether `compute_score` (verl's dispatch on data_source) hands `data_source` to a scorer:
    called with inputs that stop that scorer at once, its answer is whether whatever it raised
    came from deeper than its own frame (verl raises NotImplementedError there for a source it
    does not know)."""
    probe = _Untouchable()
    try:  # a scorer that catches the stop may print it: not for the user's console
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            compute_score(data_source, probe, probe, extra_info=None)
    except Exception as err:
        frames, tb = 0, err.__traceback__
        while tb is not None:
            frames, tb = frames + 1, tb.tb_next
        return frames > 2  # this frame, the dispatch's own, then the scorer's (or an import)
    return True


def scorer_problems(path: Path, compute_score) -> list[str]:
    """data_source values `compute_score` cannot grade (None: a custom reward function, which
    scores every one)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if compute_score is None:
        return []
    sources = pc.unique(pq.read_table(path, columns=["data_source"]).column(0)).to_pylist()
    bad = [s for s in sources if not has_scorer(compute_score, s)]
    name = getattr(compute_score, "__name__", "reward function")
    return (
        [
            f"data_source {bad[0]!r} ({len(bad)} of {len(sources)} distinct values) has no "
            f"scorer in verl's {name} (verl.utils.reward_score): use a "
            "data_source it scores (math_dapo for DAPO-Math, aime* for AIME) or set "
            "reward.custom_reward_function"
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


def check_file(path: str | Path, dataset: Dataset, counts: bool = True, scorer="default") -> Report:
    """Schema and scorers (always) and unique-prompt count (when `counts`) of one parquet file.
    scorer: the reward's scoring function ("default": verl's for the dapo manager; None: a
    custom reward function, which scores every data_source)."""
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
    if report.ok:
        scorer = default_scorer() if scorer == "default" else scorer
        report.problems += scorer_problems(report.path, scorer)
    if counts and report.ok:
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
