"""Is this environment the target's package set? Checked by the launcher before Ray starts.

The expected versions are those of scripts/stacks/<target>.lock (PyPI packages) and
scripts/stacks/<target>-git.txt (MindSpeed, vllm, vllm-ascend from git). A mismatch raises
LaunchError with one line naming the component and the fix; the launcher exits 2 on it.
Local version labels are ignored (torch 2.7.1+cpu is torch 2.7.1; vllm 0.11.0+empty is 0.11.0).

`--device npu` runs on either A2 set; the base image's torch tells which one it is.
"""

import os
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from recipes.dapo.errors import LaunchError
from recipes.launcher.a2_replay import A2_R3

STACKS = Path(__file__).resolve().parents[2] / "scripts" / "stacks"
_A2 = ("torch", "torch-npu", "megatron-core", "mindspeed", "vllm", "vllm-ascend", "transformers",
       "verl", "transferqueue")  # fmt: skip
# checked in this order: the first problem is the one reported
COMPONENTS = {
    "npu": _A2,
    "npu-cann851": (*_A2[:2], "triton-ascend", *_A2[2:]),
    "npu-cann91": (*_A2[:2], "triton-ascend", *_A2[2:]),
    "cuda": ("torch", "vllm", "megatron-core", "transformers", "verl", "transferqueue"),
}
A2_TARGETS = ("npu", "npu-cann851", "npu-cann91")
# CANN's set_env.sh exports these; torch_npu finds the toolkit through them
CANN_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
# the A2 images' packages: bootstrap never installs or replaces them
BASE_IMAGE = {
    "npu": ("torch", "torch-npu"),
    "npu-cann851": ("torch", "torch-npu", "triton-ascend"),
    "npu-cann91": ("torch", "torch-npu", "triton-ascend"),
}
IMAGES = {
    "npu": "the A2 base image with torch 2.7.1 + torch_npu 2.7.1 (CANN 8.3.RC1)",
    "npu-cann851": (
        "the A2 base image with torch 2.9.0 + torch_npu 2.9.0.post1 + triton-ascend "
        "3.2.0.dev20260322 (CANN 8.5.1: vllm-ascend's v0.18.0 image)"
    ),
    "npu-cann91": (
        "the A2 base image with torch 2.10.0 + torch_npu 2.10.0.post4 + triton-ascend 3.2.2 "
        "(CANN 9.1.0: vllm-ascend's v0.23.0.post1 image)"
    ),
}
# Whether the set's rollout returns routed_experts to verl 0.9.1 (docs/routing_replay.md). verl
# 0.9.1 asks vLLM for them only from 0.22.0 on: below it, vLLMHttpServer refuses
# rollout.enable_rollout_routing_replay=True (verl/workers/rollout/vllm_rollout/
# vllm_async_server.py:445), whatever the platform plugin can capture. npu-cann91's caveats are
# recipes.launcher.a2_replay's (what the launcher refuses there, and what it cannot check).
R3 = {
    "npu": (
        "not available: vllm 0.11.0 + vllm-ascend 0.11.0rc1 return no routed_experts "
        "(vllm-ascend captures them from v0.15.0rc1 on, and verl 0.9.1 needs vLLM >= 0.22); "
        "use R2 or disabled"
    ),
    "npu-cann851": (
        "not available with verl 0.9.1: vllm-ascend 0.18.0 captures routed_experts (vLLM "
        "0.18.0's enable_return_routed_experts), but verl 0.9.1's vLLM server refuses "
        "enable_rollout_routing_replay below vLLM 0.22; use R2 or disabled (R3 on A2 needs "
        "vllm-ascend >= 0.22.1rc1: vLLM 0.22.1, CANN 9.0.0, torch 2.10.0; the npu-cann91 set)"
    ),
    "npu-cann91": A2_R3,
}


def expected(target: str) -> dict[str, str]:
    """Distribution -> version, from the target's lock (and its git file, for the A2 sets)."""
    want = {}
    for line in (STACKS / f"{target}.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            want[name] = version
    for name, (version, _) in git_refs(target).items():
        want[name] = version
    return want


def git_refs(target: str) -> dict[str, tuple[str, str]]:
    """Name -> (installed version, tag or branch) of the target's packages from git."""
    path = STACKS / f"{target}-git.txt"
    if not path.exists():
        return {}
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    rows = [[field.strip() for field in line.split("|")] for line in lines]
    return {row[0]: (row[1], row[3]) for row in rows}


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


def _has(name: str, version: str) -> bool:
    have = installed(name)
    return have is not None and _public(have) == version


def _fix(target: str, name: str) -> str:
    if name in BASE_IMAGE.get(target, ()):
        return f"use {IMAGES[target]}; bootstrap never installs or replaces it"
    return f"run `bash scripts/bootstrap.sh --target {target}`"


def problem(target: str) -> str | None:
    """The first way this environment differs from the target's set, as one line; None if none."""
    if target in A2_TARGETS and not any(os.environ.get(var) for var in CANN_VARS):
        return (
            f"CANN is not sourced ({' / '.join(CANN_VARS)} unset): "
            "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (and nnal/atb/set_env.sh) first"
        )
    want = expected(target)
    for name in COMPONENTS[target]:
        if _has(name, want[name]):
            continue
        have = installed(name)
        found = "is not installed" if have is None else f"{have} is installed"
        needs = f"the {target} set needs {want[name]}"
        if name == "megatron-core" and "mindspeed" in git_refs(target):
            needs = f"MindSpeed ({git_refs(target)['mindspeed'][1]}) needs {want[name]}"
        return f"{name} {found}, {needs}: {_fix(target, name)}"
    return None


def a2_target() -> str | None:
    """The A2 set whose base image this is, told by its torch (torch_npu is checked after)."""
    torch = installed("torch")
    return next((t for t in A2_TARGETS if torch and _public(torch) == expected(t)["torch"]), None)


def _neither() -> str:
    torch, npu = installed("torch"), installed("torch-npu")
    found = f"torch {torch} is installed" if torch else "torch is not installed"
    found += f" (torch-npu {npu})" if npu else " (no torch-npu)"
    sets = ", ".join(
        f"the {t} set needs {IMAGES[t].removeprefix('the A2 base image with ')}" for t in A2_TARGETS
    )
    return (
        f"{found}, neither A2 set's: {sets}: use one of those base images (bootstrap never "
        f"installs or replaces torch), then `bash scripts/bootstrap.sh --target <that set>`"
    )


def device_problem(device: str) -> str | None:
    """problem() of the device's set: for npu, the A2 set of the base image."""
    if device != "npu":
        return problem(device)
    target = a2_target()
    return problem(target) if target else _neither()


def describe(device: str) -> list[str]:
    """What the dry run says of the installed stack (npu: which A2 set, and R3 there)."""
    if device != "npu":
        return []
    target = a2_target()
    if target is None:
        lines = [f"stack: {_neither()}"]
        return lines + [f"  R3 with the {t} set: {R3[t]}" for t in A2_TARGETS]
    found = problem(target)
    state = f"the {target} set" if found is None else f"the {target} set's image, but {found}"
    return [f"stack: {state}", f"  R3 with the {target} set: {R3[target]}"]


def check_installed(device: str) -> None:
    """Raise LaunchError naming the first mismatch (a cluster launch; the local run on CPU has
    the cpu set by construction, and the launcher's dry run prints the plan anywhere)."""
    if device == "cpu":
        return
    found = device_problem(device)
    if found:
        raise LaunchError(found)
