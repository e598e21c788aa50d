"""Is this environment the target's package set? Checked by the launcher before Ray starts.

The expected versions are those of scripts/stacks/<target>.lock (PyPI packages) and
scripts/stacks/npu-git.txt (MindSpeed, vllm, vllm-ascend from git). A mismatch raises
LaunchError with one line naming the component and the fix; the launcher exits 2 on it.
Local version labels are ignored (torch 2.7.1+cpu is torch 2.7.1; vllm 0.11.0+empty is 0.11.0).
"""

import os
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from recipes.dapo.cluster import LaunchError

STACKS = Path(__file__).resolve().parents[2] / "scripts" / "stacks"
# checked in this order: the first problem is the one reported
COMPONENTS = {
    "npu": ("torch", "torch-npu", "megatron-core", "mindspeed", "vllm", "vllm-ascend",
            "transformers", "verl", "transferqueue"),
    "cuda": ("torch", "vllm", "megatron-core", "transformers", "verl", "transferqueue"),
}  # fmt: skip
# CANN's set_env.sh exports these; torch_npu finds the toolkit through them
CANN_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
BASE_IMAGE = {"torch", "torch-npu"}  # the A2 image's; bootstrap never installs or replaces them


def expected(target: str) -> dict[str, str]:
    """Distribution -> version, from the target's lock (and npu-git.txt for npu)."""
    want = {}
    for line in (STACKS / f"{target}.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            want[name] = version
    if target == "npu":
        for line in (STACKS / "npu-git.txt").read_text().splitlines():
            if line and not line.startswith("#"):
                name, version = (field.strip() for field in line.split("|")[:2])
                want[name] = version
    return want


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _public(version: str) -> str:
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def _fix(target: str, name: str) -> str:
    if target == "npu" and name in BASE_IMAGE:
        return (
            "use the A2 base image with torch 2.7.1 + torch_npu 2.7.1 (CANN 8.3.RC1); "
            "bootstrap never installs or replaces them"
        )
    return f"run `bash scripts/bootstrap.sh --target {target}`"


def problem(target: str) -> str | None:
    """The first way this environment differs from the target's set, as one line; None if none."""
    if target == "npu" and not any(os.environ.get(var) for var in CANN_VARS):
        return (
            f"CANN is not sourced ({' / '.join(CANN_VARS)} unset): "
            "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (and nnal/atb/set_env.sh) first"
        )
    want = expected(target)
    for name in COMPONENTS[target]:
        have = installed(name)
        if have is not None and _public(have) == want[name]:
            continue
        found = "is not installed" if have is None else f"{have} is installed"
        needs = f"the {target} set needs {want[name]}"
        if target == "npu" and name == "megatron-core":
            needs = f"MindSpeed (v2.2.0_core_r0.12.1) needs {want[name]}"
        return f"{name} {found}, {needs}: {_fix(target, name)}"
    return None


def check_installed(device: str) -> None:
    """Raise LaunchError naming the first mismatch (a cluster launch; the local run on CPU has
    the cpu set by construction, and the launcher's dry run prints the plan anywhere)."""
    if device == "cpu":
        return
    found = problem(device)
    if found:
        raise LaunchError(found)
