"""python -m parallel: check a parallel plan for Qwen3-MoE, or pick one with --auto.

Prints the plan, the rank layout, the per-device memory, notes and warnings. Exit codes
(backend.shared.cli_contract): 0 the plan fits, 1 it is legal but does NOT fit the device memory,
2 the plan or the model config is illegal (one line naming the reason), 130/143 interrupted.
"""

import argparse
from dataclasses import replace

from backend.model.families import ConfigError
from backend.model.recompute import RECOMPUTE_CHOICES
from backend.monitor.report import ReportError
from backend.shared.cli_contract import OneLineParser, parse_or_exit_code, run_cli
from backend.shared.names import DEFAULT_EP_SKEW, DEVICE_LABELS
from parallel.advice import expert_notes, listed, plan_warnings
from parallel.auto import Candidate, rank_plans
from parallel.memory import (
    DEVICE_MEMORY_GIB,
    MemoryOptions,
    estimate_memory,
    format_memory,
    least_recompute,
)
from parallel.models import DEFAULT_MODEL_NAME, load_spec
from parallel.plan import PlanError, plan_for_model
from parallel.rank_layout import RankLayout
from parallel.report import layout_summary, model_summary, plan_summary
from parallel.skew import (
    REPORT_PERCENTILE,
    SkewAssumption,
    default_skew,
    skew_from_report,
    skew_lines,
)

DIMS = ("tp", "pp", "vpp", "cp", "ep", "etp")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m parallel", description=__doc__.splitlines()[0])
    for dim in DIMS:
        p.add_argument(
            f"--{dim}",
            type=int,
            default=None,
            help=f"{dim} size (default 1, or searched with --auto)",
        )
    p.add_argument("--first-stage-layers", type=int, default=None)
    p.add_argument("--last-stage-layers", type=int, default=None)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument(
        "--device",
        choices=("npu", "cuda", "cpu"),
        default="npu",
        help="npu: Ascend A2 (64 GiB), cuda: H100 (80 GiB)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="device memory in GiB (overrides the device default)",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"HF config.json or checkpoint dir (default: {DEFAULT_MODEL_NAME})",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=8192,
        help="tokens in one micro-batch of one data-parallel replica",
    )
    p.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="auto",
        choices=("auto", *RECOMPUTE_CHOICES),
        help="activation recompute: none, selective (core attention and the experts' SwiGLU), "
        "full (one layer per checkpoint); auto (default): the least that fits. "
        "--recompute alone is full",
    )
    p.add_argument(
        "--offload-params",
        action="store_true",
        help="params to host, grad buffers released between updates",
    )
    p.add_argument(
        "--offload-optimizer", action="store_true", help="optimizer state to host between updates"
    )
    skew = p.add_mutually_exclusive_group()
    skew.add_argument(
        "--ep-skew",
        type=float,
        default=None,
        help=f"tokens on the busiest EP rank / the mean (default {DEFAULT_EP_SKEW:g})",
    )
    skew.add_argument(
        "--skew-from",
        metavar="REPORT",
        help=f"routing report JSON of an earlier run: p{REPORT_PERCENTILE} of its "
        "per-layer ep_max_over_mean",
    )
    p.add_argument(
        "--auto",
        action="store_true",
        help="search the legal plans (pinning any dimension given) and pick one",
    )
    p.add_argument("--top", type=int, default=5, help="ranked plans shown with --auto")
    p.add_argument(
        "--packed-length-step",
        type=int,
        default=None,
        help="packed micro-batch totals rounded up to this many tokens (default: 512 on npu, "
        "off elsewhere): the padding it costs on a DAPO-like mix is printed",
    )
    p.add_argument("--debug", action="store_true", help="tracebacks for errors")
    return p


def _skew(args: argparse.Namespace) -> SkewAssumption:
    if args.skew_from:  # at the given plan's ep too (--auto searches ep: the run's alone)
        return skew_from_report(args.skew_from, ep=None if args.auto else args.ep)
    if args.ep_skew is not None:
        if not args.ep_skew >= 1:
            raise PlanError(f"--ep-skew={args.ep_skew} must be >= 1 (1: balanced routing)")
        return SkewAssumption(args.ep_skew, "--ep-skew")
    return default_skew()


def _memory_options(args: argparse.Namespace, skew: SkewAssumption) -> MemoryOptions:
    if args.micro_batch_tokens < 1:
        raise PlanError(f"--micro-batch-tokens={args.micro_batch_tokens} must be positive")
    memory = args.device_memory_gb or DEVICE_MEMORY_GIB.get(args.device)
    return MemoryOptions(
        ep_skew=skew.value,
        device_memory_gib=memory,
        micro_batch_tokens=args.micro_batch_tokens,
        recompute="none" if args.recompute == "auto" else args.recompute,
        offload_params=args.offload_params,
        offload_optimizer=args.offload_optimizer,
    )


def _device_label(args: argparse.Namespace, options: MemoryOptions) -> str:
    memory = f", {options.device_memory_gib:g} GiB" if options.device_memory_gib else ""
    return f"{DEVICE_LABELS[args.device]}{memory}"


def _given_fit(args: argparse.Namespace, spec):
    dims = {d: getattr(args, d) for d in DIMS if getattr(args, d) is not None}
    return plan_for_model(
        spec,
        args.nodes,
        args.devices_per_node,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        **dims,
    )


def _auto_pick(args, spec, options) -> Candidate:
    fixed = {d: getattr(args, d) for d in DIMS}
    ranked = rank_plans(
        spec, args.nodes, args.devices_per_node, options, fixed, args.recompute == "auto"
    )
    print(
        f"auto: {len(ranked)} legal plans; best {min(args.top, len(ranked))} "
        "(fits, inter-node tp/ep/etp/cp spans, pp, tp*cp, peak):"
    )
    for c in ranked[: args.top]:
        use = c.memory.utilization
        peak = f"{use:.0%}" if use is not None else f"{c.memory.update_bytes / 2**30:.1f} GiB"
        print(
            f"  {'fits' if c.memory.fits else 'over'} {c.fit.plan.describe()}  "
            f"spans={c.cross_node} peak={peak}"
        )
    print()
    return ranked[0]


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.model)
    skew = _skew(args)
    options = _memory_options(args, skew)
    if args.auto:
        pick = _auto_pick(args, spec, options)
        fit, layout, memory = pick.fit, pick.layout, pick.memory
    else:
        fit = _given_fit(args, spec)
        layout = RankLayout(fit.plan)
        memory = estimate_memory(fit, options)
    if args.recompute == "auto":
        choice = least_recompute(fit, options)
        memory, options = choice.estimate, replace(options, recompute=choice.mode)
        recompute_line = choice.line()
    else:
        recompute_line = f"recompute: {options.recompute} (--recompute {options.recompute})"
    print(model_summary(args.model or DEFAULT_MODEL_NAME, fit))
    print(plan_summary(fit, _device_label(args, options)))
    print(layout_summary(layout))
    print(format_memory(memory, fit.plan.pp))
    print(recompute_line)
    print("\n".join(skew_lines(fit, options, skew)))
    print("\n".join(listed("notes", expert_notes(fit, options.micro_batch_tokens))))
    warnings = plan_warnings(fit, layout, memory, options.micro_batch_tokens, options.recompute)
    print("\n".join(listed("warnings", warnings)))
    print("\n".join(_traffic_lines(args, fit)))
    return 0 if memory.fits else DOES_NOT_FIT


def _traffic_lines(args: argparse.Namespace, fit) -> list[str]:
    """The packed-length ladder's padding; on accelerators one weight sync and a save."""
    from backend.model.packing import ladder_step
    from parallel.ladder import ladder_cost
    from parallel.traffic import save_size
    from parallel.weight_sync import DEFAULT_BUCKET_MB, LINKS, sync_cost

    step = ladder_step(args.device, args.packed_length_step)
    budget, rows = args.micro_batch_tokens, 512
    lines = [ladder_cost(step, budget, fit.plan.tp, rows).line(args.device, budget, rows)]
    if args.device in LINKS:
        bucket, links = DEFAULT_BUCKET_MB << 20, LINKS[args.device]
        lines += sync_cost(fit.spec, fit.plan, bucket, links).lines(links, bucket)
        lines += save_size(fit.spec, fit.plan.world).lines(50)
    return lines


DOES_NOT_FIT = 1  # a finding, like verify's differences: the plan is legal, the memory too small


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (module docstring)."""
    args = parse_or_exit_code(build_parser(), argv)
    if isinstance(args, int):
        return args
    return run_cli(
        lambda: run(args),
        debug=args.debug,
        user_errors=(PlanError, ConfigError, ReportError),
        interrupted="nothing was written",
    )
