"""Load parameters on a worker thread, ahead of the caller that writes them."""

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
AHEAD_BYTES = 256 << 20


class ReadAhead:
    """`ra(name)` returns load(name) for names in their given order.

    Loads run in order on one worker thread (file reads and hashing release the GIL), up
    to `ahead_bytes` of values beyond the caller's (at least one). A parameter is small
    (one expert's weight: 3-6 MB): with a single one in flight, the reads and the hashing
    fed by them would wait whenever the caller's write waits for the disk.
    """

    def __init__(
        self,
        names: Iterable[str],
        load: Callable[[str], T],
        nbytes: Callable[[str], int],
        ahead_bytes: int = AHEAD_BYTES,
    ):
        self._names, self._load, self._nbytes, self._limit = iter(names), load, nbytes, ahead_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="readahead")
        self._queue: deque = deque()  # (name, bytes, future), in order
        self._ahead = 0
        self._fill()

    def _fill(self) -> None:
        while not self._queue or self._ahead < self._limit:
            name = next(self._names, None)
            if name is None:
                return
            size = self._nbytes(name)
            self._queue.append((name, size, self._pool.submit(self._load, name)))
            self._ahead += size

    def __call__(self, name: str) -> T:
        if not self._queue or self._queue[0][0] != name:
            raise AssertionError(
                f"read-ahead expected {self._queue and self._queue[0][0]}, got {name}"
            )
        _, size, future = self._queue.popleft()
        self._ahead -= size
        value = future.result()
        self._fill()
        return value

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
