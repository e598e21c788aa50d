"""The launcher refuses an environment that is not its target's package set, before Ray starts.

Faked environments: importlib.metadata answers from a dict, CANN's variables are set or unset.
"""

import os
import re
from importlib import metadata
from types import SimpleNamespace

import pytest

from recipes.dapo import cluster, launch, stack

REPO_ROOT = stack.STACKS.parents[1]


def _fake(monkeypatch, versions: dict[str, str | None], cann: bool = True):
    def version(name):
        if versions.get(name) is None:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(stack.metadata, "version", version)
    for var in stack.CANN_VARS:
        monkeypatch.delenv(var, raising=False)
    if cann:
        monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest")


def _good(target: str) -> dict[str, str]:
    want = stack.expected(target)
    return {name: want[name] for name in stack.COMPONENTS[target]}


@pytest.fixture
def nothing_starts(monkeypatch):
    """A resolved plan (files and plan checked), then whatever the launcher starts."""
    started = []
    monkeypatch.setattr(
        cluster, "run_command", lambda cmd, env, watch=None: started.append(cmd) or 0
    )
    monkeypatch.setattr(cluster, "check_ray", lambda *a: started.append("ray"))
    monkeypatch.setattr(cluster, "raise_open_files", lambda: None)
    run = SimpleNamespace(plan=SimpleNamespace(world=32), env={})
    plan = SimpleNamespace(describe=lambda: "plan", run=run, command=["verl"])
    monkeypatch.setattr(launch, "resolve", lambda *a: plan)
    return started


def _launch_fails(capsys, nothing_starts, device: str, *words: str):
    assert launch.main(["--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    for word in words:
        assert word in err, err
    assert nothing_starts == []  # no Ray, no verl, no model


def test_the_npu_set_pins_the_a2_stack():
    want = stack.expected("npu")
    assert want["torch"] == "2.7.1" and want["torch-npu"] == "2.7.1"
    assert want["megatron-core"] == "0.12.1" and want["mindspeed"] == "0.12.1"
    assert want["vllm"] == "0.11.0" and want["vllm-ascend"] == "0.11.0rc1"
    assert want["verl"] == "0.9.1"
    assert stack.expected("cuda")["megatron-core"] == "0.16.1"


@pytest.mark.parametrize("target", ["npu", "cuda"])
def test_the_exact_set_passes_local_labels_ignored(monkeypatch, target):
    versions = _good(target)
    versions["torch"] += "+cpu" if target == "npu" else "+cu130"
    versions["vllm"] += "+empty" if target == "npu" else ""
    _fake(monkeypatch, versions)
    assert stack.problem(target) is None


def test_mcore_0_16_under_mindspeed_refused_in_one_line(monkeypatch, capsys, nothing_starts):
    _fake(monkeypatch, {**_good("npu"), "megatron-core": "0.16.1"})
    _launch_fails(
        capsys, nothing_starts, "npu", "megatron-core 0.16.1", "needs 0.12.1",
        "bootstrap.sh --target npu",
    )  # fmt: skip


@pytest.mark.parametrize(
    "component, have, words",
    [
        ("mindspeed", None, ["mindspeed is not installed", "--target npu"]),
        ("mindspeed", "0.0.1.dev1", ["mindspeed 0.0.1.dev1", "needs 0.12.1"]),  # PyPI placeholder
        ("torch-npu", None, ["torch-npu is not installed", "base image"]),
        ("torch", "2.13.0", ["torch 2.13.0 is installed", "needs 2.7.1", "base image"]),
        ("vllm-ascend", "0.13.0", ["vllm-ascend 0.13.0", "needs 0.11.0rc1"]),
    ],
)
def test_missing_or_mismatched_npu_stack(
    monkeypatch, capsys, nothing_starts, component, have, words
):
    _fake(monkeypatch, {**_good("npu"), component: have})
    _launch_fails(capsys, nothing_starts, "npu", *words)


def test_cann_not_sourced(monkeypatch, capsys, nothing_starts):
    _fake(monkeypatch, _good("npu"), cann=False)
    _launch_fails(capsys, nothing_starts, "npu", "CANN is not sourced", "set_env.sh")


def test_cuda_wrong_vllm(monkeypatch, capsys, nothing_starts):
    _fake(monkeypatch, {**_good("cuda"), "vllm": "0.11.0"})
    _launch_fails(capsys, nothing_starts, "cuda", "vllm 0.11.0", "--target cuda")


def test_the_right_set_starts_and_a_dry_run_needs_none(monkeypatch, nothing_starts):
    _fake(monkeypatch, _good("npu"))
    assert launch.main(["--device", "npu"]) == 0 and nothing_starts == ["ray", ["verl"]]
    _fake(monkeypatch, {}, cann=False)
    assert launch.main(["--device", "npu", "--dry-run"]) == 0  # prints the plan anywhere
    stack.check_installed("cpu")  # the local run
    with pytest.raises(cluster.LaunchError, match="CANN"):
        stack.check_installed("npu")


def _pins(path):
    return dict(
        re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
        for line in path.read_text().splitlines()
        if re.match(r"[A-Za-z0-9_.-]+==", line)
    )


@pytest.mark.parametrize("target", ["cpu", "cuda", "npu"])
def test_each_lock_keeps_its_stack_pins(target):
    """What <target>.in pins is what its lock (what bootstrap installs) holds."""
    lock = {
        stack_name.lower(): v for stack_name, v in _pins(stack.STACKS / f"{target}.lock").items()
    }
    for name, version in _pins(stack.STACKS / f"{target}.in").items():
        assert lock[name.lower()] == version, (target, name)


def test_job_env_appends_to_pythonpath_and_imports_no_engine(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages")
    env = cluster.job_env("npu", "eth0")
    assert env["PYTHONPATH"].split(os.pathsep) == [
        "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages",
        str(REPO_ROOT),
    ]
    assert "VERL_USE_EXTERNAL_MODULES" not in env
    monkeypatch.delenv("PYTHONPATH")
    assert cluster.job_env("cuda", None)["PYTHONPATH"] == str(REPO_ROOT)
