"""A launcher command line as the RunSpec it makes (recipes.launcher.run_spec), for tests that
resolve a run without launching it."""

from recipes.launcher.arguments import build_parser, split_argv
from recipes.launcher.run_spec import RunSpec, from_args


def spec_of(argv: list[str]) -> RunSpec:
    """argv parsed and checked as the launcher does (argparse's errors raise SystemExit)."""
    own, extra = split_argv(list(argv))
    return from_args(build_parser().parse_args(own), extra)
