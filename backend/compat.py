"""Differences between the megatron-core releases we support (0.12.1 for MindSpeed, 0.16.1)."""

from functools import cache

from packaging.version import Version


@cache
def mcore_version() -> Version:
    import megatron.core

    return Version(megatron.core.__version__)


def check_plan_supported(tp: int, ep: int, etp: int) -> None:
    """Reject plans the installed megatron-core release computes wrongly or not at all."""
    if mcore_version() < Version("0.13") and tp > 1 and ep == 1 and etp == 1:
        # 0.12.1's expert linears then take the sequence-parallel reduce-scatter over TP
        raise ValueError(
            f"megatron-core {mcore_version()} cannot run tp={tp} with ep=1 and etp=1 "
            f"(its expert layers reduce-scatter over TP): set etp={tp} or ep >= 2"
        )
