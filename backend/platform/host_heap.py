"""Give the process's free heap memory back to the OS between an engine's phases (CPU runs).

glibc keeps freed blocks in its heaps for reuse. A CPU actor's passes free hundreds of MiB of
activations of varying shapes (packed micro-batches of a new length every step) among blocks
still in use, and glibc keeps the free ones: measured inside the side by side (mini, ep 2,
scripts/bench/launches/memory_breakdown.py), everything a rank of ours held beyond its
model, gradients and optimizer states between steps was free heap (429-473 MiB a rank,
281-293 MiB for verl's FSDP). `malloc_trim(0)` returns the free pages of every heap (glibc
>= 2.8 releases them inside the heap too, not only at its top), so the rank's RSS between
phases is what it uses; the next pass faults its pages in again. The engine trims after each
optimizer step and at each offload (the end of a phase), on device cpu only
(`mcore_ep.cpu_trim_heap`).

Holding glibc's mmap threshold instead (recipes.local.cpu_overrides.MANY_RANKS_ENV) returns
every large block at its free, which costs page faults on every allocation: an fp32 update
~45% slower. A trim at a phase's end pays them once a phase.
"""

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def trim_host_heap() -> bool:
    """Return free heap pages to the OS; False where the C library has no malloc_trim, or
    nothing was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
