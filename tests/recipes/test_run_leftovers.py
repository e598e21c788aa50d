"""Nothing a run starts outlives it (recipes.dapo.cluster.run_scope, recipes.dapo.cluster.reaper): after a
kill -9 of the launcher's process group, after a clean finish and after a refused run, no
process of the run, no shared-memory segment and no temp file of it is left; what is not the
run's is left alone. The trainer is tests/support/leaky_trainer.py (what Ray and vLLM leave, without
them), started by the launcher's own machinery (RunScope + cluster.run_command) in a process
of its own, as scripts/train_mcore.sh starts the launcher."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from recipes.dapo.cluster.reaper import RUN_ID

pytestmark = pytest.mark.no_mcore

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = f"""
import json, sys
from pathlib import Path
from recipes.dapo.cluster.ray_job import run_command
from recipes.dapo.cluster.run_scope import RunScope
logs, manifest, mode = sys.argv[1:]
with RunScope(Path(logs), sample_s=0.3) as scope:
    scope_file = Path(manifest + ".scope")
    scope_file.write_text(json.dumps({{"id": scope.id, "tmp": str(scope.tmp),
                                       "reaper": scope.reaper.pid}}))
    code = run_command([sys.executable, {str(REPO / "tests" / "support" / "leaky_trainer.py")!r}, manifest,
                        mode], scope.env)
sys.exit(code)
"""
DEADLINE_S = 10.0  # from the launcher's death to nothing of the run left


def launch(tmp_path: Path, mode: str) -> subprocess.Popen:
    """The launcher in a session of its own (its group is what the test kills)."""
    argv = [sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"), str(tmp_path / "run"), mode]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)


def read_when_there(path: Path, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.1)
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def carrying(run_id: str) -> list[int]:
    """Live processes whose environment holds the run's id (the process table, scanned)."""
    mark = f"{RUN_ID}={run_id}".encode()
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.append(int(name))
        except OSError:
            pass
    return [pid for pid in found if alive(pid)]


def leftovers(run: dict, scope: dict) -> list[str]:
    """What of the run is still there: processes (its id, or the manifest's), the reaper,
    segments, files, its temp dir."""
    left = [f"pid {p}" for p in {*run["pids"], *carrying(scope["id"])} if alive(p)]
    left += [f"reaper {scope['reaper']}"] if alive(scope["reaper"]) else []
    return left + [p for p in [*run["segments"], *run["files"], scope["tmp"]] if Path(p).exists()]


def wait_until_clean(run: dict, scope: dict) -> list[str]:
    deadline = time.monotonic() + DEADLINE_S
    while (left := leftovers(run, scope)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def own_segment(mapped: bool) -> shared_memory.SharedMemory:
    """A segment of the test's own (not the run's): kept mapped, or closed and left behind as
    another program's leak (no live process maps it)."""
    shm = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(shm._name, "shared_memory")
    if not mapped:
        shm.close()
    return shm


@pytest.mark.slow
def test_a_kill_9_of_the_launchers_group_leaves_nothing_of_the_run(tmp_path):
    """Catches the leak of issue 41: after `kill -9` of the launcher's process group, the run's
    processes outside the group (a new session, as Ray's raylet and vLLM's engines can be, and
    one without the run's id, as Ray's agents) lived on, and every segment and vllm_dist file
    stayed. The reaper ends them and removes what they left within 10 s."""
    launcher = launch(tmp_path, "hang")
    run = read_when_there(tmp_path / "run")
    scope = read_when_there(tmp_path / "run.scope")
    assert all(Path(p).exists() for p in run["segments"] + run["files"])
    assert Path(run["tmp"]) == Path(scope["tmp"])  # the trainer's temp dir is the run's own
    time.sleep(1.0)  # the reaper samples every 0.3 s: it has seen the holders and their maps
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_until_clean(run, scope) == []
    log = (tmp_path / "logs" / "cleanup.log").read_text()
    assert re.search(rf"run {scope['id']}: reaped: ended [2-9] processes", log)


@pytest.mark.slow
def test_a_clean_finish_ends_what_the_run_left_before_the_launcher_returns(tmp_path):
    """Catches a clean finish that leaves vLLM's segments (its engines never unlink them) and
    the processes a trainer left running: once the launcher has returned, the run's
    processes, segments and temp files are gone, the one of a holder that died unseen by any
    process too."""
    launcher = launch(tmp_path, "exit")
    assert launcher.wait(timeout=120) == 0
    run = read_when_there(tmp_path / "run")
    scope = read_when_there(tmp_path / "run.scope")
    assert leftovers(run, scope) == []
    log = (tmp_path / "logs" / "cleanup.log").read_text()
    assert "removed 3 shared-memory files (3 MiB) and 1 temp files" in log


@pytest.mark.slow
def test_what_is_not_the_runs_is_left_alone(tmp_path):
    """Catches a cleaner that removes segments it cannot prove are its run's: the test's own
    segment (mapped by the test), another program's leak (created before the run, mapped by
    nobody) and one of the run's segments that a process outside the run still maps stay."""
    mine, leaked = own_segment(mapped=True), own_segment(mapped=False)
    launcher = launch(tmp_path, "hang")
    run = read_when_there(tmp_path / "run")
    scope = read_when_there(tmp_path / "run.scope")
    name = Path(run["segments"][1]).name
    shared = shared_memory.SharedMemory(name=name)  # the test maps one of the run's
    resource_tracker.unregister(shared._name, "shared_memory")
    try:
        time.sleep(1.0)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        kept = run["segments"].pop(1)  # in use: kept
        assert wait_until_clean(run, scope) == [] and Path(kept).exists()
        assert Path(f"/dev/shm/{mine.name}").exists() and Path(f"/dev/shm/{leaked.name}").exists()
    finally:
        for shm in (mine, shared, leaked):
            shm.close()
            shm.unlink()


def test_a_refused_run_starts_nothing_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Catches a refused launch that made the run's temp dir or started its reaper before the
    check that refused it: no process started, no temp dir, /dev/shm as it was."""
    from recipes.launcher import launch as launcher

    started = []
    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or real(*a, **k))
    before_shm = set(os.listdir("/dev/shm"))
    before_tmp = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("mcore_dapo_")}
    argv = ["--device", "cpu", "--steps", "0", "--ckpt-dir", str(tmp_path / "run")]
    assert launcher.main(argv) == 2
    assert "error:" in capsys.readouterr().err
    assert started == []
    after_tmp = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("mcore_dapo_")}
    assert after_tmp == before_tmp and set(os.listdir("/dev/shm")) <= before_shm


def test_ray_and_torch_keep_their_dirs_beside_the_runs_temp_dir(monkeypatch, tmp_path):
    """Catches the run's own TMPDIR moving Ray's sessions (their logs would go with the run's
    temp dir) or torch inductor's cache (rebuilt every run): RunScope pins both where Ray and
    torch put them without it, with TMPDIR set or not."""
    from ray._common.utils import get_default_system_temp_dir
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from recipes.dapo.cluster.run_scope import kept_dirs

    for tmpdir in (None, str(tmp_path)):
        for name in ("TMPDIR", "RAY_TMPDIR", "TORCHINDUCTOR_CACHE_DIR"):
            monkeypatch.delenv(name, raising=False)
        if tmpdir:
            monkeypatch.setenv("TMPDIR", tmpdir)
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
        expected = {"RAY_TMPDIR": get_default_system_temp_dir()}
        assert kept_dirs() == {**expected, "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}


LEAKER = """
import os, signal, sys
from multiprocessing import get_context, resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
lock = get_context("spawn").Lock()  # a named semaphore, /dev/shm/sem.mp-*, while it lives
print(segment.name, flush=True)
# a kill of the whole group: the resource tracker that would unlink both goes first
os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_what_a_killed_process_leaked_in_dev_shm_is_removed_and_nothing_else():
    """Catches the leftovers a new user found after a few runs (issue 58: psm_* of killed vLLM
    engines, sem.mp-* semaphores): a process that made a segment and a semaphore and died
    between two of the reaper's samples. Made since `since` and mapped by no one: removed;
    a segment this process still maps, and one older than `since`: kept."""
    from recipes.dapo.cluster.reaper import remove_unowned

    shm = Path("/dev/shm")
    older = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(older._name, "shared_memory")  # left as a leak would be
    older.close()
    time.sleep(0.05)
    since, before = time.time(), set(os.listdir(shm))
    held = shared_memory.SharedMemory(create=True, size=4096)  # mapped here: in use
    try:
        out = subprocess.run([sys.executable, "-c", LEAKER], capture_output=True, text=True)
        leaked = set(os.listdir(shm)) - before - {held.name}
        assert out.stdout.strip() in leaked and any(n.startswith("sem.mp-") for n in leaked)
        count, size = remove_unowned(since)
        assert count == len(leaked) and size >= 1 << 16
        assert not leaked & set(os.listdir(shm))
        assert (shm / held.name).exists() and (shm / older.name).exists()
    finally:
        held.close()
        held.unlink()
        (shm / older.name).unlink(missing_ok=True)
