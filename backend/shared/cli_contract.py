"""The exit contract every command-line tool of this repo keeps (converters, parallel,
backend.monitor, the launcher):

  0    success
  1    `verify` found differences (one line per difference on stdout)
  2    bad input or environment: ONE line on stderr, `error: <file or value>: <problem>; <fix>`
  3    a bug (unexpected exception): one line; `--debug` shows the traceback
  130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: one line, and nothing half-written
       is left (outputs are built in temp dirs that an interrupt removes)
  141  stdout was closed early (`... | head`): the output stops, no traceback

`--debug` re-raises instead, so the traceback is shown.
"""

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

OK, DIFFERENCES, USER_ERROR, BUG = 0, 1, 2, 3
BROKEN_PIPE = 128 + signal.SIGPIPE


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; a KeyboardInterrupt, so every cleanup path runs for both."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame) -> None:
    # a second signal must not interrupt the cleanup the first one started
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_line(err: BaseException) -> str:
    """`error: ...` in one line; an OSError names its file."""
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"error: {where}{err.strerror}: check the path, its permissions and the free space"
    return f"error: {_one_line(err)}"


def run_cli(
    body: Callable[[], int],
    *,
    debug: bool,
    user_errors: tuple[type[BaseException], ...],
    interrupted: str = "nothing half-written was left",
) -> int:
    """body()'s exit status under the contract above (signal handlers installed meanwhile)."""
    main_thread = threading.current_thread() is threading.main_thread()  # signals go to it only
    signals = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in signals}
    try:
        code = body()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"interrupted ({signal.Signals(signum).name}): {interrupted}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except (*user_errors, OSError) as err:
        if debug:
            raise
        print(error_line(err), file=sys.stderr)
        return USER_ERROR
    except Exception as err:
        if debug:
            raise
        print(
            f"error: internal error {type(err).__name__}: {_one_line(err)} (a bug: rerun with --debug "
            "and report the traceback)",
            file=sys.stderr,
        )
        return BUG
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _silence_stdout() -> None:
    """The reader is gone: later flushes (at exit too) must not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2, like every other bad input."""

    def error(self, message: str):
        self.exit(USER_ERROR, f"error: {self.prog}: {_one_line(message)}; see {self.prog} --help\n")


def parse_or_exit_code(parser: argparse.ArgumentParser, argv) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status argparse chose (--help: 0, misuse: 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else USER_ERROR
