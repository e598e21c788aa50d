"""A large output file written front to back (a dist checkpoint's `.distcp`, an HF shard).

`open_output(path)` writes with O_DIRECT where the file system takes it (Linux ext4, xfs,
...): bytes are gathered in 32 MiB page-aligned stages (copied in without the GIL) that a
worker thread writes straight from user memory to the disk while the caller fills the
next stage. A conversion's bytes are read once and never again, so the page cache only
costs CPU: on 2 cores, writing through it took 0.3-0.5 CPU-s per GB (copy into the cache,
writeback), O_DIRECT 0.1, and that CPU is what the sha256 manifest needs. The last block
is padded to the disk's alignment and the file truncated to its length.

Where the file system refuses O_DIRECT, `BufferedOutput`: a 1 MiB buffer gathers only
small records and each finished 64 MiB is handed to the disk at once (`sync_file_range`),
so the disk works while the next tensors are produced and the final fsync waits for the
tail only.

Both are file objects for `write` / `tell` / `sync` (everything on disk) / `close`;
torch.save writes into them.
"""

import ctypes
import io
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backend.shared.integers import round_up

STAGE = 32 << 20  # bytes per O_DIRECT write
STAGES = 3  # one filling, up to two being written
GIL_FREE_COPY = 1 << 16
ALIGN = (
    4096  # O_DIRECT offset/length/address alignment (a page: enough for 512 B and 4 KiB sectors)
)
BUFFER = 1 << 20
WRITEBACK_STEP = 64 << 20
SYNC_FILE_RANGE_WRITE = 2


def open_output(path: str | Path) -> "DirectOutput | BufferedOutput":
    """The file at `path`, created or truncated; O_DIRECT where the file system allows it."""
    if hasattr(os, "O_DIRECT"):
        try:
            return DirectOutput(path)
        except OSError:  # EINVAL: the file system does not do O_DIRECT
            pass
    return BufferedOutput(path)


class DirectOutput(io.RawIOBase):
    def __init__(self, path: str | Path):
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        self._stages = [_aligned(STAGE) for _ in range(STAGES)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(1, STAGES):
            self._free.put(i)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="direct-write")  # in file order
        self._pending: list[Future] = []
        self._error: OSError | None = None  # the first failed write, raised to the caller
        self._stage, self._fill = 0, 0  # the stage being filled and its bytes
        self._stage_offset = 0  # where it goes in the file
        self._size = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data) -> int:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        n, done = len(src), 0
        while done < n:
            take = min(n - done, STAGE - self._fill)
            _copy(
                self._stages[self._stage][self._fill : self._fill + take], src[done : done + take]
            )
            self._fill += take
            done += take
            if self._fill == STAGE:
                self._submit(self._stage, self._stage_offset, STAGE)
                self._stage, self._fill = (
                    self._free.get(),
                    0,
                )  # waits while both others are in flight
                self._stage_offset += STAGE
        self._size += n
        return n

    def _submit(self, stage: int, offset: int, length: int, recycle: bool = True) -> None:
        self._check()
        self._pending = [f for f in self._pending if not f.done()] + [
            self._writer.submit(self._write_stage, stage, offset, length, recycle)
        ]

    def _write_stage(self, stage: int, offset: int, length: int, recycle: bool) -> None:
        view = memoryview(self._stages[stage])[:length]
        try:
            done = 0
            while done < length:
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as err:
            self._error = self._error or err
        finally:
            if recycle:
                self._free.put(stage)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def sync(self) -> None:
        """Everything written is on disk. The stage being filled is written padded to the
        alignment and kept: later writes go on filling it and rewrite its tail."""
        if self._fill:
            self._submit(
                self._stage, self._stage_offset, round_up(self._fill, ALIGN), recycle=False
            )
        for f in self._pending:
            f.result()
        self._pending = []
        self._check()
        os.ftruncate(self._fd, self._size)
        os.fsync(self._fd)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._writer.shutdown(wait=True)
            os.close(self._fd)
            self._stages = []
        finally:
            super().close()


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src; a large copy without the GIL (ctypes calls release it), so the reading
    and hashing threads run meanwhile."""
    if len(src) < GIL_FREE_COPY:
        dst[:] = src
    else:
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, len(src))


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None  # not Linux: the kernel's own writeback, and the fsync at the end
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_START_WRITEBACK = _sync_file_range()


class BufferedOutput(io.BufferedWriter):
    def __init__(self, path: str | Path):
        super().__init__(io.FileIO(path, "wb"), BUFFER)
        self._handed = 0  # bytes already given to the disk

    def write(self, data) -> int:
        n = super().write(data)
        if _START_WRITEBACK is not None and self.tell() - self._handed >= WRITEBACK_STEP:
            super().flush()
            end = self.tell()
            _START_WRITEBACK(self.fileno(), self._handed, end - self._handed, SYNC_FILE_RANGE_WRITE)
            self._handed = end
        return n

    def sync(self) -> None:
        """Everything written is on disk."""
        self.flush()
        os.fsync(self.fileno())
