"""Checkpoint outputs: the converters' checks of a target (exists, parent, free space) and their
atomic, one-writer output directory (backend.shared.atomic_outputs' mechanism, ConversionError)."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.shared import atomic_outputs
from converters.errors import ConversionError

# headroom over the source size: metadata, manifest, serialisation overhead
SPACE_MARGIN = 1.05


def check_target(target: Path, force: bool) -> None:
    if target.exists() and not force:
        raise ConversionError(
            f"output {target} exists: pass --force to replace it or choose another path"
        )
    if not target.parent.is_dir():
        raise ConversionError(
            f"parent directory {target.parent} of the output does not exist: create it first"
        )


def check_free_space(target: Path, need_bytes: int) -> None:
    """Refuse before writing anything when the target's filesystem cannot hold the output."""
    free = shutil.disk_usage(target.parent).free
    need = int(need_bytes * SPACE_MARGIN)
    if free < need:
        raise ConversionError(
            f"not enough disk space at {target.parent}: {need / 1e9:.2f} GB needed, "
            f"{free / 1e9:.2f} GB free; free space or write the output elsewhere"
        )


@contextmanager
def atomic_dir(target: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success it replaces `target` (readers see the old
    checkpoint or the new one, never a half), on error it is removed; a second writer into
    the same place gets a ConversionError."""
    with atomic_outputs.atomic_dir(target, force, check=check_target, error=ConversionError) as tmp:
        yield tmp
