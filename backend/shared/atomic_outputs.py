"""Outputs appear whole or not at all: written in a temp dir beside the target, renamed at the end.

One writer per output: `.NAME.lock` beside the target is held (flock) from the first check to
the rename, so a second writer into the same place is refused in one line. Temp dirs are
named `.NAME.tmp-<pid>-<random>`: a run killed without cleanup (SIGKILL, power loss) leaves
one, and the next run into the same place removes it once process <pid> is gone.

The mechanism only: each user passes its own check of the target and the error type its
command line reports (converters.atomic for checkpoints, backend.monitor.outdir for pages).
"""

import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove `.NAME.tmp-<pid>-*` / `.NAME.old-<pid>-*` beside target whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[0-9a-f]+$")
    removed = []
    for path in target.parent.iterdir():
        match = pattern.match(path.name)
        if match and int(match[2]) != os.getpid() and not _alive(int(match[2])):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(
                missing_ok=True
            )
            removed.append(path)
    return removed


@contextmanager
def output_lock(target: Path, error: type[Exception]) -> Iterator[None]:
    """Exclusive lock on writing `target`: a `.NAME.lock` file beside it, flock'ed, holding
    the owner's pid, removed on release. A second writer gets `error`."""
    lock = target.parent / f".{target.name}.lock"
    fd = _take_lock(lock, target, error)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        lock.unlink(missing_ok=True)  # before the unlock: a waiter then finds a fresh file
        os.close(fd)


def _take_lock(lock: Path, target: Path, error: type[Exception]) -> int:
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise error(
                f"{target} is being written by another process (pid {owner}, lock {lock}): "
                "wait for it to finish or choose another output"
            ) from None
        try:  # locked: but is it still the file at that path (not one its owner just removed)?
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _temp_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def atomic_dir(
    target: str | Path,
    force: bool = False,
    *,
    check: Callable[[Path, bool], None],
    error: type[Exception],
) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success it replaces `target`, on error it is removed.

    The rename is atomic on one filesystem, so a reader sees the old output or the new one,
    never a half-written one. Held under `output_lock` throughout; leftovers of killed
    runs into the same place are removed first. `check(target, force)` refuses a target
    before and again under the lock; `error` is what a second writer gets.
    """
    target = Path(target).absolute()
    check(target, force)
    with output_lock(target, error):
        check(target, force)  # again, now that no other writer can be between
        remove_stale_temps(target)
        with _swap_in(target) as tmp:
            yield tmp


@contextmanager
def _swap_in(target: Path) -> Iterator[Path]:
    tmp = _temp_name(target, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if target.exists():  # --force: move the old output aside first, drop it after the swap
            old = _temp_name(target, "old")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
