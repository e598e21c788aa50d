"""Load the next parameter on a worker thread while the caller writes the current one."""

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ReadAhead:
    """`ra(name)` returns load(name) for names in their given order; the following one is
    already loading (file reads release the GIL), so reads overlap writes. At most two
    loaded values exist at a time: the caller's and the one in flight."""

    def __init__(self, names: Iterable[str], load: Callable[[str], T]):
        self._names, self._load = iter(names), load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="readahead")
        self._next = None
        self._schedule()

    def _schedule(self) -> None:
        name = next(self._names, None)
        self._next = None if name is None else (name, self._pool.submit(self._load, name))

    def __call__(self, name: str) -> T:
        if self._next is None or self._next[0] != name:
            raise AssertionError(f"read-ahead expected {self._next and self._next[0]}, got {name}")
        value = self._next[1].result()
        self._schedule()
        return value

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
