"""`python -m converters <verb>`: hf-to-mcore, mcore-to-hf, verify.

Bad input is one line on stderr and exit code 2 (--debug shows the traceback);
verify exits 1 when the checkpoints differ.
"""

import argparse
import os
import re
import sys
import warnings

import torch

from converters.errors import USER_ERRORS

SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    match = SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 4GB, 500MB")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[match[2].upper()]
    return int(float(match[1]) * scale)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m converters", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    def common(p):
        p.add_argument("--force", action="store_true", help="replace an existing output")
        p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast (default: keep the source dtype)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--debug", action="store_true", help="tracebacks for input errors")

    h2m = verbs.add_parser("hf-to-mcore", help="HF safetensors dir -> megatron-core torch_dist checkpoint")
    h2m.add_argument("hf_dir")
    h2m.add_argument("out")
    h2m.add_argument("--target-config", help="config.json the training run uses; must match the checkpoint")
    for name in ("tp", "ep", "pp", "etp"):
        h2m.add_argument(f"--{name}", type=int, default=1, help="check the output suits this plan")
    common(h2m)

    m2h = verbs.add_parser("mcore-to-hf", help="torch_dist checkpoint (or verl global_step_N/actor) -> HF dir")
    m2h.add_argument("ckpt")
    m2h.add_argument("out")
    m2h.add_argument("--template", required=True, help="HF dir of the model: config, tokenizer files are copied")
    m2h.add_argument("--config", help="config.json of the checkpoint (default: the template's)")
    m2h.add_argument("--max-shard-size", type=parse_size, default=parse_size("4GB"))
    common(m2h)

    ver = verbs.add_parser("verify", help="compare two checkpoints, or check one against its manifest")
    ver.add_argument("a")
    ver.add_argument("b", nargs="?")
    ver.add_argument("--atol", type=float, help="tolerance (default: bit-exact)")
    ver.add_argument("--config", help="config.json for dist checkpoints without one")
    ver.add_argument("--debug", action="store_true")
    return parser


def _run(args) -> int:
    from converters import convert, verify

    progress = not getattr(args, "no_progress", True)
    if args.verb == "hf-to-mcore":
        plan = (args.tp, args.ep, args.pp, args.etp)
        out = convert.convert_hf_to_mcore(args.hf_dir, args.out, target_config=args.target_config,
                                          plans=[plan], dtype=args.dtype, force=args.force, progress=progress)
    elif args.verb == "mcore-to-hf":
        out = convert.convert_mcore_to_hf(args.ckpt, args.out, template=args.template, config=args.config,
                                          dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                          force=args.force, progress=progress)
    else:
        if args.b is None:
            n, bad = verify.check_manifest(args.a, config=args.config)
            print(f"verify: {n} tensors checked against the manifest, {bad} mismatches")
        else:
            n, bad = verify.compare(args.a, args.b, atol=args.atol, config=args.config)
            print(f"verify: {n} tensors compared, {bad} mismatches")
        return 1 if bad else 0
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        if not args.debug:  # megatron's import-time notices (no Apex/TE) are noise here
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
        # the work is copies and disk I/O: OpenMP workers would only spin against the sha256
        # threads (measured: bf16 copy_ 0.3 GB/s with 2 threads on 2 busy cores, 10 with 1)
        torch.set_num_threads(1)
        try:
            return _run(args)
        except USER_ERRORS as err:
            if args.debug:
                raise
            print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted: no output was written", file=sys.stderr)
            return 130
        finally:
            torch.set_num_threads(threads)


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown (every output is closed and
    fsynced by now; only the final garbage collection and destructors are skipped)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
