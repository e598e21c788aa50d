"""The launcher refuses an environment that is not its target's package set, before Ray starts.

Faked environments: importlib.metadata answers from a dict, CANN's variables are set or unset.
"""

import os
import re
from importlib import metadata
from types import SimpleNamespace

import pytest

from recipes.dapo.cluster import ray_job
from recipes.dapo.errors import LaunchError
from recipes.launcher import launch, run_spec, stack

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
def nothing_starts(monkeypatch, tmp_path):
    """A resolved plan (files and plan checked), then whatever the launcher starts."""
    started = []
    monkeypatch.setattr(ray_job, "run_command", lambda cmd, env, *a: started.append(cmd) or 0)
    monkeypatch.setattr(ray_job, "check_ray", lambda *a: started.append("ray"))
    monkeypatch.setattr(ray_job, "raise_open_files", lambda: None)
    run = SimpleNamespace(
        plan=SimpleNamespace(world=32, nodes=4, devices_per_node=8), env={}, ckpt_dir=str(tmp_path),
        device="npu", rollout_nodes=0, ray_address=None,
    )  # fmt: skip
    plan = SimpleNamespace(describe=lambda: "plan", run=run, command=["verl"], groups={})
    spec = lambda args, extra: SimpleNamespace(  # noqa: E731  (checked: no files needed)
        device=args.device, is_local=False, dry_run=args.dry_run, plan=run.plan,
        split=SimpleNamespace(rollout_devices=0), ray_address=None, verbose=False, debug=False,
    )  # fmt: skip
    monkeypatch.setattr(run_spec, "from_args", spec)
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


def test_the_npu_cann851_set_pins_the_cann_8_5_1_stack():
    """vllm-ascend 0.18.0's image (torch 2.9.0, torch_npu 2.9.0.post1, triton-ascend dev build),
    MindSpeed core_r0.16.0 with megatron-core 0.16.0; verl, transformers, transferqueue as the
    npu set."""
    want, old = stack.expected("npu-cann851"), stack.expected("npu")
    assert (want["torch"], want["torch-npu"]) == ("2.9.0", "2.9.0.post1")
    assert want["triton-ascend"] == "3.2.0.dev20260322"
    assert want["megatron-core"] == "0.16.0" and want["mindspeed"] == "0.16.0"
    assert want["vllm"] == "0.18.0" and want["vllm-ascend"] == "0.18.0"
    for name in ("verl", "transformers", "transferqueue", "numpy"):
        assert want[name] == old[name], name
    refs = stack.git_refs("npu-cann851")
    assert [refs[n][1] for n in ("mindspeed", "vllm", "vllm-ascend")] == [
        "core_r0.16.0", "v0.18.0", "v0.18.0",
    ]  # fmt: skip
    assert stack.A2_TARGETS == ("npu", "npu-cann851", "npu-cann91")


def test_the_npu_cann91_set_pins_the_cann_9_1_stack():
    """vllm-ascend 0.23.0.post1's pins (torch 2.10.0, torch_npu 2.10.0.post4, triton-ascend
    3.2.2), its vLLM 0.23.0, MindSpeed core_r0.16.0 with megatron-core 0.16.0 (verl's Ascend
    guidance); transformers 5.10.4 over vllm-ascend's 5.5.4 pin; vllm-ascend from its sdist."""
    want, old = stack.expected("npu-cann91"), stack.expected("npu-cann851")
    assert (want["torch"], want["torch-npu"], want["triton-ascend"]) == (
        "2.10.0", "2.10.0.post4", "3.2.2",
    )  # fmt: skip
    assert (want["torchvision"], want["torchaudio"]) == ("0.25.0", "2.10.0")
    assert want["megatron-core"] == "0.16.0" and want["mindspeed"] == "0.16.0"
    assert want["vllm"] == "0.23.0" and want["vllm-ascend"] == "0.23.0.post1"
    for name in ("verl", "transformers", "transferqueue", "numpy"):
        assert want[name] == old[name], name
    refs = stack.git_refs("npu-cann91")
    assert [refs[n][1] for n in ("mindspeed", "vllm", "vllm-ascend")] == [
        "core_r0.16.0", "v0.23.0", "sdist",
    ]  # fmt: skip
    assert stack.BASE_IMAGE["npu-cann91"] == ("torch", "torch-npu", "triton-ascend")


@pytest.mark.parametrize("target", ["npu", "npu-cann851", "npu-cann91", "cuda"])
def test_the_exact_set_passes_local_labels_ignored(monkeypatch, target):
    versions = _good(target)
    versions["torch"] += "+cu130" if target == "cuda" else "+cpu"
    versions["vllm"] += "" if target == "cuda" else "+empty"
    if target == "npu-cann851":  # as vllm-ascend's v0.18.0 image names its own wheel
        versions["torch-npu"] += "+git4c901a4"
    _fake(monkeypatch, versions)
    assert stack.problem(target) is None
    if target != "cuda":  # --device npu finds the set by the image's torch
        assert stack.a2_target() == target and stack.device_problem("npu") is None


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
        ("torch", "2.13.0", ["torch 2.13.0 is installed", "neither A2 set", "torch 2.7.1 +"]),
        ("vllm-ascend", "0.13.0", ["vllm-ascend 0.13.0", "needs 0.11.0rc1"]),
    ],
)
def test_missing_or_mismatched_npu_stack(
    monkeypatch, capsys, nothing_starts, component, have, words
):
    _fake(monkeypatch, {**_good("npu"), component: have})
    _launch_fails(capsys, nothing_starts, "npu", *words)


@pytest.mark.parametrize(
    "component, have, words",
    [
        ("triton-ascend", None, ["triton-ascend is not installed", "needs 3.2.0.dev20260322"]),
        ("torch-npu", "2.9.0", ["torch-npu 2.9.0 is installed", "needs 2.9.0.post1", "CANN 8.5.1"]),
        (
            "megatron-core",
            "0.12.1",
            ["megatron-core 0.12.1", "MindSpeed (core_r0.16.0) needs 0.16.0"],
        ),
        ("vllm-ascend", "0.11.0rc1", ["vllm-ascend 0.11.0rc1", "--target npu-cann851"]),
        ("mindspeed", "0.12.1", ["mindspeed 0.12.1", "needs 0.16.0", "--target npu-cann851"]),
    ],
)
def test_the_cann_8_5_1_image_with_a_wrong_component(
    monkeypatch, capsys, nothing_starts, component, have, words
):
    """torch 2.9.0 makes it the npu-cann851 set's image: the rest is checked against that set."""
    _fake(monkeypatch, {**_good("npu-cann851"), component: have})
    _launch_fails(capsys, nothing_starts, "npu", *words)


def _described(monkeypatch, capsys, versions: dict[str, str], cann: bool = True) -> list[str]:
    """The launcher's dry run (the shipped 4x8 plan on npu): its `stack:` line and what follows
    it. Packages outside `versions` answer as installed here."""
    real = metadata.version
    monkeypatch.setattr(stack.metadata, "version", lambda n: versions.get(n) or real(n))
    for var in stack.CANN_VARS:
        monkeypatch.delenv(var, raising=False)
    if cann:
        monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest")
    plan = ["--tp", "4", "--ep", "8", "--nodes", "4", "--devices-per-node", "8"]
    assert launch.main([*plan, "--device", "npu", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stack: "))
    return lines[start : next(i for i in range(start + 1, len(lines)) if lines[i][0] != " ")]


def test_dry_run_names_the_a2_set_and_r3_there(monkeypatch, capsys):
    stack_line, r3 = _described(monkeypatch, capsys, _good("npu-cann851"))
    assert stack_line == "stack: the npu-cann851 set"
    assert r3.startswith("  R3 with the npu-cann851 set: not available with verl 0.9.1: ")
    assert "vllm-ascend 0.18.0 captures routed_experts" in r3 and "below vLLM 0.22" in r3
    assert "use R2 or disabled" in r3
    stack_line, r3 = _described(monkeypatch, capsys, _good("npu"))
    assert stack_line == "stack: the npu set"
    assert r3.startswith("  R3 with the npu set: not available: vllm 0.11.0 + vllm-ascend ")
    broken = {**_good("npu-cann851"), "vllm": "0.11.0"}
    stack_line, _ = _described(monkeypatch, capsys, broken)
    assert stack_line.startswith("stack: the npu-cann851 set's image, but vllm 0.11.0 is ")
    assert "--target npu-cann851" in stack_line
    stack_line, _ = _described(monkeypatch, capsys, _good("npu-cann851"), cann=False)
    assert stack_line.startswith("stack: the npu-cann851 set's image, but CANN is not sourced")


def test_dry_run_on_npu_cann91_says_r3_is_available_with_its_caveats(monkeypatch, capsys):
    """The CANN 9.1 image: R3 available (vllm-ascend 0.23.0.post1 on vLLM 0.23.0), with what
    it cannot record and what has not run; the routes sized as uint8 for Qwen3-30B-A3B."""
    stack_line, r3 = _described(monkeypatch, capsys, _good("npu-cann91"))
    assert stack_line == "stack: the npu-cann91 set"
    assert r3.startswith("  R3 with the npu-cann91 set: available: vllm-ascend 0.23.0.post1 ")
    for caveat in (
        "quantized MoE (records nothing)",
        "EPLB",
        "DP 1 with TP > 1",
        "vllm-ascend#15451",
        "not run on A2 here",
        "runs on A3 only",
        "uint8",
    ):
        assert caveat in r3, caveat  # fmt: skip
    broken = {**_good("npu-cann91"), "triton-ascend": "3.2.0.dev20260322"}
    stack_line, _ = _described(monkeypatch, capsys, broken)
    assert stack_line.startswith("stack: the npu-cann91 set's image, but triton-ascend 3.2.0.dev")
    assert "CANN 9.1.0" in stack_line and "never installs or replaces it" in stack_line


def test_dry_run_on_neither_a2_set_names_both_and_the_fix(monkeypatch, capsys):
    stack_line, *r3 = _described(monkeypatch, capsys, {"torch": "2.8.0", "torch-npu": "2.8.0"})
    assert stack_line.startswith("stack: torch 2.8.0 is installed (torch-npu 2.8.0), neither A2 ")
    assert "the npu set needs torch 2.7.1 + torch_npu 2.7.1 (CANN 8.3.RC1)" in stack_line
    assert "the npu-cann851 set needs torch 2.9.0 + torch_npu 2.9.0.post1" in stack_line
    assert stack_line.endswith("then `bash scripts/bootstrap.sh --target <that set>`")
    assert "the npu-cann91 set needs torch 2.10.0 + torch_npu 2.10.0.post4" in stack_line
    assert [line.split(":")[0] for line in r3] == [
        "  R3 with the npu set", "  R3 with the npu-cann851 set", "  R3 with the npu-cann91 set",
    ]  # fmt: skip


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
    with pytest.raises(LaunchError, match="CANN"):
        stack.check_installed("npu")


def _pins(path):
    return dict(
        re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
        for line in path.read_text().splitlines()
        if re.match(r"[A-Za-z0-9_.-]+==", line)
    )


@pytest.mark.parametrize("target", ["cpu", "cuda", "npu", "npu-cann851", "npu-cann91"])
def test_each_lock_keeps_its_stack_pins(target):
    """What <target>.in pins is what its lock (what bootstrap installs) holds."""
    lock = {
        stack_name.lower(): v for stack_name, v in _pins(stack.STACKS / f"{target}.lock").items()
    }
    for name, version in _pins(stack.STACKS / f"{target}.in").items():
        assert lock[name.lower()] == version, (target, name)


def test_job_env_appends_to_pythonpath_and_imports_no_engine(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages")
    env = ray_job.job_env("npu", "eth0")
    assert env["PYTHONPATH"].split(os.pathsep) == [
        "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages",
        str(REPO_ROOT),
    ]
    assert "VERL_USE_EXTERNAL_MODULES" not in env
    monkeypatch.delenv("PYTHONPATH")
    assert ray_job.job_env("cuda", None)["PYTHONPATH"] == str(REPO_ROOT)


def test_the_memory_probe_reaches_the_cpu_jobs_workers_only_when_asked(monkeypatch, tmp_path):
    """The side by side's probe directory reaches every worker of a CPU job (both engines'
    ranks); without it no worker gets the variable, so no probe is installed."""
    from backend.instruments.memory_probe import MEMORY_PROBE_ENV

    monkeypatch.delenv(MEMORY_PROBE_ENV, raising=False)
    assert MEMORY_PROBE_ENV not in ray_job.job_env("cpu", None)
    monkeypatch.setenv(MEMORY_PROBE_ENV, str(tmp_path))
    assert ray_job.job_env("cpu", None)[MEMORY_PROBE_ENV] == str(tmp_path)
    assert MEMORY_PROBE_ENV not in ray_job.job_env("cuda", None)  # CPU runs only


def test_the_release_the_tests_read_is_the_one_imported():
    """tests.support.mcore_release reads the package metadata (no import at collection): it must name
    the megatron-core that imports, overlay included (scripts/test.sh's 0.12.1 run)."""
    from backend.platform.compat import mcore_version
    from tests.support.mcore_release import MCORE_RELEASE

    assert MCORE_RELEASE == mcore_version()
