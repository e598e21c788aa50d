"""bootstrap.sh refuses what it must not touch, before installing anything."""

import subprocess
import sys
from pathlib import Path

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
    assert run.stderr.strip() == "bootstrap: unknown target 'tpu': use --target cpu, cuda or npu"


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
