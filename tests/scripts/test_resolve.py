"""scripts/stacks/resolve.py: a failed fetch from the package index is tried again, then told
in one line naming the package and the platform; a set that does not resolve still fails.
pip is faked (no network): each fake run answers with what pip 26.3 prints."""

import subprocess

import pytest

from tests.support.bad_inputs import NO_INDEX, resolve_script

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

CONFLICT = (
    "ERROR: Cannot install torch==2.7.1 because these package versions have conflicting "
    "dependencies.\nERROR: ResolutionImpossible: for help visit https://pip.pypa.io/\n"
)
# pip with the index unreachable may report the missing page as a conflict
CONFLICT_AFTER_NO_INDEX = NO_INDEX.splitlines()[0] + "\n" + CONFLICT


@pytest.fixture
def resolve(monkeypatch):
    module = resolve_script()
    monkeypatch.setattr(module, "FETCH_WAIT_S", (0, 0))
    return module


def fake_pip(monkeypatch, resolve, answers: list[tuple[int, str]]) -> list:
    """subprocess.run in resolve.py answers (returncode, stderr) in turn; the calls are kept."""
    calls = []

    def run(cmd, **kwargs):
        code, err = answers[min(len(calls), len(answers) - 1)]
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, code, "", err)

    monkeypatch.setattr(resolve.subprocess, "run", run)
    return calls


def test_a_fetch_failing_every_try_is_one_line_naming_package_and_platform(monkeypatch, resolve):
    calls = fake_pip(monkeypatch, resolve, [(1, NO_INDEX)])
    with pytest.raises(resolve.FetchError) as err:
        resolve.run_pip(["pip"], "torch==2.7.1's aarch64 metadata", "npu (Python 3.10, aarch64)")
    assert len(calls) == resolve.FETCH_TRIES == 3
    assert str(err.value) == (
        "npu (Python 3.10, aarch64): fetching torch==2.7.1's aarch64 metadata from the package "
        "index failed 3 times (connection broken by): check the network or the index "
        "(PIP_INDEX_URL), then rerun"
    )


@pytest.mark.parametrize("failure", [NO_INDEX, CONFLICT_AFTER_NO_INDEX])
def test_a_fetch_that_fails_once_is_tried_again(failure, monkeypatch, resolve):
    calls = fake_pip(monkeypatch, resolve, [(1, failure), (0, "")])
    assert resolve.run_pip(["pip"], None, "npu (Python 3.10, x86_64)").returncode == 0
    assert len(calls) == 2


def test_a_set_that_does_not_resolve_fails_at_once_and_never_passes(monkeypatch, resolve):
    calls = fake_pip(monkeypatch, resolve, [(1, CONFLICT)])
    assert resolve.run_pip(["pip"], None, "cpu (Python 3.11, x86_64)").returncode == 1
    assert len(calls) == 1
    # a fetch hiccup first: tried again, and the set's own failure is what comes back
    calls = fake_pip(monkeypatch, resolve, [(1, NO_INDEX), (1, CONFLICT)])
    assert resolve.run_pip(["pip"], None, "cpu (Python 3.11, x86_64)").returncode == 1
    assert len(calls) == 2


def test_the_package_set_resolution_names_what_pip_was_collecting(monkeypatch, resolve):
    collecting = "Collecting verl==0.9.1\n  Obtaining dependency information for verl==0.9.1\n"

    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, collecting, NO_INDEX)

    monkeypatch.setattr(resolve.subprocess, "run", run)
    with pytest.raises(resolve.FetchError, match="fetching verl==0.9.1 from the package index"):
        resolve.run_pip(["pip"], None, "cuda (Python 3.12, x86_64)")
