"""`python -m converters <verb>`: hf-to-mcore, mcore-to-hf, verify, manifest.

Exit codes (backend.shared.cli_contract): 0 done, 1 verify found differences, 2 bad input (one line
on stderr naming the file and the fix; --debug shows the traceback), 130 / 143 interrupted
by SIGINT / SIGTERM (no output left behind).
"""

import argparse
import os
import re
import sys
import warnings

import torch

from backend.shared.cli_contract import BROKEN_PIPE, OneLineParser, parse_or_exit_code, run_cli
from converters.errors import USER_ERRORS

SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    match = SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 4GB, 500MB")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[match[2].upper()]
    return int(float(match[1]) * scale)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m converters", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    def flags(p, output: bool = True):
        if output:
            p.add_argument(
                "--force", action="store_true", help="replace an existing output (the only way to)"
            )
            p.add_argument(
                "--dtype",
                choices=("bf16", "fp16", "fp32"),
                help="cast (default: keep the source dtype)",
            )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--debug", action="store_true", help="tracebacks for input errors")

    out_help = "output directory (must not exist unless --force; written atomically)"
    h2m = verbs.add_parser(
        "hf-to-mcore", help="HF safetensors dir -> megatron-core torch_dist checkpoint"
    )
    h2m.add_argument("hf_dir", help="HF checkpoint dir (config.json + safetensors)")
    h2m.add_argument("out", help=out_help)
    h2m.add_argument(
        "--target-config", help="config.json the training run uses; must match the checkpoint"
    )
    for name in ("tp", "ep", "pp", "etp"):
        h2m.add_argument(
            f"--{name}", type=positive_int, default=1, help="check the output suits this plan"
        )
    flags(h2m)

    m2h = verbs.add_parser(
        "mcore-to-hf", help="torch_dist checkpoint (or verl global_step_N/actor) -> HF dir"
    )
    m2h.add_argument(
        "ckpt",
        help="dist checkpoint dir, or verl's global_step_N/actor, global_step_N, checkpoint dir",
    )
    m2h.add_argument("out", help=out_help)
    m2h.add_argument(
        "--template", required=True, help="HF dir of the model: config, tokenizer files are copied"
    )
    m2h.add_argument("--config", help="config.json of the checkpoint (default: the template's)")
    m2h.add_argument("--max-shard-size", type=parse_size, default=parse_size("4GB"))
    m2h.add_argument(
        "--no-manifest-check",
        action="store_true",
        help="read a checkpoint that has no manifest.json (its bytes are then not checked)",
    )
    flags(m2h)

    ver = verbs.add_parser(
        "verify", help="compare two checkpoints, or check one against its manifest"
    )
    ver.add_argument("a", help="HF dir or dist checkpoint")
    ver.add_argument(
        "b", nargs="?", help="the other checkpoint (default: check A against its manifest.json)"
    )
    ver.add_argument("--atol", type=float, help="tolerance (default: bit-exact)")
    ver.add_argument("--config", help="config.json for dist checkpoints without one")
    flags(ver, output=False)

    man = verbs.add_parser(
        "manifest", help="write manifest.json (sha256 of every file) for a checkpoint dir"
    )
    man.add_argument(
        "ckpt", help="a checkpoint directory you trust (e.g. a training save without one)"
    )
    man.add_argument("--force", action="store_true", help="replace its existing manifest.json")
    flags(man, output=False)
    return parser


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _run(args) -> int:
    from converters import convert, verify

    # a bar only on a terminal: in a log or a pipe it would break the one-line error contract
    progress = not getattr(args, "no_progress", True) and sys.stderr.isatty()
    if args.verb == "hf-to-mcore":
        plan = (args.tp, args.ep, args.pp, args.etp)
        out = convert.convert_hf_to_mcore(
            args.hf_dir,
            args.out,
            target_config=args.target_config,
            plans=[plan],
            dtype=args.dtype,
            force=args.force,
            progress=progress,
        )
    elif args.verb == "mcore-to-hf":
        out = convert.convert_mcore_to_hf(
            args.ckpt,
            args.out,
            template=args.template,
            config=args.config,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            force=args.force,
            progress=progress,
            check_manifest=not args.no_manifest_check,
        )
    elif args.verb == "manifest":
        out = verify.write_trusted_manifest(args.ckpt, force=args.force)
    else:
        return _verify(args, verify)
    print(f"wrote {out}")
    return 0


def _verify(args, verify) -> int:
    if args.b is None:
        n, bad = verify.check_manifest(args.a, config=args.config)
        print(f"verify: {n} tensors and files checked against the manifest, {bad} mismatches")
    else:
        if os.path.realpath(args.a) == os.path.realpath(args.b):
            print(
                f"warning: {args.a} and {args.b} are the same checkpoint: this compares it with itself",
                file=sys.stderr,
            )
        n, bad = verify.compare(args.a, args.b, atol=args.atol, config=args.config)
        print(f"verify: {n} tensors compared, {bad} mismatches")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit_code(_parser(), argv)
    if isinstance(args, int):
        return args
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        if not args.debug:  # megatron's import-time notices (no Apex/TE) are noise here
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
        # the work is copies and disk I/O: OpenMP workers would only spin against the sha256
        # threads (converters/README.md, "Streaming", has the measured copy rates)
        torch.set_num_threads(1)
        try:
            return run_cli(
                lambda: _run(args),
                debug=args.debug,
                user_errors=USER_ERRORS,
                interrupted="no output was written",
            )
        finally:
            torch.set_num_threads(threads)


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown (every output is closed and
    fsynced by now; only the final garbage collection and destructors are skipped)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader left (`| head`): nothing to tell it
            code = code or BROKEN_PIPE
    os._exit(code)
