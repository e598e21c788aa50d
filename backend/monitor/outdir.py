"""Write a directory of outputs atomically: build it beside the target, then rename it in."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.monitor.report import ReportError

MARKER = ".routing-balance-output"  # lets a later render replace only our own directories


def _check_replaceable(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ReportError(f"{out} is a file: pass a directory path for the output")
    if any(out.iterdir()) and not (out / MARKER).exists():
        raise ReportError(f"{out} is not empty and was not written by this tool: "
                          "pass a new or empty directory")
    if any(out.iterdir()) and not force:
        raise ReportError(f"{out} exists: pass --force to replace it or choose another directory")


@contextmanager
def atomic_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp directory to fill; on success it replaces `out` (readers never see a half);
    an existing output of ours only with `force`."""
    out = Path(out)
    _check_replaceable(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        (tmp / MARKER).write_text("")
        os.chmod(tmp, 0o755)
        old = tmp.with_name(tmp.name + ".old")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
