"""The routing report's HTML page (backend.monitor.render) for a run the way the engine records
one: trainer steps of several optimizer updates, the old-log-prob pass counted with each step's
first update (with the rollout mismatch), the engine's warnings and the launcher's alarms."""

import json
import re

import pytest
import torch

from backend.model.router_replay import agreement_metrics
from backend.monitor.history import LoadHistory
from backend.monitor.render import render
from backend.monitor.report import build_report, load_report, save_report, with_warnings

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

LAYERS, EXPERTS, UPDATES_PER_STEP = 2, 8, 4
PLAN = {"tp": 1, "ep": 1, "pp": 1, "cp": 1, "dp": 1, "etp": 1, "edp": 1, "world": 1}
ALARM = {"kind": "entropy_floor", "step": 2, "level": "alarm", "measured": 0.01,
         "text": "policy entropy 0.01 is below the floor 0.05; usual causes: ..."}  # fmt: skip
SKEW = {"kind": "ep_skew", "step": 5, "trainer_step": 2, "text": "EP skew 2.5x at layer 1"}


def _mismatch(trainer_step: int) -> dict:
    same_L = torch.tensor([100, 100 - 10 * trainer_step])
    return {**agreement_metrics(same_L, torch.full((LAYERS,), 100)),
            "actor/rollout_logprob_abs_diff/mean": 1e-3 * trainer_step,
            "actor/rollout_logprob_abs_diff/p99": 5e-3, "actor/rollout_logprob_abs_diff/max": 1e-2}  # fmt: skip


def trainer_run(path, trainer_steps=2, named=True):
    """`trainer_steps` steps of 4 updates; update u puts u tokens on expert 0 of layer 0."""
    history = LoadHistory(("update", "old_log_prob"), LAYERS, EXPERTS, 1, 4)
    for update in range(1, trainer_steps * UPDATES_PER_STEP + 1):
        step, first = (update - 1) // UPDATES_PER_STEP + 1, update % UPDATES_PER_STEP == 1
        counts_PLE = torch.full((2, LAYERS, EXPERTS), 10, dtype=torch.int64)
        counts_PLE[0, 0, 0] += update
        if not first:
            counts_PLE[1] = 0
        history.add(update, counts_PLE, {"moe/aux_loss/total": 0.01 * update},
                    mismatch=_mismatch(step) if first else None,
                    trainer_step=step if named else None)  # fmt: skip
    report = build_report(history, PLAN, model="/models/Qwen3-30B-A3B", top_k=2,
                          warnings=[SKEW], run="qwen3-30b-a3b-a2-tp4-ep8",
                          trainer_steps=trainer_steps)  # fmt: skip
    return save_report(report, path)


def test_the_phases_share_the_trainer_step_axis(tmp_path):
    report = load_report(trainer_run(tmp_path / "r.json"))
    assert report.on_trainer_steps and report.axis_label == "trainer step"
    for phase in ("update", "old_log_prob"):  # update 1..8 and 1, 5 before: now both 1, 2
        steps, curve_SL = report.trainer_curve(phase, "max_over_mean")
        assert steps == [1, 2] and curve_SL.shape == (2, LAYERS)
    _, curve_SL = report.trainer_curve("update", "max_over_mean")
    each = [(10 + u) / ((80 + u) / 8) for u in range(1, 9)]  # layer 0, update u: max / mean
    assert curve_SL[:, 0].tolist() == pytest.approx([sum(each[:4]) / 4, sum(each[4:]) / 4])
    steps, series = report.series("mismatch", ["moe/routing_agreement/layer_01"])
    assert steps == [1, 2] and series["moe/routing_agreement/layer_01"] == pytest.approx([0.9, 0.8])
    older = load_report(trainer_run(tmp_path / "o.json", named=False))  # before trainer_step
    assert older.axis_label == "optimizer update"
    assert older.trainer_curve("old_log_prob", "max_over_mean")[0] == [1, 5]


def test_the_page_names_run_and_model_counts_what_it_holds_and_shows_mismatch_and_alarms(
    tmp_path,
):
    path = trainer_run(tmp_path / "r.json")
    data = with_warnings(json.loads(path.read_text()), [ALARM])
    html = render(load_report(save_report(data, path)), tmp_path / "page") / "index.html"
    page = html.read_text()
    title = "Routing balance: qwen3-30b-a3b-a2-tp4-ep8 (Qwen3-30B-A3B)"
    assert f"<title>{title}</title>" in page and f"<h1>{title}</h1>" in page
    cells = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", page)
    assert ("trainer steps", "2 (1-2)") in cells and ("optimizer updates", "8 (1-8)") in cells
    assert ("window", "4 optimizer updates") in cells
    assert "rollout vs actor: routing agreement and log-prob mismatch" in page
    for png in ("agreement.png", "logprob_diff.png", "update_imbalance.png",
                "old_log_prob_imbalance.png", "aux_loss.png"):  # fmt: skip
        assert f'src="{png}"' in page and (tmp_path / "page" / png).is_file()
    assert "1 alarm(s), 1 warning(s)" in page
    assert "<td>alarm</td><td>step 2</td><td>entropy_floor</td>" in page
    assert "<td>warning</td><td>step 2 (update 5)</td><td>ep_skew</td>" in page


def test_alarms_join_the_reports_warnings_once_in_step_order():
    report = {"warnings": [SKEW]}
    merged = with_warnings(report, [ALARM, {**ALARM, "step": 1}])
    assert [w["step"] for w in merged["warnings"]] == [1, 2, 5]
    assert with_warnings(merged, [ALARM])["warnings"] == merged["warnings"]
    assert report == {"warnings": [SKEW]}  # not changed in place


def test_the_run_report_takes_the_launchers_alarms(tmp_path):
    from recipes.dapo.console.health_report import routing_report

    moe = trainer_run(tmp_path / "moe_report.json")
    (tmp_path / "alarms.jsonl").write_text(json.dumps(ALARM) + "\n" + '{"torn": ')
    written = routing_report(moe, tmp_path)
    kept = json.loads(written["routing_report"].read_text())["warnings"]
    assert [w["kind"] for w in kept] == ["entropy_floor", "ep_skew"]
    assert "policy entropy 0.01 is below the floor" in written["routing_html"].read_text()
    assert routing_report(tmp_path / "missing.json", tmp_path) == {}
