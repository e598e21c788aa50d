"""A large output file written front to back (a dist checkpoint's `.distcp`, an HF shard).

Two costs of a plain buffered file are avoided:
- a big buffer copies every tensor once more in user space before the kernel copies it
  again; with a 1 MiB buffer only small records (zip headers, norms) are gathered and
  anything bigger goes straight to the kernel;
- the kernel starts writing dirty pages only once a tenth of RAM is dirty, so a
  checkpoint smaller than that reaches the disk during the final fsync, after all the
  work. Here each finished 64 MiB stretch is handed to the disk at once
  (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, Linux: starts writeback, does not wait), so
  the disk works while the next tensors are produced and `sync()` waits for the tail only.
"""

import ctypes
import io
import os
from pathlib import Path

BUFFER = 1 << 20
WRITEBACK_STEP = 64 << 20
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None  # not Linux: the kernel's own writeback, and the fsync at the end
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


_START_WRITEBACK = _sync_file_range()


class OutputFile(io.BufferedWriter):
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
