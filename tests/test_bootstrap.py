"""bootstrap.sh refuses what it must not touch, before installing anything."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[1]


def _bootstrap(*args, **env):
    return subprocess.run(
        ["bash", "scripts/bootstrap.sh", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(REPO / ".cache"), **env},
        timeout=120,
    )


def test_unknown_target_is_refused():
    run = _bootstrap("--target", "tpu")
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "bootstrap: unknown target 'tpu': use --target cpu, cuda, npu or npu-cann851"
    )


def test_npu_never_replaces_the_images_torch():
    """No torch_npu here (and torch 2.13.0 in the cpu set): refused in one line naming the
    component, nothing installed."""
    run = _bootstrap("--target", "npu", PYTHON=sys.executable)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "base image with torch 2.7.1 + torch_npu 2.7.1" in line
    assert "torch 2.13.0 is installed, the npu set needs 2.7.1" in line or (
        "torch-npu is not installed" in line
    )
    assert not (REPO / ".stack").exists()


def test_npu_cann851_never_replaces_the_images_torch():
    run = _bootstrap("--target", "npu-cann851", PYTHON=sys.executable)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line == (
        "bootstrap: torch 2.13.0 is installed, the npu-cann851 set needs 2.9.0: use the A2 base "
        "image with torch 2.9.0 + torch_npu 2.9.0.post1 + triton-ascend 3.2.0.dev20260322 "
        "(CANN 8.5.1: vllm-ascend's v0.18.0 image)"
    )
    assert not (REPO / ".stack").exists()


def _image(tmp_path, **versions: str) -> str:
    """A PYTHONPATH whose dist-info directories make importlib.metadata answer `versions` (a
    base image's packages, faked: metadata only)."""
    for name, version in versions.items():
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(tmp_path)


def test_npu_cann851_checks_triton_ascend_too(tmp_path):
    """vllm-ascend's v0.18.0 image: its own torch_npu build (local label) passes; without its
    triton-ascend dev build the set is refused, naming it."""
    path = _image(tmp_path, torch="2.9.0+cpu", torch_npu="2.9.0.post1+git4c901a4")
    run = _bootstrap("--target", "npu-cann851", PYTHON=sys.executable, PYTHONPATH=path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(
        "bootstrap: triton-ascend is not installed, the npu-cann851 set needs 3.2.0.dev20260322: "
        "use the A2 base image with torch 2.9.0"
    )


def test_npu_cann851_image_passes_then_cann_must_be_sourced(tmp_path):
    """The whole base image matches (local labels ignored): the next refusal is CANN's, before
    anything is installed."""
    path = _image(
        tmp_path, torch="2.9.0+cpu", torch_npu="2.9.0.post1+git4c901a4",
        triton_ascend="3.2.0.dev20260322",
    )  # fmt: skip
    run = _bootstrap("--target", "npu-cann851", PYTHON=sys.executable, PYTHONPATH=path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "bootstrap: CANN is not sourced: source /usr/local/Ascend/ascend-toolkit/set_env.sh "
        "(and nnal/atb/set_env.sh) first"
    ]
    assert run.stdout == "" and not (REPO / ".stack").exists()
