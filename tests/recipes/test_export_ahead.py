"""The finish's export, ready when verl's processes end (recipes.local.export_ahead): when its
process starts and exports, what the finish takes of it, and what a cancelled one leaves. The
process is the real `main` with a stand-in export; the trainer test
(tests/recipes/test_verl_cpu_trainer.py) runs the real export through the launcher."""

import json
import subprocess
import sys
import time
from pathlib import Path

from recipes.local.export_ahead import NICE, ExportAhead, logged_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
EXPORT = "print('wrote it'); return out, 1e-6"  # the stand-in check_export's body


class StandIn(ExportAhead):
    """export_ahead.main with check_export's body `body` and a preload that leaves a mark."""

    body = EXPORT

    def command(self) -> list[str]:
        marker = Path(self.args[-1]).parent / "started"
        code = f"""
import sys, time
from recipes.local import export, export_ahead
export.preload = lambda: open({str(marker)!r}, "a").write("x\\n")
def check_export(actor, template, out):
    {self.body}
export.check_export = check_export
sys.exit(export_ahead.main({self.args!r}))
"""
        return [sys.executable, "-c", code]


def _checkpoint(run: Path, sealed: bool = True, logged: bool = True) -> Path:
    actor = run / "checkpoints" / f"global_step_{STEPS}" / "actor"
    (actor / "model" / "dist_ckpt").mkdir(parents=True, exist_ok=True)
    (actor / "meta.json").write_text("{}")
    if sealed:
        (actor / "model" / "dist_ckpt" / "manifest.json").write_text("{}")
    rows = [{"step": s, "data": {}} for s in range(1, STEPS + (1 if logged else 0))]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": '  # a row being written
    (run / "launch_000.jsonl").write_text(text)
    return actor


def _ahead(run: Path, preload: bool = True, cls=StandIn) -> ExportAhead:
    run.mkdir(exist_ok=True)
    checkpoints, metrics = run / "checkpoints", run / "launch_000.jsonl"
    return cls(checkpoints, metrics, STEPS, run / "model", run / "export", preload).start()


def _started(run: Path, wait_s: float = 0.0) -> int:
    marker, deadline = run / "started", time.time() + wait_s
    while not marker.is_file() and time.time() < deadline:
        time.sleep(0.1)
    return len(marker.read_text().split()) if marker.is_file() else 0


def test_logged_step_reads_the_rows_verl_wrote(tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert not logged_step(metrics, 1)  # no file yet
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert logged_step(metrics, 2) and not logged_step(metrics, 3)


def test_the_export_imports_early_and_waits_for_the_sealed_logged_checkpoint(tmp_path):
    """Bug caught: an export of a checkpoint still being written (no manifest yet), or one
    started during the last validation (its row not yet written)."""
    ahead = _ahead(tmp_path)
    assert _started(tmp_path, wait_s=30) == 1  # imports during verl's start-up
    # below Ray's workers (nice 15): bug caught, the preload's imports delaying verl's start-up
    stat = Path(f"/proc/{ahead._proc.pid}/stat").read_text()
    assert int(stat[stat.rindex(")") + 2 :].split()[16]) == NICE == 19
    _checkpoint(tmp_path, sealed=False)
    time.sleep(1.5)
    assert not (tmp_path / "export").exists() and ahead._proc.poll() is None  # still waiting
    actor = _checkpoint(tmp_path)
    taken = ahead.take(actor)
    assert taken is not None and (taken.export, taken.diff) == (tmp_path / "export", 1e-6)
    assert taken.output == "wrote it"  # to the run's log


def test_a_run_that_ends_without_its_checkpoint_ends_the_wait(tmp_path):
    """Bug caught: the finish waiting for an export that can never start (the run saved no
    final step), or taking an export of a checkpoint still unsealed or not logged."""
    for sealed, logged in ((False, True), (True, False)):
        run = tmp_path / f"{sealed}{logged}"
        ahead = _ahead(run)
        actor = _checkpoint(run, sealed=sealed, logged=logged)
        _started(run, wait_s=30)
        began = time.perf_counter()
        assert ahead.take(actor) is None
        assert time.perf_counter() - began < 5


def test_a_checkpoint_ready_just_before_the_end_is_taken(tmp_path):
    """Bug caught: the run's end seen before a last look, its export thrown away and made
    again in the finish."""
    ahead = _ahead(tmp_path)
    _started(tmp_path, wait_s=30)
    assert ahead.take(_checkpoint(tmp_path)) is not None


def test_beyond_four_ranks_the_process_starts_once_the_checkpoint_is_ready(tmp_path):
    """Bug caught: ~0.35 GB of imports held through a run whose ranks bind memory."""
    ahead = _ahead(tmp_path, preload=False)
    time.sleep(1.5)
    assert _started(tmp_path) == 0
    actor = _checkpoint(tmp_path)
    assert _started(tmp_path, wait_s=30) == 1
    assert ahead.take(actor) is not None


def test_another_checkpoint_or_a_failed_export_is_not_taken(tmp_path):
    """Bug caught: the finish reporting an export of a step it did not pick, or a failed one."""
    run = tmp_path / "a"
    ahead = _ahead(run)
    actor = _checkpoint(run)
    assert ahead.take(actor.parent.parent / "global_step_1" / "actor") is None

    class Failing(StandIn):
        body = "raise RuntimeError('it broke')"

    run = tmp_path / "b"
    ahead = _ahead(run, cls=Failing)
    assert ahead.take(_checkpoint(run)) is None


def test_a_failed_run_ends_the_export(tmp_path):
    class Slow(StandIn):
        body = "time.sleep(60)"

    ahead = _ahead(tmp_path, cls=Slow)
    _checkpoint(tmp_path)
    _started(tmp_path, wait_s=30)
    time.sleep(1.0)  # in the export
    began = time.perf_counter()
    ahead.cancel()
    assert time.perf_counter() - began < 5 and ahead._proc.poll() is not None


def test_an_ended_export_leaves_no_half_written_output(tmp_path):
    """Bug caught: the export process killed by the cancel with its temp dir left beside the
    export (SIGTERM ends Python without its cleanup unless handled)."""
    actor = _checkpoint(tmp_path)
    out, began = tmp_path / "export_hf", tmp_path / "began"
    code = f"""
import time
from pathlib import Path
from converters.atomic import atomic_dir
from recipes.local import export, export_ahead

def check_export(actor, template, out):
    with atomic_dir(out, force=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        Path({str(began)!r}).write_text("in")
        time.sleep(60)

export.check_export, export.preload = check_export, lambda: None
export_ahead.main([{str(actor.parents[1])!r}, {str(tmp_path / "launch_000.jsonl")!r}, "{STEPS}",
                   "t", {str(out)!r}])
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE)
    deadline = time.time() + 60
    while not began.is_file() and time.time() < deadline:
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=10) == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "began",
        "checkpoints",
        "launch_000.jsonl",
    ]
