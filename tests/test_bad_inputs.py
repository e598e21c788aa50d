"""Each bad input of tests/support/bad_inputs.py gives its exit code and exactly its one line, with
no output and no side effect left; docs/bad_inputs.md is the table of exactly these rows."""

import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.support.bad_inputs import CASES, Case, Ctx, table
from tests.support.bad_inputs_model import BROKEN_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _main(cli: str):
    if cli == "converters":
        from converters.cli import main
    elif cli == "parallel":
        from parallel.cli import main
    elif cli == "launcher":
        from recipes.launcher.launch import main
    elif cli == "ray_node":
        from recipes.dapo.cluster.ray_node import main
    elif cli == "resolve":
        from tests.support.bad_inputs import resolve_script

        main = resolve_script().main
    else:
        from backend.monitor.cli import main
    return main


def _pattern(message: str, ctx: Ctx) -> re.Pattern:
    known = {
        "tmp": str(ctx.tmp),
        "hf": str(ctx.hf),
        "mcore": str(ctx.mcore),
        "pid": str(os.getpid()),
    }
    parts, at = [], 0
    for match in PLACEHOLDER.finditer(message):
        parts.append(re.escape(message[at : match.start()]))
        name = match[1]
        parts.append(re.escape(known[name]) if name in known else ".+?")
        at = match.end()
    return re.compile("".join(parts) + re.escape(message[at:]))


@pytest.fixture(scope="module")
def sources(tiny_hf_dir, tmp_path_factory):
    from converters.convert import convert_hf_to_mcore

    return tiny_hf_dir, convert_hf_to_mcore(tiny_hf_dir, tmp_path_factory.mktemp("bad") / "mcore")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.cli}: {c.what}" for c in CASES])
def test_bad_input(case: Case, sources, tmp_path, capsys, monkeypatch):
    from recipes.dapo.cluster import ray_job

    real_run = ray_job.run_command
    monkeypatch.setattr(ray_job, "run_command", lambda cmd, *a, **kw: pytest.fail(f"started {cmd}"))
    ctx = Ctx(tmp_path, *sources)
    argv = [str(a) for a in case.setup(ctx)]
    if case.child:  # the training child's place taken by the case's stand-in
        child = [sys.executable, "-c", case.child(ctx)]
        monkeypatch.setattr(
            ray_job, "run_command", lambda cmd, env, *a, **kw: real_run(child, env, *a, **kw)
        )
    capsys.readouterr()
    started = time.perf_counter()
    try:
        code = _main(case.cli)(argv)
    finally:
        getattr(ctx, "release", lambda: None)()
    out, err = capsys.readouterr()
    assert code == case.code, (out, err)
    if case in BROKEN_MODEL_DIR:  # headers and config only: seconds, before Ray
        assert time.perf_counter() - started < 15.0
    pattern = _pattern(case.message, ctx)
    if case.stream == "err":
        assert err.count("\n") == 1 and pattern.fullmatch(err.rstrip("\n")), err
    else:
        assert any(pattern.fullmatch(line) for line in out.splitlines()), out
    if case.child:  # the training child's traceback only in the launch's log
        assert "Traceback" not in out, out
    assert not {"out", "o", "pwned"} & {
        p.name for p in tmp_path.iterdir()
    }  # nothing written, nothing run
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or p.name.endswith(".lock")]


def test_every_cli_has_its_rows_and_the_table_is_current():
    counts = {
        cli: sum(c.cli == cli for c in CASES)
        for cli in ("converters", "parallel", "launcher", "monitor")
    }
    assert (
        counts["converters"] >= 20
        and counts["parallel"] + counts["launcher"] >= 12
        and counts["monitor"] >= 8
    )
    assert (REPO / "docs" / "bad_inputs.md").read_text() == table(), (
        "run: python -m tests.support.bad_inputs > docs/bad_inputs.md"
    )
