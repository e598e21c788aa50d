"""The Shim record: one named patch of megatron-core, why it exists, where it applies."""

from collections.abc import Callable
from dataclasses import dataclass

# the megatron-core releases the project tests (0.12.1 under MindSpeed, 0.16.1 elsewhere, and
# the newest, 0.19.2: its mcore_compat tests)
TESTED_RELEASES = ("0.12.1", "0.16.1", "0.19.2")


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    devices: tuple[str, ...]
    # the tested megatron-core releases whose code needs it (read in their sources); on the
    # others the patch is a no-op or patches what they never call
    releases: tuple[str, ...]
    patch: Callable[[], None]
