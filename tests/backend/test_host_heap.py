"""trim_host_heap returns freed heap memory to the OS."""

import torch

from backend.instruments.memory_probe import malloc_heap_mib, read_rss
from backend.platform.host_heap import trim_host_heap


def test_freed_tensors_kept_in_the_heap_leave_the_rss_after_a_trim():
    """Bug caught: a trim that releases nothing (only the heap's top, or the wrong call): the
    holes between live blocks, what a pass's freed activations leave, stay resident."""
    # 32 KB each: heap blocks (below glibc's mmap threshold), larger than a page, as
    # activations are; a 4 KB hole holds no whole page to give back
    blocks = [torch.ones(8000) for _ in range(6_000)]
    free_before = malloc_heap_mib()["heap_free_mib"]
    del blocks[::2]  # ~90 MiB of holes between the live half
    retained = malloc_heap_mib()["heap_free_mib"] - free_before  # these holes, resident
    before = read_rss()["rss_mib"]
    assert retained > 50
    assert trim_host_heap() is True
    assert before - read_rss()["rss_mib"] > 0.5 * retained
    assert sum(b.sum().item() for b in blocks[:10]) == 80_000  # the live ones are untouched
