"""Check the DAPO datasets before a run: DAPO-Math-17k (train) and AIME-2024 (validation).

    .venv/bin/python -m scripts.prepare_data --data-dir ~/data/dapo
    .venv/bin/python -m scripts.prepare_data --train-file A.parquet --val-file B.parquet

Checks the columns verl's DAPO recipe reads and the number of distinct prompts, and prints
one line per problem with the fix (for a missing file: the download command). Exit status:
0 when both files are fine, 1 otherwise. Nothing is downloaded or changed.
"""

import argparse
from pathlib import Path

from recipes.launcher.datasets import TRAIN, VAL, check_file, describe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path("~/data/dapo"),
        help=f"directory holding {TRAIN.filename} and {VAL.filename}",
    )
    p.add_argument("--train-file", type=Path, help=f"default: DATA_DIR/{TRAIN.filename}")
    p.add_argument("--val-file", type=Path, help=f"default: DATA_DIR/{VAL.filename}")
    p.add_argument("--schema-only", action="store_true", help="skip counting prompts")
    args = p.parse_args(argv)
    data_dir = args.data_dir.expanduser()
    ok = True
    for path, dataset in (
        (args.train_file or data_dir / TRAIN.filename, TRAIN),
        (args.val_file or data_dir / VAL.filename, VAL),
    ):
        report = check_file(path.expanduser(), dataset, counts=not args.schema_only)
        print("\n".join(describe(report, dataset)))
        ok &= report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
