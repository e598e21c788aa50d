"""bootstrap.sh refuses what it must not touch, before installing anything."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

REPO = Path(__file__).resolve().parents[2]


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
        "bootstrap: unknown target 'tpu': use --target cpu, cuda, npu, npu-cann851 or npu-cann91"
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
        info.mkdir(parents=True)
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


def test_npu_cann91_checks_its_image_then_cann(tmp_path):
    """The CANN 9.1.0 image (torch 2.10.0, torch_npu 2.10.0.post4, triton-ascend 3.2.2): the
    cann851 image's triton-ascend is refused naming this set's; the whole image passes and CANN
    must be sourced next, before anything is installed (nothing in .stack)."""
    run = _bootstrap("--target", "npu-cann91", PYTHON=sys.executable)
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "bootstrap: torch 2.13.0 is installed, the npu-cann91 set needs 2.10.0: use the A2 base "
        "image with torch 2.10.0 + torch_npu 2.10.0.post4 + triton-ascend 3.2.2 (CANN 9.1.0: "
        "vllm-ascend's v0.23.0.post1 image)"
    )
    old = _image(tmp_path / "old", torch="2.10.0+cpu", torch_npu="2.10.0.post4",
                 triton_ascend="3.2.0.dev20260322")  # fmt: skip
    run = _bootstrap("--target", "npu-cann91", PYTHON=sys.executable, PYTHONPATH=old)
    assert run.stderr.startswith(
        "bootstrap: triton-ascend 3.2.0.dev20260322 is installed, the npu-cann91 set needs 3.2.2"
    )
    good = _image(tmp_path / "good", torch="2.10.0+cpu", torch_npu="2.10.0.post4",
                  triton_ascend="3.2.2")  # fmt: skip
    run = _bootstrap("--target", "npu-cann91", PYTHON=sys.executable, PYTHONPATH=good)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().startswith("bootstrap: CANN is not sourced")
    assert not (REPO / ".stack").exists()


def test_npu_cann91_builds_vllm_ascend_from_its_checked_sdist(tmp_path):
    """Past the checks (a faked image: pip and git record their calls): the lock --no-deps, then
    MindSpeed and vllm from git, then vllm-ascend 0.23.0.post1 (no git tag has it) from PyPI's
    sdist with its sha256 required, built against the image (--no-build-isolation) for A2."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copytree(REPO / "scripts" / "stacks", repo / "scripts" / "stacks")
    shutil.copy(REPO / "scripts" / "bootstrap.sh", repo / "scripts")
    log, fake = tmp_path / "calls.log", tmp_path / "bin"
    fake.mkdir()
    image = _image(tmp_path / "image", torch="2.10.0+cpu", torch_npu="2.10.0.post4",
                   triton_ascend="3.2.2")  # fmt: skip
    (fake / "python").write_text(
        f'#!/bin/bash\nif [[ $1 == -m ]]; then echo "SOC=$SOC_VERSION $*" >> {log}; '
        f'[[ $* == *"-r "* ]] && cp "${{@: -1}}" {tmp_path}/req_$RANDOM.txt; exit 0; fi\n'
        f'PYTHONPATH={image} exec {sys.executable} "$@"\n'
    )
    (fake / "git").write_text(
        f'#!/bin/bash\necho "git $*" >> {log}\n[[ $1 == clone ]] && mkdir -p "${{@: -1}}"\n'
        "[[ $* == *rev-parse\\ --quiet* ]] && exit 1\nexit 0\n"
    )
    for exe in fake.iterdir():
        exe.chmod(0o755)
    run = subprocess.run(
        ["bash", "scripts/bootstrap.sh", "--target", "npu-cann91"], cwd=repo, capture_output=True,
        text=True, timeout=120, env={"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path),
        "PYTHON": str(fake / "python"), "ASCEND_HOME_PATH": "/usr/local/Ascend"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    pips = [c for c in calls if " pip install " in c]
    assert "--no-deps -r" in pips[0]  # the lock first
    assert [c.split()[-1].rsplit("/", 1)[-1] for c in pips[2:4]] == ["mindspeed", "vllm"]
    sdist = pips[4]
    assert sdist.startswith("SOC=ascend910b1 ") and "--no-build-isolation" in sdist
    assert "--no-binary vllm-ascend --require-hashes -r" in sdist
    reqs = [p.read_text() for p in tmp_path.glob("req_*.txt")]
    assert (
        "vllm-ascend==0.23.0.post1 --hash=sha256:"
        "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1\n"
    ) in reqs
    assert not any("vllm-ascend" in c for c in calls if c.startswith("git clone"))
    assert (repo / ".stack").read_text().startswith("npu-cann91 ")


def _fake_cpu_python(tmp_path, fail_on: str = "") -> tuple[Path, Path]:
    """A repo copy and a python that records its calls: `-c` runs the real one, `-m venv` makes
    a venv of itself, everything else (pip, compileall) prints a line and succeeds, except a
    call containing `fail_on`, which prints an error and exits 3."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copytree(REPO / "scripts" / "stacks", repo / "scripts" / "stacks")
    shutil.copy(REPO / "scripts" / "bootstrap.sh", repo / "scripts")
    shutil.copy(REPO / "pyproject.toml", repo)
    calls, fake = tmp_path / "calls.log", tmp_path / "bin" / "python3.11"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\n'
        f'[[ $1 == -c ]] && exec {sys.executable} "$@"\n'
        'if [[ $1 == -m && $2 == venv ]]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi\n'
        f'if [[ -n "{fail_on}" && "$*" == *"{fail_on}"* ]]; then echo "ERROR: pip could not"; exit 3; fi\n'
        'echo "pip chatter: $*"\n'
    )
    fake.chmod(0o755)
    return repo, calls


def _bootstrap_cpu(repo: Path, fake_bin: Path, *args: str):
    return subprocess.run(
        ["bash", "scripts/bootstrap.sh", *args], cwd=repo, capture_output=True, text=True, timeout=120,
        env={"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": str(repo.parent)},
    )  # fmt: skip


def test_cpu_console_gets_a_line_a_stage_and_pip_goes_to_the_log(tmp_path):
    """Bug caught: pip's ~260 lines (index warnings, setuptools' banners) on a newcomer's
    console; pip byte-compiling the set one file at a time (68 of 128 s); a newcomer's run
    paying to compile the whole set (36 s) where it imports ~45% of its bytecode."""
    repo, calls = _fake_cpu_python(tmp_path)
    run = _bootstrap_cpu(repo, tmp_path / "bin")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("bootstrap: installing the cpu set into .venv")
    assert "pip's output in .cache/bootstrap.log" in lines[0]
    stages = [line.rsplit(" (", 1)[0] for line in lines[1:-1]]
    assert stages == [
        "bootstrap: pip 26.3", "bootstrap: torch 2.13.0",
        "bootstrap: the set (cpu.in, cpu.lock) and this project", "bootstrap: vLLM's CPU build",
        "bootstrap: bytecode",
    ]  # fmt: skip
    assert all(line.endswith(" s)") for line in lines[1:-1])
    assert lines[-1].startswith("bootstrap: done in ") and "torch 2.13.0" in lines[-1]
    assert "chatter" not in run.stdout + run.stderr
    assert "pip chatter: -m pip install" in (repo / ".cache" / "bootstrap.log").read_text()
    recorded = calls.read_text().splitlines()
    installs = [c for c in recorded if c.startswith("-m pip install")]
    assert len(installs) == 5 and all("--no-compile" in c for c in installs)
    # only the directories a run imports (cpu-bytecode.txt), each alone; the rest with the tests'
    assert "scripts/stacks/bytecode_dirs.py compile" in recorded
    assert "-m compileall -q -q -j 0 .venv/lib" not in recorded
    assert not any("overlays" in c for c in recorded)  # the tests' releases: --test-overlays
    assert (repo / ".venv" / ".bootstrap-stamp").is_file()
    # the stamp makes a second run return at once, silently
    again = _bootstrap_cpu(repo, tmp_path / "bin")
    assert again.returncode == 0 and again.stdout == ""


def test_cpu_test_overlays_come_only_with_their_flag_once(tmp_path):
    """Bug caught: every newcomer's first run paying for the test suite's two megatron-core
    releases (9 s and 0.7 GB of a fresh bootstrap); or the suite running without them."""
    repo, calls = _fake_cpu_python(tmp_path)
    assert _bootstrap_cpu(repo, tmp_path / "bin").returncode == 0
    calls.write_text("")
    run = _bootstrap_cpu(repo, tmp_path / "bin", "--test-overlays")
    assert run.returncode == 0, run.stderr
    lines = [line.rsplit(" (", 1)[0] for line in run.stdout.splitlines()]
    assert lines == [
        "bootstrap: the tests' overlays into .venv/overlays", "bootstrap: megatron-core 0.12.1 and 0.19.2",
        "bootstrap: their bytecode",
        "bootstrap: the rest of the set's bytecode (the tests import more than a run)",
    ]  # fmt: skip
    recorded = calls.read_text().splitlines()
    targets = [c.split("--target ")[1].split()[0] for c in recorded if "--target" in c]
    assert targets == [".venv/overlays/megatron-core-0.12.1", ".venv/overlays/megatron-core-0.19.2"]
    assert recorded[-2:] == [
        "-m compileall -q -q -j 0 .venv/overlays", "-m compileall -q -q -j 0 .venv/lib",
    ]  # fmt: skip
    again = _bootstrap_cpu(repo, tmp_path / "bin", "--test-overlays")
    assert again.returncode == 0 and again.stdout == ""
    refused = _bootstrap("--target", "cuda", "--test-overlays")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "bootstrap: --test-overlays is for --target cpu (the test suite's megatron-core releases)"
    )


def test_cpu_a_failing_stage_names_itself_shows_the_logs_end_and_leaves_no_stamp(tmp_path):
    repo, _ = _fake_cpu_python(tmp_path, fail_on="torch==")
    run = _bootstrap_cpu(repo, tmp_path / "bin")
    assert run.returncode == 3
    err = run.stderr.splitlines()
    assert err[0] == "bootstrap: torch 2.13.0 failed (exit 3); the end of .cache/bootstrap.log:"
    assert err[-1] == "ERROR: pip could not"
    assert "bootstrap: pip 26.3 (" in run.stdout and "the set" not in run.stdout
    assert not (repo / ".venv" / ".bootstrap-stamp").exists()
