"""Differences between the megatron-core releases we support (0.12.1 for MindSpeed, 0.16.1, 0.19.2)."""

from functools import cache

from packaging.version import Version


@cache
def mcore_version() -> Version:
    import megatron.core

    # 0.19 appends `+<git HEAD>` of whatever repository its files sit in (package_info.py)
    return Version(Version(megatron.core.__version__).public)


def check_plan_supported(tp: int, ep: int, etp: int) -> None:
    """Reject plans the installed megatron-core release computes wrongly or not at all."""
    if mcore_version() < Version("0.13") and tp > 1 and ep == 1 and etp == 1:
        # 0.12.1's expert linears then take the sequence-parallel reduce-scatter over TP
        raise ValueError(
            f"megatron-core {mcore_version()} cannot run tp={tp} with ep=1 and etp=1 "
            f"(its expert layers reduce-scatter over TP): set etp={tp} or ep >= 2"
        )


def async_save_kwargs() -> dict:
    """dist_checkpointing.save's keywords for megatron-core's own async writer.

    0.19 defaults `async_strategy` to "nvrx" (nvidia-resiliency-ext, a CUDA-only package);
    "mcore" is the forked writer that 0.12.1 and 0.16.1 always use (they have no keyword)."""
    return {"async_strategy": "mcore"} if mcore_version() >= Version("0.19") else {}
