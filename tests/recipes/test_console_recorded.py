"""The console on the main job's recorded CPU run, as a person reads it (recipes.dapo.console.screen,
recipes.dapo.console.filters).

tests/data/main_console_stream.log is that run's child output (colours and Ray's prefixes as
they came), trimmed: verl's printed config and vLLM's argument list dropped, the step lines
cut to the metrics the console reads, the engine's aux-loss line in its `config:` form.
tests/data/main_finish_stderr.log is what the export's reload printed during the finish.
A fake clock follows the lines' own timestamps (0.05 s a line without one), so that the
start-up lines come as they would have.
"""

import io
import re
import sys
from pathlib import Path

import pytest

from recipes.dapo.console.filters import NOT_APPLICABLE, STARTUP_EVERY_S, STILL_EVERY_S
from recipes.dapo.console.screen import NUMBER, RAY_PREFIX, Console, clean, warning_text
from recipes.dapo.console.step_line import LEGEND

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

DATA = Path(__file__).parents[1] / "data"
STREAM = DATA / "main_console_stream.log"
FINISH = DATA / "main_finish_stderr.log"
STARTING = re.compile(r"^starting: (.+) \((\d+) s\)$")
STILL = re.compile(r"^  \.\.\. (\d+) s$")
STAMP = re.compile(r"\d\d-\d\d (\d\d):(\d\d):(\d\d)")


class Clock:
    """The recorded run's seconds: the first timestamped line at 5 s (the launcher's own
    start before it)."""

    def __init__(self):
        self.now, self.first = 0.0, None

    def __call__(self) -> float:
        return self.now

    def line(self, raw: str) -> None:
        self.now += 0.05
        if m := STAMP.search(raw):
            at = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
            self.first = at if self.first is None else self.first
            self.now = max(self.now, 5.0 + at - self.first)


@pytest.fixture(scope="module")
def shown(tmp_path_factory) -> tuple[list[str], str]:
    """The recorded run through a CPU run's Console: (the console's lines, the log)."""
    tmp = tmp_path_factory.mktemp("console")
    out, clock, log_path = io.StringIO(), Clock(), tmp / "launch_000.log"
    console = Console(log_path.open("w", buffering=1), log_path, out=out, device="cpu",
                      clock=clock, _started=0.0)  # fmt: skip
    for raw in STREAM.read_text(encoding="utf-8").splitlines():
        clock.line(raw)
        console.feed(raw)
        console.tick()
    console.child_done(0)
    with console.capture():  # the finish: the export's reload prints its warnings
        sys.stderr.write(FINISH.read_text(encoding="utf-8"))
    console.close()
    return out.getvalue().splitlines(), log_path.read_text(encoding="utf-8")


def test_no_warning_twice_whatever_rays_nested_prefix(shown):
    """Catches vLLM's warnings shown twice, once plain and once as `(vLLMHttpServer pid=1)
    (EngineCore pid=2) WARNING ...`: only the outer prefix was taken off."""
    assert clean("(A pid=1) (EngineCore pid=2) WARNING x") == "WARNING x"
    lines, _ = shown
    keys = [NUMBER.sub("#", RAY_PREFIX.sub("", line)) for line in lines if "WARN" in line]
    assert len(keys) == len(set(keys))
    assert not any("pid=" in line for line in lines)


def test_notices_that_do_not_apply_go_to_the_log_with_a_count(shown):
    """Catches a CPU run's console listing vLLM's and torch's CPU-stack notices (no libnuma,
    no Triton, no IPC, eager mode, LoRA updates, deprecations) as if they were problems."""
    lines, log = shown
    warned = [warning_text(clean(raw)) or "" for raw in log.splitlines()]
    held = [n for n in NOT_APPLICABLE if any(n.pattern.search(text) for text in warned)]
    assert len(held) == len(NOT_APPLICABLE)  # every rule is for a notice the run printed
    for notice in NOT_APPLICABLE:
        assert not any(notice.pattern.search(line) for line in lines), notice.reason
    count = [line for line in lines if line.startswith("held back ")]
    assert len(count) == 1
    assert re.match(
        r"held back \d+ library notices that do not apply to a CPU run \(log: ", count[0]
    )
    assert "held back (do not apply to this run):" in log
    assert lines.index(count[0]) < lines.index(next(x for x in lines if x.startswith("log: /")))


def test_the_aux_loss_setting_is_a_config_line(shown):
    """Catches the router aux loss's settings printed as a WARNING."""
    lines, _ = shown
    config = [line for line in lines if "router aux loss" in line]
    assert config == ["config: router aux loss: on, balance global_batch coeff=0.001, "
                      "f from the old-log-prob pass, tokens=all"]  # fmt: skip


def test_the_legend_once_before_the_first_step_line(shown):
    """Catches a step line a person cannot read (`route 3.76x/4 L1`) or a legend repeated."""
    lines, _ = shown
    assert lines.count(LEGEND) == 1
    first_step = next(i for i, line in enumerate(lines) if line.startswith("[") and "/35" in line)
    assert lines.index(LEGEND) == first_step - 1
    for field in ("reward", "val", "entropy", "ppo_kl", "grad", "|dlogp|", "agree", "route",
                  "ep", "comm"):  # fmt: skip
        assert f"{field} " in LEGEND or f"{field} =" in LEGEND


def test_start_up_names_each_phase_once_until_the_first_step(shown):
    """Catches a silent start-up, start-up lines that keep coming once the steps do, and a
    phase's name repeated every 15 s (`starting: the first validation (592 s)`, `(607 s)`,
    `(622 s)`...): a lasting phase gets its time alone, at most once a minute."""
    lines, _ = shown
    first_step = lines.index(LEGEND)
    starting = [(i, STARTING.match(line)) for i, line in enumerate(lines)]
    starting = [(i, m.group(1), int(m.group(2))) for i, m in starting if m]
    assert len(starting) >= 4 and all(i < first_step for i, _, _ in starting)
    phases = [p for _, p, _ in starting]
    assert len(phases) == len(set(phases))  # each phase named once, in the order they come
    assert {"verl's driver and data", "vLLM rollout", "the first validation"} <= set(phases)
    assert starting[0][2] >= STARTUP_EVERY_S
    still = [int(m.group(1)) for line in lines[:first_step] if (m := STILL.match(line))]
    for a, b in zip(still, still[1:], strict=False):
        assert b - a >= STILL_EVERY_S  # a lasting phase: its time, at most once a minute


def test_the_summary_is_free_of_the_reloads_warnings(shown):
    """Catches megatron-core's and torch's FutureWarnings of the export's reload printed
    after the `log:` line, inside the summary."""
    lines, log = shown
    after = lines[next(i for i, x in enumerate(lines) if x.startswith("log: /")) :]
    assert not any("Warning" in line for line in after)
    assert "`load_state_dict` is deprecated" in log  # in the log, as it came


def test_the_recorded_runs_console_is_short(shown):
    """The main job's console was 84 lines; each rule above takes lines off it."""
    lines, _ = shown
    warnings = [line for line in lines if "WARN" in line or "Warning" in line]
    assert not warnings, warnings  # every warning of the run is one that does not apply
    assert len(lines) < 84


def test_wall_time_and_start_up_count_from_the_process_start():
    """Catches the wall time counted from the launcher's `run()` (after Python's start and its
    imports, seconds the person waited): launched_at is this process's start."""
    import time

    from recipes.launcher.launch import launched_at

    t0 = launched_at()
    assert t0 <= time.perf_counter() - 0.5  # pytest has run its imports and this module's
