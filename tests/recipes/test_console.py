"""The launcher's console (recipes.dapo.console.screen): all output to the log, a short view on screen.

The step lines are made by verl's own console logger (`concat_dict_to_str`) from the recorded
main job (tests/data/dapo_cpu_metrics.jsonl), with Ray's prefix and colours as the driver
prints them; the other lines are ones the CPU run prints.
"""

import io
import json
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from verl.utils.logger.aggregate_logger import concat_dict_to_str

from backend.monitor.alarms import AlarmRules, HealthAlarms
from recipes.dapo.cluster import ray_job
from recipes.dapo.console.screen import (
    Console,
    clean,
    open_console,
    parse_step,
    step_line,
    warning_text,
)
from recipes.dapo.console.step_line import LEGEND
from recipes.local.cpu_overrides import TOY_ALARMS
from tests.backend.test_alarms import TINY_SHAPE

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

STREAM = Path(__file__).parents[1] / "data" / "dapo_cpu_metrics.jsonl"
RAY = "\x1b[36m(TaskRunnerV1 pid=6295)\x1b[0m "
TQ = ("(SimpleStorageUnit pid=6652) 2026-12-01 17:36:27,063 - WARNING - transfer_queue.utils"
      ".common - target_num_threads 8 should not exceed total physical CPU cores 2. Setting to 2.")  # fmt: skip
NOISE = [
    "(TaskRunnerV1 pid=6295)                  'log_prob_micro_batch_size': None,",
    "ray init kwargs: {'num_cpus': 32, 'runtime_env': {'env_vars': {'NCCL_DEBUG': 'WARN'}}}",
    "(TaskRunnerV1 pid=6295) Training Progress:  69%|######8   | 24/35 [04:13<01:59, 10.82s/it]",
    "(TaskRunnerV1 pid=6295) INFO:2026-12-01 17:43:40,424:Saving checkpoint to /x/global_step_30",
]


def verl_step_lines(shape: bool = False) -> list[str]:
    """The recorded steps as verl's driver prints them (numpy scalars, as its metrics are);
    `shape`: with the model's shape, which the monitor publishes since the recording."""
    rows = [json.loads(line) for line in STREAM.read_text().splitlines()]
    added = TINY_SHAPE if shape else {}
    return [RAY + concat_dict_to_str({k: np.float64(v) for k, v in (row["data"] | added).items()},
                                     step=row["step"]) for row in rows]  # fmt: skip


def console(tmp_path, **kwargs) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    log_path = tmp_path / "run.log"
    made = Console(log_path.open("w", buffering=1), log_path, out=out, **kwargs)
    return made, out


def test_verls_step_line_parses_back_to_its_metrics():
    line = verl_step_lines()[20]
    step, metrics = parse_step(clean(line))
    row = json.loads(STREAM.read_text().splitlines()[20])
    assert step == row["step"] == 20 and metrics == row["data"]
    assert parse_step(clean(NOISE[3])) is None


def test_warnings_are_told_from_values_progress_bars_and_info():
    assert warning_text(clean(TQ)) == (
        "- WARNING - transfer_queue.utils.common - target_num_threads 8 should not exceed total "
        "physical CPU cores 2. Setting to 2."
    )
    python_warning = ("/w/.venv/lib/python3.11/site-packages/megatron/core/models/backends.py:21:"
                      " UserWarning: Apex is not installed. Falling back to Torch Norm")  # fmt: skip
    assert warning_text(python_warning).startswith("megatron/core/models/backends.py:21: User")
    assert warning_text("WARNING [comm_share] step 3: communication takes 40%") is not None
    vllm = "(EngineCore pid=9) WARNING 12-01 17:35:41 [cpu.py:118] Pin memory is not supported"
    assert warning_text(clean(vllm)) == "WARNING [cpu.py:118] Pin memory is not supported"
    assert warning_text("ERROR worker.py:421 -- Unhandled error (suppress with ...)") is not None
    assert all(warning_text(clean(line)) is None for line in NOISE)
    assert len(warning_text("UserWarning: " + "x" * 500)) == 200


def test_one_line_per_step_each_warning_once_and_everything_in_the_log(tmp_path):
    con, out = console(tmp_path, total_steps=35, alarms=HealthAlarms(AlarmRules(**TOY_ALARMS)))
    steps = verl_step_lines(shape=True)
    fed = ["(TaskRunnerV1 pid=1) INFO:x:Total training steps: 35", *NOISE, *[TQ] * 500]
    for i, line in enumerate(steps):
        fed += [line, *NOISE, TQ.replace("pid=6652", f"pid={i}")]
    for line in fed:
        con.feed(line + "\n")
    con.child_done(0)
    shown = out.getvalue().splitlines()
    assert len(shown) < 60 and len(fed) == 721
    alarms = [s for s in shown if s.startswith("ALARM")]  # the recorded run's routing, once each
    assert [a.split(":")[0] for a in alarms] == [
        "ALARM [routing] step 1",
        "ALARM [routing] step 29",
    ]
    step_rows = [s for s in shown if s.startswith("[")]
    assert len(step_rows) == 36 and step_rows[-1].startswith("[" + "#" * 20 + "] 35/35")
    assert "val 1 " in step_rows[-1] or "val 1 |" in step_rows[-1]
    tq = [s for s in shown if "target_num_threads" in s]
    assert len(tq) == 2 and tq[1].startswith("  536x ")  # shown once, then counted at the end
    assert shown[-2:] == ["alarms: routing x2", f"log: {con.log_path}"]
    logged = con.log_path.read_text().splitlines()
    assert logged[: len(fed)] == fed  # every line, as it came, then every repeated warning
    assert logged[len(fed) :] == ["repeated warnings (1 of 1 distinct):", f"  536x {tq[0]}"]


def test_the_compact_step_line_names_what_a_step_is_judged_by():
    _, metrics = parse_step(clean(verl_step_lines(shape=True)[25]))
    line = step_line(25, 35, metrics)
    assert line.startswith(
        "[##############......] 25/35 | reward 0.0156 | val 0.438 | entropy 0.689"
    )
    for part in ("ppo_kl 0.0144", "grad 1.61", "|dlogp| 0.0152", "agree 0.965",
                 "route 3.97x/4 L1", "ep 1.00x", "7.3s", "comm 1%"):  # fmt: skip
        assert part in line, (part, line)  # route: layer 1's max/mean of the most, E/K = 8/2
    assert len(line) < 200
    _, unshaped = parse_step(clean(verl_step_lines()[25]))  # a stream without E and K
    assert "| route 3.97x L1 |" in step_line(25, 35, unshaped)
    assert step_line(0, None, {"val-aux/x/reward/mean@8": -1.9}) == "step 0 | val -1.9"


def test_alarms_print_their_line_and_are_kept_in_the_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    con = open_console(tmp_path, 0, False, 35, str(tmp_path / "tb"), AlarmRules(**TOY_ALARMS))
    out = io.StringIO()
    con.out = out
    for line in verl_step_lines()[:14]:
        con.feed(line.replace("actor/ppo_kl:np.float64(0.0062", "actor/ppo_kl:np.float64(0.62"))
    con.child_done(0)
    alarm_lines = [s for s in out.getvalue().splitlines() if s.startswith("ALARM")]
    assert len(alarm_lines) == 1 and alarm_lines[0].startswith(
        "ALARM [kl] step 13: ppo_kl 0.623 is above 0.1"
    )
    (kept,) = [json.loads(s) for s in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert kept["kind"] == "kl" and kept["step"] == 13 and kept["level"] == "alarm"
    assert "alarms: kl x1" in out.getvalue()
    con.close()
    assert (tmp_path / "logs" / "launch_000.log").is_file()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    (point,) = events.Scalars("alarms/kl")
    assert point.step == 13 and point.value == pytest.approx(0.6227, abs=1e-4)  # the measured value


def test_a_failed_child_shows_the_end_of_its_log(tmp_path):
    con, out = console(tmp_path)
    for i in range(40):
        con.feed(f"line {i}\n")
    con.feed("RuntimeError: the real reason\n")
    con.child_done(1)
    shown = out.getvalue()
    assert "exited with status 1" in shown and "  RuntimeError: the real reason" in shown
    assert "line 10\n" not in shown and "  line 39" in shown


def test_run_command_passes_every_child_line_through_the_console(tmp_path):
    child = ("import sys\nprint('step:1 - actor/entropy:0.5', flush=True)\n"
             "print('UserWarning: careful', file=sys.stderr, flush=True)\n"
             "print('chatter')\nsys.exit(5)\n")  # fmt: skip
    con, out = console(tmp_path, total_steps=1)
    assert ray_job.run_command([sys.executable, "-c", child], {}, con) == 5
    assert sorted(con.log_path.read_text().splitlines()) == sorted(
        ["step:1 - actor/entropy:0.5", "UserWarning: careful", "chatter"]
    )
    shown = out.getvalue()
    assert "1/1 | entropy 0.5" in shown and "UserWarning: careful" in shown
    assert "chatter" in shown  # only in the tail of a failed run
    assert con.child_over


def test_run_command_with_a_console_still_passes_sigterm_on(tmp_path):
    mark = tmp_path / "child-got-sigterm"
    child = (
        "import signal, sys, time, pathlib\n"
        f"def stop(*a): pathlib.Path({str(mark)!r}).write_text('x'); print('stopping'); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    con, _ = console(tmp_path)

    def terminate_when_ready() -> None:
        while "ready" not in con.log_path.read_text():
            time.sleep(0.05)
        import os

        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_ready, daemon=True).start()
    # the child stopped (its own status 7); the launcher's is the signal's (the CLI contract)
    assert ray_job.run_command([sys.executable, "-c", child], {}, con) == 143
    assert mark.read_text() == "x" and "stopping" in con.log_path.read_text()


def test_verbose_shows_every_line_as_it_comes(tmp_path):
    con, out = console(tmp_path, verbose=True)
    fed = [verl_step_lines()[3], *NOISE, TQ, TQ]
    for line in fed:
        con.feed(line + "\n")
    con.child_done(0)
    shown = out.getvalue().splitlines()
    assert shown[: len(fed)] == fed and shown[len(fed) :] == [
        "alarms: none",
        f"log: {con.log_path}",
    ]


def test_the_childs_own_traceback_is_held_then_shown_in_full(tmp_path, monkeypatch):
    """A traceback of the child's own is held (it may be a refusal, recipes.dapo.console.tracebacks);
    once the child has outlived it, it is shown in full and the lines held with it as they
    would have been. A Ray worker's traceback is not the child's: its error shows at once."""
    from recipes.dapo.console import tracebacks

    con, out = console(tmp_path, total_steps=35)
    worker = ["(WorkerDict pid=7) Traceback (most recent call last):",
              "(WorkerDict pid=7) KeyError: 'lost'"]  # fmt: skip
    own = ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "ValueError: bad"]
    for line in [*worker, *own, verl_step_lines()[1], TQ]:
        con.feed(line + "\n")
    assert out.getvalue().splitlines() == ["KeyError: 'lost'"]
    con.tick()  # not yet outlived
    monkeypatch.setattr(tracebacks, "HOLD_S", 0.0)
    con.tick()
    shown = out.getvalue().splitlines()
    assert shown[1:4] == own and shown[4] == LEGEND  # before the first step line
    assert shown[5].startswith("[....................]  1/35 | reward")
    assert "target_num_threads 8" in shown[6] and len(shown) == 7
    con.child_done(0)
    assert "Traceback" not in "".join(out.getvalue().splitlines()[7:])


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_status_line_that_the_next_line_clears(tmp_path):
    con, _ = console(tmp_path, total_steps=35)
    con.out = Terminal()
    con.feed(NOISE[2] + "\n")  # a progress bar of verl's: logged, and shown as the status
    status = con.out.getvalue()
    assert (
        status.startswith("\r\x1b[K[....................]  0/35 ") and "Training Progress" in status
    )
    con.feed(verl_step_lines()[1] + "\n")
    after = con.out.getvalue()[len(status) :]
    # cleared, then the legend (the first step line's) and the step
    assert after.startswith(f"\r\x1b[K{LEGEND}\n[....................]  1/35 | ")
    assert "\r" not in con.log_path.read_text()


def test_repeats_that_differ_only_in_request_and_actor_ids_are_one_warning(tmp_path):
    """Bug caught: a lost rollout node's hundreds of agent-loop errors, one per request uid
    and Ray actor id, each shown as a new warning (236 console lines in one such run)."""
    con, out = console(tmp_path, total_steps=3)
    uids = ["c44cbac2-a4c1-4357-aa7c-2e12560abc96", "230d0b03-3917-46a9-9156-301fe63ca310"]
    actors = ["17642924d381ad2440eff6b201000000", "4a25afb338a79d9944b9f20401000000"]
    for uid in uids * 50:
        con.feed(f"{RAY}ERROR Error in _run_prompt for uid={uid}\n")
    for actor in actors * 50:
        con.feed(f"{RAY}ray.exceptions.ActorUnavailableError: The actor {actor} is unavailable: The actor is temporarily unavailable\n")  # fmt: skip
    shown = out.getvalue().splitlines()
    assert [s for s in shown if "_run_prompt" in s] == [
        f"ERROR Error in _run_prompt for uid={uids[0]}"
    ]
    assert len([s for s in shown if "ActorUnavailableError" in s]) == 1
