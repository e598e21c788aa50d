"""python -m backend.monitor render REPORT.json -o OUTDIR
python -m backend.monitor compare A.json [B.json] -o OUTDIR [--window early late]"""

import argparse
import sys

from backend.monitor.compare import Side, Thresholds, compare
from backend.monitor.compare_render import render_compare
from backend.monitor.render import render
from backend.monitor.report import ReportError, load_report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.monitor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rend = sub.add_parser("render", help="HTML page with plots of one report")
    rend.add_argument("report")
    rend.add_argument("-o", "--out", required=True)
    rend.add_argument("--phase", action="append", help="phase(s) to show (default: all with tokens)")
    comp = sub.add_parser("compare", help="routing changes between two reports or two windows")
    comp.add_argument("reports", nargs="+", metavar="REPORT")
    comp.add_argument("-o", "--out", required=True)
    comp.add_argument("--window", nargs=2, metavar=("A", "B"), default=("all", "all"),
                      help="early | late | all | window index, for A and B (default: all all)")
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
        sides.append(Side(label, counts, args.ep or report.ep))
    if len(reports) == 1 and sides[0].label == sides[1].label:
        raise ReportError(f"--window {' '.join(args.window)} both select {sides[0].label} of "
                          f"{ra.path}: it needs at least two windows (lower window_steps)")
    return sides[0], sides[1]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "render":
            out = render(load_report(args.report), args.out, args.phase)
            print(f"wrote {out}/index.html")
            return 0
        a, b = _sides(args)
        result = compare(a, b, Thresholds(args.jsd_threshold, args.share_threshold))
        out = render_compare(result, a, b, args.out)
        print("\n".join([result["summary"], *result["sentences"], f"wrote {out}/index.html"]))
        return 0
    except (ReportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
