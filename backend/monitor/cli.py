"""python -m backend.monitor render REPORT.json -o OUTDIR
python -m backend.monitor compare A.json [B.json] -o OUTDIR [--window early late]

Exit codes (backend.shared.cli_contract): 0 written, 2 bad input (one line naming the file and the
fix; --debug shows the traceback), 130/143 interrupted (no output left half-written)."""

import argparse
import os
import sys

from backend.monitor.compare import Side, Thresholds, compare
from backend.monitor.compare_render import render_compare
from backend.monitor.render import render
from backend.monitor.report import ReportError, load_report
from backend.shared.cli_contract import OneLineParser, parse_or_exit_code, run_cli


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m backend.monitor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def flags(p):
        p.add_argument(
            "-o", "--out", required=True, help="output directory (replaced only with --force)"
        )
        p.add_argument(
            "--force", action="store_true", help="replace an earlier output of this tool"
        )
        p.add_argument("--debug", action="store_true", help="tracebacks for errors")

    rend = sub.add_parser("render", help="HTML page with plots of one report")
    rend.add_argument("report", help="moe_report.json written by the monitor")
    flags(rend)
    rend.add_argument(
        "--phase", action="append", help="phase(s) to show (default: all with tokens)"
    )
    comp = sub.add_parser("compare", help="routing changes between two reports or two windows")
    comp.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="one report (with --window A B) or two (A then B)",
    )
    flags(comp)
    comp.add_argument(
        "--window",
        nargs=2,
        metavar=("A", "B"),
        default=("all", "all"),
        help="early | late | all | window index, for A and B (default: all all)",
    )
    comp.add_argument("--phase", default="update")
    comp.add_argument("--ep", type=int, help="evaluate EP-rank metrics of both at this EP degree")
    comp.add_argument("--jsd-threshold", type=float, default=Thresholds.jsd_bits)
    comp.add_argument("--share-threshold", type=float, default=Thresholds.top_share)
    return parser


def _sides(args) -> tuple[Side, Side]:
    if len(args.reports) > 2:
        raise ReportError(f"compare takes one or two reports, got {len(args.reports)}")
    if len(args.reports) == 1 and tuple(args.window) == ("all", "all"):
        raise ReportError("one report given: pass a second report, or --window early late")
    reports = [load_report(p) for p in args.reports]
    ra, rb = reports[0], reports[-1]
    sides = []
    for report, which in ((ra, args.window[0]), (rb, args.window[1])):
        span, counts = report.window(args.phase, which)
        name = report.label if len(reports) == 2 else ""
        label = f"{name} {span}".strip() if which != "all" else report.label
        agreement = report.agreement_L(*_span(report, args.phase, which))
        sides.append(Side(label, counts, args.ep or report.ep, agreement))
    if len(reports) == 1 and sides[0].label == sides[1].label:
        raise ReportError(
            f"--window {' '.join(args.window)} both select {sides[0].label} of "
            f"{ra.path}: it needs at least two windows (lower window_steps)"
        )
    return sides[0], sides[1]


def _span(report, phase: str, which: str) -> tuple[int | None, int | None]:
    """The steps a window covers (None, None: all)."""
    if which == "all":
        return None, None
    span, _ = report.window(phase, which)
    first, last = span.removeprefix("steps ").split("-")
    return int(first), int(last)


def _run(args) -> int:
    if args.command == "render":
        out = render(load_report(args.report), args.out, args.phase, force=args.force)
        print(f"wrote {out}/index.html")
        return 0
    a, b = _sides(args)
    result = compare(a, b, Thresholds(args.jsd_threshold, args.share_threshold))
    out = render_compare(result, a, b, args.out, force=args.force)
    print("\n".join([result["summary"], *result["sentences"], f"wrote {out}/index.html"]))
    if len(args.reports) == 2 and os.path.realpath(args.reports[0]) == os.path.realpath(
        args.reports[1]
    ):
        print(
            f"warning: {args.reports[0]} and {args.reports[1]} are the same file: "
            "this compared the run with itself",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit_code(_parser(), argv)
    if isinstance(args, int):
        return args
    return run_cli(
        lambda: _run(args),
        debug=args.debug,
        user_errors=(ReportError, ValueError),
        interrupted="no output was written",
    )
