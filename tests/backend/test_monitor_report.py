"""Report JSON, HTML rendering and the compare CLI on crafted routing histories."""

import json

import pytest
import torch

from backend.monitor.cli import main
from backend.monitor.history import LoadHistory
from backend.monitor.report import SCHEMA_VERSION, build_report, load_report, save_report

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

LAYERS, EXPERTS = 4, 16
BALANCED_LE = torch.full((LAYERS, EXPERTS), 50, dtype=torch.int64)


def _collapsed_LE(layer: int) -> torch.Tensor:
    counts = BALANCED_LE.clone()
    counts[layer] = 5
    counts[layer, :3] = 300  # three experts take most of the layer's tokens
    return counts


def _write(path, steps_LE, ep=2, window=2, model="run"):
    history = LoadHistory(("update",), LAYERS, EXPERTS, ep, window)
    for step, counts_LE in enumerate(steps_LE):
        history.add(step, counts_LE[None], {"moe/aux_loss": 0.1})
    plan = {"tp": 1, "ep": ep, "pp": 1, "cp": 1, "dp": ep, "etp": 1, "edp": 1, "world": ep}
    return save_report(build_report(history, plan, model=model, top_k=2), path)


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_roundtrip(tmp_path):
    path = _write(tmp_path / "a.json", [BALANCED_LE] * 3)
    report = load_report(path)
    assert report.shape == (LAYERS, EXPERTS) and report.ep == 2
    assert report.cumulative("update").sum() == 3 * LAYERS * EXPERTS * 50
    assert [w["complete"] for w in report.windows("update")] == [True, False]
    assert report.meta["steps"] == 3 and report.meta["top_k"] == 2
    steps, curve_SL = report.step_curve("update", "max_over_mean")
    assert steps == [0, 1, 2] and curve_SL.shape == (3, LAYERS) and (curve_SL == 1.0).all()


def test_render_writes_html_and_images(tmp_path, capsys):
    report = _write(tmp_path / "a.json", [BALANCED_LE, _collapsed_LE(1)])
    out = tmp_path / "html"
    code, _, err = _cli(capsys, "render", report, "-o", out)
    assert code == 0, err
    html = (out / "index.html").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "aux_loss.png",
        "update_ep_load.png",
        "update_heatmap.png",
        "update_imbalance.png",
    ]
    assert all(f'src="{name}"' in html for name in pngs)
    assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    code, _, err = _cli(capsys, "render", report, "-o", out)
    assert (
        code == 2
        and err == f"error: {out} exists: pass --force to replace it or choose another directory\n"
    )
    assert _cli(capsys, "render", report, "-o", out, "--force")[0] == 0  # replaces its own dir


def test_outputs_one_writer_and_dead_runs_temp_dirs_removed(tmp_path, capsys):
    """render and compare share backend.shared.atomic_outputs' lock and pid-named temp dirs."""
    import os

    from backend.monitor.compare import Side, Thresholds, compare
    from backend.monitor.compare_render import render_compare
    from backend.monitor.render import render
    from backend.monitor.report import ReportError
    from backend.shared.atomic_outputs import output_lock
    from tests.support.bad_inputs import dead_pid

    a = _write(tmp_path / "a.json", [BALANCED_LE, _collapsed_LE(2)])
    stale = tmp_path / f".cmp.tmp-{dead_pid()}-0badc0de"  # a compare killed by SIGKILL
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / f".cmp.tmp-{os.getppid()}-feedf00d"  # our parent's: alive, kept
    live.mkdir()
    code, _, err = _cli(capsys, "compare", a, a, "-o", tmp_path / "cmp")
    assert code == 0, err
    assert not stale.exists() and live.is_dir() and (tmp_path / "cmp" / "compare.json").is_file()
    live.rmdir()

    with output_lock((tmp_path / "cmp").absolute(), ReportError):  # another writer holds it
        code, out, err = _cli(capsys, "compare", a, a, "-o", tmp_path / "cmp", "--force")
        refused = (
            f"error: {tmp_path}/cmp is being written by another process (pid {os.getpid()}, "
            f"lock {tmp_path}/.cmp.lock): wait for it to finish or choose another output\n"
        )
        assert code == 2 and out == "" and err == refused
        with pytest.raises(ReportError, match="is being written by another process"):
            render(load_report(a), tmp_path / "cmp")  # the code path, force=True by default
    side = Side("a", BALANCED_LE, 2)
    render_compare(compare(side, side, Thresholds()), side, side, tmp_path / "cmp")  # replaces
    render(load_report(a), tmp_path / "html")
    render(load_report(a), tmp_path / "html")  # code callers re-render their own dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "cmp", "html"]


def test_compare_identical_is_quiet(tmp_path, capsys):
    a = _write(tmp_path / "a.json", [BALANCED_LE, _collapsed_LE(2)])
    b = _write(tmp_path / "b.json", [BALANCED_LE, _collapsed_LE(2)])
    code, out, err = _cli(capsys, "compare", a, b, "-o", tmp_path / "cmp")
    assert code == 0, err
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["sentences"] == [] and out.startswith("no layer changed notably")
    assert all(row["jsd"] == 0.0 for row in result["layers"])


def test_compare_same_distribution_resampled_is_quiet(tmp_path, capsys):
    probs_E = torch.linspace(1.0, 3.0, EXPERTS)  # unbalanced, but the same in both runs
    generator = torch.Generator().manual_seed(0)

    def sample():
        draws = torch.multinomial(probs_E, 4000 * LAYERS, replacement=True, generator=generator)
        return torch.stack([d.bincount(minlength=EXPERTS) for d in draws.view(LAYERS, -1)])

    a = _write(tmp_path / "a.json", [sample()])
    b = _write(tmp_path / "b.json", [sample()])
    code, out, err = _cli(capsys, "compare", a, b, "-o", tmp_path / "cmp")
    assert code == 0 and out.startswith("no layer changed notably"), err + out


def test_compare_flags_collapse_across_ep_degrees(tmp_path, capsys):
    a = _write(tmp_path / "a.json", [BALANCED_LE] * 2, ep=2, model="ep2")
    b = _write(tmp_path / "b.json", [_collapsed_LE(3)] * 2, ep=4, model="ep4")
    code, out, err = _cli(capsys, "compare", a, b, "-o", tmp_path / "cmp")
    assert code == 0, err
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    # 3 x 300 of 900 + 13 x 5 = 965 tokens: top 3 take 93%, was 3 / 16 = 19%
    assert result["sentences"][0].startswith(
        "layer 3: top 3 experts now take 93% of tokens, was 19%"
    )
    assert len(result["sentences"]) == 1 and "1 of 4 layers changed notably" in out
    assert result["ep_a"] == 2 and result["ep_b"] == 4
    movers = result["movers"]
    assert {m["expert"] for m in movers[:3]} == {0, 1, 2} and {m["layer"] for m in movers} == {3}
    assert sorted(p.name for p in (tmp_path / "cmp").glob("*.png")) == [
        "ep_max_over_mean.png",
        "jsd.png",
        "max_over_mean.png",
        "share_delta.png",
    ]


def test_compare_windows_of_one_run(tmp_path, capsys):
    run = _write(tmp_path / "run.json", [BALANCED_LE] * 2 + [_collapsed_LE(0)] * 2, window=2)
    code, out, err = _cli(capsys, "compare", run, "--window", "early", "late", "-o", tmp_path / "w")
    assert code == 0, err
    assert "layer 0: top 3 experts now take 93% of tokens, was 19%" in out
    result = json.loads((tmp_path / "w" / "compare.json").read_text())
    assert result["a"] == "steps 0-1" and result["b"] == "steps 2-3"


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    good = _write(tmp_path / "a.json", [BALANCED_LE])
    data = json.loads(good.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "v2.json").write_text(json.dumps(data))
    history = LoadHistory(("update",), LAYERS, EXPERTS // 2, 1, 1)
    history.add(0, torch.ones(1, LAYERS, EXPERTS // 2, dtype=torch.int64), {})
    small = save_report(build_report(history, {"ep": 1}), tmp_path / "small.json")
    history = LoadHistory(("update", "ref"), LAYERS, EXPERTS, 1, 1)
    history.add(0, torch.stack([BALANCED_LE, torch.zeros_like(BALANCED_LE)]), {})
    no_ref = save_report(build_report(history, {"ep": 1}), tmp_path / "no_ref.json")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "keep.txt").write_text("x")
    cases = {
        ("render", tmp_path / "missing.json", "-o", tmp_path / "o1"): "no such report file",
        ("render", tmp_path / "v2.json", "-o", tmp_path / "o2"): "schema version 2",
        ("compare", good, small, "-o", tmp_path / "o3"): "layer/expert count mismatch",
        ("compare", good, "-o", tmp_path / "o4"): "--window early late",
        ("render", good, "-o", tmp_path / "junk"): "not written by this tool",
        ("compare", good, "--window", "early", "9", "-o", tmp_path / "o5"): "window '9' not in",
        ("compare", no_ref, good, "--phase", "ref", "-o", tmp_path / "o6"): "no phase 'ref'",
        ("compare", no_ref, no_ref, "--phase", "ref", "-o", tmp_path / "o7"): "has no tokens",
        ("compare", good, "--window", "early", "late", "-o", tmp_path / "o8"): "both select",
    }
    for argv, message in cases.items():
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
    assert (tmp_path / "junk" / "keep.txt").exists()


@pytest.mark.parametrize("damage", ["truncate", "shape"])
def test_damaged_report_rejected(tmp_path, capsys, damage):
    path = _write(tmp_path / "a.json", [BALANCED_LE])
    if damage == "truncate":
        path.write_text(path.read_text()[:100])
    else:
        data = json.loads(path.read_text())
        data["phases"]["update"]["cumulative"].pop()
        path.write_text(json.dumps(data))
    code, _, err = _cli(capsys, "render", path, "-o", tmp_path / "o")
    assert code == 2 and err.startswith("error: ")


def _write_with_agreement(path, agreement_L_per_step):
    from backend.model.router_replay import agreement_metrics

    history = LoadHistory(("update",), LAYERS, EXPERTS, 1, 2)
    for step, agreement_L in enumerate(agreement_L_per_step):
        mismatch = agreement_metrics(torch.tensor(agreement_L) * 100, torch.full((LAYERS,), 100))
        history.add(step, BALANCED_LE[None], {}, mismatch=mismatch)
    plan = {"tp": 1, "ep": 1, "pp": 1, "cp": 1, "dp": 1, "etp": 1, "edp": 1, "world": 1}
    return save_report(build_report(history, plan, model="run", top_k=2), path)


def test_compare_sets_routing_agreement_per_layer_side_by_side(tmp_path, capsys):
    a = _write_with_agreement(tmp_path / "a.json", [[1.0, 0.9, 0.8, 0.7], [1.0, 0.7, 0.8, 0.5]])
    b = _write_with_agreement(tmp_path / "b.json", [[1.0] * LAYERS, [1.0] * LAYERS])
    assert load_report(a).agreement_L().tolist() == pytest.approx([1.0, 0.8, 0.8, 0.6])
    code, _, _ = _cli(capsys, "compare", a, b, "-o", tmp_path / "cmp")
    assert code == 0
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())["layers"]
    assert [r["agreement_a"] for r in rows] == pytest.approx([1.0, 0.8, 0.8, 0.6])
    assert [r["agreement_b"] for r in rows] == [1.0] * LAYERS
    assert "agreement_a" in (tmp_path / "cmp" / "index.html").read_text()
    # a run that never measured it: null on its side
    c = _write(tmp_path / "c.json", [BALANCED_LE] * 2, ep=1)
    assert _cli(capsys, "compare", a, c, "-o", tmp_path / "cmp2")[0] == 0
    rows = json.loads((tmp_path / "cmp2" / "compare.json").read_text())["layers"]
    assert rows[1]["agreement_b"] is None and rows[1]["agreement_a"] == pytest.approx(0.8)
