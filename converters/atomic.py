"""Outputs appear whole or not at all: written in a temp dir beside the target, renamed at the end."""

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from converters.errors import ConversionError

# headroom over the source size: metadata, manifest, serialisation overhead
SPACE_MARGIN = 1.05


def check_target(target: Path, force: bool) -> None:
    if target.exists() and not force:
        raise ConversionError(f"output {target} exists: pass --force to replace it or choose another path")
    if not target.parent.is_dir():
        raise ConversionError(f"parent directory {target.parent} of the output does not exist: create it first")


def check_free_space(target: Path, need_bytes: int) -> None:
    """Refuse before writing anything when the target's filesystem cannot hold the output."""
    free = shutil.disk_usage(target.parent).free
    need = int(need_bytes * SPACE_MARGIN)
    if free < need:
        raise ConversionError(
            f"not enough disk space at {target.parent}: {need / 1e9:.2f} GB needed, "
            f"{free / 1e9:.2f} GB free; free space or write the output elsewhere"
        )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(target: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success it replaces `target`, on error it is removed.

    The rename is atomic on one filesystem, so a reader sees the old output or the new one,
    never a half-written checkpoint (a crash can leave only a `.<name>.tmp-*` dir behind).
    """
    target = Path(target).absolute()
    check_target(target, force)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if target.exists():  # --force: move the old output aside first, drop it after the swap
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
