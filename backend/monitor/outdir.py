"""Write a directory of outputs atomically, one writer at a time: backend.shared.atomic_outputs'
mechanism (built in `.NAME.tmp-<pid>-*` beside the target, renamed in under the `.NAME.lock`
flock; leftovers of killed runs are removed by the next run once their process is gone)."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.monitor.report import ReportError
from backend.shared import atomic_outputs

MARKER = ".routing-balance-output"  # lets a later render replace only our own directories


def _check_replaceable(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ReportError(f"{out} is a file: pass a directory path for the output")
    if any(out.iterdir()) and not (out / MARKER).exists():
        raise ReportError(
            f"{out} is not empty and was not written by this tool: pass a new or empty directory"
        )
    if any(out.iterdir()) and not force:
        raise ReportError(f"{out} exists: pass --force to replace it or choose another directory")


@contextmanager
def atomic_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp directory to fill; on success it replaces `out` (readers never see a half);
    an existing output of ours only with `force`; a second writer into `out` is refused."""
    out = Path(out)

    def check(_absolute: Path, force: bool) -> None:  # before and under the lock
        _check_replaceable(out, force)  # messages name the path as given

    out.parent.mkdir(parents=True, exist_ok=True)  # the lock file lives there
    with atomic_outputs.atomic_dir(out, force, check=check, error=ReportError) as tmp:
        yield tmp
        (tmp / MARKER).write_text("")
        os.chmod(tmp, 0o755)
