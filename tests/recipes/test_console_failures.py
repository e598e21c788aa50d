"""A failed training child told on the console in one line that names its cause
(recipes.dapo.console.tracebacks.cause_in, Console.failure_line), from recorded runs:

tests/data/failed_worker_stream.log: the end of a run whose actor worker could not load the
model (config.json edited after the save: `converters.table.MappingError` inside the worker,
wrapped twice in Ray's RayTaskError by the driver, then Hydra's hint), recorded before the
launcher checked model directories; tests/data/failed_config_stream.log: a run whose engine
config was refused where Hydra instantiates it (`EngineConfigError('...')`, no traceback).
Paths in both are shortened to /repo and /run."""

import io
from pathlib import Path

import pytest

from recipes.dapo.console.screen import HYDRA_HINT, Console
from recipes.dapo.console.tracebacks import CAUSE_CHARS, cause_in

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

DATA = Path(__file__).parents[1] / "data"


def _fail(tmp_path, stream: str, code: int = 1) -> tuple[Console, list[str]]:
    out, log_path = io.StringIO(), tmp_path / "launch_000.log"
    console = Console(log_path.open("w", buffering=1), log_path, out=out, device="cpu")
    for raw in (DATA / stream).read_text(encoding="utf-8").splitlines():
        console.feed(raw)
    console.child_done(code)
    console.close()
    return console, out.getvalue().splitlines()


def test_a_workers_error_is_named_on_the_error_line(tmp_path):
    """Catches the error line saying only 'exited with status 1' (and Hydra's hint) while the
    cause (the worker's MappingError) sits in the log: the innermost exception, not Ray's
    RayTaskError wrapper, one line, with the log's path."""
    console, shown = _fail(tmp_path, "failed_worker_stream.log")
    line = console.failure_line(1)
    assert line.startswith(
        "error: verl's trainer exited with status 1: converters.table.MappingError: HF "
        "checkpoint lacks weights: model.layers.0.mlp.experts.8.gate_proj.weight"
    )
    assert line.endswith(f"... (log: {tmp_path / 'launch_000.log'})") and "\n" not in line
    assert len(console.cause) == CAUSE_CHARS
    # the traceback is still shown above (the end of the log), Hydra's hint is not
    assert "the training job exited with status 1; the log ends with:" in shown
    assert any("converters.table.MappingError: HF checkpoint lacks weights" in s for s in shown)
    assert not any(HYDRA_HINT in s for s in shown), shown
    assert shown[-1] == f"log: {tmp_path / 'launch_000.log'}"


def test_a_config_target_hydra_could_not_build_is_named(tmp_path):
    console, shown = _fail(tmp_path, "failed_config_stream.log")
    assert console.cause == (
        "EngineConfigError: recompute='sometimes': choose one of ('none', 'selective', "
        "'full') (or a bool)"
    )
    assert not any(HYDRA_HINT in s for s in shown)


def test_the_root_of_a_chained_exception_is_its_cause():
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in f',
        "KeyError: 'layers'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        "RuntimeError: could not build the model",
    ]
    assert cause_in(lines) == "KeyError: 'layers'"
    assert cause_in(lines[-1:]) == "RuntimeError: could not build the model"
    assert cause_in(["Note: a plain line", "INFO:x: not an error"]) is None


def test_a_failure_with_no_exception_shows_the_logs_end(tmp_path):
    """A child that died without a traceback (killed by the OOM killer): no cause to name, so
    the console shows the end of its log instead, still without Hydra's hint."""
    log = tmp_path / "l.log"
    console = Console(log.open("w", buffering=1), log, out=(out := io.StringIO()), device="cpu")
    for raw in ("step 1 done", f"{HYDRA_HINT} for a complete stack trace."):
        console.feed(raw)
    console.child_done(137)
    console.close()
    assert console.cause is None
    assert console.failure_line(137) == f"error: verl's trainer exited with status 137 (log: {log})"
    assert "the training job exited with status 137; the log ends with:" in out.getvalue()
    assert HYDRA_HINT not in out.getvalue()
